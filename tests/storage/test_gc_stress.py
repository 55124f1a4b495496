"""Stress: gc in a loop against concurrent ingests that reuse old, unreferenced blocks.

The set-up of the data-loss report: a store whose blocks are old and
unreferenced (a run's ref removed, block times two days back), then ingests
that reuse exactly those blocks while gc runs again and again, with a grace
of 0 and with the default. Afterwards nothing reachable may be missing and
every dump must export bit-exact. One ingest runs as a ``gradpipe ingest``
process, one in this process on its own Store object (each holds its own
lease); gc runs in a thread on a third Store object, as a separate job would.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
import types
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path

import dask.config
import pytest

import gradpipe as gp
from gradpipe.formats.safetensors import read_safetensors
from gradpipe.ingestion.api import ingest
from gradpipe.runs import open_run
from gradpipe.testing.s3server import S3Server
from gradpipe.testing.training import SampleRun, TrainingConfig, write_sample_run

pytestmark = pytest.mark.slow

CONFIG = TrainingConfig(vocab_size=4000, embed_dim=16, hidden=32, peers=3, steps=3)
#: Small chunks, each a block of its own (not inline in its manifest): thousands of
#: blocks, so gc and the writers overlap on many of them.
SMALL = {
    "gradpipe.chunk-bytes": 2048,
    "gradpipe.ingest.task-bytes": 65536,
    "gradpipe.inline-bytes": 0,
}
TWO_DAYS = 2 * 86400
ROUNDS = 3


@pytest.fixture(scope="module")
def sample(tmp_path_factory: pytest.TempPathFactory) -> SampleRun:
    return write_sample_run(tmp_path_factory.mktemp("sample"), CONFIG)


@pytest.fixture
def small_chunks() -> Iterator[None]:
    with dask.config.set(SMALL):
        yield


def _env() -> dict[str, str]:
    """The subprocess's environment: this process's chunk settings."""
    env = dict(os.environ)
    env["DASK_GRADPIPE__CHUNK_BYTES"] = str(dask.config.get("gradpipe.chunk-bytes"))
    env["DASK_GRADPIPE__INGEST__TASK_BYTES"] = str(dask.config.get("gradpipe.ingest.task-bytes"))
    env["DASK_GRADPIPE__INLINE_BYTES"] = str(dask.config.get("gradpipe.inline-bytes"))
    return env


def _age_everything(root: Path) -> int:
    """Set every block's time two days back (local disk); returns how many."""
    old = time.time() - TWO_DAYS
    count = 0
    for path in (root / "blocks").rglob("*"):
        if path.is_file():
            os.utime(path, (old, old))
            count += 1
    return count


def _aging_on_s3(server: S3Server, url: str) -> Callable[[], int]:
    """The same for a store on the loopback S3 server (moto runs in this process)."""
    store = gp.open_store(url, mode="a")
    bucket, _, prefix = url.removeprefix("s3://").partition("/")

    def age() -> int:
        old = time.time() - TWO_DAYS
        keys = [info.key for info in store.backend.list("blocks")]
        for key in keys:
            server.set_mtime(bucket, f"{prefix}/{key}", old)
        return len(keys)

    return age


def _orphan_runs(store: gp.Store) -> None:
    """Remove every run's ref: all their blocks become unreferenced garbage."""
    for name in store.refs.names():
        store.backend.delete(f"refs/{name}")


class GcLoop:
    """gc, again and again, on its own Store object until stopped."""

    def __init__(self, url: str, grace: float) -> None:
        self.store = gp.open_store(url, mode="a")
        self.grace = grace
        self.runs = 0
        self.deleted = 0
        self.errors: list[BaseException] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="gc-loop", daemon=True)

    def __enter__(self) -> GcLoop:
        self._thread.start()
        return self

    def _loop(self) -> None:
        while not self._stop.is_set():
            try:
                report = gp.gc(self.store, grace=self.grace, wait=120)
            except BaseException as exc:  # reported by the test, not lost in a thread
                self.errors.append(exc)
                return
            self.runs += 1
            self.deleted += report.deleted

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(timeout=180)
        assert not self._thread.is_alive(), "gc loop did not stop"


def _cli_ingest(url: str, pattern: str, run: str) -> subprocess.Popen[str]:
    code = "from gradpipe.cli import main; raise SystemExit(main())"
    return subprocess.Popen(
        [sys.executable, "-c", code, "ingest", url, pattern, "--run", run, "--json"],
        env=_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def _check_every_dump(kit: types.ModuleType, store: gp.Store, sample: SampleRun, run: str) -> None:
    recorded = open_run(store, run)
    assert len(recorded) == len(sample.steps) * len(sample.peers)
    for step in sample.steps:
        for peer in sample.peers:
            want = read_safetensors(sample.dump_path(step, peer))[0]
            kit.assert_all_bit_exact(recorded.dump(step, peer).read_all(), want)


def _stress(
    kit: types.ModuleType,
    url: str,
    sample: SampleRun,
    grace: float,
    age: Callable[[], int],
    rounds: int = ROUNDS,
) -> GcLoop:
    store = gp.open_store(url, mode="a")
    first = ingest(store, sample.dump_pattern, run="seed")
    assert first.ok
    for round_no in range(rounds):
        _orphan_runs(store)
        assert age() > 300
        cli_run, api_run = f"cli{round_no}", f"api{round_no}"
        with GcLoop(url, grace) as loop:
            proc = _cli_ingest(url, sample.dump_pattern, cli_run)
            report = ingest(gp.open_store(url, mode="a"), sample.dump_pattern, run=api_run)
            out, err = proc.communicate(timeout=300)
            # Let gc run at least once more after both writers are done.
            deadline = time.monotonic() + 60
            runs_at_end = loop.runs
            while loop.runs <= runs_at_end + 1 and not loop.errors:
                assert time.monotonic() < deadline, "gc made no progress"
                time.sleep(0.05)
        assert not loop.errors, loop.errors
        assert proc.returncode == 0, err
        assert json.loads(out)["ingested"] == len(sample.steps) * len(sample.peers)
        assert report.ok, report.summary()
        check = gp.verify(store)
        assert check.ok, check.summary()
        for run in (cli_run, api_run):
            _check_every_dump(kit, store, sample, run)
        assert loop.runs >= 2
    return loop


@pytest.mark.parametrize("grace", [0.0, None], ids=["grace-0", "grace-default"])
def test_gc_loop_never_loses_what_concurrent_ingests_reuse_local(
    kit: types.ModuleType,
    sample: SampleRun,
    tmp_path: Path,
    small_chunks: None,
    grace: float | None,
) -> None:
    root = tmp_path / "store"
    gp.open_store(root, mode="w")
    effective = gp.config.get_seconds("gc.grace") if grace is None else grace
    loop = _stress(kit, str(root), sample, effective, lambda: _age_everything(root))
    # The blocks were two days old: both graces let gc delete the orphans it saw.
    assert loop.deleted > 0


@pytest.mark.parametrize("grace", [0.0, None], ids=["grace-0", "grace-default"])
def test_gc_loop_never_loses_what_concurrent_ingests_reuse_s3(
    kit: types.ModuleType,
    sample: SampleRun,
    s3: S3Server,
    small_chunks: None,
    grace: float | None,
) -> None:
    # moto takes ~10 ms per request: fewer, larger chunks and two rounds.
    url = f"s3://gradpipe-test/{uuid.uuid4().hex[:8]}"
    gp.open_store(url, mode="w")
    effective = gp.config.get_seconds("gc.grace") if grace is None else grace
    with dask.config.set({"gradpipe.chunk-bytes": 8192}):
        loop = _stress(kit, url, sample, effective, _aging_on_s3(s3, url), rounds=2)
    assert loop.deleted > 0


def test_two_gcs_and_a_writer(sample: SampleRun, tmp_path: Path, small_chunks: None) -> None:
    root = tmp_path / "store"
    store = gp.open_store(root, mode="w")
    assert ingest(store, sample.dump_pattern, run="seed").ok
    _orphan_runs(store)
    _age_everything(root)
    reports: list[gp.GcReport] = []
    errors: list[BaseException] = []

    def collect() -> None:
        try:
            reports.append(gp.gc(gp.open_store(root, mode="a"), grace=0, wait=120))
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=collect) for _ in range(2)]
    for t in threads:
        t.start()
    written = ingest(gp.open_store(root, mode="a"), sample.dump_pattern, run="new")
    for t in threads:
        t.join(timeout=180)
    assert not errors, errors
    assert written.ok
    assert len(reports) == 2
    assert gp.verify(store).ok
    assert len(open_run(store, "new")) == len(sample.steps) * len(sample.peers)
    # Between them, the two gcs deleted each orphan at most once.
    total = sum(r.deleted for r in reports)
    assert total > 0
    assert not list((root / "locks").glob("exclusive-*"))
