"""Ingest on a real Dask cluster: a ``dask scheduler`` and two ``dask worker`` processes.

The cluster runs as separate processes on loopback, as a user would start it,
and ``gradpipe ingest --scheduler ADDR`` (or ``DASK_SCHEDULER_ADDRESS``) sends
the graph there. What the cluster stores must be what local threads store:
the same tensor ids for every (step, peer, tensor). Dump manifests carry the
source path, so two ingests of the same files share tensor ids, and the run
ids differ only if the paths do; the tests compare tensor ids.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from dask.utils import key_split

import gradpipe as gp
from gradpipe.formats.safetensors import read_safetensors
from gradpipe.ingestion.api import ingest
from gradpipe.ingestion.discover import discover_dumps
from gradpipe.ingestion.graph import build_ingest_graph
from gradpipe.ingestion.tasks import inspect_dumps
from gradpipe.runs import open_run
from gradpipe.testing import SampleRun, TrainingConfig, write_sample_run
from gradpipe.testing.ids import run_tensor_ids

distributed = pytest.importorskip("distributed")

BIN = Path(sys.executable).parent
GRAPH_PREFIXES = {"gradpipe-read", "gradpipe-encode", "gradpipe-dump", "gradpipe-commit"}
ALL_PREFIXES = GRAPH_PREFIXES | {"gradpipe-inspect"}
# Small chunks and tasks so that even a small run makes a graph with many tasks per dump.
CHUNK_BYTES = 64 << 10
TASK_BYTES = 4 * CHUNK_BYTES
SETTINGS = {"gradpipe.chunk-bytes": CHUNK_BYTES, "gradpipe.ingest.task-bytes": TASK_BYTES}


# --- processes ----------------------------------------------------------------------
def _stop(proc: subprocess.Popen[bytes]) -> None:
    """Stop a process started in its own session, and everything it started."""
    if proc.poll() is None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGTERM)
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(timeout=10)
    # The nanny's worker processes share the group; make sure none outlives the test.
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)
    with contextlib.suppress(subprocess.TimeoutExpired):
        proc.wait(timeout=10)


def _spawn(args: list[str], log: Path) -> subprocess.Popen[bytes]:
    with log.open("wb") as out:
        return subprocess.Popen(
            args, stdout=out, stderr=subprocess.STDOUT, start_new_session=True, cwd=log.parent
        )


def _wait_for_file(path: Path, proc: subprocess.Popen[bytes], log: Path) -> None:
    deadline = time.monotonic() + 60
    while not (path.exists() and path.stat().st_size):
        if proc.poll() is not None:
            raise RuntimeError(f"dask scheduler exited with {proc.returncode}:\n{log.read_text()}")
        if time.monotonic() > deadline:
            raise TimeoutError(f"no scheduler file after 60 s:\n{log.read_text()}")
        time.sleep(0.1)
    time.sleep(0.1)  # the file is written in one go, but let the writer close it


class Cluster:
    """Addresses of a running scheduler, and a client on it (not the default client)."""

    def __init__(self, address: str, client: Any, workers: list[subprocess.Popen[bytes]]):
        self.address, self.client, self.workers = address, client, workers

    def prefix_counts(self) -> dict[str, int]:
        """Tasks of each gradpipe prefix that reached memory on the scheduler, ever."""

        def counts(dask_scheduler: Any) -> dict[str, int]:
            return {
                name: int(prefix.state_counts["memory"])
                for name, prefix in dask_scheduler.task_prefixes.items()
                if name.startswith("gradpipe-")
            }

        return dict(self.client.run_on_scheduler(counts))

    def span_names(self) -> set[str]:
        def names(dask_scheduler: Any) -> list[str]:
            spans = dask_scheduler.extensions["spans"].spans
            return sorted({span.name[-1] for span in spans.values()})

        return set(self.client.run_on_scheduler(names))


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    from distributed import Client

    root = tmp_path_factory.mktemp("cluster")
    scheduler_file = root / "scheduler.json"
    procs: list[subprocess.Popen[bytes]] = []
    client = None
    try:
        log = root / "scheduler.log"
        scheduler = _spawn(
            [
                str(BIN / "dask"),
                "scheduler",
                "--host",
                "127.0.0.1",
                "--port",
                "0",
                "--scheduler-file",
                str(scheduler_file),
                "--no-dashboard",
            ],
            log,
        )
        procs.append(scheduler)
        _wait_for_file(scheduler_file, scheduler, log)
        address = json.loads(scheduler_file.read_text())["address"]
        assert address.startswith("tcp://127.0.0.1:")
        workers = []
        for i in range(2):
            worker = _spawn(
                [
                    str(BIN / "dask"),
                    "worker",
                    address,
                    "--nthreads",
                    "1",
                    "--no-dashboard",
                    "--host",
                    "127.0.0.1",
                    "--local-directory",
                    str(root / f"worker{i}"),
                    "--death-timeout",
                    "60",
                    # One worker loads gradpipe's warm-up itself; the other gets the plugin
                    # from the runner (test_workers_are_warmed_up).
                    *(["--preload", "gradpipe.graph.warmup"] if i == 0 else []),
                ],
                root / f"worker{i}.log",
            )
            procs.append(worker)
            workers.append(worker)
        client = Client(address, set_as_default=False, timeout=30)
        client.wait_for_workers(2, timeout=60)
        yield Cluster(address, client, workers)
    finally:
        if client is not None:
            client.close()
        for proc in reversed(procs):
            _stop(proc)


# --- data ---------------------------------------------------------------------------
@pytest.fixture(scope="module")
def sample(tmp_path_factory: pytest.TempPathFactory) -> SampleRun:
    config = TrainingConfig(vocab_size=6_000, embed_dim=32, hidden=48, peers=3, steps=3)
    return write_sample_run(tmp_path_factory.mktemp("sample"), config)


@pytest.fixture(scope="module")
def local_ids(sample: SampleRun, tmp_path_factory: pytest.TempPathFactory) -> dict[Any, str]:
    """Tensor ids of the sample ingested by ``gradpipe ingest`` on local threads.

    A fresh process, without ``--scheduler`` or ``DASK_SCHEDULER_ADDRESS``, has no
    client to find: the report's dashboard is None only on the threaded scheduler.
    """
    root = tmp_path_factory.mktemp("local") / "store"
    doc = _cli_ingest(root, sample)
    _check_doc(doc, sample)
    assert doc["dashboard"] is None
    ids = run_tensor_ids(gp.open_store(str(root), mode="r"), "r")
    expected = len(sample.steps) * len(sample.peers) * len(sample.config.param_shapes())
    assert len(ids) == expected
    return ids


def _cli_ingest(
    store: Path, sample: SampleRun, *args: str, env: dict[str, str] | None = None
) -> dict[str, Any]:
    """``gradpipe ingest STORE PATTERN --run r --json ARGS``; its JSON document."""
    environ = {k: v for k, v in os.environ.items() if k != "DASK_SCHEDULER_ADDRESS"}
    environ.update(
        DASK_GRADPIPE__CHUNK_BYTES=str(CHUNK_BYTES),
        DASK_GRADPIPE__INGEST__TASK_BYTES=str(TASK_BYTES),
        **(env or {}),
    )
    command = [str(BIN / "gradpipe"), "ingest", str(store), sample.dump_pattern, "--run", "r"]
    done = subprocess.run(
        [*command, "--json", *args], capture_output=True, env=environ, timeout=120, check=False
    )
    assert done.returncode == 0, (done.stdout.decode(), done.stderr.decode())
    doc = json.loads(done.stdout)
    assert isinstance(doc, dict)
    return doc


def _check_doc(doc: dict[str, Any], sample: SampleRun) -> None:
    n = len(sample.steps) * len(sample.peers)
    assert doc["ok"] is True
    assert doc["failed"] == 0
    assert doc["ingested"] == n
    assert doc["tensors"] == n * len(sample.config.param_shapes())
    assert doc["raw_bytes"] == sample.config.dump_bytes()


# --- tests --------------------------------------------------------------------------
def test_cli_ingest_on_cluster_matches_local_threads(
    cluster: Cluster, sample: SampleRun, local_ids: dict[Any, str], tmp_path: Path
) -> None:
    before = cluster.prefix_counts()
    doc = _cli_ingest(tmp_path / "store", sample, "--scheduler", cluster.address)
    _check_doc(doc, sample)
    assert doc["dashboard"] is not None  # reported for a cluster, None for local threads

    store = gp.open_store(str(tmp_path / "store"), mode="r")
    assert doc["run_id"] == store.refs.get("runs/r")
    assert run_tensor_ids(store, "r") == local_ids
    assert gp.verify(store).ok

    # The work ran on the cluster, under readable task names, in a named span.
    ran = {k: v - before.get(k, 0) for k, v in cluster.prefix_counts().items()}
    assert {k for k, v in ran.items() if v} == ALL_PREFIXES
    assert ran["gradpipe-commit"] == 1
    assert ran["gradpipe-dump"] == len(sample.steps) * len(sample.peers)
    assert ran["gradpipe-read"] == ran["gradpipe-encode"] > ran["gradpipe-dump"]
    assert {"gradpipe-ingest", "gradpipe-inspect"} <= cluster.span_names()

    # And the data the workers stored is the source, bit for bit.
    run = open_run(store, "r")
    for step in sample.steps:
        for peer in sample.peers:
            tensors, meta = read_safetensors(sample.dump_path(step, peer))
            dump = run.dump(step, peer)
            assert dump.metadata == meta
            for name, want in tensors.items():
                got = dump.read(name)
                assert got.dtype == want.dtype
                assert got.shape == want.shape
                assert np.array_equal(got.view(np.uint8), want.view(np.uint8))


def test_scheduler_address_from_environment(
    cluster: Cluster, sample: SampleRun, local_ids: dict[Any, str], tmp_path: Path
) -> None:
    before = cluster.prefix_counts()
    doc = _cli_ingest(tmp_path / "store", sample, env={"DASK_SCHEDULER_ADDRESS": cluster.address})
    _check_doc(doc, sample)
    after = cluster.prefix_counts()
    assert after.get("gradpipe-commit", 0) == before.get("gradpipe-commit", 0) + 1
    store = gp.open_store(str(tmp_path / "store"), mode="r")
    assert run_tensor_ids(store, "r") == local_ids

    # A second ingest of the same files finds them all recorded: no graph, nothing to run.
    doc = _cli_ingest(tmp_path / "store", sample, env={"DASK_SCHEDULER_ADDRESS": cluster.address})
    assert doc["ok"] is True
    assert doc["ingested"] == 0
    assert doc["skipped"] == len(sample.steps) * len(sample.peers)
    assert cluster.prefix_counts() == after


def test_python_api_task_names_on_the_scheduler(
    cluster: Cluster, sample: SampleRun, local_ids: dict[Any, str], tmp_path: Path
) -> None:
    from distributed import get_task_stream

    # The graph itself: every key reads well on the dashboard, one commit, one task per dump.
    fs, dumps, _ = discover_dumps(sample.dump_pattern)
    headers = inspect_dumps(fs, dumps)
    pairs = [(d, h) for d, h in zip(dumps, headers, strict=True)]
    store = gp.open_store(str(tmp_path / "store"), mode="w")
    graph, key = build_ingest_graph(
        store,
        "r",
        fs,
        pairs,
        chunk_bytes=CHUNK_BYTES,
        unit_bytes=TASK_BYTES,
        codecs=None,
        message="test",
    )
    names = Counter(key_split(k) for k in graph)
    assert set(names) == GRAPH_PREFIXES
    assert key_split(key) == "gradpipe-commit"
    assert names["gradpipe-commit"] == 1
    assert names["gradpipe-dump"] == len(dumps)
    assert names["gradpipe-read"] == names["gradpipe-encode"] > len(dumps)

    import dask.config

    with (
        dask.config.set(SETTINGS),
        get_task_stream(cluster.client) as stream,
    ):
        report = ingest(store, sample.dump_pattern, run="r", client=cluster.client)
    assert report.ok, report.summary()
    assert report.ingested == len(dumps)
    assert run_tensor_ids(store, "r") == local_ids
    ran = Counter(key_split(task["key"]) for task in stream.data)
    assert set(ran) == ALL_PREFIXES
    assert ran["gradpipe-commit"] == 1
    assert ran["gradpipe-dump"] == len(dumps)
    # Both workers took part (each runs one thread; there are many read/encode tasks).
    assert len({task["worker"] for task in stream.data}) == 2
    # The caller's client stays open: ingest closes only clients it opened.
    assert cluster.client.status == "running"


def test_workers_are_warmed_up(cluster: Cluster, sample: SampleRun, tmp_path: Path) -> None:
    """Every worker imports the task modules when it starts or when a runner first
    registers the warm-up plugin, and registering it again (each runner registers it
    before its first graph) keeps the plugin the workers have."""
    from gradpipe.graph.warmup import TASK_MODULES
    from gradpipe.graph.warmup_plugin import PLUGIN_NAME

    store = gp.open_store(str(tmp_path / "store"), mode="w")

    def warmed(dask_worker: Any) -> tuple[int | None, list[str]]:
        import sys

        plugin = dask_worker.plugins.get(PLUGIN_NAME)
        return (
            None if plugin is None else id(plugin),
            [m for m in TASK_MODULES if m in sys.modules],
        )

    seen = []
    for run in ("a", "b"):  # two operations, two runners on the same client
        assert ingest(store, sample.dump_pattern, run=run, client=cluster.client).ok
        seen.append(cluster.client.run(warmed))
    for first, second in zip(seen[0].values(), seen[1].values(), strict=True):
        assert first[0] is not None
        assert first[1] == list(TASK_MODULES)
        assert second[0] == first[0]  # the same plugin object: not set up a second time
