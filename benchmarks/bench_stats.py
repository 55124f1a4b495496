"""``gradpipe stats`` on 2,000 dumps, beside listing the store and reading every chunk.

Data: ``--dumps N`` (default 2,000) dumps of ``--peers`` (default 4) peers over
N / peers steps, each holding the 105 tensors of a MiniLM-L6 / BERT-small-shaped
encoder (``gradpipe.testing.transformer``'s names and layout: 6 layers, word,
position and token-type embeddings, pooler, classifier) at a reduced width
(vocabulary 1000, hidden 32, intermediate 128, 64 positions), 440 KiB of float32
per dump: seeded normal gradients, the word-embedding gradient non-zero in 8% of
its rows (the batch's tokens). Statistics cost per manifest and per tensor, not
per byte, so the dumps are narrow to keep 2,000 of them on disk; about half of
their tensors are small enough to be kept inline in their manifests, the others
are blocks of their own, as in users' dumps. The dumps are written and ingested
(untimed) once under ``bench-data/stats/``; later runs reuse them (``--fresh``
makes them again).

Rows, medians of ``--repeat`` (default 5) runs in alternation, page cache warm:

- ``gradpipe stats STORE --run r --format json`` (a subprocess, the whole command:
  interpreter start, imports, manifests, listing, JSON of every record to
  ``/dev/null``), and with ``--by tensor`` (the table);
- ``gp.compression_stats(store, run="r")`` in this process, with the reads it
  made counted by a recording backend wrapper (``gradpipe.testing.faults``):
  manifests read, listings, and chunk reads (which must be 0);
- anchors: ``fsspec`` ``LocalFileSystem().find(STORE, detail=True)`` (every object
  of the store with its size: what one listing costs in Python) and ``du -sb
  STORE`` (the same walk in C);
- ``from the data``: what statistics cost without the manifests' chunk
  statistics: every dump read back (``dump.read_all()``, all chunks decoded and
  checked) and its density, NaN/Inf counts and norm computed with numpy; one
  run (not a median) unless ``--skip-data``.

Run: ``python benchmarks/bench_stats.py`` (``--dumps N``, ``--peers N``,
``--repeat N``, ``--fresh``, ``--skip-data``); about three minutes the first
time (writing and ingesting), one minute after.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
DATA = ROOT / "bench-data" / "stats"
RUN = "r"
SHAPE = {"vocab_size": 1000, "hidden": 32, "intermediate": 128, "max_positions": 64, "seq_len": 32}


def _dump(step: int, peer: int, shapes: dict[str, tuple[int, ...]]) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(step * 1000 + peer)
    out = {}
    for name, shape in shapes.items():
        values = (rng.standard_normal(shape) * 1e-3).astype(np.float32)
        if name == "embeddings.word_embeddings.weight":
            rows = rng.random(shape[0]) < 0.08
            values[~rows] = 0
        out[name] = values
    return out


def prepare(dumps: int, peers: int, fresh: bool) -> Path:
    """The store holding the run, made (with its dumps) if missing."""
    import gradpipe as gp
    from gradpipe.formats.safetensors import write_safetensors
    from gradpipe.testing.transformer import TransformerConfig

    store_dir = DATA / f"store-{dumps}x{peers}"
    if fresh:
        shutil.rmtree(DATA, ignore_errors=True)
    if store_dir.exists():
        return store_dir
    shapes = TransformerConfig(**SHAPE, heads=4, peers=peers).param_shapes()
    dump_dir = DATA / f"dumps-{dumps}x{peers}"
    print(f"writing {dumps} dumps of {len(shapes)} tensors under {dump_dir} ...", flush=True)
    for i in range(dumps):
        step, peer = divmod(i, peers)
        path = dump_dir / f"step={step:05d}" / f"peer=p{peer}.safetensors"
        path.parent.mkdir(parents=True, exist_ok=True)
        with path.open("wb") as f:
            write_safetensors(f, _dump(step, peer, shapes), {"num_examples": "8"})
    print(f"ingesting into {store_dir} ...", flush=True)
    store = gp.open_store(str(store_dir), mode="w")
    report = gp.ingest(store, str(dump_dir / "step={step}" / "peer={peer}.safetensors"), run=RUN)
    print(report.summary(), flush=True)
    shutil.rmtree(dump_dir)  # statistics never read them; keep the disk
    return store_dir


def timed(fn: Callable[[], object]) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def command(*argv: str) -> Callable[[], object]:
    env = dict(os.environ, PYTHONPATH=str(ROOT))

    def run() -> object:
        return subprocess.run(
            argv, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, env=env
        )

    return run


def counted_stats(store_dir: Path) -> tuple[dict[str, int], object]:
    """One in-process run through a recording backend: reads by kind, and the Dataset."""
    import gradpipe as gp
    from gradpipe.core.ids import block_key
    from gradpipe.runs import open_run
    from gradpipe.testing.faults import faulty_store

    store = gp.open_store(str(store_dir), mode="r")
    counting, backend = faulty_store(store)
    ds = gp.compression_stats(counting, run=RUN)
    view = open_run(store, RUN)
    chunks = {
        block_key(b)
        for entry in view
        for info in view.dump(entry.step, entry.peer).infos().values()
        for b in info.data_children()
    }
    reads = [key for op, key in backend.calls if op == "read"]
    return {
        "manifest reads": sum(key not in chunks for key in reads),
        "chunk reads": sum(key in chunks for key in reads),
        "listings": sum(op == "list" for op, _ in backend.calls),
        "ref reads": sum(op == "read_versioned" for op, _ in backend.calls),
    }, ds


def from_the_data(store_dir: Path) -> tuple[float, float]:
    """Seconds to compute density, NaN/Inf and norms by reading every chunk; MiB read."""
    import gradpipe as gp
    from gradpipe.runs import open_run

    view = open_run(gp.open_store(str(store_dir), mode="r"), RUN)
    nbytes = 0

    def run() -> None:
        nonlocal nbytes
        for entry in view:
            for array in view.dump(entry.step, entry.peer).read_all().values():
                nbytes += array.nbytes
                wide = array.astype(np.float64)
                finite = wide[np.isfinite(wide)]
                np.count_nonzero(wide), np.isnan(wide).sum(), np.sqrt(finite @ finite)

    return timed(run), nbytes / 2**20


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dumps", type=int, default=2000)
    parser.add_argument("--peers", type=int, default=4)
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--fresh", action="store_true")
    parser.add_argument("--skip-data", action="store_true")
    args = parser.parse_args()

    import fsspec

    import gradpipe as gp

    store_dir = prepare(args.dumps, args.peers, args.fresh)
    url = str(store_dir)
    gradpipe = [sys.executable, "-m", "gradpipe.cli"]
    local = fsspec.filesystem("file")
    rows: dict[str, Callable[[], object]] = {
        "fsspec find(STORE, detail=True)": lambda: local.find(url, detail=True),
        "du -sb STORE": command("du", "-sb", url),
        "gp.compression_stats (in process)": lambda: gp.compression_stats(
            gp.open_store(url, mode="r"), run=RUN
        ),
    }
    stats = [*gradpipe, "stats", url, "--run", RUN]
    rows["gradpipe stats --format json"] = command(*stats, "--format", "json")
    rows["gradpipe stats --by tensor"] = command(*stats, "--by", "tensor")
    # Warm the page cache (every manifest and directory) and the imports once.
    for name in ("fsspec find(STORE, detail=True)", "gp.compression_stats (in process)"):
        rows[name]()
    times: dict[str, list[float]] = {name: [] for name in rows}
    for _ in range(args.repeat):
        for name, fn in rows.items():
            times[name].append(timed(fn))
    counts, ds = counted_stats(store_dir)
    totals = gp.summarize_stats(ds)  # type: ignore[arg-type]
    objects = len(local.find(url))
    anchor = statistics.median(times["fsspec find(STORE, detail=True)"])

    print(
        f"\n{args.dumps} dumps ({args.dumps // args.peers} steps x {args.peers} peers), "
        f"{ds.sizes['tensor']} tensors each; store: {objects} objects, "  # type: ignore[attr-defined]
        f"{float(totals['raw_bytes']) / 2**20:,.0f} MiB raw -> "
        f"{float(totals['stored_bytes']) / 2**20:,.0f} MiB stored (ratio "
        f"{float(totals['ratio']):.2f}); median of {args.repeat}, page cache warm"
    )
    print(f"{'':42s} {'wall s':>8s} {'x find':>8s} {'ms/dump':>8s}")
    for name, samples in times.items():
        t = statistics.median(samples)
        print(f"{name:42s} {t:8.3f} {t / anchor:8.2f} {1000 * t / args.dumps:8.3f}")
    if not args.skip_data:
        t, mib = from_the_data(store_dir)
        name = f"from the data (read {mib:,.0f} MiB, 1 run)"
        print(f"{name:42s} {t:8.3f} {t / anchor:8.2f} {1000 * t / args.dumps:8.3f}")
    print("\nreads by gp.compression_stats: " + ", ".join(f"{k} {v}" for k, v in counts.items()))


if __name__ == "__main__":
    main()
