"""Scale of the run manifest: bytes and time per commit as a run grows to 20,000 dumps.

A run is committed ``--per-commit`` dumps at a time (default 100) up to
``--dumps`` (default 20,000; 8 peers per step), into a fresh local store, in
two layouts measured in the same run:

- **shards** (gradpipe now): the run's entries in a tree of shards
  (``gradpipe.core.run_shards``, 128 entries per leaf, 64 links per inner
  shard); a commit writes the path to its entries;
- **one manifest** (gradpipe before, the anchor): the same code with an
  unbounded leaf, which keeps every entry in the run's manifest, byte for
  byte the format-1/3 manifest older gradpipe wrote, rewritten in full at
  every commit.

Each commit goes through the ingest's own commit (``commit_run``: read the
run, check each dump against it, merge, store, one compare-and-swap of the
ref) with tiny real dumps (one 4-value float32 tensor inside each dump's
manifest, written before the commit and not counted); ingesting 20,000 files
takes far longer and measures the file reading, not the run. Bytes are what
the commit creates in the store (run manifest, shards, ref entry and ref),
counted at the backend. The table gives the mean over the ``--window``
commits that end at each N. Then the whole run is read back (every entry,
fresh ``open_run``), and a real ``gp.ingest`` of 100 small safetensors files
goes into each 20,000-dump run.
Run: ``python benchmarks/bench_scale.py [--dumps 20000] [--per-commit 100]``.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import statistics
import tempfile
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

import gradpipe as gp
import gradpipe.core.run_shards as run_shards
from gradpipe.core.run_shards import TreeShape
from gradpipe.formats.safetensors import write_safetensors
from gradpipe.storage.backend import Backend
from gradpipe.testing.faults import FaultyBackend
from gradpipe.testing.run_commits import commit_tiny_dumps, write_tiny_dumps

PEERS = 8
FILES = PEERS * (100 // PEERS)  # the real ingest's files: 12 steps of 8 peers
LAYOUTS = {"shards": run_shards.DEFAULT_SHAPE, "one manifest": TreeShape(leaf=10**9, branch=2)}


class _Counting(FaultyBackend):
    """Counts the bytes of every object created and every read request (faults none)."""

    def __init__(self, inner: Backend) -> None:
        super().__init__(inner)
        self.created = 0
        self.reads = 0

    def write_if_absent(self, key: str, data: bytes | memoryview) -> bool:
        new = super().write_if_absent(key, data)
        self.created += len(data) if new else 0
        return new

    def write_many_if_absent(self, items: Sequence[tuple[str, bytes | memoryview]]) -> list[bool]:
        news = super().write_many_if_absent(items)
        self.created += sum(len(d) for (_, d), new in zip(items, news, strict=True) if new)
        return news

    def swap(self, key: str, data: bytes, expected: str | None) -> str:
        token = super().swap(key, data, expected)
        self.created += len(data)
        return token

    def read(self, key: str) -> bytes:
        self.reads += 1
        return super().read(key)


@contextlib.contextmanager
def layout(shape: TreeShape) -> Iterator[None]:
    """Commit with ``shape`` (the module default every commit looks up)."""
    saved = run_shards.DEFAULT_SHAPE
    run_shards.DEFAULT_SHAPE = shape  # type: ignore[misc]  # the benchmark's two layouts
    try:
        yield
    finally:
        run_shards.DEFAULT_SHAPE = saved  # type: ignore[misc]


@dataclass
class Grown:
    """One layout's commits: bytes and seconds of each, and the store they built."""

    store: gp.Store
    backend: _Counting
    bytes: list[int] = field(default_factory=list)
    seconds: list[float] = field(default_factory=list)
    dump_seconds: float = 0.0
    read_seconds: float = float("inf")
    reads: int = 0
    lookup_seconds: float = float("inf")
    lookup_reads: int = 0
    ingest_seconds: float = 0.0
    ingest_bytes: int = 0


def counting_store(root: Path) -> tuple[gp.Store, _Counting]:
    plain = gp.open_store(root, mode="w")
    backend = _Counting(plain.backend)
    return gp.Store(backend, mode="a", url=plain.url), backend


def grow(root: Path, shape: TreeShape, total: int, per_commit: int) -> Grown:
    """Commit ``total`` tiny dumps, ``per_commit`` at a time, with ``shape``."""
    store, backend = counting_store(root)
    out = Grown(store, backend)
    with layout(shape):
        for lo in range(0, total, per_commit):
            keys = [(n // PEERS, f"p{n % PEERS}") for n in range(lo, lo + per_commit)]
            started = time.perf_counter()
            results = write_tiny_dumps(store, "r", keys)
            out.dump_seconds += time.perf_counter() - started
            before = backend.created
            started = time.perf_counter()
            done = commit_tiny_dumps(store, "r", results)
            out.seconds.append(time.perf_counter() - started)
            out.bytes.append(backend.created - before)
            if len(done.committed) != per_commit:
                raise RuntimeError(f"commit at {lo} recorded {len(done.committed)} dumps")
    return out


def read_back(g: Grown, total: int) -> None:
    """Time a fresh read of every entry, and a fresh lookup of one (best of the calls)."""
    fresh = gp.Store(g.backend, mode="r", url=g.store.url)
    gc.collect()
    g.backend.reads = 0
    started = time.perf_counter()
    run = gp.open_run(fresh, "r")
    entries = list(run)
    g.read_seconds = min(g.read_seconds, time.perf_counter() - started)
    g.reads = g.backend.reads
    if len(entries) != total or len(run.steps) != total // PEERS:
        raise RuntimeError(f"read back {len(entries)} dumps of {total}")
    g.backend.reads = 0
    started = time.perf_counter()
    entry = gp.open_run(fresh, "r").manifest.entry(total // PEERS // 2, "p3")
    g.lookup_seconds = min(g.lookup_seconds, time.perf_counter() - started)
    g.lookup_reads = g.backend.reads
    if entry is None:
        raise RuntimeError("a recorded dump was not found")


def ingest_files(g: Grown, shape: TreeShape, files: str) -> None:
    """A real ``gp.ingest`` of the small files into the grown run."""
    with layout(shape):
        before = g.backend.created
        started = time.perf_counter()
        report = gp.ingest(g.store, files, run="r")
        g.ingest_seconds = time.perf_counter() - started
        g.ingest_bytes = g.backend.created - before
    if report.ingested != FILES:
        raise RuntimeError(report.summary())


def write_files(folder: Path, first_step: int) -> str:
    """96 small safetensors dumps (12 steps x 8 peers, one 4-float tensor each) after the run."""
    for n in range(FILES):
        step, peer = first_step + n // PEERS, f"p{n % PEERS}"
        path = folder / f"step={step}" / f"peer={peer}.safetensors"
        path.parent.mkdir(parents=True, exist_ok=True)
        write_safetensors(path, {"w": np.full(4, n, np.float32)}, {})
    return f"{folder}/step={{step}}/peer={{peer}}.safetensors"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dumps", type=int, default=20000)
    parser.add_argument("--per-commit", type=int, default=100)
    parser.add_argument("--at", default="1000,5000,10000,20000", help="N of the table's rows")
    parser.add_argument("--window", type=int, default=5, help="commits averaged per row")
    parser.add_argument("--dir", default=None, help="where the stores go (default: a temp dir)")
    parser.add_argument("--repeat", type=int, default=3, help="reads back: best of N")
    args = parser.parse_args()
    marks = [int(n) for n in args.at.split(",") if int(n) <= args.dumps]
    grown: dict[str, Grown] = {}
    with tempfile.TemporaryDirectory(dir=args.dir) as tmp:
        files = write_files(Path(tmp) / "files", args.dumps // PEERS)
        warm, _ = counting_store(Path(tmp) / "warm-up")  # imports, thread pools: paid here
        gp.ingest(warm, write_files(Path(tmp) / "warm-files", 0), run="r")
        for name, shape in LAYOUTS.items():
            started = time.perf_counter()
            root = Path(tmp) / name.replace(" ", "-")
            grown[name] = grow(root, shape, args.dumps, args.per_commit)
            print(f"[{name}: {time.perf_counter() - started:.0f} s]", flush=True)
        for _ in range(args.repeat):  # alternating, best of the repeats
            for g in grown.values():
                read_back(g, args.dumps)
        for name, g in grown.items():
            ingest_files(g, LAYOUTS[name], files)
        report(grown, args, marks)


def report(grown: dict[str, Grown], args: argparse.Namespace, marks: list[int]) -> None:
    new, old = grown["shards"], grown["one manifest"]
    print(
        f"\n{args.dumps} tiny dumps committed {args.per_commit} at a time ({PEERS} peers per "
        f"step) through commit_run into a local store; mean of the {args.window} commits "
        "ending at N"
    )
    head = (
        f"{'N':>6} | {'KiB/commit':>10} {'ms/commit':>9} {'us/dump':>7} | "
        f"{'KiB/commit':>10} {'ms/commit':>9} {'us/dump':>7} | {'bytes x':>7} {'time x':>6}"
    )
    print(f"{'':>6} | {'shards (now)':^29} | {'one manifest (before)':^29} |")
    print(head)
    for n in marks:
        hi = n // args.per_commit
        lo = max(0, hi - args.window)
        row = []
        for g in (new, old):
            kib = statistics.mean(g.bytes[lo:hi]) / 1024
            ms = statistics.mean(g.seconds[lo:hi]) * 1e3
            row.append((kib, ms))
        (kib_new, ms_new), (kib_old, ms_old) = row
        per = args.per_commit
        print(
            f"{n:>6} | {kib_new:>10.1f} {ms_new:>9.1f} {ms_new * 1e3 / per:>7.0f} | "
            f"{kib_old:>10.1f} {ms_old:>9.1f} {ms_old * 1e3 / per:>7.0f} | "
            f"{kib_old / kib_new:>6.0f}x {ms_old / ms_new:>5.1f}x"
        )
    print(
        f"{'all':>6} | {sum(new.bytes) / 2**20:>8.1f} MiB {sum(new.seconds):>7.1f} s {'':>7} | "
        f"{sum(old.bytes) / 2**20:>8.1f} MiB {sum(old.seconds):>7.1f} s {'':>7} | "
        f"{sum(old.bytes) / sum(new.bytes):>6.0f}x {sum(old.seconds) / sum(new.seconds):>5.1f}x"
    )
    first, last = marks[0] // args.per_commit, marks[-1] // args.per_commit
    for name, g in (("shards", new), ("one manifest", old)):
        a = statistics.mean(g.bytes[max(0, first - args.window) : first])
        b = statistics.mean(g.bytes[max(0, last - args.window) : last])
        print(f"{name}: bytes per commit at N={marks[-1]} / at N={marks[0]}: {b / a:.2f}x")
    print(f"(writing the tiny dumps themselves, not counted above: {new.dump_seconds:.1f} s)")
    print(
        f"\nreading the run at N={args.dumps} (a fresh open_run, local disk, warm page cache, "
        f"best of {args.repeat})"
    )
    print(f"{'':<13} {'every entry':>14} {'one entry':>14}")
    for name, g in (("shards", new), ("one manifest", old)):
        print(
            f"{name:<13} {g.read_seconds * 1e3:>6.0f} ms {g.reads:>3} rd "
            f"{g.lookup_seconds * 1e3:>6.1f} ms {g.lookup_reads:>3} rd"
        )
    print(f"\na real gp.ingest of {FILES} small safetensors files into the run at N={args.dumps}")
    for name, g in (("shards", new), ("one manifest", old)):
        print(f"{name:<13} {g.ingest_seconds:>6.2f} s, {g.ingest_bytes / 1024:>8.1f} KiB written")


if __name__ == "__main__":
    main()
