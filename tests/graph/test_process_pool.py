"""Graphs on local worker processes (``processes=True``, ``--processes``): issue 19.

The processes are real (spawned by Dask's multiprocessing context); each test pays about
half a second to start a pool.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import dask.config
import psutil
import pytest

import gradpipe as gp
from gradpipe.errors import GradpipeError, InvalidInputError
from gradpipe.graph.process_pool import LocalProcesses
from gradpipe.storage.catalog import read_run
from gradpipe.testing import SampleRun, TrainingConfig, write_sample_run
from gradpipe.testing.ids import run_tensor_ids

BIN = Path(sys.executable).parent
SETTINGS = {"gradpipe.chunk-bytes": 64 << 10, "gradpipe.ingest.task-bytes": 256 << 10}


@pytest.fixture(scope="module")
def sample(tmp_path_factory: pytest.TempPathFactory) -> SampleRun:
    config = TrainingConfig(vocab_size=6_000, embed_dim=32, hidden=48, peers=3, steps=3)
    return write_sample_run(tmp_path_factory.mktemp("sample"), config)


@pytest.fixture(scope="module")
def thread_ids(sample: SampleRun, tmp_path_factory: pytest.TempPathFactory) -> dict[Any, str]:
    store = gp.open_store(str(tmp_path_factory.mktemp("threads") / "store"), mode="w")
    with dask.config.set(SETTINGS):
        assert gp.ingest(store, sample.dump_pattern, run="r", workers=2).ok
    return run_tensor_ids(store, "r")


def _pids(runner: gp.Runner, n: int = 8) -> set[int]:
    graph = {("pid", i): (os.getpid,) for i in range(n)}
    return set(runner.get(graph, list(graph), name="gradpipe-test"))


def test_ingest_on_processes_is_bit_exact_with_threads(
    sample: SampleRun, thread_ids: dict[Any, str], tmp_path: Path
) -> None:
    store = gp.open_store(str(tmp_path / "store"), mode="w")
    # The settings reach the spawned processes: the tensor ids (which depend on the chunk
    # size and on which chunks are kept inline) are those of the threaded ingest.
    with dask.config.set(SETTINGS):
        report = gp.ingest(store, sample.dump_pattern, run="r", workers=2, processes=True)
    assert report.ok, report.summary()
    assert report.ingested == len(sample.steps) * len(sample.peers)
    assert run_tensor_ids(store, "r") == thread_ids
    assert gp.verify(store, all_blocks=True).ok


def test_one_pool_serves_many_graphs_and_closes(sample: SampleRun, tmp_path: Path) -> None:
    with gp.runner(processes=True, workers=2) as runner:
        assert repr(runner) == "<gradpipe Runner on local processes (2 workers)>"
        first = _pids(runner)
        assert os.getpid() not in first
        store = gp.open_store(str(tmp_path / "store"), mode="w")
        assert gp.ingest(store, sample.dump_pattern, run="r", runner=runner).ok
        seen = first | _pids(runner)
        assert len(seen) <= 2  # a new pool would have brought new processes
    _gone(seen)


def _gone(pids: set[int], timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while any(_alive(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not any(_alive(p) for p in pids)


def _alive(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def test_a_setting_changed_between_graphs_reaches_new_processes() -> None:
    def setting() -> Any:
        from gradpipe.config import get_setting

        return get_setting("inline-bytes")

    with gp.runner(processes=True, workers=1) as runner:
        before = runner.get({"s": (setting,)}, ["s"], name="gradpipe-test")
        with dask.config.set({"gradpipe.inline-bytes": 12345}):
            assert runner.get({"s": (setting,)}, ["s"], name="gradpipe-test") == [12345]
        assert runner.get({"s": (setting,)}, ["s"], name="gradpipe-test") == before


def test_a_killed_process_fails_the_graph_clearly_and_the_next_graph_runs() -> None:
    def die() -> None:
        os.kill(os.getpid(), signal.SIGKILL)

    with gp.runner(processes=True, workers=2) as runner:
        before = _pids(runner)
        with pytest.raises(GradpipeError, match="died during gradpipe-test"):
            runner.get({"x": (die,)}, ["x"], name="gradpipe-test")
        assert _pids(runner).isdisjoint(before)  # a new pool


def test_a_pool_broken_between_graphs_is_replaced_silently() -> None:
    pool = LocalProcesses(2)
    try:
        assert pool.get({"x": (abs, -1)}, ["x"], name="gradpipe-test") == [1]
        first = set(pool.pids)
        assert len(first) == 2
        os.kill(pool.pids[0], signal.SIGKILL)  # dies while idle
        _gone({pool.pids[0]})
        # Broken *between* graphs: once the executor has seen it (its own thread marks the
        # pool a moment after the death; a death in that moment fails the next graph).
        deadline = time.monotonic() + 10
        while not getattr(pool._pool, "_broken", False) and time.monotonic() < deadline:
            time.sleep(0.01)
        assert pool.get({"x": (abs, -2)}, ["x"], name="gradpipe-test") == [2]
        assert first.isdisjoint(pool.pids)
    finally:
        pool.close()


def test_workers_leave_ctrl_c_to_the_parent_and_take_their_share_of_threads() -> None:
    from gradpipe.storage._pools import read_threads

    pool = LocalProcesses(2)
    try:
        assert pool.get({"x": (abs, -1)}, ["x"], name="gradpipe-test") == [1]
        pids = set(pool.pids)
        for pid in pids:
            os.kill(pid, signal.SIGINT)  # as a terminal's Ctrl-C reaches the process group
        time.sleep(0.3)
        graph = {("t", i): (read_threads,) for i in range(4)}
        assert (
            pool.get(graph, list(graph), name="gradpipe-test") == [max(1, read_threads() // 2)] * 4
        )
        assert set(pool.pids) == pids  # the same processes: none died of the SIGINT
    finally:
        pool.close()


def test_workers_exit_when_their_parent_is_killed(tmp_path: Path) -> None:
    script = tmp_path / "parent.py"
    script.write_text(
        "import sys, time\n"
        "from gradpipe.graph.process_pool import LocalProcesses\n"
        "pool = LocalProcesses(2)\n"
        "pool.get({'x': (abs, -1)}, ['x'], name='gradpipe-test')\n"
        "print(*pool.pids, flush=True)\n"
        "time.sleep(600)\n"
    )
    parent = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, text=True)
    try:
        assert parent.stdout is not None
        pids = {int(p) for p in parent.stdout.readline().split()}
        assert len(pids) == 2
        assert all(_alive(p) for p in pids)
    finally:
        parent.kill()  # SIGKILL: no cleanup of its own runs
        parent.wait()
    _gone(pids)


def test_a_worker_killed_mid_ingest_commits_nothing_and_a_rerun_succeeds(
    sample: SampleRun, thread_ids: dict[Any, str], tmp_path: Path
) -> None:
    store_path = tmp_path / "store"
    store = gp.open_store(str(store_path), mode="w")
    killed: list[int] = []
    with dask.config.set(SETTINGS), gp.runner(processes=True, workers=2) as runner:
        _pids(runner)  # the pool is up, with the settings of the ingest
        assert runner._pool is not None
        victim = runner._pool.pids[0]

        def kill_at_the_first_block() -> None:
            # Mid-ingest by construction: the first block is written by the first encode
            # task, long before the commit (many small tasks, SETTINGS).
            deadline = time.monotonic() + 60
            while time.monotonic() < deadline:
                if any(p.is_file() for p in (store_path / "blocks").rglob("*")):
                    os.kill(victim, signal.SIGKILL)
                    killed.append(victim)
                    return
                time.sleep(0.002)

        killer = threading.Thread(target=kill_at_the_first_block)
        killer.start()
        try:
            with pytest.raises(GradpipeError, match="died during"):
                gp.ingest(store, sample.dump_pattern, run="r", runner=runner)
        finally:
            killer.join()
    assert killed
    assert read_run(store, "r", missing_ok=True)[0] is None  # no commit
    assert gp.verify(store, all_blocks=True).ok
    with dask.config.set(SETTINGS):
        assert gp.ingest(store, sample.dump_pattern, run="r", workers=2, processes=True).ok
    assert run_tensor_ids(store, "r") == thread_ids


def test_processes_ignore_the_environment_scheduler(monkeypatch: pytest.MonkeyPatch) -> None:
    # An explicit choice of local processes wins over DASK_SCHEDULER_ADDRESS (a default).
    monkeypatch.setenv("DASK_SCHEDULER_ADDRESS", "tcp://127.0.0.1:9")
    with gp.runner(processes=True, workers=1) as runner:
        assert runner.client is None
        assert runner.get({"x": 1, "y": (sum, ["x", "x"])}, ["y"], name="gradpipe-test") == [2]


def test_processes_with_a_cluster_are_refused() -> None:
    with pytest.raises(InvalidInputError, match="pass one or the other"):
        gp.runner(processes=True, scheduler="tcp://127.0.0.1:9")
    with pytest.raises(InvalidInputError, match="pass one or the other"):
        gp.Runner(object(), processes=True)  # type: ignore[arg-type]


@pytest.mark.slow
def test_dashboard_with_processes_is_a_cluster_of_single_threaded_processes() -> None:
    with gp.runner(processes=True, workers=2, dashboard=True) as runner:
        assert runner.client is not None
        workers = runner.client.scheduler_info()["workers"].values()
        assert sorted(w["nthreads"] for w in workers) == [1, 1]
        pids = runner.client.run(os.getpid).values()
        assert len(set(pids) - {os.getpid()}) == 2
        assert runner.get({"x": 1, "y": (sum, ["x", "x"])}, ["y"], name="gradpipe-test") == [2]


def test_cli_ingest_processes(
    sample: SampleRun, thread_ids: dict[Any, str], tmp_path: Path
) -> None:
    env = {k: v for k, v in os.environ.items() if k != "DASK_SCHEDULER_ADDRESS"}
    env.update(
        DASK_GRADPIPE__CHUNK_BYTES=str(SETTINGS["gradpipe.chunk-bytes"]),
        DASK_GRADPIPE__INGEST__TASK_BYTES=str(SETTINGS["gradpipe.ingest.task-bytes"]),
    )
    store = tmp_path / "store"
    command = [str(BIN / "gradpipe"), "ingest", str(store), sample.dump_pattern, "--run", "r"]
    done = subprocess.run(
        [*command, "--processes", "--workers", "2", "--json"],
        capture_output=True, env=env, timeout=120, check=False, text=True,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout)["ok"] is True
    assert run_tensor_ids(gp.open_store(str(store), mode="r"), "r") == thread_ids
    refused = subprocess.run(
        [*command, "--processes", "--scheduler", "tcp://127.0.0.1:9"],
        capture_output=True, env=env, timeout=60, check=False, text=True,
    )  # fmt: skip
    assert refused.returncode == 2
    assert "pass one or the other" in refused.stderr


def test_local_processes_close_is_idempotent() -> None:
    pool = LocalProcesses(1)
    assert pool.get({"x": (abs, -3)}, ["x"], name="gradpipe-test") == [3]
    pool.close()
    pool.close()
    assert pool.get({"x": (abs, -4)}, ["x"], name="gradpipe-test") == [4]
    pool.close()


@pytest.mark.parametrize("method", ["fedavg", "median", "krum"])
def test_aggregates_on_processes_are_those_of_threads(
    sample: SampleRun, tmp_path: Path, method: str
) -> None:
    store = gp.open_store(str(tmp_path / "store"), mode="w")
    assert gp.ingest(store, sample.dump_pattern, run="r", workers=2).ok
    options: dict[str, Any] = {"byzantine": 0} if method == "krum" else {}
    threads = gp.aggregate(store, run="r", method=method, name="a", **options)
    with gp.runner(processes=True, workers=2) as runner:
        # force: computed again (not memoised), on the processes; the same id means the
        # same bytes, statistics and provenance.
        processes = gp.aggregate(
            store, run="r", method=method, name="a", runner=runner, force=True, **options
        )
    assert threads.ok
    assert processes.ok
    assert [s.status for s in processes.steps] == ["computed"] * len(sample.steps)
    assert [s.aggregate for s in processes.steps] == [s.aggregate for s in threads.steps]


def test_cli_aggregate_processes(
    sample: SampleRun, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from gradpipe.cli import main

    store = gp.open_store(str(tmp_path / "store"), mode="w")
    assert gp.ingest(store, sample.dump_pattern, run="r", workers=2).ok
    threads = gp.aggregate(store, run="r", method="fedavg", name="t")
    argv = ["aggregate", store.url, "--run", "r", "--method", "fedavg", "--name", "p"]
    assert main([*argv, "--processes", "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    processes = gp.open_run(store, "r")
    # Other names, so other provenance: the aggregates' tensors are compared.
    for outcome, theirs in zip(doc["steps"], threads.steps, strict=True):
        ours = processes.aggregate("p", step=outcome["step"])
        mine = processes.aggregate("t", step=theirs.step)
        assert ours.manifest.tensor_ids
        assert ours.manifest.tensor_ids == mine.manifest.tensor_ids


def test_a_script_without_a_main_guard_is_not_run_again_in_the_processes(
    tmp_path: Path,
) -> None:
    # Spawned processes import the parent's __main__ by default: this script would run its
    # own top level in each worker (and fail there, starting processes while bootstrapping).
    script = tmp_path / "unguarded.py"
    script.write_text(
        "import os\n"
        "import gradpipe as gp\n"
        "print('top level ran', flush=True)\n"
        "with gp.runner(processes=True, workers=2) as runner:\n"
        "    pids = runner.get({('p', i): (os.getpid,) for i in range(4)},\n"
        "                      [('p', i) for i in range(4)], name='gradpipe-test')\n"
        "print('in workers:', os.getpid() not in pids)\n"
    )
    done = subprocess.run(
        [sys.executable, str(script)], capture_output=True, text=True, timeout=120, check=False
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines() == ["top level ran", "in workers: True"]
