"""Creating small objects in a local store: ``O_TMPFILE`` + ``linkat`` against a named temp file.

Writes N objects of a few KiB through ``LocalBackend.write_if_absent`` both
ways, into fresh directories on the disk given (default: the current
directory's), alternating the two methods, and prints the best of the rounds.
Run: ``python benchmarks/bench_small_objects.py [--count 2000] [--size 3000] [--dir .]``.
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time
from pathlib import Path

from gradpipe.storage._local import LocalBackend


def once(directory: str, anonymous: bool, payloads: list[bytes]) -> float:
    with tempfile.TemporaryDirectory(dir=directory) as root:
        backend = LocalBackend(root)
        backend._tmpfile = anonymous and backend._tmpfile
        for i in range(256):
            Path(root, "blocks", f"{i:02x}").mkdir(parents=True)
        started = time.perf_counter()
        for i, data in enumerate(payloads):
            backend.write_if_absent(f"blocks/{i % 256:02x}/{i:010d}", data)
        return time.perf_counter() - started


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--count", type=int, default=2000)
    parser.add_argument("--size", type=int, default=3000)
    parser.add_argument("--dir", default=".")
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    payloads = [os.urandom(args.size) for _ in range(args.count)]
    best = {"O_TMPFILE + linkat": float("inf"), "named temp + link + unlink": float("inf")}
    for _ in range(args.rounds):
        for name, seconds in list(best.items()):
            best[name] = min(seconds, once(args.dir, name.startswith("O_"), payloads))
    base = best["named temp + link + unlink"]
    where = os.path.abspath(args.dir)
    print(f"{args.count} objects of {args.size} bytes in {where}, best of {args.rounds}")
    print(f"{'method':<28} {'seconds':>8} {'us/object':>10} {'speed-up':>9}")
    for name, seconds in best.items():
        per_object = seconds / args.count * 1e6
        print(f"{name:<28} {seconds:>8.3f} {per_object:>10.0f} {base / seconds:>8.2f}x")


if __name__ == "__main__":
    main()
