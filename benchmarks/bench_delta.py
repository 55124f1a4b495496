"""What a delta against the previous version saves, per tensor class, on transformer training state.

For each step of a MiniLM-shaped fine-tuning run (``gradpipe.testing.transformer``),
every tensor of the training state (parameters, Adam ``exp_avg``, ``exp_avg_sq``) and
one peer's gradients is encoded three ways with gradpipe's lossless policy
(``choose_codec``, per 4 MiB chunk): in full, as the XOR of its bit patterns with
the previous step's, and as the wrapping integer difference of the bit patterns. The
table prints stored bytes over the full encoding's, per class and step: below 1.0 a
delta pays. This is the measurement behind the chain design (which delta, and how
often a keyframe), not a speed benchmark.

Run: ``python benchmarks/bench_delta.py`` (``--steps N``, default 6; ``--dtype
float32|bfloat16``).
"""

from __future__ import annotations

import argparse
from collections.abc import Callable, Iterable

import numpy as np

from gradpipe.codecs import choose_codec
from gradpipe.codecs.ops.delta import int_delta, xor_delta
from gradpipe.core.chunking import choose_chunk_shape, chunk_ranges
from gradpipe.core.dtypes import parse_dtype
from gradpipe.testing.transformer import TransformerConfig, train_transformer

CHUNK_BYTES = 4 << 20


def encoded_size(array: np.ndarray) -> int:
    """Bytes gradpipe's lossless policy stores for ``array`` (all-zero chunks cost nothing)."""
    flat = np.ascontiguousarray(array).reshape(-1)
    shape = choose_chunk_shape(array.shape, array.dtype.itemsize, CHUNK_BYTES)
    total = 0
    for lo, hi in chunk_ranges(array.shape, shape):
        chunk = flat[lo:hi]
        if not chunk.view(np.uint8).any():
            continue
        total += len(choose_codec(chunk).encode(chunk))
    return total


def as_dtype(words: np.ndarray, like: np.ndarray) -> np.ndarray:
    """Delta words shown to the codec as the tensor's own dtype (its planes line up)."""
    return words.view(like.dtype).reshape(like.shape)


Delta = Callable[[np.ndarray, np.ndarray], np.ndarray]


def sizes(
    current: dict[str, np.ndarray], previous: dict[str, np.ndarray], names: Iterable[str]
) -> tuple[int, int, int, int]:
    """Raw, full, XOR-delta and integer-delta stored bytes over ``names``."""
    raw = full = xor = diff = 0
    for name in names:
        now, before = current[name], previous[name]
        raw += now.nbytes
        full += encoded_size(now)
        xor += encoded_size(as_dtype(xor_delta(now, before), now))
        diff += encoded_size(as_dtype(int_delta(now, before), now))
    return raw, full, xor, diff


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    args = parser.parse_args()
    config = TransformerConfig(steps=args.steps, peers=2)
    wire = parse_dtype(args.dtype)
    print(
        f"data: train_transformer(TransformerConfig(steps={args.steps}, peers=2)), MiniLM-L6 "
        f"shapes, AdamW lr {config.learning_rate}; tensors as {args.dtype}; 4 MiB chunks"
    )
    print("stored bytes over the full encoding's (below 1.0: the delta against the previous")
    print("step is smaller); 'full' is the full encoding's ratio raw/stored; the last column")
    print("is the integer delta against step 0 (a keyframe `step` versions back)\n")
    header = (
        f"{'step':>4} {'class':<12} {'raw MiB':>8} {'full':>7} {'xor/full':>9} {'int/full':>9}"
        f" {'int vs step 0':>14}"
    )
    print(header)
    print("-" * len(header))
    previous: dict[str, dict[str, np.ndarray]] | None = None
    first: dict[str, dict[str, np.ndarray]] | None = None
    for step in train_transformer(config):
        classes = {
            "params": step.params,
            "exp_avg": step.exp_avg,
            "exp_avg_sq": step.exp_avg_sq,
            "grads peer0": step.gradients[config.peer_names[0]],
        }
        current = {k: {n: a.astype(wire) for n, a in v.items()} for k, v in classes.items()}
        if previous is not None and first is not None:
            for kind, tensors in current.items():
                raw, full, xor, diff = sizes(tensors, previous[kind], sorted(tensors))
                # Against the first step: what gradpipe's keyframe-relative deltas store
                # for a chunk whose keyframe is `step` versions back.
                *_, keyed = sizes(tensors, first[kind], sorted(tensors))
                print(
                    f"{step.step:>4} {kind:<12} {raw / 2**20:>8.1f} {raw / full:>7.2f}"
                    f" {xor / full:>9.3f} {diff / full:>9.3f} {keyed / full:>14.3f}"
                )
        first = first if first is not None else current
        previous = current


if __name__ == "__main__":
    main()
