"""bfloat16 and float16 conversion: round-to-nearest-even against the seed's truncation.

The seed converted float32 to bfloat16 by dropping the low 16 bits (rounding
toward zero); gradpipe rounds to nearest, ties to even. This prints, per class
of tensor of a MiniLM-shaped fine-tuning step (``gradpipe.testing.transformer``,
torch or numpy), the error of each conversion over the non-zero values: the
largest and mean relative error, the mean *signed* relative error (the bias:
truncation always shrinks magnitudes), and the relative L2 error of the whole
class, plus the one-thread conversion speed in MiB/s of float32 input (a
numpy ``astype(float16)`` and ``ml_dtypes`` bfloat16 cast as anchors).

    python benchmarks/bench_rounding.py [--steps N] [--repeat N]
"""

from __future__ import annotations

import argparse
import time

import ml_dtypes
import numpy as np

from gradpipe.codecs.ops.half_precision import (
    bf16_bits,
    bf16_truncate_bits,
    from_bf16_bits,
    to_fp16,
)
from gradpipe.testing.transformer import TransformerConfig, train_transformer


def classes(steps: int) -> dict[str, np.ndarray]:
    *_, last = train_transformer(TransformerConfig(steps=steps, peers=2))
    grads = last.gradients["peer0"]

    def cat(d: dict[str, np.ndarray], keep: object = None) -> np.ndarray:
        parts = [v.reshape(-1) for k, v in d.items() if keep is None or keep(k)]
        return np.concatenate(parts).astype(np.float32)

    return {
        "embedding grads": cat(grads, lambda k: "embeddings" in k),
        "dense grads": cat(grads, lambda k: k.endswith("weight") and "embeddings" not in k),
        "params": cat(last.params),
        "exp_avg": cat(last.exp_avg),
        "exp_avg_sq": cat(last.exp_avg_sq),
    }


def errors(x: np.ndarray, y: np.ndarray) -> tuple[float, float, float, float]:
    nz = x != 0
    x64, y64 = x[nz].astype(np.float64), y[nz].astype(np.float64)
    rel = (y64 - x64) / np.abs(x64)
    signed = np.sign(x64) * rel  # negative: magnitude shrunk
    l2 = np.linalg.norm(y64 - x64) / np.linalg.norm(x64)
    return float(np.abs(rel).max()), float(np.abs(rel).mean()), float(signed.mean()), float(l2)


def speed(func: object, x: np.ndarray, repeat: int) -> float:
    best = float("inf")
    for _ in range(repeat):
        t = time.perf_counter()
        func(x)
        best = min(best, time.perf_counter() - t)
    return x.nbytes / 2**20 / best


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--repeat", type=int, default=5)
    args = parser.parse_args()
    data = classes(args.steps)
    print(
        f"data: train_transformer(TransformerConfig(steps={args.steps}, peers=2)), MiniLM-L6 "
        "shapes, the last step's peer0 gradients and the state after it; errors over non-zero "
        "values, float64"
    )
    print(
        f"{'class':<16} {'conversion':<18} {'max rel':>9} {'mean rel':>9} {'bias':>10} "
        f"{'rel L2':>9}"
    )
    for name, x in data.items():
        rows = {
            "bf16 nearest-even": from_bf16_bits(bf16_bits(x)),
            "bf16 truncate": from_bf16_bits(bf16_truncate_bits(x)),
            "fp16 nearest-even": to_fp16(x)[0].astype(np.float32),
        }
        for label, y in rows.items():
            mx, mean, bias, l2 = errors(x, y)
            print(f"{name:<16} {label:<18} {mx:>9.3g} {mean:>9.3g} {bias:>+10.2e} {l2:>9.3g}")
    x = np.concatenate(list(data.values()))
    mib = x.nbytes / 2**20
    print(f"\nconversion speed, one thread, {mib:.0f} MiB float32, best of {args.repeat}")
    for label, func in {
        "gradpipe bf16 nearest-even": bf16_bits,
        "seed bf16 truncate": bf16_truncate_bits,
        "ml_dtypes astype(bfloat16)": lambda v: v.astype(ml_dtypes.bfloat16),
        "gradpipe fp16 (+ overflow count)": to_fp16,
        "numpy astype(float16)": lambda v: v.astype(np.float16),
    }.items():
        print(f"  {label:<34} {speed(func, x, args.repeat):>8.0f} MiB/s")


if __name__ == "__main__":
    main()
