"""Ingest of many tiny dumps: time per dump as the run grows (what the test no longer times).

Data: ``--dumps`` counts (default 500, 2000, 8000) of tiny safetensors dumps,
4 peers per step, each two float32 tensors of 6 and 3 values, different in every
dump (nothing dedups), written under a temporary directory in /tmp. Each size is
ingested with ``gradpipe.ingest`` on the local threaded scheduler into a new
local store, best of ``--repeat`` runs. Columns: dumps, wall seconds,
milliseconds per dump, and per-dump time relative to the smallest size (about
1.0 when the cost per dump does not grow with the run; the anchor is the
smallest size itself). ``tests/test_ingest_scale.py`` checks the same property by
counting tasks, file opens and store round trips instead of timing.

Run: ``python benchmarks/bench_ingest_small.py [--dumps 500 2000 8000] [--repeat 3]``.
"""

from __future__ import annotations

import argparse
import shutil
import tempfile
import time
from pathlib import Path

import numpy as np

import gradpipe as gp
from gradpipe.formats.safetensors import write_safetensors

PEERS = 4


def write_dumps(root: Path, n: int) -> str:
    for i in range(n):
        step, peer = divmod(i, PEERS)
        path = root / f"step={step:05d}" / f"peer=p{peer}.safetensors"
        path.parent.mkdir(parents=True, exist_ok=True)
        rng = np.random.default_rng(i)
        tensors = {
            "layer.weight": rng.standard_normal((2, 3)).astype(np.float32),
            "layer.bias": np.arange(3, dtype=np.float32) + np.float32(i + 1),
        }
        with path.open("wb") as f:
            write_safetensors(f, tensors, {"num_examples": str(i % 7 + 1)})
    return str(root / "step={step}" / "peer={peer}.safetensors")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dumps", type=int, nargs="+", default=[500, 2000, 8000])
    parser.add_argument("--repeat", type=int, default=3, help="best of N runs (default 3)")
    args = parser.parse_args()
    base = Path(tempfile.mkdtemp(prefix="gp-bench-small-"))
    try:
        rows = []
        for n in args.dumps:
            pattern = write_dumps(base / f"dumps{n}", n)
            best = float("inf")
            for attempt in range(args.repeat):
                store = gp.open_store(str(base / f"store{n}-{attempt}"), mode="w")
                start = time.perf_counter()
                report = gp.ingest(store, pattern, run="r")
                best = min(best, time.perf_counter() - start)
                if not report.ok or report.ingested != n:
                    raise SystemExit(report.summary())
            rows.append((n, best))
        anchor = rows[0][1] / rows[0][0]
        print(f"{'dumps':>7}  {'seconds':>8}  {'ms/dump':>8}  {'vs smallest':>11}")
        for n, seconds in rows:
            per = seconds / n
            print(f"{n:>7}  {seconds:>8.2f}  {per * 1e3:>8.2f}  {per / anchor:>11.2f}")
    finally:
        shutil.rmtree(base, ignore_errors=True)


if __name__ == "__main__":
    main()
