"""The nightly job against a flaky S3 endpoint: nothing lost, doubled or damaged.

Every test puts :class:`~gradpipe.testing.faultproxy.FaultProxy` between the
job and the loopback S3 server, injecting every fault kind (5xx, SlowDown,
slow replies, resets, truncated bodies, dropped replies to requests that
landed) at about 1% of requests each, then checks the store with the faults
off (:func:`~gradpipe.testing.nightly.check_nightly`): ``verify`` clean; each
dump, aggregate and snapshot present exactly once; every export bit-exact
against its source file or the fault-free job's. On top of the faults: a Dask
worker SIGKILLed mid-stage; the client SIGKILLed mid-commit (with its commit
landed and not), then the job run again; two copies of the job racing.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import dask.config
import fsspec
import pytest

import gradpipe as gp
from gradpipe.ingestion.api import recorded_id
from gradpipe.testing import SampleRun, TrainingConfig, write_sample_run
from gradpipe.testing.faultproxy import KINDS, FaultProxy
from gradpipe.testing.nightly import Nightly, check_nightly, run_nightly
from gradpipe.testing.s3server import S3Server

pytestmark = [pytest.mark.s3, pytest.mark.slow]

BUCKET = "gradpipe-test"
SEED = int(os.environ.get("GRADPIPE_TEST_SEED", "20240611"))
RATES = dict.fromkeys(KINDS, 0.01)  # about 7% of requests see a fault
# Small chunks: hundreds of requests per night, so every kind of fault lands somewhere.
# 8 attempts per request, as for any endpoint this flaky: 5 (the default) would let one
# request in ~10^5 fail for good, a failed night rather than lost data, but a flaky test.
SETTINGS = {
    "gradpipe.chunk-bytes": 16 << 10,
    "gradpipe.inline-bytes": 1024,
    "gradpipe.storage.retries.max-attempts": 8,
}
DAYS = [[0, 1], [2, 3]]  # the steps each night finds new


@pytest.fixture(scope="module")
def sample(tmp_path_factory: pytest.TempPathFactory) -> SampleRun:
    config = TrainingConfig(vocab_size=3000, embed_dim=16, hidden=32, peers=3, steps=4)
    return write_sample_run(tmp_path_factory.mktemp("sample"), config)


@pytest.fixture(scope="module")
def reference(sample: SampleRun, tmp_path_factory: pytest.TempPathFactory) -> gp.Store:
    """The same job over every step, on local disk, without faults."""
    root = Path(sample.directory)
    job = Nightly(
        store=str(tmp_path_factory.mktemp("reference") / "store"),
        dumps=str(root / "dumps" / "step={step}" / "peer={peer}.safetensors"),
        states=str(root / "state" / "step={step}.safetensors"),
    )
    with dask.config.set(SETTINGS):
        report = run_nightly(job)
    assert report.ok, report.to_dict()
    return gp.open_store(job.store)


@pytest.fixture
def proxy(s3: S3Server) -> Iterator[FaultProxy]:
    with FaultProxy(s3.endpoint_url, seed=SEED, rates=RATES, delay=(0.01, 0.05)) as proxy:
        yield proxy


@pytest.fixture
def settings() -> Iterator[None]:
    with dask.config.set(SETTINGS):
        yield


class Place:
    """Where one test's dumps, state files and store live in the bucket."""

    def __init__(self, s3: S3Server, sample: SampleRun) -> None:
        self.s3 = s3
        self.sample = sample
        self.prefix = f"{BUCKET}/{uuid.uuid4().hex[:8]}"
        self.fs = fsspec.filesystem("s3", skip_instance_cache=True, **s3.storage_options)

    def upload(self, steps: list[int]) -> None:
        """New dumps and state files arrive, as a training job writes them."""
        for step in steps:
            for peer in self.sample.peers:
                self.fs.put(
                    self.sample.dump_path(step, peer),
                    f"{self.prefix}/dumps/step={step:04d}/peer={peer}.safetensors",
                )
            state = f"{self.prefix}/state/step={step:04d}.safetensors"
            self.fs.put(self.sample.state_path(step), state)

    def job(self, proxy: FaultProxy) -> Nightly:
        return Nightly(
            store=f"s3://{self.prefix}/store",
            dumps=f"s3://{self.prefix}/dumps/step={{step}}/peer={{peer}}.safetensors",
            states=f"s3://{self.prefix}/state/step={{step}}.safetensors",
            storage_options=proxy.storage_options,
        )

    def store(self) -> gp.Store:
        """The store read straight from the server, past the proxy."""
        return gp.open_store(f"s3://{self.prefix}/store", storage_options=self.s3.storage_options)

    def objects(self) -> dict[str, tuple[str, int]]:
        """Every object of the store but lock objects, with its ETag and size."""
        self.fs.invalidate_cache()
        found = self.fs.find(f"{self.prefix}/store", detail=True)
        return {
            k: (str(v.get("ETag")), int(v["size"])) for k, v in found.items() if "/locks/" not in k
        }


@pytest.fixture
def place(s3: S3Server, sample: SampleRun) -> Place:
    return Place(s3, sample)


def _checked(place: Place, job: Nightly, steps: list[int], reference: gp.Store) -> None:
    problems = check_nightly(place.store(), job, place.sample, steps=steps, reference=reference)
    assert problems == [], f"seed {SEED}: {problems}"


# --- nights with faults -----------------------------------------------------------------
@pytest.mark.usefixtures("settings")
def test_nights_through_faults_lose_nothing(
    place: Place, proxy: FaultProxy, reference: gp.Store
) -> None:
    job = place.job(proxy)
    done: list[int] = []
    for steps in DAYS:
        with proxy.paused():
            place.upload(steps)
        done += steps
        report = run_nightly(job)
        assert report.ok, (SEED, report.to_dict())
        assert report.stages["ingest"]["ingested"] == len(steps) * len(place.sample.peers)
        with proxy.paused():
            _checked(place, job, done, reference)
    counts = proxy.counts()
    assert set(counts) == set(KINDS), f"seed {SEED}: only {counts}"
    # Conditional PUTs (blocks, refs, locks) lost replies after landing, and survived.
    assert (
        proxy.counts_by_operation()[("drop", "CPUT")] + proxy.counts_by_operation()[("500", "CPUT")]
        > 0
    )
    # Run again: nothing new, nothing written.
    with proxy.paused():
        before = place.objects()
    again = run_nightly(job)
    assert again.ok
    assert again.stages["ingest"]["ingested"] == 0
    assert again.stages["aggregate"]["computed"] == 0
    with proxy.paused():
        assert place.objects() == before


# --- a worker killed -----------------------------------------------------------------
def _encoded(dask_scheduler: Any) -> int:
    prefix = dask_scheduler.task_prefixes.get("gradpipe-encode")
    return int(prefix.state_counts["memory"]) if prefix is not None else 0


@pytest.mark.usefixtures("settings")
def test_worker_killed_mid_ingest_through_faults(
    place: Place, proxy: FaultProxy, reference: gp.Store
) -> None:
    distributed = pytest.importorskip("distributed")
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
        with proxy.paused():
            place.upload(DAYS[0] + DAYS[1])
        job = place.job(proxy)
        outcome: dict[str, Any] = {}

        def night() -> None:
            try:
                with gp.runner(client) as runner:
                    outcome["report"] = run_nightly(job, runner=runner)
            except BaseException as exc:  # re-raised in the test's thread
                outcome["error"] = exc

        pids = client.run(os.getpid)
        thread = threading.Thread(target=night, daemon=True)
        thread.start()
        deadline = time.monotonic() + 120
        while client.run_on_scheduler(_encoded) < 4:
            assert thread.is_alive(), outcome.get("error")
            assert time.monotonic() < deadline, "no encode task finished in 120 s"
            time.sleep(0.01)
        busy = client.processing()
        victim = max(pids, key=lambda addr: len(busy.get(addr, ())))
        os.kill(pids[victim], signal.SIGKILL)
        killed_mid_stage = recorded_id(place.store(), job.run) is None
        thread.join(timeout=300)
        assert not thread.is_alive(), "the night did not finish within 300 s of the kill"
        if "error" in outcome:
            raise outcome["error"]
        assert outcome["report"].ok, outcome["report"].to_dict()
        assert killed_mid_stage, "the ingest committed before the worker was killed"
        with proxy.paused():
            _checked(place, job, DAYS[0] + DAYS[1], reference)
        assert proxy.total > 0
    finally:
        client.close()
        cluster.close()


# --- the client killed mid-commit ---------------------------------------------------------
def _environ() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k != "DASK_SCHEDULER_ADDRESS"}
    env["DASK_GRADPIPE__CHUNK_BYTES"] = str(SETTINGS["gradpipe.chunk-bytes"])
    env["DASK_GRADPIPE__INLINE_BYTES"] = str(SETTINGS["gradpipe.inline-bytes"])
    env["DASK_GRADPIPE__STORAGE__RETRIES__MAX_ATTEMPTS"] = "8"
    return env


@contextlib.contextmanager
def _night_process(job: Nightly, path: Path) -> Iterator[subprocess.Popen[bytes]]:
    path.write_text(job.to_json(), encoding="utf-8")
    proc = subprocess.Popen(
        [sys.executable, "-m", "gradpipe.testing.nightly", str(path)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        env=_environ(),
        start_new_session=True,
    )
    try:
        yield proc
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.communicate(timeout=60)


@pytest.mark.usefixtures("settings")
@pytest.mark.parametrize("landed", [True, False], ids=["commit-landed", "commit-lost"])
def test_client_killed_mid_commit_then_run_again(
    place: Place, proxy: FaultProxy, reference: gp.Store, tmp_path: Path, landed: bool
) -> None:
    with proxy.paused():
        place.upload(DAYS[0])
    job = place.job(proxy)
    ref_key = f"{place.prefix}/store/refs/runs/{job.run}"
    held = proxy.hold("CPUT", ref_key, land=landed)
    with _night_process(job, tmp_path / "job.json") as proc:
        arrived = False
        deadline = time.monotonic() + 180
        while not arrived and proc.poll() is None and time.monotonic() < deadline:
            arrived = held.arrived.wait(0.05)
        assert arrived, (proc.poll(), proc.stderr.read().decode() if proc.poll() else "")
        os.killpg(proc.pid, signal.SIGKILL)  # its commit is in flight
        proc.wait(30)
        held.release()
    assert proc.returncode == -signal.SIGKILL
    with proxy.paused():
        store = place.store()
        assert gp.verify(store).ok
        committed = recorded_id(store, job.run)
        assert (committed is not None) is landed
        if landed:  # the commit is whole: every dump of the night
            assert len(gp.open_run(store, job.run)) == len(DAYS[0]) * len(place.sample.peers)
    report = run_nightly(job)  # the next run finishes the work, with faults
    assert report.ok, report.to_dict()
    ingested = report.stages["ingest"]["ingested"]
    assert ingested == (0 if landed else len(DAYS[0]) * len(place.sample.peers))
    with proxy.paused():
        _checked(place, job, DAYS[0], reference)
        before = place.objects()
    again = run_nightly(job)
    assert again.stages["ingest"]["ingested"] == 0
    with proxy.paused():
        assert place.objects() == before


# --- two runs racing ------------------------------------------------------------------------
@pytest.mark.usefixtures("settings")
def test_two_nights_racing(
    place: Place, proxy: FaultProxy, reference: gp.Store, tmp_path: Path
) -> None:
    with proxy.paused():
        place.upload(DAYS[0] + DAYS[1])
    job = place.job(proxy)
    with (
        _night_process(job, tmp_path / "a.json") as a,
        _night_process(job, tmp_path / "b.json") as b,
    ):
        outs = [p.communicate(timeout=600) for p in (a, b)]
    for proc, (out, err) in zip((a, b), outs, strict=True):
        assert proc.returncode == 0, err.decode()[-3000:]
        assert json.loads(out)["ok"]
    reports = [json.loads(out)["stages"] for out, _ in outs]
    # Between them every dump was ingested; the second found what the first committed.
    dumps = len(place.sample.peers) * len(DAYS[0] + DAYS[1])
    assert sum(r["ingest"]["ingested"] + r["ingest"]["skipped"] for r in reports) >= dumps
    with proxy.paused():
        _checked(place, job, DAYS[0] + DAYS[1], reference)
    assert proxy.total > 0
