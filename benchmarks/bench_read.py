"""Reads at disk speed: ``gradpipe export``, ``ls``, ``--version``, ``get_tensor``, ``read_all``.

Data: ``gradpipe.testing.write_transformer_run`` with ``TransformerConfig(steps=--steps)``
(default 2 steps x 2 peers): a BERT-small / MiniLM-L6-shaped encoder fine-tuned
with real backprop and AdamW; each float32 dump holds 105 tensors, 87 MiB (half
of them small LayerNorm/bias vectors kept inline in their manifests, a 45 MiB
token-embedding gradient with ~0.3% of rows non-zero, dense 384x384 and
384x1536 gradients), as users' dumps are. The run is written under
``bench-data/read/`` and ingested there with ``gradpipe.ingest``, once; later
runs reuse both (``--fresh`` makes them again).

Every figure is the median of ``--repeat`` runs (default 5), the contenders of a
table alternating run by run, with the page cache warm (every file is read once
before timing). Tables:

(a) whole commands, wall seconds (subprocesses): ``gradpipe export STORE --run r
    --step 0 --peer peer0 -o OUT`` beside a ``python -c`` that loads the same
    original file with ``safetensors.numpy.load_file`` and writes it with
    ``save_file``; the export's output is checked to be byte-identical to the
    original file. gradpipe also checks every block against its id and fsyncs
    the output before renaming it into place; safetensors does neither (a third row adds
    the fsync to the anchor);
(b) ``gradpipe ls STORE`` and ``gradpipe --version`` beside ``python -c pass``;
(c) in this process, MiB/s of tensor bytes: ``store.get_tensor`` of the largest
    tensor beside ``safetensors.safe_open(...).get_tensor`` of it, and
    ``dump.read_all()`` beside ``safetensors.numpy.load_file`` of the dump.

PASS/FAIL lines follow for the targets: export <= 1.5x the safetensors round
trip; ``ls`` and ``--version`` <= 0.3 s. On a small machine shared with other
work the figures move by tens of percent from run to run; the ratios, measured
in alternation, move less.

Run: ``python benchmarks/bench_read.py`` (``--repeat N``, ``--steps N``, ``--fresh``).
"""

from __future__ import annotations

import argparse
import filecmp
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
DATA = ROOT / "bench-data" / "read"
RUN = "r"
EXPORT_TARGET = 1.5
STARTUP_TARGET = 0.3


def prepare(steps: int, fresh: bool) -> tuple[Path, Path]:
    """The transformer run's directory and its store, made if missing."""
    from gradpipe import ingest, open_run, open_store
    from gradpipe.testing.transformer import TransformerConfig, write_transformer_run

    run_dir, store_dir = DATA / "run", DATA / "store"
    if fresh:
        shutil.rmtree(DATA, ignore_errors=True)
    config = TransformerConfig(steps=steps)
    if not (run_dir / "done").exists():
        shutil.rmtree(run_dir, ignore_errors=True)
        print(f"writing {config.steps} steps x {config.peers} peers under {run_dir} ...")
        write_transformer_run(run_dir, config, states=False)
        (run_dir / "done").touch()
    pattern = str(run_dir / "dumps" / "step={step}" / "peer={peer}.safetensors")
    store = open_store(store_dir, mode="a")
    try:
        recorded = len(open_run(store, RUN))
    except KeyError:
        recorded = 0
    if recorded < config.steps * config.peers:
        print(f"ingesting into {store_dir} ...")
        report = ingest(store, pattern, run=RUN)
        if not report.ok:
            raise SystemExit(report.summary())
    return run_dir, store_dir


def wall(argv: list[str]) -> float:
    start = time.perf_counter()
    subprocess.run(argv, check=True, stdout=subprocess.DEVNULL)
    return time.perf_counter() - start


def alternate(contenders: dict[str, Callable[[], float]], repeat: int) -> dict[str, float]:
    """Median of ``repeat`` runs of each, run in turn (one of each per round)."""
    times: dict[str, list[float]] = {name: [] for name in contenders}
    for _ in range(repeat):
        for name, run in contenders.items():
            times[name].append(run())
    return {name: statistics.median(t) for name, t in times.items()}


def timed(call: Callable[[], object]) -> Callable[[], float]:
    def run() -> float:
        start = time.perf_counter()
        call()
        return time.perf_counter() - start

    return run


def verdict(ok: bool) -> str:
    return "PASS" if ok else "FAIL"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--fresh", action="store_true", help="write and ingest the run again")
    args = parser.parse_args()

    run_dir, store_dir = prepare(args.steps, args.fresh)
    source = run_dir / "dumps" / "step=0000" / "peer=peer0.safetensors"
    mib = source.stat().st_size / 2**20
    env_python = sys.executable
    with tempfile.TemporaryDirectory(prefix="gp-bench-read-") as tmp:
        out_gp, out_st = Path(tmp) / "gp.safetensors", Path(tmp) / "st.safetensors"
        gradpipe = [env_python, "-m", "gradpipe.cli"]
        export = [*gradpipe, "export", str(store_dir), "--run", RUN, "--step", "0"]
        export += ["--peer", "peer0", "-o", str(out_gp)]
        anchor = (
            "from safetensors.numpy import load_file, save_file; "
            f"save_file(load_file({str(source)!r}), {str(out_st)!r})"
        )
        # The same, then made durable as gradpipe makes its output: fsync before it counts.
        durable = f"{anchor}; import os; fd = os.open({str(out_st)!r}, os.O_RDONLY); os.fsync(fd)"
        contenders = {
            "gradpipe export": lambda: wall(export),
            "safetensors load_file + save_file": lambda: wall([env_python, "-c", anchor]),
            "  the same + fsync": lambda: wall([env_python, "-c", durable]),
        }
        alternate(contenders, 1)  # warm the page cache and every import
        if not filecmp.cmp(out_gp, source, shallow=False):
            raise SystemExit("gradpipe export did not reproduce the original file")
        export_times = alternate(contenders, args.repeat)
        startup = alternate(
            {
                "gradpipe ls STORE": lambda: wall([*gradpipe, "ls", str(store_dir)]),
                "gradpipe --version": lambda: wall([*gradpipe, "--version"]),
                "python -c pass": lambda: wall([env_python, "-c", "pass"]),
            },
            args.repeat,
        )

    from safetensors import safe_open
    from safetensors.numpy import load_file

    from gradpipe import open_run, open_store
    from gradpipe.storage.reads import read_threads

    store = open_store(store_dir, mode="a")
    dump = open_run(store, RUN).dump(0, "peer0")
    infos = dump.infos()
    largest = max(infos, key=lambda n: infos[n].nbytes)
    big_mib = infos[largest].nbytes / 2**20

    def safe_get() -> np.ndarray:
        with safe_open(str(source), framework="numpy") as f:
            return f.get_tensor(largest)

    # The dump's tensor manifests live inside its manifest; put_tensor gives the
    # largest one an id of its own (its blocks are stored already: dedup).
    tensor_id = store.put_tensor(safe_get(), name="bench-read")
    if not np.array_equal(store.get_tensor(tensor_id).view(np.uint8), safe_get().view(np.uint8)):
        raise SystemExit(f"get_tensor({largest!r}) is not bit-exact")
    reads = alternate(
        {
            "store.get_tensor": timed(lambda: store.get_tensor(tensor_id)),
            "safe_open().get_tensor": timed(safe_get),
            "dump.read_all()": timed(dump.read_all),
            "safetensors load_file": timed(lambda: load_file(str(source))),
        },
        args.repeat,
    )

    cores = read_threads()
    print(
        f"\ndata: transformer run (MiniLM-L6 shape, float32), dump step 0 / peer0: {mib:.1f} MiB,"
        f" {len(infos)} tensors; median of {args.repeat}, alternating; {cores} decoding threads;"
        f" load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} cores\n"
    )
    anchor_s = export_times["safetensors load_file + save_file"]
    print(f"{'(a) whole command':40s} {'wall s':>8s} {'MiB/s':>8s} {'x anchor':>9s}")
    for name, t in export_times.items():
        print(f"{name:40s} {t:8.3f} {mib / t:8.0f} {t / anchor_s:9.2f}")
    pass_s = startup["python -c pass"]
    print(f"\n{'(b) start-up':40s} {'wall s':>8s} {'- pass s':>9s}")
    for name, t in startup.items():
        print(f"{name:40s} {t:8.3f} {t - pass_s:9.3f}")
    print(f"\n{'(c) in process':40s} {'MiB':>8s} {'MiB/s':>8s} {'x anchor':>9s}")
    rows = [
        ("store.get_tensor", big_mib, "safe_open().get_tensor"),
        ("safe_open().get_tensor", big_mib, "safe_open().get_tensor"),
        ("dump.read_all()", mib, "safetensors load_file"),
        ("safetensors load_file", mib, "safetensors load_file"),
    ]
    for name, size, against in rows:
        speed, anchor_speed = size / reads[name], size / reads[against]
        print(f"{name:40s} {size:8.1f} {speed:8.0f} {speed / anchor_speed:9.2f}")
    ratio = export_times["gradpipe export"] / anchor_s
    print()
    durable_ratio = export_times["gradpipe export"] / export_times["  the same + fsync"]
    print(f"{verdict(ratio <= EXPORT_TARGET)}: export {ratio:.2f}x the safetensors round trip")
    print(f"       (target <= {EXPORT_TARGET}x; {durable_ratio:.2f}x the round trip with fsync)")
    for name in ("gradpipe ls STORE", "gradpipe --version"):
        t = startup[name]
        print(f"{verdict(t <= STARTUP_TARGET)}: {name} {t:.3f} s (target <= {STARTUP_TARGET} s)")


if __name__ == "__main__":
    main()
