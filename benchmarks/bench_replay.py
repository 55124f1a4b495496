"""Optimizer replay against torch's AdamW: how often the prediction is exact, and what it saves.

The data: ``--steps N`` (default 8) steps of the MiniLM-L6 / BERT-small-shaped encoder of
``gradpipe.testing.transformer`` (``--mib M`` shrinks it), fine-tuned by 2 data-parallel peers
with real backprop and ``torch.optim.AdamW`` (``foreach=False``: torch's single-tensor CPU
kernels; weight decay 0.01). The gradient each step applied is the peers' mean as the trainer
took it (float32, fixed peer order).

For every step after the first, each state array (``param``, ``exp_avg``, ``exp_avg_sq``) is
predicted by :func:`gradpipe.core.replay.replay` from the state before the step and the
applied gradient, in both variants (``plain``, ``fma``); the parameters from the exact new
moments, as a reader that decodes the moments first has them. Columns:

- ``exact %``: elements whose predicted bits equal torch's;
- ``full``: the array encoded on its own with gradpipe's lossless policy (per 1 MiB slice,
  as the store's chunks), MiB over all steps;
- ``delta``: the integer delta of its bits against the previous step's array (what snapshot
  chains store today, the smaller of delta and full per slice);
- ``replay``: the integer delta against the prediction (the residual; the smaller of
  residual, delta and full per slice; an exact slice is charged its encoded residual of zeros,
  ~90 bytes, not nothing);
- ``decay``: moments only, the delta against ``beta * previous`` (issue 21's prediction
  without the gradient);
- ``zipnn``: ZipNN's compression of the same arrays (``pip install zipnn``), the anchor.

The table ends with the totals and how many times smaller replay is than ZipNN. The gradient
is not counted: replay pays when the gradients are kept in the store anyway.
"""

from __future__ import annotations

import argparse
import platform
import time

import numpy as np

from gradpipe.codecs.delta import DeltaCodec
from gradpipe.codecs.policy import choose_codec
from gradpipe.core.replay import OptimizerStep, replay
from gradpipe.testing.transformer import TransformerConfig, train_transformer

SLICE = 1 << 18  # float32 values per slice: 1 MiB, the store's chunk size
MIB = float(1 << 20)


def _slices(values: np.ndarray) -> list[np.ndarray]:
    flat = values.reshape(-1)
    return [flat[i : i + SLICE] for i in range(0, flat.size, SLICE)]


def _full(values: np.ndarray) -> int:
    return len(bytes(choose_codec(values).encode(values)))


def _delta(values: np.ndarray, base: np.ndarray, *, equal_is_free: bool = False) -> int:
    """The compressed int delta's bytes. An unchanged chunk costs nothing in today's chains
    (the version keeps its parent's block): ``equal_is_free``. A residual of zeros is charged
    its encoded size (~90 bytes a chunk), what storing it as a block would take."""
    if equal_is_free and np.array_equal(values.view(np.uint32), base.view(np.uint32)):
        return 0
    words = DeltaCodec("int", "float32").bind(base).encode(values).view(np.uint32)
    return len(bytes(choose_codec(words).encode(words)))  # compressed as the store does


def _zipnn_bytes(arrays: list[np.ndarray]) -> int | None:
    try:
        from zipnn import ZipNN
    except ImportError:
        return None
    z = ZipNN(input_format="numpy", bytearray_dtype="float32")
    return sum(len(z.compress(a)) for a in arrays)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--mib", type=float, default=None, help="shrink the model to ~M MiB")
    args = parser.parse_args()
    config = (
        TransformerConfig.for_dump_size(args.mib, steps=args.steps)
        if args.mib
        else TransformerConfig(steps=args.steps)
    )
    started = time.perf_counter()
    steps = list(train_transformer(config, backend="torch"))
    trained = time.perf_counter() - started
    names = list(steps[0].params)
    roles = ("param", "exp_avg", "exp_avg_sq")
    rows: dict[tuple[str, str], list[float]] = {}
    totals = {"full": 0, "delta": 0, "replay": 0, "decay": 0}
    zipnn_inputs: list[np.ndarray] = []
    started = time.perf_counter()
    for t in range(1, len(steps)):
        before, after = steps[t - 1], steps[t]
        for name in names:
            peers = [after.gradients[p][name] for p in config.peer_names]
            grad = np.zeros(peers[0].shape, dtype=np.float32)
            for g in peers:  # the trainer's mean: float32, fixed peer order
                grad += g
            grad /= np.float32(config.peers)
            previous = {
                "param": before.params[name],
                "exp_avg": before.exp_avg[name],
                "exp_avg_sq": before.exp_avg_sq[name],
            }
            actual = {
                "param": after.params[name],
                "exp_avg": after.exp_avg[name],
                "exp_avg_sq": after.exp_avg_sq[name],
            }
            predictions = {}
            for variant in ("plain", "fma"):
                step = OptimizerStep(
                    "adamw",
                    lr=config.learning_rate,
                    step=t + 1,
                    weight_decay=config.weight_decay,
                    variant=variant,
                )
                # Moments predicted from the state before; parameters from the exact new
                # moments, as a reader decodes them (moments first).
                moments = replay(step, previous, grad)
                known = {role: actual[role] for role in ("exp_avg", "exp_avg_sq")}
                predictions[variant] = {
                    **moments,
                    "param": replay(step, previous, grad, known=known)["param"],
                }
            decayed = {
                "exp_avg": (previous["exp_avg"] * np.float32(0.9)).astype(np.float32),
                "exp_avg_sq": (previous["exp_avg_sq"] * np.float32(0.999)).astype(np.float32),
            }
            for role in roles:
                values = actual[role]
                zipnn_inputs.append(values)
                for variant, predicted in predictions.items():
                    same = int((predicted[role].view(np.uint32) == values.view(np.uint32)).sum())
                    row = rows.setdefault((role, variant), [0, 0])
                    row[0] += same
                    row[1] += values.size
                pieces = zip(
                    _slices(values),
                    _slices(previous[role]),
                    _slices(predictions["fma"][role]),
                    _slices(decayed.get(role, previous[role])),
                    strict=True,
                )
                for piece, prior, guess, decay in pieces:
                    full = _full(piece)
                    delta = min(full, _delta(piece, prior, equal_is_free=True))
                    totals["full"] += full
                    totals["delta"] += delta
                    totals["replay"] += min(delta, _delta(piece, guess))
                    totals["decay"] += min(delta, _delta(piece, decay))
    coded = time.perf_counter() - started
    raw = sum(a.nbytes for a in zipnn_inputs)
    zipnn = _zipnn_bytes(zipnn_inputs)
    print(
        f"# {platform.machine()}, {platform.processor() or 'cpu'}; {len(names)} tensors, "
        f"{raw / MIB / (len(steps) - 1):.1f} MiB of state per step, {len(steps) - 1} steps "
        f"predicted (training {trained:.0f} s, coding {coded:.0f} s)"
    )
    print(f"{'array':<12}{'variant':<9}{'exact %':>9}")
    for (role, variant), (same, total) in rows.items():
        print(f"{role:<12}{variant:<9}{100 * same / total:>9.2f}")
    print()
    print(f"{'encoding':<34}{'MiB':>9}{'x raw':>8}{'x zipnn':>9}")
    print(f"{'raw':<34}{raw / MIB:>9.2f}{1.0:>8.2f}")
    if zipnn is not None:
        print(f"{'zipnn':<34}{zipnn / MIB:>9.2f}{raw / zipnn:>8.2f}{1.0:>9.2f}")
    labels = {
        "full": "full (gradpipe lossless)",
        "delta": "delta vs previous (today)",
        "decay": "decay prediction (no gradient)",
        "replay": "replay residual (fma)",
    }
    for key, label in labels.items():
        size = max(totals[key], 1)
        versus = f"{zipnn / size:>9.2f}" if zipnn is not None else ""
        print(f"{label:<34}{size / MIB:>9.2f}{raw / size:>8.2f}{versus}")


if __name__ == "__main__":
    main()
