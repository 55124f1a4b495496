"""A server optimizer step (FedAdam) out of core, beside the same step on whole arrays.

The data: one run of 2 peers whose dumps hold ``--tensors`` float32 tensors of
``--mparams`` million parameters in all (normal noise, seed 0; default 4 x 16 M
= 64 M parameters, 256 MiB per copy), ingested into a local store in /tmp and
aggregated (FedAvg); a snapshot chain holds the parameters and FedAdam's state
(``m``, ``v``) after one round. Each row applies round 2 (step 1) to its own
copy of that chain, in a fresh subprocess, best of ``--repeat`` runs; peak
memory is the rise of the subprocess's resident high-water mark (``VmHWM`` of
``/proc/self/status``, reset through ``/proc/self/clear_refs`` when the row
starts, after imports; Linux only):

- ``gradpipe apply_server_update``: the graph of one task per chunk, on local
  threads (``--workers``), writing the next snapshot chunk by chunk;
- ``whole arrays (restore, step, snapshot)``: what the step did before it was
  out of core: ``gp.restore`` of the whole state, the aggregate read whole,
  :func:`gradpipe.aggregation.server_opt.server_step` per tensor, ``gp.snapshot``;
- ``numpy server_step only``: the step's arithmetic on arrays already in memory
  (no store): the compute anchor.

Columns: seconds, ratio to the numpy row, peak RSS above the interpreter's
after imports (MiB), and that over the size of one copy of the parameters.
The two stored rows are checked to give the same parameters bit for bit.

Run: ``python benchmarks/bench_server.py [--mparams 64] [--tensors 4]``.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import shutil
import tempfile
import time
from pathlib import Path
from typing import Any

import dask.config
import numpy as np

import gradpipe as gp
from gradpipe.aggregation.server_opt import ServerOptimizerConfig, server_step
from gradpipe.formats.safetensors import write_safetensors

LR = 0.01


def rss() -> tuple[int, int]:
    """This process's resident set now and its high-water mark since the last reset, bytes."""
    fields = {}
    for line in Path("/proc/self/status").read_text().splitlines():
        key, _, value = line.partition(":")
        if key in ("VmRSS", "VmHWM"):
            fields[key] = int(value.split()[0]) * 1024
    return fields["VmRSS"], fields["VmHWM"]


def reset_peak() -> int:
    """Start a new high-water mark here (Linux: ``5`` to clear_refs); the RSS now."""
    Path("/proc/self/clear_refs").write_text("5")
    return rss()[0]


def peak_above(idle: int) -> int:
    return rss()[1] - idle


def prepare(root: Path, mparams: int, tensors: int) -> None:
    rng = np.random.default_rng(0)
    size = mparams * 2**20 // tensors
    for step in (0, 1):
        for peer in ("p0", "p1"):
            arrays = {
                f"layer{i}.weight": rng.normal(size=size).astype(np.float32) * 1e-3
                for i in range(tensors)
            }
            path = root / "dumps" / f"step={step}" / f"peer={peer}.safetensors"
            path.parent.mkdir(parents=True, exist_ok=True)
            write_safetensors(str(path), arrays, {"num_examples": "32"})
    store = gp.open_store(root / "store", mode="w")
    assert gp.ingest(store, str(root / "dumps/step={step}/peer={peer}.safetensors"), run="r").ok
    assert gp.aggregate(store, run="r", method="fedavg").ok
    params = {f"layer{i}.weight": rng.normal(size=size).astype(np.float32) for i in range(tensors)}
    for name in ("ours", "whole"):
        gp.snapshot(store, name, {"params": params}, step=0)
        gp.apply_server_update(
            store, run="r", step=0, aggregate="fedavg", snapshot=name, optimizer="fedadam", lr=LR
        )


def contender(kind: str, root: str, workers: int, queue: Any) -> None:
    store = gp.open_store(root + "/store", mode="a")
    config = ServerOptimizerConfig.from_dict({"method": "fedadam", "lr": LR})
    if kind == "numpy":
        view = gp.open_run(store, "r").aggregate("fedavg", step=1)
        grads = view.read_all()
        state = gp.restore(store, "whole")
        idle = reset_peak()
        start = time.perf_counter()
        for name, g in grads.items():
            own = {k: state["server_optimizer"][k][name] for k in ("m", "v")}
            server_step(state["params"][name], g, own, config, t=2)
        queue.put((time.perf_counter() - start, peak_above(idle)))
        return
    idle = reset_peak()
    start = time.perf_counter()
    if kind == "ours":
        with gp.runner(workers=workers) as runner:
            gp.apply_server_update(
                store, run="r", step=1, aggregate="fedavg", snapshot="ours",
                optimizer="fedadam", lr=LR, runner=runner,
            )  # fmt: skip
    else:
        state = gp.restore(store, "whole")
        grads = gp.open_run(store, "r").aggregate("fedavg", step=1).read_all()
        server = state["server_optimizer"]
        for name, g in grads.items():
            own = {k: server[k][name] for k in ("m", "v")}
            state["params"][name], after = server_step(
                state["params"][name], g, own, config, t=server["t"] + 1
            )
            for k in ("m", "v"):
                server[k][name] = after[k]
        server["t"] += 1
        gp.snapshot(store, "whole", state, step=1)
    queue.put((time.perf_counter() - start, peak_above(idle)))


def measure(kind: str, root: str, workers: int) -> tuple[float, int]:
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    proc = ctx.Process(target=contender, args=(kind, root, workers, queue))
    proc.start()
    result = queue.get()
    proc.join()
    return result


def reset(store: gp.Store, name: str) -> None:
    """Drop the snapshot a run added, so every repeat applies the same round."""
    versions = gp.snapshot_log(store, name)
    if len(versions) > 2:
        store.refs.set(f"snapshots/{name}", versions[1].id, expected=versions[-1].id)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--mparams", type=int, default=64, help="million parameters in all")
    parser.add_argument("--tensors", type=int, default=4)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--repeat", type=int, default=2)
    args = parser.parse_args()
    root = Path(tempfile.mkdtemp(prefix="gradpipe-bench-server-"))
    try:
        with dask.config.set({"gradpipe.chunk-bytes": "4 MiB"}):
            prepare(root, args.mparams, args.tensors)
        store = gp.open_store(root / "store", mode="a")
        rows = {}
        for kind in ("ours", "whole", "numpy"):
            runs = []
            for _ in range(args.repeat):
                reset(store, "ours")
                reset(store, "whole")
                runs.append(measure(kind, str(root), args.workers))
            rows[kind] = min(runs)
        ours, whole = gp.restore(store, "ours"), gp.restore(store, "whole")
        same = all(np.array_equal(ours["params"][n], whole["params"][n]) for n in ours["params"])
        copy = args.mparams * 2**20 * 4
        names = {
            "ours": "gradpipe apply_server_update",
            "whole": "whole arrays (restore, step, snapshot)",
            "numpy": "numpy server_step only",
        }
        print(
            f"FedAdam server step, {args.mparams} M float32 parameters in {args.tensors} "
            f"tensors ({copy / 2**20:.0f} MiB per copy), {args.workers} threads; "
            f"stored rows bit-identical: {same}"
        )
        print(f"{'contender':<40} {'seconds':>8} {'x numpy':>8} {'peak MiB':>9} {'x copy':>7}")
        for kind, (seconds, peak) in rows.items():
            print(
                f"{names[kind]:<40} {seconds:8.2f} {seconds / rows['numpy'][0]:8.2f} "
                f"{peak / 2**20:9.0f} {peak / copy:7.2f}"
            )
    finally:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
