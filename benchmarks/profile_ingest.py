"""The ingest to profile: a transformer-shaped run ingested by the Python API with threads.

Writes the dumps once under ``bench-data/profile/`` (not timed), then ingests them into a
fresh store and prints the report. Profile it with a sampling profiler, e.g.::

    py-spy record -r 200 -f raw -o ingest.txt -- python benchmarks/profile_ingest.py
    python -m pyinstrument benchmarks/profile_ingest.py

``--mib`` sizes the run (default 1000: twelve 87 MiB dumps).
"""

from __future__ import annotations

import argparse
import shutil
import time
from pathlib import Path

import gradpipe as gp
from gradpipe.testing import TransformerConfig, write_transformer_run


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mib", type=float, default=1000, help="MiB of dumps (default 1000)")
    parser.add_argument("--root", default="bench-data/profile", help="where data and store go")
    args = parser.parse_args()
    root = Path(args.root)
    data = root / f"run-{args.mib:g}"
    if not data.exists():
        write_transformer_run(data, TransformerConfig.for_dump_size(args.mib), states=False)
    pattern = str(data / "dumps" / "step={step}" / "peer={peer}.safetensors")
    shutil.rmtree(root / "store", ignore_errors=True)
    store = gp.open_store(root / "store", mode="w")
    started = time.perf_counter()
    report = gp.ingest(store, pattern, run="r")
    print(report.summary())
    print(f"{time.perf_counter() - started:.2f} s")


if __name__ == "__main__":
    main()
