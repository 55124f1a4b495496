"""Scaling with cores: ingest, export, snapshot and restore at one core and at all cores.

For each operation, on transformer-shaped data (``gradpipe.testing.write_transformer_run``:
MiniLM-L6 widths, real backprop and AdamW, 87 MiB float32 gradient dumps of 105 tensors; the
training states are parameters + both Adam moments, 260 MiB each), the script prints:

- MiB/s of logical tensor bytes with the process pinned to one core and to every core it may
  use (``os.sched_setaffinity`` in the child; gradpipe sizes its thread pools from the
  affinity, and ``workers=`` follows it), and the speed-up;
- the **GIL share**: of the samples in which a thread of the process was busy (``py-spy
  record``, idle threads left out), the share that held the GIL (``py-spy record --gil``),
  both recorded at all cores over the timed part only (py-spy attaches to the child once its
  imports, gradpipe's task modules included, and data loading are done);
- the speed-up Amdahl's law allows on 16 and 64 cores if the GIL-holding part were the only
  serial part: ``1 / (g + (1 - g) / n)``.

Anchors, measured in the same run on the same files, each with the same core counts:

- ``cp -r`` of the dump directory (ingest's anchor; one process whatever the core count, so
  its "all cores" figure is the same copy again),
- safetensors ``load_file`` + ``save_file`` of every dump, one thread per core
  (export's anchor: what a Python user would run),
- ``torch.save`` / ``torch.load`` of every training state, one thread per core
  (snapshot's and restore's anchors), where torch is installed,
- ZipNN (``zipnn.ZipNN``, its own threads) compressing every dump's tensors, where installed.

"gradpipe ingest, processes" is the same ingest on gradpipe's local process pool
(``gp.runner(processes=True)``: one single-threaded process per core, no GIL shared), and
"gradpipe ingest, LocalCluster" on a ``distributed`` ``LocalCluster`` of as many
single-threaded processes (a scheduler and a nanny per worker besides); each is started and
warmed up before the timed part, as a long-lived pool or cluster would be.

Every timed part runs in a child process of its own (``--child``), so the parent never
shares its GIL, the page cache is warmed by an untimed first pass, and each row is the best
of ``--repeat`` runs. Data goes under ``--root`` (default ``bench-data/scaling``), written once.

``--gil-top N`` then prints, per operation, the N functions that held the GIL most (their own
samples over all GIL-holding samples): what still serialises the threads.

Run: ``python benchmarks/bench_scaling.py`` (``--mib M`` of dumps, default 1000;
``--states N``, default 3; ``--repeat N``; ``--skip-gil`` without py-spy; ``--ops`` a subset;
``--gil-top N``).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import linecache
import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, NoReturn

MiB = 2**20
_STATE_OPS = ("snapshot", "restore", "torch-save", "torch-load")
OPS = ("ingest", "export", "snapshot", "restore")
ANCHORS = {
    "ingest": ("cp-r", "cp -r"),
    "export": ("safetensors", "safetensors load+save"),
    "snapshot": ("torch-save", "torch.save"),
    "restore": ("torch-load", "torch.load"),
}


# --- the children: one timed operation each, printing {"seconds", "bytes"} as JSON ---------


def _dumps(data: Path) -> list[Path]:
    return sorted((data / "dumps").glob("step=*/peer=*.safetensors"))


def _states(data: Path, count: int) -> list[Path]:
    return sorted((data / "state").glob("step=*.safetensors"))[:count]


def _logical_bytes(paths: list[Path]) -> int:
    from safetensors import safe_open

    total = 0
    for path in paths:
        with safe_open(path, framework="numpy") as f:
            for key in f.keys():  # noqa: SIM118 - safe_open has no __iter__
                total += _slice_bytes(f.get_slice(key))
    return total


def _slice_bytes(view: Any) -> int:
    import numpy as np

    sizes = {"F32": 4, "F16": 2, "BF16": 2, "F64": 8, "I64": 8, "I32": 4, "U8": 1, "I8": 1}
    return int(np.prod(view.get_shape(), dtype=np.int64)) * sizes[view.get_dtype()]


def _nested_state(path: Path) -> dict[str, Any]:
    """A training state as a torch loop keeps it: {"params", "exp_avg", "exp_avg_sq"}."""
    from safetensors.numpy import load_file

    flat = load_file(path)
    state: dict[str, dict[str, Any]] = {}
    for key, value in flat.items():
        kind, name = key.split("/", 1)
        state.setdefault(kind, {})[name] = value
    return state


def _state_bytes(state: dict[str, Any]) -> int:
    return sum(a.nbytes for group in state.values() for a in group.values())


def _pool(cores: int, func: Callable[[Any], Any], items: list[Any]) -> None:
    with ThreadPoolExecutor(cores) as pool:
        for _ in pool.map(func, items):
            pass


#: Set in a child run under py-spy: called where the timed part starts.
_READY: list[Callable[[], None]] = []


def _start() -> float:
    """The start of the timed part: a profiler attaches here, after imports and loading."""
    for ready in _READY:
        ready()
    return time.perf_counter()


def _wait_for_profiler() -> None:
    print("READY", flush=True)
    sys.stdin.readline()


def child(op: str, cores: int, data: Path, work: Path, states: int) -> NoReturn:
    """Run ``op`` once, pinned to ``cores`` cores; print the seconds and logical bytes, exit."""
    os.sched_setaffinity(0, sorted(os.sched_getaffinity(0))[:cores])
    import gradpipe as gp
    from gradpipe.graph.warmup import warm_up

    # gradpipe's modules are imported before the timed part, as the anchors' are (torch and
    # safetensors are imported before their timers start): the timed part is the work. The
    # imports (about 0.6 s on the 2-core machine) are a constant of a process's start-up
    # that no core count changes; counted in, they hid the scaling of a 1-2 s operation.
    warm_up()
    _ = (gp.ingest, gp.export_dump, gp.snapshot, gp.restore)  # their modules, imported lazily

    dumps = _dumps(data)
    pattern = str(data / "dumps" / "step={step}" / "peer={peer}.safetensors")
    out = work / "out"
    shutil.rmtree(out, ignore_errors=True)
    out.mkdir(parents=True)
    # Dumps' logical bytes for the operations on them (the state ones count their states).
    nbytes = _logical_bytes(dumps) if op not in _STATE_OPS else 0
    if op == "ingest":
        store = gp.open_store(out / "store", mode="w")
        started = _start()
        report = gp.ingest(store, pattern, run="r", workers=cores)
        seconds = time.perf_counter() - started
        if report.failures:
            raise SystemExit(f"ingest failed: {report.failures}")
    elif op in ("ingest-processes", "ingest-cluster"):
        # The same ingest on one single-threaded process per core: gradpipe's local process
        # pool, or a distributed LocalCluster; either started (and warmed up) before the timed
        # part, as a long-lived pool or cluster would be.
        store = gp.open_store(out / "store", mode="w")
        with contextlib.ExitStack() as stack:
            if op == "ingest-processes":
                runner = stack.enter_context(gp.runner(processes=True, workers=cores))
                runner.get({"up": (os.getpid,)}, ["up"], name="gradpipe-start")
            else:
                from distributed import Client, LocalCluster

                cluster = stack.enter_context(
                    LocalCluster(
                        n_workers=cores,
                        threads_per_worker=1,
                        processes=True,
                        dashboard_address=":0",
                    )
                )
                runner = stack.enter_context(gp.runner(stack.enter_context(Client(cluster))))
                runner.get({"up": (os.getpid,)}, ["up"], name="gradpipe-start")
            started = _start()
            report = gp.ingest(store, pattern, run="r", runner=runner)
            seconds = time.perf_counter() - started
        if report.failures:
            raise SystemExit(f"ingest failed: {report.failures}")
    elif op == "export":
        store = gp.open_store(work / "ingested", mode="r")
        keys = [(int(p.parent.name.split("=")[1]), p.stem.split("=")[1]) for p in dumps]
        started = _start()
        _pool(
            cores,
            lambda k: gp.export_dump(store, "r", k[0], k[1], out / f"{k[0]}-{k[1]}.safetensors"),
            keys,
        )
        seconds = time.perf_counter() - started
    elif op in ("snapshot", "restore"):
        loaded = [_nested_state(p) for p in _states(data, states)]
        nbytes = sum(_state_bytes(s) for s in loaded)
        if op == "snapshot":
            store = gp.open_store(out / "store", mode="w")
            started = _start()
            for step, state in enumerate(loaded):
                gp.snapshot(store, "s", state, step=step)
        else:
            store = gp.open_store(work / "snapshots", mode="r")
            started = _start()
            for step in range(len(loaded)):
                gp.restore(store, "s", step=step)
        seconds = time.perf_counter() - started
    elif op == "cp-r":
        started = _start()
        subprocess.run(["cp", "-r", str(data / "dumps"), str(out / "dumps")], check=True)
        seconds = time.perf_counter() - started
    elif op == "safetensors":
        from safetensors.numpy import load_file, save_file

        started = _start()
        _pool(cores, lambda p: save_file(load_file(p), out / f"{p.parent.name}-{p.name}"), dumps)
        seconds = time.perf_counter() - started
    elif op in ("torch-save", "torch-load"):
        import torch

        loaded = [_nested_state(p) for p in _states(data, states)]
        nbytes = sum(_state_bytes(s) for s in loaded)
        tensors = [
            {k: {n: torch.from_numpy(a) for n, a in g.items()} for k, g in s.items()}
            for s in loaded
        ]
        files = [out / f"{i}.pt" for i in range(len(tensors))]
        torch.set_num_threads(cores)
        if op == "torch-load":
            for state, path in zip(tensors, files, strict=True):
                torch.save(state, path)
        started = _start()
        if op == "torch-save":
            _pool(cores, lambda i: torch.save(tensors[i], files[i]), list(range(len(files))))
        else:
            _pool(cores, lambda p: torch.load(p, weights_only=True), files)
        seconds = time.perf_counter() - started
    elif op == "zipnn":
        import zipnn
        from safetensors.numpy import load_file

        arrays = [a for p in dumps for a in load_file(p).values()]
        z = zipnn.ZipNN(input_format="numpy", bytearray_dtype="float32", threads=cores)
        started = _start()
        for array in arrays:
            z.compress(array)
        seconds = time.perf_counter() - started
    else:
        raise SystemExit(f"unknown operation {op!r}")
    # Printed and gone while the data is still referenced: freeing GiBs of arrays holds the
    # GIL, and a profile attached to this child is to see the timed part, not its teardown.
    print(json.dumps({"seconds": seconds, "bytes": nbytes}), flush=True)
    os._exit(0)


# --- the parent: data, timings, py-spy, the table ------------------------------------------


@dataclass
class Row:
    op: str
    label: str
    one: float  # MiB/s at one core
    all: float  # MiB/s at all cores
    gil: float | None = None  # share of busy samples holding the GIL

    @property
    def speedup(self) -> float:
        return self.all / self.one

    def amdahl(self, cores: int) -> float | None:
        if self.gil is None:
            return None
        return 1 / (self.gil + (1 - self.gil) / cores)


def _child_argv(op: str, cores: int, args: argparse.Namespace, work: Path) -> list[str]:
    return [
        sys.executable,
        __file__,
        "--child",
        op,
        "--cores",
        str(cores),
        "--root",
        str(args.root),
        "--work",
        str(work),
        "--states",
        str(args.states),
    ]


def _run_child(argv: list[str]) -> dict[str, float]:
    done = subprocess.run(argv, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise SystemExit(f"{' '.join(argv)} failed:\n{done.stdout}\n{done.stderr}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def mib_per_s(op: str, cores: int, args: argparse.Namespace, work: Path) -> float:
    best = 0.0
    for _ in range(args.repeat):
        os.sync()
        result = _run_child(_child_argv(op, cores, args, work))
        best = max(best, result["bytes"] / MiB / result["seconds"])
    return best


def _stacks(raw: Path) -> Counter[str]:
    """Samples per innermost frame in a py-spy ``--format raw`` file (folded stacks + count)."""
    frames: Counter[str] = Counter()
    for line in raw.read_text().splitlines():
        stack, _, count = line.rpartition(" ")
        if count.isdigit():
            frames[stack.rpartition(";")[2].strip() or "(native)"] += int(count)
    return frames


#: Innermost frames of a thread blocked on a lock, a queue or a selector. py-spy counts some
#: of these waits as busy (a lock taken with a timeout), which would inflate the busy samples
#: and so understate the GIL share: they are left out of both counts.
_WAITS = (
    "Condition.wait (threading.py",
    "Event.wait (threading.py",
    "Semaphore.acquire (threading.py",
    "Thread.join (threading.py",
    "Queue.get (queue.py",
    "BaseSelector.select (selectors.py",
    "EpollSelector.select (selectors.py",
)


def _waiting(frame: str) -> bool:
    if frame.startswith(_WAITS):
        return True
    # A pool thread waiting for work: the innermost Python line is the queue's get.
    if frame.startswith("_worker (") and "concurrent/futures/thread.py:" in frame:
        path, _, line = frame[frame.index("(") + 1 : -1].rpartition(":")
        source = linecache.getline(_stdlib(path), int(line)) if line.isdigit() else ""
        return "get(" in source
    return False


def _stdlib(path: str) -> str:
    return path if Path(path).is_absolute() else str(Path(os.__file__).parent / path)


def _samples(raw: Path) -> int:
    """Busy samples: those whose innermost frame is not waiting (see ``_WAITS``)."""
    return sum(n for frame, n in _stacks(raw).items() if not _waiting(frame))


def gil_holders(op: str, work: Path, top: int) -> list[str]:
    """The ``top`` functions that held the GIL most in ``op``'s profile, as table lines."""
    raw = work / f"{op}-gil.txt"
    if not raw.exists():
        return []
    frames = _stacks(raw)
    total = sum(frames.values())
    return [f"  {100 * n / total:5.1f}%  {frame}" for frame, n in frames.most_common(top)]


def gil_share(op: str, cores: int, args: argparse.Namespace, work: Path) -> float | None:
    """GIL-holding over busy samples of the timed part of ``op`` (two runs, one each)."""
    counts = []
    for extra in ([], ["--gil"]):
        samples = _spied(op, cores, args, work, extra)
        if samples is None:
            return None
        counts.append(samples)
    busy, held = counts
    return held / busy if busy else None


def _spied(
    op: str, cores: int, args: argparse.Namespace, work: Path, extra: list[str]
) -> int | None:
    """py-spy samples of one child run, attached once the child is set up (``_start``)."""
    spy = shutil.which("py-spy") or str(Path(sys.executable).parent / "py-spy")
    raw = work / f"{op}{'-gil' if extra else ''}.txt"
    raw.unlink(missing_ok=True)
    argv = [*_child_argv(op, cores, args, work), "--spy"]
    child = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    assert child.stdin is not None
    assert child.stdout is not None
    if child.stdout.readline().strip() != "READY":
        child.kill()
        print(f"{op}: the child did not get ready", file=sys.stderr)
        return None
    record = [spy, "record", "-r", "200", "-f", "raw", "-o", str(raw), *extra]
    profiler = subprocess.Popen(
        [*record, "--pid", str(child.pid)], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE
    )
    time.sleep(1.0)  # py-spy attaches and starts sampling
    child.stdin.write("\n")
    child.stdin.flush()
    child.stdin.close()
    child.stdout.read()  # the child's end; it cannot be reaped while py-spy still traces it
    try:
        _, err = profiler.communicate(timeout=60)
    except subprocess.TimeoutExpired:
        # Seen once: py-spy --gil hung on a child that had exited, and both waited forever.
        profiler.kill()
        _, err = profiler.communicate()
        err += b" (py-spy hung after the child ended, and was killed)"
    child.wait()
    if child.returncode != 0 or not raw.exists():
        print(f"py-spy failed on {op}: {err.decode()[-300:]}", file=sys.stderr)
        return None
    return _samples(raw)


def prepare(args: argparse.Namespace, work: Path) -> None:
    """Write the training run once; ingest and snapshot it once for export and restore."""
    import gradpipe as gp
    from gradpipe.testing import TransformerConfig, write_transformer_run

    data = Path(args.root) / f"run-{args.mib:g}"
    if not data.exists():
        config = TransformerConfig.for_dump_size(args.mib)  # full-size dumps, steps to fit
        if config.steps < args.states:  # each step also writes one training state
            config = replace(config, steps=args.states)
        write_transformer_run(data, config)
    args.root = data
    subprocess.run(["cp", "-r", str(data), str(work / "warm")], check=True)  # page cache
    shutil.rmtree(work / "warm")
    pattern = str(data / "dumps" / "step={step}" / "peer={peer}.safetensors")
    gp.ingest(gp.open_store(work / "ingested", mode="w"), pattern, run="r")
    snapshots = gp.open_store(work / "snapshots", mode="w")
    for step, path in enumerate(_states(data, args.states)):
        gp.snapshot(snapshots, "s", _nested_state(path), step=step)


def _available(op: str) -> bool:
    module = {"torch-save": "torch", "torch-load": "torch", "zipnn": "zipnn"}.get(op)
    if module is None:
        return True
    try:
        __import__(module)
    except ImportError:
        return False
    return True


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mib", type=float, default=1000, help="MiB of dumps (default 1000)")
    parser.add_argument("--states", type=int, default=3, help="training states (default 3)")
    parser.add_argument("--repeat", type=int, default=2, help="best of N (default 2)")
    parser.add_argument("--root", default="bench-data/scaling", help="where the data goes")
    parser.add_argument("--ops", default=",".join(OPS), help="a subset of " + ",".join(OPS))
    parser.add_argument("--skip-gil", action="store_true", help="no py-spy profiles")
    parser.add_argument(
        "--gil-top", type=int, default=0, help="print the N functions holding the GIL most"
    )
    parser.add_argument("--child", help=argparse.SUPPRESS)
    parser.add_argument("--cores", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--work", help=argparse.SUPPRESS)
    parser.add_argument("--spy", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.spy:
        _READY.append(_wait_for_profiler)
    if args.child:
        child(args.child, args.cores, Path(args.root), Path(args.work), args.states)

    cores = len(os.sched_getaffinity(0))
    with tempfile.TemporaryDirectory(prefix="gradpipe-scaling-") as tmp:
        work = Path(tmp)
        prepare(args, work)
        dumps = _dumps(Path(args.root))
        print(
            f"data: {len(dumps)} transformer-shaped dumps "
            f"({sum(p.stat().st_size for p in dumps) / MiB:.0f} MiB), "
            f"{args.states} training states; {cores} cores; best of {args.repeat}"
        )
        rows: list[Row] = []
        for op in args.ops.split(","):
            gil = None if args.skip_gil else gil_share(op, cores, args, work)
            rows.append(Row(op, f"gradpipe {op}", *_both(op, cores, args, work), gil))
            anchor, label = ANCHORS[op]
            if _available(anchor):
                rows.append(Row(op, label, *_both(anchor, cores, args, work)))
        if "ingest" in args.ops.split(","):
            for op, how in (("ingest-processes", "processes"), ("ingest-cluster", "LocalCluster")):
                label = f"ingest, {how}"
                rows.append(Row("ingest", f"gradpipe {label}", *_both(op, cores, args, work)))
        if _available("zipnn"):
            rows.append(Row("ingest", "zipnn (compress)", *_both("zipnn", cores, args, work)))
        print_table(rows, cores)
        for op in args.ops.split(",") if args.gil_top and not args.skip_gil else ():
            print(f"\nheld the GIL in {op} (own samples over all GIL-holding samples):")
            print("\n".join(gil_holders(op, work, args.gil_top)))


def _both(op: str, cores: int, args: argparse.Namespace, work: Path) -> tuple[float, float]:
    return mib_per_s(op, 1, args, work), mib_per_s(op, cores, args, work)


def _cell(value: float | None, spec: str, unit: str) -> str:
    return f"{'-':>9}" if value is None else f"{format(value, spec)}{unit}".rjust(9)


def print_table(rows: list[Row], cores: int) -> None:
    head = (
        f"{'operation':<30} {'1 core MiB/s':>12} {f'{cores} cores MiB/s':>15} {'speed-up':>9} "
        f"{'GIL share':>9} {'Amdahl 16':>9} {'Amdahl 64':>9} {'x anchor':>9}"
    )
    print(head)
    print("-" * len(head))
    anchors: dict[str, Row] = {}
    for r in rows:  # each operation's first anchor (ZipNN is shown, not compared)
        if not r.label.startswith("gradpipe"):
            anchors.setdefault(r.op, r)
    for row in rows:
        anchor = anchors.get(row.op)
        ratio = row.all / anchor.all if anchor and row.label.startswith("gradpipe") else None
        gil = None if row.gil is None else 100 * row.gil
        print(
            f"{row.label:<30} {row.one:>12.0f} {row.all:>15.0f} {_cell(row.speedup, '.2f', 'x')} "
            f"{_cell(gil, '.0f', '%')} {_cell(row.amdahl(16), '.1f', 'x')} "
            f"{_cell(row.amdahl(64), '.1f', 'x')} {_cell(ratio, '.2f', 'x')}"
        )
    print(
        "GIL share: py-spy samples holding the GIL over busy samples, at all cores; Amdahl: the "
        "speed-up on n cores if the GIL-holding part were the only serial part."
    )


if __name__ == "__main__":
    main()
