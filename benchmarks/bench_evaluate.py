"""The codec evaluation on transformer gradients and training state, beside ZipNN and numcodecs.

The data (``gradpipe.testing.transformer``): a MiniLM-L6 / BERT-small-shaped encoder
(vocabulary 30522, hidden 384, 6 layers, 105 tensors) fine-tuned with real backprop
and AdamW by 2 data-parallel peers for ``--steps`` steps (default 6), written under a
temporary directory and ingested into a local store (default chunking, 4 MiB) as two
runs:

- ``gradients``: every step's float32 gradient dump of each peer (87 MiB each);
- ``state``: the training state after the last ``--state-steps`` steps (default 2),
  one file per step: parameters, AdamW ``exp_avg`` and ``exp_avg_sq`` (and the step
  counters), 260 MiB each, what a snapshot holds.

On each, ``gp.evaluate_codecs`` measures its default candidates (the lossless default,
numcodecs' own ``Zstd()`` and ``Blosc()``, bf16, fp16, ``bitround-7+zstd``,
``topk-0.01``, ``qsgd-16``, ``powersgd-4``, ``projection-0.1``) on a seeded sample of
``--sample`` chunks (default 64; every tensor the same share), on one worker thread
so that its per-chunk encode/decode times are one core's, like the anchors'. The
anchors are then run, one thread, on the very chunks the evaluation sampled (the
float32 ones), with the same float64 fidelity figures:

- ZipNN (``ZipNN(input_format="numpy", bytearray_dtype="float32")``, lossless),
- numcodecs ``BitRound(keepbits=7)`` then ``Zstd()`` (the rounding gradpipe's
  ``bitround-7`` wraps),
- numcodecs ``Quantize(digits=6, dtype="f4")`` then ``Zstd()`` (an absolute
  precision of 1e-6: the kind of quantiser numcodecs has).

One table per data set; "vs zipnn" is each ratio over ZipNN's on the same chunks.
Below it, the evaluation's notes (error feedback, the projection's norms and inner
products, skipped chunks). Speeds on this shared 2-core machine move by tens of
percent between runs; ratios and fidelity do not (the sample is seeded).

Run: ``python benchmarks/bench_evaluate.py`` (``--steps N``, ``--state-steps N``,
``--sample N``, ``--seed S``, ``--mib M`` to shrink the model to about M MiB per
dump); about ten minutes at the defaults, most of it training and ingesting.
"""

from __future__ import annotations

import argparse
import math
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from bench_ingest import zipnn_compressor
from numcodecs import BitRound, Quantize, Zstd

import gradpipe as gp
from gradpipe.evaluation.fidelity import Fidelity, measure_fidelity
from gradpipe.evaluation.report import EvaluationReport, describe_bound
from gradpipe.formats.safetensors import write_safetensors
from gradpipe.testing import TransformerConfig, train_transformer

MIB = 2**20


def write_data(root: Path, config: TransformerConfig, state_steps: int) -> tuple[str, str]:
    """Gradient dumps of every step and the state of the last ``state_steps``; two patterns."""
    last = config.steps - state_steps
    for result in train_transformer(config):
        for peer, grads in result.gradients.items():
            path = root / "dumps" / f"step={result.step:04d}" / f"peer={peer}.safetensors"
            path.parent.mkdir(parents=True, exist_ok=True)
            write_safetensors(path, grads, {"num_examples": str(result.num_examples[peer])})
        if result.step >= last:
            state = {f"params/{k}": v for k, v in result.params.items()}
            state |= {f"exp_avg/{k}": v for k, v in result.exp_avg.items()}
            state |= {f"exp_avg_sq/{k}": v for k, v in result.exp_avg_sq.items()}
            path = root / "state" / f"step={result.step:04d}.safetensors"
            path.parent.mkdir(parents=True, exist_ok=True)
            write_safetensors(path, state)
    return (
        str(root / "dumps" / "step={step}" / "peer={peer}.safetensors"),
        str(root / "state" / "step={step}.safetensors"),
    )


@dataclass
class Row:
    name: str
    chunks: int
    ratio: float | None
    bits: float | None
    enc: float | None
    dec: float | None
    fidelity: Fidelity | None
    bound: str
    held: str


def anchor_row(
    name: str,
    chunks: list[np.ndarray],
    encode: Callable[[np.ndarray], bytes],
    decode: Callable[[bytes], np.ndarray],
) -> Row:
    raw = stored = 0
    enc = dec = 0.0
    parts = []
    for x in chunks:
        start = time.perf_counter()
        frame = encode(x)
        middle = time.perf_counter()
        y = np.asarray(decode(frame)).reshape(-1).view(np.uint8)[: x.nbytes].view(x.dtype)
        end = time.perf_counter()
        raw, stored = raw + x.nbytes, stored + len(frame)
        enc, dec = enc + middle - start, dec + end - middle
        parts.append(measure_fidelity(x, y))
    values = sum(x.size for x in chunks)
    return Row(
        name,
        len(chunks),
        raw / stored,
        8 * stored / values,
        raw / MIB / enc,
        raw / MIB / dec,
        Fidelity.merge(parts),
        "",
        "",
    )


def anchors(chunks: list[np.ndarray]) -> list[Row]:
    zipnn = zipnn_compressor()
    zstd = Zstd()

    def chained(first: Any) -> tuple[Callable[[np.ndarray], bytes], Callable[[bytes], np.ndarray]]:
        def encode(x: np.ndarray) -> bytes:
            return bytes(zstd.encode(first.encode(x)))

        def decode(frame: bytes) -> np.ndarray:
            return np.asarray(first.decode(zstd.decode(frame)))

        return encode, decode

    return [
        anchor_row("zipnn", chunks, lambda x: bytes(zipnn.compress(x)), zipnn.decompress),
        anchor_row("BitRound(7)+Zstd", chunks, *chained(BitRound(keepbits=7))),
        anchor_row("Quantize(6)+Zstd", chunks, *chained(Quantize(digits=6, dtype="f4"))),
    ]


def sampled_chunks(store: gp.Store, report: EvaluationReport) -> list[np.ndarray]:
    """The float32 chunks the evaluation sampled, read back from the store."""
    run = gp.open_run(store, report.run)
    out = []
    for unit in report.units:
        dump = run.dump(unit.step, unit.peer)
        info = dump.info(unit.tensor)
        if info.dtype != "float32":
            continue
        start, stop = info.chunk_ranges()[unit.chunk]
        out.append(np.asarray(dump.read(unit.tensor)).reshape(-1)[start:stop].copy())
    return out


def gradpipe_rows(report: EvaluationReport) -> list[Row]:
    return [
        Row(
            r.name,
            len(r.chunks),
            r.ratio,
            r.bits_per_value,
            r.encode_mib_s,
            r.decode_mib_s,
            r.fidelity,
            describe_bound(r.bound),
            f"{r.bound_held_chunks}/{len(r.chunks)}",
        )
        for r in report.results
    ]


def fmt(value: float | None, spec: str, width: int) -> str:
    if value is None:
        return f"{'—':>{width}}"
    if math.isinf(value):
        return f"{'inf':>{width}}"
    return f"{value:>{width}{spec}}"


def table(title: str, rows: list[Row], anchor: Row) -> str:
    lines = [
        title,
        f"{'codec':<18} {'chunks':>6} {'ratio':>8} {'vs zipnn':>8} {'bits/val':>8} "
        f"{'enc MiB/s':>9} {'dec MiB/s':>9} {'rel L2':>8} {'cosine':>8} {'norm':>6} "
        f"{'sign':>6}  {'bound':<22} {'held':>6}",
    ]
    for row in rows:
        f = row.fidelity
        vs = None if row.ratio is None or anchor.ratio is None else row.ratio / anchor.ratio
        lines.append(
            f"{row.name:<18} {row.chunks:>6} {fmt(row.ratio, '.3f', 8)} {fmt(vs, '.3f', 8)} "
            f"{fmt(row.bits, '.2f', 8)} {fmt(row.enc, '.0f', 9)} {fmt(row.dec, '.0f', 9)} "
            f"{fmt(None if f is None else f.rel_l2_error, '.2g', 8)} "
            f"{fmt(None if f is None else f.cosine, '.5f', 8)} "
            f"{fmt(None if f is None else f.norm_ratio, '.3f', 6)} "
            f"{fmt(None if f is None else f.sign_agreement, '.3f', 6)}  "
            f"{row.bound:<22} {row.held:>6}"
        )
    return "\n".join(lines)


def evaluate(store: gp.Store, run: str, label: str, args: argparse.Namespace) -> None:
    start = time.perf_counter()
    with gp.runner(workers=1) as one:
        report = gp.evaluate_codecs(store, run=run, sample=args.sample, seed=args.seed, runner=one)
    took = time.perf_counter() - start
    chunks = sampled_chunks(store, report)
    extra = anchors(chunks)
    rows = gradpipe_rows(report)
    print()
    print(
        table(
            f"{label}: {len(report.units)} sampled chunks (seed {args.seed}), "
            f"{sum(c.nbytes for c in chunks) / MIB:.1f} MiB; evaluation {took:.0f} s",
            rows + extra,
            extra[0],
        )
    )
    notes = report.summary().split("\n\n", 2)
    if len(notes) == 3:
        print()
        print(notes[2])
    if not report.ok:
        print("FAIL: a codec broke its stated bound")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--state-steps", type=int, default=2)
    parser.add_argument("--sample", type=int, default=64)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--mib", type=float, help="shrink the model to about M MiB per dump")
    args = parser.parse_args()
    config = TransformerConfig(steps=args.steps)
    if args.mib:
        config = TransformerConfig.for_dump_size(args.mib * 2 * args.steps, steps=args.steps)
    with tempfile.TemporaryDirectory(prefix="bench-evaluate-") as tmp:
        root = Path(tmp)
        start = time.perf_counter()
        dumps, state = write_data(root, config, min(args.state_steps, args.steps))
        print(
            f"data: {config.numel() / 1e6:.1f} M parameters, {config.steps} steps x "
            f"{config.peers} peers, trained and written in {time.perf_counter() - start:.0f} s"
        )
        store = gp.open_store(root / "store", mode="w")
        for pattern, run in ((dumps, "gradients"), (state, "state")):
            report = gp.ingest(store, pattern, run=run)
            if not report.ok:
                raise RuntimeError(report.summary())
        evaluate(store, "gradients", "MiniLM-shaped gradients (float32 dumps)", args)
        evaluate(store, "state", "MiniLM-shaped training state (params + AdamW moments)", args)


if __name__ == "__main__":
    main()
