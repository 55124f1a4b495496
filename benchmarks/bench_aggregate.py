"""Federated averages from the store: gradpipe beside numpy and Flower in memory (issue 9).

The data: P peers' updates of one step (``--peers``, default 8 and 32), each a
dense float32 tensor set with the names and shapes of ``gradpipe.testing.transformer``'s
encoder: below its 22.7 M parameters the MiniLM shape shrunk by
``TransformerConfig.for_dump_size`` (``--params-m`` small), above it BERT-base width
(hidden 768, 12 heads, intermediate 3072, vocabulary 30522) with as many layers as
reach ``--params-m`` million parameters (default 50: 4 layers, 52.3 M). Values are
seeded standard normals (``numpy.random.default_rng((seed, peer))``); the first
``f = max(1, P // 8)`` peers are Byzantine (scaled by 10), so Krum has something to
reject; each peer's ``num_examples`` (100-999, seeded) is its FedAvg weight. Each peer
is one safetensors dump (step 0) under a temporary directory in /tmp; the P = 8 run
is hard links to the first 8 peers of the largest run. Every run is ingested into
one gradpipe store (untimed; content addressing shares the common blocks).

Rows (method x contender), each in its own child process (``sys.executable`` on
this script), so that its peak RSS (``getrusage(RUSAGE_SELF).ru_maxrss``: the
child's whole high-water mark, imports and loaded inputs included) is its own:

- ``numpy in memory``: the peers' tensors read into memory (untimed), then, timed,
  per tensor ``out = w0 * x0``, then ``multiply(x_p, w_p, out=tmp); add(out, tmp,
  out=out)`` with float32 weights ``n_p / sum(n)``: the memory-bandwidth bound,
  one thread as numpy runs it,
- ``Flower aggregate_inplace``: ``flwr.server.strategy.aggregate.aggregate_inplace``
  on ``(None, FitRes)`` pairs whose ``Parameters`` came from
  ``ndarrays_to_parameters`` (untimed); the timed call includes deserialising
  the tensors, which is what Flower's server does with every round's results,
- ``Flower aggregate_median`` / ``aggregate_krum(num_malicious=f, to_keep=0)`` on
  ``(NDArrays, num_examples)`` lists in memory,
- ``gradpipe (threads)``: ``gp.aggregate(store, run=..., steps=[0], method=...,
  name=..., force=True)`` on the default local threads, timed end to end (graph
  build, reads, compute, writes, commit), and ``gradpipe (LocalCluster)``: the same
  with ``client=`` a ``LocalCluster(n_workers=1, threads_per_worker=<cores>,
  processes=False)`` (start-up untimed). While ``gp.aggregate`` or a method is
  missing from the build, the row says so and the anchors still print.

Median and Krum run at ``--robust-peers`` (default 8): Flower's Krum computes all
P^2 pairwise distances over the flattened model in Python, and its median stacks
every layer, so P = 32 at 50 M parameters takes minutes and ~13 GiB.

Columns: peers, input GiB (P x M x 4 bytes), wall seconds (best of ``--repeat``,
default 1), GiB/s of input, the ratio to the anchor (numpy in memory for FedAvg,
Flower's function for median and Krum), the largest |error| against a float64
reference computed here (FedAvg: ``sum(n_p x_p) / sum(n)`` in float64, with the
bound ``2 n eps32 max|x|`` per tensor; median: float64 ``numpy.median``; Krum: the
update of the peer a float64 distance matrix selects), and peak RSS.

Last, out of core: P = 8 peers of ``--ooc-gib`` GiB in all (default 4) ingested
into a new store, and gradpipe's FedAvg on ``LocalCluster(n_workers=2,
threads_per_worker=1, processes=True, memory_limit=<ooc-gib / 4> GiB)``, whose
workers' RSS is polled every 0.2 s (``client.run``); restarts show as new worker
pids. Beside it numpy and Flower in memory run in children under
``resource.setrlimit(RLIMIT_AS, <the same limit>)``, and fail with MemoryError.

Run: ``python benchmarks/bench_aggregate.py`` (``--peers 8,32``, ``--params-m M``,
``--robust-peers 8``, ``--repeat N``, ``--ooc-gib G``, ``--skip-ooc``,
``--skip-cluster``); about ten minutes at the defaults on two cores.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import resource
import struct
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import numpy as np

import gradpipe as gp
from gradpipe.formats.safetensors import write_safetensors
from gradpipe.testing import TransformerConfig

MiB, GiB = 2**20, 2**30
EPS32 = float(np.finfo(np.float32).eps)
UNAVAILABLE = "not available in this build"
BLOCK = 1 << 21  # elements per block of the float64 reference pass

Flat = dict[str, np.ndarray]


# --- the data ---------------------------------------------------------------------
def model_shapes(params: float) -> tuple[dict[str, tuple[int, ...]], str]:
    """Tensor shapes of about ``params`` parameters, and what they are."""
    base = TransformerConfig(peers=1, steps=1)
    if params <= base.numel():
        config = TransformerConfig.for_dump_size(params * 4 / MiB, peers=1, steps=1)
        what = "MiniLM-shaped, shrunk by TransformerConfig.for_dump_size"
    else:
        wide = replace(base, hidden=768, heads=12, intermediate=3072, layers=1)
        per_layer = replace(wide, layers=2).numel() - wide.numel()
        layers = 1 + max(0, math.ceil((params - wide.numel()) / per_layer))
        config = replace(wide, layers=layers)
        what = f"BERT-base width (hidden 768, intermediate 3072, vocab 30522), {layers} layers"
    shapes = config.param_shapes()
    return shapes, f"{what}: {len(shapes)} tensors, {config.numel() / 1e6:.1f} M parameters"


@dataclass(frozen=True)
class Peers:
    """P peers' dumps of step 0 in one directory: ``step=0/peer=peerNN.safetensors``."""

    directory: Path
    peers: int
    shapes: dict[str, tuple[int, ...]]

    def path(self, peer: int) -> Path:
        return self.directory / "step=0" / f"peer=peer{peer:02d}.safetensors"

    @property
    def pattern(self) -> str:
        return str(self.directory / "step={step}" / "peer={peer}.safetensors")

    @property
    def numel(self) -> int:
        return sum(math.prod(s) for s in self.shapes.values())

    @property
    def nbytes(self) -> int:
        return 4 * self.numel * self.peers

    @property
    def byzantine(self) -> int:
        return max(1, self.peers // 8)

    def files(self) -> list[PeerFile]:
        return [PeerFile(self.path(p)) for p in range(self.peers)]


def write_peers(directory: Path, shapes: dict[str, tuple[int, ...]], peers: int) -> Peers:
    """Write ``peers`` dumps of seeded normal updates (the first ``byzantine`` scaled by 10)."""
    data = Peers(directory, peers, shapes)
    data.path(0).parent.mkdir(parents=True)
    for peer in range(peers):
        rng = np.random.default_rng((0, peer))
        num_examples = int(rng.integers(100, 1000))
        tensors = {}
        for name, shape in shapes.items():
            tensors[name] = rng.standard_normal(shape, dtype=np.float32)
            if peer < data.byzantine:
                tensors[name] *= 10
        meta = {"num_examples": str(num_examples), "step": "0", "peer": f"peer{peer:02d}"}
        write_safetensors(data.path(peer), tensors, meta)
    return data


def link_peers(source: Peers, directory: Path, peers: int) -> Peers:
    """The first ``peers`` of ``source``, as hard links (the same bytes, no copy)."""
    data = Peers(directory, peers, source.shapes)
    data.path(0).parent.mkdir(parents=True)
    for peer in range(peers):
        os.link(source.path(peer), data.path(peer))
    return data


class PeerFile:
    """One dump read with plain file reads into fresh arrays (no mmap: an allocation
    that does not fit raises MemoryError, also under RLIMIT_AS)."""

    def __init__(self, path: Path) -> None:
        self.path = path
        with path.open("rb") as f:
            (size,) = struct.unpack("<Q", f.read(8))
            header = json.loads(f.read(size))
        self.base = 8 + size
        self.meta: dict[str, str] = header.pop("__metadata__", {})
        self.header: dict[str, Any] = header

    @property
    def num_examples(self) -> int:
        return int(self.meta["num_examples"])

    def read(self, name: str, start: int = 0, stop: int | None = None) -> np.ndarray:
        """Elements ``start:stop`` of tensor ``name``, flat (all of it, shaped, by default)."""
        info = self.header[name]
        shape = tuple(info["shape"])
        count = math.prod(shape) if stop is None else stop - start
        out = np.empty(count, dtype=np.float32)
        with self.path.open("rb", buffering=0) as f:
            f.seek(self.base + info["data_offsets"][0] + 4 * start)
            f.readinto(memoryview(out).cast("B"))
        return out.reshape(shape) if stop is None else out

    def read_all(self, names: list[str]) -> list[np.ndarray]:
        return [self.read(name) for name in names]


# --- the float64 references ---------------------------------------------------------
@dataclass
class Reference:
    fedavg: Flat
    bound: dict[str, float]  # 2 n eps32 max|x| per tensor
    median: Flat | None = None
    krum: int | None = None  # the peer Krum selects


def krum_select(distances: np.ndarray, byzantine: int) -> int:
    n = len(distances)
    closest = max(1, n - byzantine - 2)
    scores = [np.sort(np.delete(distances[i], i))[:closest].sum() for i in range(n)]
    return int(np.argmin(scores))


def reference(data: Peers, robust: bool) -> Reference:
    """FedAvg (and median, Krum's choice) in float64, streaming blocks of every tensor."""
    files = data.files()
    weights = np.array([f.num_examples for f in files], dtype=np.float64)
    weights /= weights.sum()
    ref = Reference(fedavg={}, bound={}, median={} if robust else None)
    distances = np.zeros((data.peers, data.peers))
    for name, shape in data.shapes.items():
        size = math.prod(shape)
        avg = np.empty(size)
        med = np.empty(size) if robust else None
        top = 0.0
        for start in range(0, size, BLOCK):
            stop = min(size, start + BLOCK)
            x = np.stack([f.read(name, start, stop) for f in files]).astype(np.float64)
            avg[start:stop] = weights @ x
            top = max(top, float(np.abs(x).max()))
            if robust and med is not None:
                med[start:stop] = np.median(x, axis=0)
                sq = np.einsum("ij,ij->i", x, x)
                distances += np.maximum(sq[:, None] + sq[None, :] - 2 * (x @ x.T), 0)
        ref.fedavg[name] = avg.reshape(shape)
        ref.bound[name] = 2 * data.peers * EPS32 * top
        if ref.median is not None and med is not None:
            ref.median[name] = med.reshape(shape)
    if robust:
        ref.krum = krum_select(distances, data.byzantine)
    return ref


def max_error(result: Path, data: Peers, ref: Reference, method: str) -> tuple[float, float]:
    """Largest |result - reference| and its largest ratio to the FedAvg bound (fedavg only)."""
    flat = np.load(result, mmap_mode="r")
    worst, ratio, offset = 0.0, 0.0, 0
    krum = data.files()[ref.krum] if method == "krum" and ref.krum is not None else None
    for name, shape in data.shapes.items():
        size = math.prod(shape)
        got = np.asarray(flat[offset : offset + size], dtype=np.float64).reshape(shape)
        offset += size
        if method == "fedavg":
            want = ref.fedavg[name]
        elif method == "median" and ref.median is not None:
            want = ref.median[name]
        elif krum is not None:
            want = krum.read(name).astype(np.float64)
        else:
            raise AssertionError(f"no reference for {method}")
        err = float(np.abs(got - want).max())
        worst = max(worst, err)
        if method == "fedavg":
            ratio = max(ratio, err / ref.bound[name])
    return worst, ratio


# --- the contenders, each in a child process ------------------------------------------
def peak_rss() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def numpy_fedavg(peers: list[list[np.ndarray]], weights: np.ndarray) -> list[np.ndarray]:
    out = []
    for layer in zip(*peers, strict=True):
        acc = layer[0] * weights[0]
        tmp = np.empty_like(acc)
        for x, w in zip(layer[1:], weights[1:], strict=True):
            np.multiply(x, w, out=tmp)
            np.add(acc, tmp, out=acc)
        out.append(acc)
    return out


def load_inputs(spec: dict[str, Any]) -> tuple[Any, Any]:
    """The contender's inputs, in memory (untimed), and the function to time."""
    files = [PeerFile(Path(p)) for p in spec["files"]]
    names = spec["names"]
    counts = [f.num_examples for f in files]
    kind = spec["kind"]
    if kind == "numpy":
        weights = (np.array(counts, dtype=np.float64) / sum(counts)).astype(np.float32)
        peers = []
        for f in files:
            peers.append(f.read_all(names))
            spec["loaded"] = len(peers)
        return (peers, weights), lambda a: numpy_fedavg(*a)
    from flwr.common import Code, FitRes, Status, ndarrays_to_parameters
    from flwr.server.strategy import aggregate as flower

    if kind == "flower-inplace":
        results = []
        for f, n in zip(files, counts, strict=True):
            params = ndarrays_to_parameters(f.read_all(names))
            results.append((None, FitRes(Status(Code.OK, ""), params, n, {})))
            spec["loaded"] = len(results)
        return results, flower.aggregate_inplace
    inputs = []
    for f, n in zip(files, counts, strict=True):
        inputs.append((f.read_all(names), n))
        spec["loaded"] = len(inputs)
    if kind == "flower-median":
        return inputs, flower.aggregate_median
    byzantine = spec["byzantine"]
    return inputs, lambda a: flower.aggregate_krum(a, num_malicious=byzantine, to_keep=0)


def gradpipe_call(spec: dict[str, Any], client: Any = None) -> tuple[float, Any]:
    """Time ``gp.aggregate``; returns (seconds, store) or raises UnavailableError."""
    store = gp.open_store(spec["store"], mode="a")
    method = spec["method"]
    options: dict[str, Any] = {"byzantine": spec["byzantine"]} if method == "krum" else {}
    if client is not None:
        options["runner"] = gp.runner(client)
    try:
        aggregate = gp.aggregate  # type: ignore[attr-defined]
    except AttributeError as exc:
        raise UnavailableError(UNAVAILABLE) from exc
    start = time.perf_counter()
    try:
        report = aggregate(
            store, run=spec["run"], steps=[0], method=method, name=method, force=True, **options
        )
    except gp.InvalidInputError as exc:
        if method in str(exc):
            raise UnavailableError(UNAVAILABLE) from exc
        raise
    except TypeError as exc:  # an option this build does not take yet (byzantine=)
        if any(option in str(exc) for option in options):
            raise UnavailableError(f"{UNAVAILABLE} ({exc})") from exc
        raise
    seconds = time.perf_counter() - start
    if not report.ok:
        raise UnavailableError(f"report not ok: {json.dumps(report.to_dict())[:300]}")
    return seconds, store


class UnavailableError(Exception):
    """gradpipe cannot run this row in this build (the row says why)."""


def child(spec: dict[str, Any]) -> dict[str, Any]:
    """Run one contender; returns seconds, peak and idle RSS, or a note."""
    out: dict[str, Any] = {"idle_rss": peak_rss()}
    if spec.get("limit"):
        import psutil

        if spec["kind"].startswith("flower"):
            import flwr.server.strategy.aggregate  # noqa: F401  (imported before the limit)
        out["vms"] = psutil.Process().memory_info().vms  # address space already in use
        resource.setrlimit(resource.RLIMIT_AS, (spec["limit"], spec["limit"]))
    try:
        if spec["kind"].startswith("gradpipe"):
            if spec["kind"] == "gradpipe-cluster":
                from distributed import Client, LocalCluster

                threads = os.cpu_count() or 1
                with (
                    LocalCluster(
                        n_workers=1,
                        threads_per_worker=threads,
                        processes=False,
                        dashboard_address=":0",
                    ) as cluster,
                    Client(cluster, set_as_default=False) as client,
                ):
                    seconds, store = gradpipe_call(spec, client)
            else:
                seconds, store = gradpipe_call(spec)
            out |= {"seconds": seconds, "peak_rss": peak_rss()}
            agg = gp.open_run(store, spec["run"]).aggregate(spec["method"], step=0)  # type: ignore[attr-defined]
            result = [np.asarray(agg.read(name)).ravel() for name in spec["names"]]
        else:
            inputs, func = load_inputs(spec)
            start = time.perf_counter()
            result = func(inputs)
            out |= {"seconds": time.perf_counter() - start, "peak_rss": peak_rss()}
            result = [np.asarray(a, dtype=np.float32).ravel() for a in result]
    except UnavailableError as exc:
        return out | {"note": str(exc)}
    except MemoryError:
        done = spec.get("loaded", 0)
        return out | {
            "note": f"MemoryError after {done} of {len(spec['files'])} peers in memory",
            "peak_rss": peak_rss(),
        }
    np.save(spec["result"], np.concatenate(result))
    return out


def run_child(spec: dict[str, Any]) -> dict[str, Any]:
    env = dict(os.environ, OMP_NUM_THREADS="1", OPENBLAS_NUM_THREADS="1")
    env.pop("DASK_SCHEDULER_ADDRESS", None)
    done = subprocess.run(
        [sys.executable, __file__, "--child", json.dumps(spec)],
        capture_output=True,
        env=env,
        check=False,
        text=True,
    )
    lines = done.stdout.strip().splitlines()
    if done.returncode != 0 or not lines:
        tail = (done.stderr or done.stdout).strip().splitlines()[-3:]
        return {"note": f"exit {done.returncode}: {' | '.join(tail)[:300]}"}
    doc: dict[str, Any] = json.loads(lines[-1])
    return doc


# --- the table ------------------------------------------------------------------------
@dataclass
class Row:
    method: str
    contender: str
    peers: int
    nbytes: int
    seconds: float | None = None
    peak_rss: int = 0
    error: float | None = None
    bound_ratio: float | None = None
    note: str = ""
    extra: dict[str, Any] = field(default_factory=dict)


def measure(
    method: str, contender: str, kind: str, data: Peers, ref: Reference, tmp: Path, **spec: Any
) -> Row:
    """Best of ``repeat`` runs of one contender, and its error against the reference."""
    repeat = spec.pop("repeat", 1)
    result = tmp / "result.npy"
    base = {
        "kind": kind,
        "method": method,
        "files": [str(data.path(p)) for p in range(data.peers)],
        "names": list(data.shapes),
        "byzantine": data.byzantine,
        "result": str(result),
    }
    row = Row(method, contender, data.peers, data.nbytes)
    best: dict[str, Any] = {}
    for _ in range(repeat):
        doc = run_child(base | spec)
        if "note" in doc:
            row.note = doc["note"]
            return row
        if not best or doc["seconds"] < best["seconds"]:
            best = doc
    row.seconds, row.peak_rss = best["seconds"], best["peak_rss"]
    row.error, ratio = max_error(result, data, ref, method)
    row.bound_ratio = ratio if method == "fedavg" else None
    result.unlink()
    print(f"  {method:<7} {contender:<28} P={data.peers:<3} {row.seconds:8.2f} s", flush=True)
    return row


def print_table(rows: list[Row]) -> None:
    header = (
        f"{'method':<7} {'contender':<28} {'peers':>5} {'input GiB':>9} {'wall s':>8}"
        f" {'GiB/s':>7} {'x anchor':>8} {'max |err|':>10} {'err/bound':>9} {'peak RSS GiB':>12}"
    )
    print(header)
    print("-" * len(header))
    anchors = {
        (r.method, r.peers): r
        for r in rows
        if r.contender in ("numpy in memory", "Flower aggregate_median", "Flower aggregate_krum")
    }
    for r in rows:
        head = f"{r.method:<7} {r.contender:<28} {r.peers:>5} {r.nbytes / GiB:>9.2f}"
        if r.seconds is None:
            print(f"{head}  {r.note}")
            continue
        anchor = anchors.get((r.method, r.peers))
        ratio = f"{anchor.seconds / r.seconds:>8.2f}" if anchor and anchor.seconds else f"{'-':>8}"
        bound = f"{r.bound_ratio:>9.3f}" if r.bound_ratio is not None else f"{'-':>9}"
        print(
            f"{head} {r.seconds:>8.2f} {r.nbytes / GiB / r.seconds:>7.2f} {ratio}"
            f" {r.error:>10.2e} {bound} {r.peak_rss / GiB:>12.2f}"
        )


def verdicts(rows: list[Row]) -> None:
    print("\ntarget: gradpipe FedAvg >= 0.5x the in-memory numpy throughput, end to end")
    for r in rows:
        if r.method != "fedavg" or not r.contender.startswith("gradpipe"):
            continue
        numpy_row = next(a for a in rows if a.contender == "numpy in memory" and a.peers == r.peers)
        if r.seconds is None or numpy_row.seconds is None:
            print(f"  n/a   {r.contender}, P={r.peers}: {r.note or numpy_row.note}")
            continue
        ratio = numpy_row.seconds / r.seconds
        verdict = "PASS" if ratio >= 0.5 else "FAIL"
        print(f"  {verdict}  {r.contender}, P={r.peers}: {ratio:.2f}x numpy in memory")


# --- out of core ----------------------------------------------------------------------
def ooc_gradpipe(store_url: str, limit: int) -> dict[str, Any]:
    """gradpipe's FedAvg on a process cluster under ``limit``, with polled worker RSS."""
    import psutil
    from distributed import Client, LocalCluster

    def rss() -> tuple[int, int]:
        return os.getpid(), psutil.Process().memory_info().rss

    out: dict[str, Any] = {}
    with (
        LocalCluster(
            n_workers=2,
            threads_per_worker=1,
            processes=True,
            memory_limit=limit,
            dashboard_address=":0",
            host="127.0.0.1",
        ) as cluster,
        Client(cluster, set_as_default=False) as client,
    ):
        client.run(warm)  # idle RSS with gradpipe's modules loaded, as after any task
        idle = {addr: v[1] for addr, v in client.run(rss).items()}
        peaks: dict[str, int] = {}
        pids: dict[str, set[int]] = {}
        stop = threading.Event()

        def poll() -> None:
            while not stop.is_set():
                try:
                    for addr, (pid, value) in client.run(rss, nanny=False).items():
                        peaks[addr] = max(peaks.get(addr, 0), value)
                        pids.setdefault(addr, set()).add(pid)
                except Exception:  # a worker restarting: keep polling
                    pass
                stop.wait(0.2)

        watcher = threading.Thread(target=poll, daemon=True)
        watcher.start()
        spec = {"store": store_url, "run": "ooc", "method": "fedavg", "byzantine": 1}
        try:
            out["seconds"], _ = gradpipe_call(spec, client)
        except UnavailableError as exc:
            out["note"] = str(exc)
        except Exception as exc:  # e.g. KilledWorker: the limit was breached
            out["note"] = f"FAILED: {type(exc).__name__}: {str(exc)[:200]}"
        finally:
            stop.set()
            watcher.join()
        out |= {"idle": idle, "peaks": peaks, "restarts": sum(len(p) - 1 for p in pids.values())}
    return out


def warm() -> None:
    """Import what an aggregation task imports (run on each worker before its idle RSS)."""
    import importlib

    for module in ("gradpipe.codecs", "gradpipe.storage", "gradpipe.runs", "numcodecs"):
        importlib.import_module(module)


def out_of_core(args: argparse.Namespace, tmp: Path) -> None:
    limit = int(args.ooc_gib * GiB / 4)
    peers = 8
    shapes, what = model_shapes(args.ooc_gib * GiB / (4 * peers))
    print(f"\n=== out of core: FedAvg of {peers} peers, {args.ooc_gib:g} GiB in all ===")
    start = time.perf_counter()
    data = write_peers(tmp / "ooc", shapes, peers)
    store_url = str(tmp / "ooc-store")
    store = gp.open_store(store_url, mode="w")
    report = gp.ingest(store, data.pattern, run="ooc")
    if not report.ok:
        raise RuntimeError(f"ingest failed: {report.to_dict()}")
    chunk = gp_chunk_bytes()
    print(
        f"data: {what}; {data.nbytes / GiB:.2f} GiB of peers; written and ingested "
        f"(untimed) in {time.perf_counter() - start:.0f} s; worker memory_limit "
        f"{limit / GiB:.2f} GiB (input = {data.nbytes / limit:.1f}x the limit); "
        f"gradpipe chunk-bytes {chunk / MiB:.0f} MiB"
    )
    if limit < GiB / 2:
        print(f"  (a {limit / MiB:.0f} MiB limit is near an idle worker's RSS: expect restarts)")
    doc = ooc_gradpipe(store_url, limit)
    if "note" in doc:
        print(f"  gradpipe (LocalCluster 2x1, processes): {doc['note']}")
    if "seconds" in doc:
        print(
            f"  gradpipe (LocalCluster 2x1, processes, memory_limit {limit / GiB:.2f} GiB): "
            f"completed in {doc['seconds']:.1f} s "
            f"({data.nbytes / GiB / doc['seconds']:.2f} GiB/s)"
        )
    if doc.get("peaks"):
        print(f"    worker restarts (new pids seen while polling): {doc['restarts']}")
        for addr, peak in sorted(doc["peaks"].items()):
            idle = doc["idle"].get(addr, 0)
            print(
                f"    worker {addr}: peak RSS {peak / MiB:.0f} MiB (idle {idle / MiB:.0f} MiB; "
                f"peak - idle = {(peak - idle) / MiB:.0f} MiB = {(peak - idle) / chunk:.1f} chunks)"
                f", {100 * peak / limit:.0f}% of the limit"
            )
    base = {
        "method": "fedavg",
        "files": [str(data.path(p)) for p in range(peers)],
        "names": list(shapes),
        "byzantine": 1,
        "result": str(tmp / "ooc-result.npy"),
        "limit": limit,
    }
    for name, kind in (
        ("numpy in memory", "numpy"),
        ("Flower aggregate_inplace", "flower-inplace"),
    ):
        doc = run_child(base | {"kind": kind})
        seconds = doc.get("seconds")
        told = f"completed in {seconds:.1f} s (!)" if seconds is not None else doc.get("note")
        used = (
            f"; {doc['vms'] / GiB:.2f} GiB of address space in use after imports"
            if "vms" in doc
            else ""
        )
        print(f"  {name} under RLIMIT_AS {limit / GiB:.2f} GiB: {told}{used}")


def gp_chunk_bytes() -> int:
    import dask
    from dask.utils import parse_bytes

    return int(parse_bytes(dask.config.get("gradpipe.chunk-bytes", "4 MiB")))


# --- main -----------------------------------------------------------------------------
def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--child", help=argparse.SUPPRESS)
    parser.add_argument("--peers", default="8,32", help="peer counts (default 8,32)")
    parser.add_argument("--params-m", type=float, default=50, help="M parameters (default 50)")
    parser.add_argument("--robust-peers", default="8", help="peer counts of median/Krum rows")
    parser.add_argument("--repeat", type=int, default=1, help="best of N runs (default 1)")
    parser.add_argument("--ooc-gib", type=float, default=4, help="GiB of out-of-core peers")
    parser.add_argument("--skip-ooc", action="store_true", help="no out-of-core run")
    parser.add_argument("--skip-cluster", action="store_true", help="no LocalCluster rows")
    args = parser.parse_args()
    if args.child:
        print(json.dumps(child(json.loads(args.child))))
        return
    counts = sorted({int(p) for p in args.peers.split(",")})
    robust = {int(p) for p in args.robust_peers.split(",") if p}
    start = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="gradpipe-bench-aggregate-", dir="/tmp") as name:
        tmp = Path(name)
        shapes, what = model_shapes(args.params_m * 1e6)
        largest = write_peers(tmp / "dumps" / f"p{counts[-1]}", shapes, counts[-1])
        runs = {p: link_peers(largest, tmp / "dumps" / f"p{p}", p) for p in counts[:-1]}
        runs[counts[-1]] = largest
        store_url = str(tmp / "store")
        store = gp.open_store(store_url, mode="w")
        for p, data in runs.items():
            report = gp.ingest(store, data.pattern, run=f"p{p}")
            if not report.ok:
                raise RuntimeError(f"ingest failed: {report.to_dict()}")
        print(f"=== aggregation of one step, P peers x {args.params_m:g} M float32 parameters ===")
        print(
            f"data: {what}; seeded normal updates, f = max(1, P // 8) peers scaled by 10, "
            f"num_examples 100-999; one safetensors dump per peer, ingested into one store "
            f"(untimed); generated and ingested in {time.perf_counter() - start:.0f} s"
        )
        rows: list[Row] = []
        for p, data in runs.items():
            ref = reference(data, p in robust)
            common = {"store": store_url, "run": f"p{p}", "repeat": args.repeat}
            gradpipe_rows = [("gradpipe (threads)", "gradpipe")]
            if not args.skip_cluster:
                gradpipe_rows.append(("gradpipe (LocalCluster thr.)", "gradpipe-cluster"))
            methods = [("fedavg", "numpy in memory", "numpy")]
            methods.append(("fedavg", "Flower aggregate_inplace", "flower-inplace"))
            if p in robust:
                methods.append(("median", "Flower aggregate_median", "flower-median"))
                methods.append(("krum", "Flower aggregate_krum", "flower-krum"))
            for method in dict.fromkeys(m for m, _, _ in methods):
                for contender, kind in [(c, k) for m, c, k in methods if m == method]:
                    rows.append(measure(method, contender, kind, data, ref, tmp, **common))
                for contender, kind in gradpipe_rows:
                    rows.append(measure(method, contender, kind, data, ref, tmp, **common))
            del ref
        print(
            f"\nwall s: best of {args.repeat}, each row in its own child process; GiB/s of "
            f"input (P x M x 4 bytes); x anchor: the anchor's wall s / the row's (anchor: numpy "
            f"in memory for fedavg, Flower's function for median and krum); max |err| against "
            f"a float64 reference; err/bound: max over tensors of |err| / (2 n eps32 max|x|) "
            f"(<= 1 is within the bound); peak RSS: the child's ru_maxrss (imports, inputs "
            f"in memory and outputs included); numpy: one thread; gradpipe LocalCluster: "
            f"1 worker x {os.cpu_count()} threads, processes=False\n"
        )
        print_table(rows)
        verdicts(rows)
        if not args.skip_ooc:
            out_of_core(args, tmp)
    print(f"\ntotal {time.perf_counter() - start:.0f} s")


if __name__ == "__main__":
    main()
