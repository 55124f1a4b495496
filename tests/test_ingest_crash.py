"""Crashes during ingest: the client killed with SIGKILL, a Dask worker killed mid-graph.

What is guaranteed, and asserted:

- after ``gradpipe ingest`` is SIGKILLed at any moment, ``verify`` is clean and the
  run ref is absent or a *complete* commit: the one before this ingest (recorded
  here first) or one that holds every dump of this ingest, never a part of it;
- re-running the ingest finishes the work: every dump is present, with the tensor
  ids of an uninterrupted ingest, and reads back bit-exact against the source files;
- with a ``LocalCluster`` of processes, SIGKILLing a worker while the graph runs
  loses its tasks and results; Dask reruns them and the ingest completes in full.

Kill moments: as soon as the first block file appears, at fractions of the
measured wall time of an uninterrupted ``gradpipe ingest`` of the same files
(with jitter from a seeded ``random.Random``; the seed is in every assertion
message), and as soon as the new commit is visible.
"""

from __future__ import annotations

import contextlib
import os
import random
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import dask.config
import pytest

import gradpipe as gp
from gradpipe.formats.safetensors import read_safetensors
from gradpipe.ingestion.api import IngestReport, ingest, recorded_id
from gradpipe.runs import open_run
from gradpipe.storage._local import TEMP_PREFIX
from gradpipe.testing import SampleRun, TrainingConfig, write_sample_run
from gradpipe.testing.ids import TensorIds, run_tensor_ids

BIN = Path(sys.executable).parent
# Small chunks make thousands of blocks: an ingest of ~30 MiB that takes about a second.
CHUNK_BYTES = 16 << 10
SETTINGS = {"gradpipe.chunk-bytes": CHUNK_BYTES}
EARLY_STEPS = 2  # ingested first, as "the commit before" the killed ingest
SEED = int(os.environ.get("GRADPIPE_TEST_SEED", "20240611"))


# --- data -----------------------------------------------------------------------
@pytest.fixture(scope="module")
def sample(tmp_path_factory: pytest.TempPathFactory) -> SampleRun:
    config = TrainingConfig(vocab_size=12_000, embed_dim=32, hidden=64, peers=4, steps=5)
    return write_sample_run(tmp_path_factory.mktemp("sample"), config)


@pytest.fixture(scope="module")
def early_pattern(sample: SampleRun, tmp_path_factory: pytest.TempPathFactory) -> str:
    """The first steps of the sample, as hard links: same file versions, other paths.

    Ingesting these first records those dumps with the fingerprints the full
    ingest sees, so the full ingest skips them and adds the rest.
    """
    root = tmp_path_factory.mktemp("early")
    pattern = str(root / "step={step}" / "peer={peer}.safetensors")
    for step in sample.steps[:EARLY_STEPS]:
        for peer in sample.peers:
            link = Path(pattern.format(step=f"{step:04d}", peer=peer))
            link.parent.mkdir(parents=True, exist_ok=True)
            os.link(sample.dump_path(step, peer), link)
    return pattern


def _check_bit_exact(store: gp.Store, sample: SampleRun) -> None:
    run = open_run(store, "r")
    assert run.steps == sample.steps
    assert run.peers == sample.peers
    for step in sample.steps:
        for peer in sample.peers:
            tensors, meta = read_safetensors(sample.dump_path(step, peer))
            dump = run.dump(step, peer)
            assert dump.metadata == meta
            assert dump.names == list(tensors)
            for name, want in tensors.items():
                got = dump.read(name)
                assert got.dtype == want.dtype, (step, peer, name)
                assert got.shape == want.shape, (step, peer, name)
                assert got.tobytes() == want.tobytes(), (step, peer, name)


def _ingest(store: gp.Store, pattern: str) -> IngestReport:
    with dask.config.set(SETTINGS):
        return ingest(store, pattern, run="r")


def _block_files(root: Path) -> int:
    blocks = root / "blocks"
    if not blocks.exists():
        return 0
    return sum(1 for p in blocks.rglob("*") if p.is_file() and not p.name.startswith(TEMP_PREFIX))


# --- the client process -----------------------------------------------------------
def _command(store: Path, sample: SampleRun) -> list[str]:
    return [str(BIN / "gradpipe"), "ingest", str(store), sample.dump_pattern, "--run", "r"]


def _environ() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k != "DASK_SCHEDULER_ADDRESS"}
    env["DASK_GRADPIPE__CHUNK_BYTES"] = str(CHUNK_BYTES)
    return env


@contextlib.contextmanager
def _client(store: Path, sample: SampleRun) -> Iterator[subprocess.Popen[bytes]]:
    proc = subprocess.Popen(
        _command(store, sample),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        env=_environ(),
        start_new_session=True,
    )
    try:
        yield proc
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.communicate(timeout=30)


@pytest.fixture(scope="module")
def reference(
    sample: SampleRun, tmp_path_factory: pytest.TempPathFactory
) -> tuple[TensorIds, float]:
    """Tensor ids of an uninterrupted ``gradpipe ingest``, and its wall time."""
    root = tmp_path_factory.mktemp("reference") / "store"
    start = time.perf_counter()
    with _client(root, sample) as proc:
        _, err = proc.communicate(timeout=120)
    seconds = time.perf_counter() - start
    assert proc.returncode == 0, err.decode()
    store = gp.open_store(str(root), mode="r")
    _check_bit_exact(store, sample)
    ids = run_tensor_ids(store, "r")
    assert len(ids) == len(sample.steps) * len(sample.peers) * len(sample.config.param_shapes())
    return ids, seconds


# --- (a) SIGKILL the client ---------------------------------------------------------
@pytest.mark.slow
def test_sigkill_client_leaves_a_complete_commit_and_rerun_finishes(
    sample: SampleRun,
    early_pattern: str,
    reference: tuple[TensorIds, float],
    tmp_path: Path,
) -> None:
    ids, seconds = reference
    rng = random.Random(SEED)
    total = len(sample.steps) * len(sample.peers)
    early = EARLY_STEPS * len(sample.peers)
    # Kill points: as soon as the first block lands (surely mid-graph), at fractions
    # of the uninterrupted wall time, and as soon as the commit is visible (between
    # the compare-and-swap and the end of the process).
    kills: list[str | float] = ["first block", 0.35, 0.7, 0.95, "commit"]
    mid_graph = 0  # rounds whose kill left blocks but no new commit: the interesting case
    for i, kill in enumerate(kills):
        root = tmp_path / f"store{i}"
        store = gp.open_store(str(root), mode="w")
        before: str | None = None
        if i % 2 == 0:  # half the rounds start from an earlier commit, half from nothing
            first = _ingest(store, early_pattern)
            assert first.ok, first.summary()
            assert first.ingested == early
            before = recorded_id(store, "r")
            assert before is not None
        blocks_before = _block_files(root)

        def landed(
            kill: str | float = kill,
            before: str | None = before,
            root: Path = root,
            store: gp.Store = store,
            blocks_before: int = blocks_before,
        ) -> bool:
            if kill == "first block":
                return _block_files(root) > blocks_before
            return recorded_id(store, "r") != before

        with _client(root, sample) as proc:
            start = time.perf_counter()
            if isinstance(kill, float):
                time.sleep(seconds * kill * rng.uniform(0.9, 1.1))
            else:
                while proc.poll() is None and not landed():
                    time.sleep(0.002)
            finished = proc.poll() is not None
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=30)
            # It may have finished between the poll and the kill.
            finished = finished or proc.returncode == 0
        delay = time.perf_counter() - start
        where = f"seed {SEED}, round {i}: kill at {kill!r} after {delay:.3f} s of {seconds:.3f} s"
        if not finished:
            assert proc.returncode == -signal.SIGKILL, where

        # The store is readable and consistent, at a complete commit.
        report = gp.verify(store)
        assert report.ok, (where, report.to_dict())
        now = recorded_id(store, "r")
        if now != before:
            assert now is not None, where
            assert len(open_run(store, "r")) == total, where
            assert run_tensor_ids(store, "r") == ids, where
        elif _block_files(root) > blocks_before:
            mid_graph += 1
        if kill == "commit":
            assert now != before, where
        if finished:
            assert proc.returncode == 0, where
            assert now != before, where

        # Running it again finishes the work, bit-exact.
        rerun = _ingest(store, sample.dump_pattern)
        assert rerun.ok, (where, rerun.summary())
        assert rerun.ingested + rerun.skipped == total, where
        if now != before:
            assert rerun.ingested == 0, where
        else:
            assert rerun.skipped == (early if before else 0), where
        assert len(open_run(store, "r")) == total, where
        assert run_tensor_ids(store, "r") == ids, where
        _check_bit_exact(store, sample)
    # At least one kill fell inside the graph (after blocks were written, before the
    # commit); otherwise this test would only have tested start-up and the finish.
    assert mid_graph >= 1, f"seed {SEED}: no kill landed mid-graph (ingest {seconds:.2f} s)"


# --- (b) kill a worker ----------------------------------------------------------------
def _encoded(dask_scheduler: Any) -> int:
    prefix = dask_scheduler.task_prefixes.get("gradpipe-encode")
    return int(prefix.state_counts["memory"]) if prefix is not None else 0


def _gone(pid: int, timeout: float = 15) -> bool:
    import psutil

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            if psutil.Process(pid).status() == psutil.STATUS_ZOMBIE:
                return True
        except psutil.NoSuchProcess:
            return True
        time.sleep(0.05)
    return False


@pytest.mark.slow
def test_worker_killed_mid_graph_ingest_completes(
    sample: SampleRun, reference: tuple[TensorIds, float], tmp_path: Path
) -> None:
    distributed = pytest.importorskip("distributed")
    ids, _ = reference
    total = len(sample.steps) * len(sample.peers)
    cluster = distributed.LocalCluster(
        n_workers=2,
        threads_per_worker=1,
        processes=True,
        dashboard_address=None,
        host="127.0.0.1",
        silence_logs=50,  # the killed worker's "lost" messages are what we expect
    )
    client = distributed.Client(cluster, set_as_default=False)
    try:
        # Smaller chunks on later attempts: more tasks, longer graph, a surer mid-graph kill.
        for attempt, chunk_bytes in enumerate((CHUNK_BYTES, CHUNK_BYTES // 2, CHUNK_BYTES // 4)):
            store = gp.open_store(str(tmp_path / f"store{attempt}"), mode="w")
            outcome: dict[str, Any] = {}

            def run(
                store: gp.Store = store,
                chunk_bytes: int = chunk_bytes,
                outcome: dict[str, Any] = outcome,
            ) -> None:
                try:
                    with dask.config.set({"gradpipe.chunk-bytes": chunk_bytes}):
                        outcome["report"] = ingest(
                            store, sample.dump_pattern, run="r", client=client
                        )
                except BaseException as exc:  # re-raised in the test's thread
                    outcome["error"] = exc

            encoded_before = client.run_on_scheduler(_encoded)
            pids = client.run(os.getpid)
            thread = threading.Thread(target=run, daemon=True)
            thread.start()
            deadline = time.monotonic() + 60
            while client.run_on_scheduler(_encoded) < encoded_before + 8:
                assert thread.is_alive() or "error" not in outcome, outcome.get("error")
                assert time.monotonic() < deadline, "no encode task finished in 60 s"
                time.sleep(0.01)
            # Kill the worker that holds results or is running tasks right now.
            busy = client.processing()
            victim = max(pids, key=lambda addr: len(busy.get(addr, ())))
            os.kill(pids[victim], signal.SIGKILL)
            killed_mid_graph = thread.is_alive() and recorded_id(store, "r") is None
            thread.join(timeout=120)
            assert not thread.is_alive(), "ingest did not finish within 120 s of the kill"
            if "error" in outcome:
                raise outcome["error"]
            report: IngestReport = outcome["report"]
            assert report.ok, report.summary()
            assert report.ingested == total
            assert _gone(pids[victim]), f"worker pid {pids[victim]} survived SIGKILL"
            if chunk_bytes == CHUNK_BYTES:
                assert run_tensor_ids(store, "r") == ids
            assert len(open_run(store, "r")) == total
            assert gp.verify(store).ok
            _check_bit_exact(store, sample)
            if killed_mid_graph:
                break
            # The graph finished before the kill landed: the nanny restarts the worker;
            # wait for it and try again with more, smaller tasks.
            client.wait_for_workers(2, timeout=60)
        else:
            pytest.fail("three ingests all finished before the worker kill landed")
    finally:
        client.close()
        cluster.close()
