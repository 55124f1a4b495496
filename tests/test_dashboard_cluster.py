"""The gradpipe dashboard on real ``dask scheduler`` and ``dask worker`` processes.

As a user runs it: ``dask scheduler --preload gradpipe.dashboard`` (or a plain
scheduler given the plugin through ``client.register_plugin``), workers on
loopback, and ``gradpipe ingest`` / ``gradpipe aggregate --scheduler ADDR`` in
processes of their own. The page, its JSON and the Prometheus metrics are read
over HTTP during an ingest (held at its lease by a gc lock the test takes) and
after it, and the page is drawn by headless Chromium when it is installed.
"""

from __future__ import annotations

import contextlib
import html
import json
import os
import shutil
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

import gradpipe as gp
from gradpipe.testing import SampleRun, TrainingConfig, write_sample_run

distributed = pytest.importorskip("distributed")
prometheus_parser = pytest.importorskip("prometheus_client.parser")

BIN = Path(sys.executable).parent
DEADLINE = 60.0  # seconds to wait for something that happens in well under one


# --- processes ----------------------------------------------------------------------
@dataclass
class Cluster:
    """A running scheduler (with its HTTP server), its workers, and a client on it."""

    address: str
    http: str
    client: Any
    root: Path
    procs: list[subprocess.Popen[bytes]] = field(default_factory=list)

    def get(self, path: str) -> str:
        with urllib.request.urlopen(self.http + path, timeout=10) as response:
            body: bytes = response.read()
        return body.decode()

    def doc(self) -> dict[str, Any]:
        doc = json.loads(self.get("/json/gradpipe.json"))
        assert isinstance(doc, dict)
        return doc

    def metrics(self) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
        return {
            (sample.name, tuple(sorted(sample.labels.items()))): sample.value
            for family in prometheus_parser.text_string_to_metric_families(self.get("/metrics"))
            for sample in family.samples
            if sample.name.startswith("gradpipe_")
        }

    def logs(self) -> str:
        return "\n".join(
            f"--- {log.name}\n{log.read_text(errors='replace')[-3000:]}"
            for log in sorted(self.root.glob("*.log"))
        )


def _spawn(args: list[str], log: Path) -> subprocess.Popen[bytes]:
    with log.open("wb") as out:
        return subprocess.Popen(
            args, stdout=out, stderr=subprocess.STDOUT, start_new_session=True, cwd=log.parent
        )


def _stop(proc: subprocess.Popen[bytes]) -> None:
    """Stop a process started in its own session, and everything it started."""
    if proc.poll() is None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGTERM)
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(timeout=10)
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)
    with contextlib.suppress(subprocess.TimeoutExpired):
        proc.wait(timeout=10)


def _until(what: str, check: Callable[[], Any], cluster: Cluster | None = None) -> Any:
    """Poll ``check`` until it returns something true; its value."""
    deadline = time.monotonic() + DEADLINE
    while True:
        value = check()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"{what}: not after {DEADLINE} s\n{cluster and cluster.logs()}")
        time.sleep(0.1)


@contextlib.contextmanager
def dask_cluster(
    root: Path, *, preload: str | None, workers: int = 2, prefix: str = ""
) -> Iterator[Cluster]:
    from distributed import Client

    root.mkdir(parents=True, exist_ok=True)
    scheduler_file = root / "scheduler.json"
    args = [str(BIN / "dask"), "scheduler", "--host", "127.0.0.1", "--port", "0"]
    args += ["--dashboard-address", "127.0.0.1:0", "--scheduler-file", str(scheduler_file)]
    args += ["--preload", preload] if preload else []
    args += ["--dashboard-prefix", prefix] if prefix else []
    procs = [_spawn(args, root / "scheduler.log")]
    client = None
    try:
        cluster = Cluster("", "", None, root, procs)
        identity = _until(
            "the scheduler's identity file",
            lambda: procs[0].poll() is None and _json(scheduler_file),
            cluster,
        )
        cluster.address = identity["address"]
        cluster.http = f"http://127.0.0.1:{identity['services']['dashboard']}{prefix}"
        for i in range(workers):
            worker = [str(BIN / "dask"), "worker", cluster.address, "--nthreads", "1"]
            worker += ["--no-dashboard", "--host", "127.0.0.1", "--death-timeout", "60"]
            worker += ["--local-directory", str(root / f"worker{i}")]
            procs.append(_spawn(worker, root / f"worker{i}.log"))
        client = Client(cluster.address, set_as_default=False, timeout=30)
        client.wait_for_workers(workers, timeout=DEADLINE)
        cluster.client = client
        yield cluster
    finally:
        if client is not None:
            client.close()
        for proc in reversed(procs):
            _stop(proc)


def _json(path: Path) -> dict[str, Any] | None:
    try:
        doc = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError):  # being written
        return None
    return doc if isinstance(doc, dict) else None


@pytest.fixture(scope="module")
def sample(tmp_path_factory: pytest.TempPathFactory) -> SampleRun:
    return write_sample_run(tmp_path_factory.mktemp("sample"), TrainingConfig(peers=3, steps=2))


@pytest.fixture(scope="module")
def preloaded(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    """``dask scheduler --preload gradpipe.dashboard`` and two workers."""
    with dask_cluster(tmp_path_factory.mktemp("preloaded"), preload="gradpipe.dashboard") as c:
        yield c


def _gradpipe(*args: str) -> subprocess.Popen[bytes]:
    """``gradpipe ARGS --json`` in a process of its own, as a batch job runs."""
    environ = {k: v for k, v in os.environ.items() if k != "DASK_SCHEDULER_ADDRESS"}
    return subprocess.Popen(
        [str(BIN / "gradpipe"), *args, "--json"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        env=environ,
    )


def _finish(proc: subprocess.Popen[bytes]) -> dict[str, Any]:
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 0, (out.decode(), err.decode())
    doc = json.loads(out)
    assert isinstance(doc, dict)
    return doc


def _operation(doc: dict[str, Any], kind: str, run: str, state: str) -> dict[str, Any] | None:
    wanted = (kind, run, state)
    found = [op for op in doc["operations"] if (op["kind"], op["run"], op["state"]) == wanted]
    return found[0] if found else None


# --- tests --------------------------------------------------------------------------
def test_ingest_and_aggregate_with_scheduler_show_on_the_page(
    preloaded: Cluster, sample: SampleRun, tmp_path: Path
) -> None:
    cluster = preloaded
    store_path = tmp_path / "store"
    store = gp.open_store(store_path, mode="w")
    before = cluster.metrics()

    # During: gc's lock holds the ingest at its lease, after its inspect graph ran.
    with store.lock.exclusive("the test holds writers back"):
        job = _gradpipe(
            "ingest", str(store_path), sample.dump_pattern, "--run", "held", "--scheduler",
            cluster.address,
        )  # fmt: skip
        try:

            def inspected() -> dict[str, Any] | None:
                """The ingest, once its inspect graph ran (it then waits for its lease)."""
                op = _operation(cluster.doc(), "ingest", "held", "running")
                if op is None or not op["stages"]:
                    return None
                planned = sum(stage["tasks"] for stage in op["stages"])
                return op if op["tasks"]["done"] == op["tasks"]["total"] == planned else None

            running = _until("the ingest on the page as running", inspected, cluster)
            assert [s["stage"] for s in running["stages"]] == ["gradpipe-inspect"]
            assert running["store"] == store.url
            page = cluster.get("/gradpipe")
            assert '<span class="running">running</span>' in page
            assert ">held<" in page
            metrics = cluster.metrics()
            assert metrics["gradpipe_operations_running", (("kind", "ingest"),)] == 1
        except BaseException:
            _stop(job)
            raise
    ingested = _finish(job)
    assert ingested["ingested"] == len(sample.steps) * len(sample.peers)

    # After: the report's figures, the commit, and every task done.
    op = _operation(cluster.doc(), "ingest", "held", "done")
    assert op is not None, cluster.doc()
    assert op["bytes_in"] == ingested["raw_bytes"]
    assert op["bytes_stored"] == ingested["stored_bytes"]
    assert op["ratio"] == pytest.approx(ingested["raw_bytes"] / ingested["stored_bytes"], rel=1e-3)
    assert op["commit"] == ingested["run_id"] == store.refs.get("runs/held")
    assert [s["stage"] for s in op["stages"]] == ["gradpipe-inspect", "gradpipe-ingest"]
    assert op["tasks"]["done"] == op["tasks"]["total"] == sum(s["tasks"] for s in op["stages"])
    assert op["failed"] == 0
    # The workers' byte counts reach the scheduler with their heartbeats.
    _until(
        "the workers' read bytes in the operation's spans",
        lambda: (
            _operation(cluster.doc(), "ingest", "held", "done")["bytes_read"]  # type: ignore[index]
            >= ingested["raw_bytes"]
        ),
        cluster,
    )

    job = _gradpipe(
        "aggregate", str(store_path), "--run", "held", "--method", "fedavg", "--scheduler",
        cluster.address,
    )  # fmt: skip
    aggregated = _finish(job)
    doc = cluster.doc()
    agg = _operation(doc, "aggregate", "held", "done")
    assert agg is not None, doc
    assert agg["figures"]["computed"] == len(sample.steps)
    assert agg["commit"] == aggregated["run_id"]
    assert agg["bytes_in"] == aggregated["logical_bytes"]
    [run] = [r for r in doc["runs"] if r["run"] == "held"]
    assert [(c["kind"], c["commit"]) for c in run["commits"]] == [
        ("aggregate", aggregated["run_id"]),
        ("ingest", ingested["run_id"]),
    ]  # newest first
    assert "gradpipe-aggregate-reduce" in doc["tasks"]  # few peers: one task per chunk

    page = cluster.get("/gradpipe")
    for text in ("Latest commits per run", aggregated["run_id"], ingested["run_id"], ">aggregate<"):
        assert text in page
    after = cluster.metrics()
    ingest, aggregate = (("kind", "ingest"),), (("kind", "aggregate"),)
    done = (("kind", "ingest"), ("state", "done"))

    def grew(name: str, labels: tuple[tuple[str, str], ...]) -> float:
        return after[name, labels] - before.get((name, labels), 0)

    assert grew("gradpipe_operations_total", done) == 1
    assert grew("gradpipe_input_bytes_total", ingest) == ingested["raw_bytes"]
    assert after["gradpipe_stored_bytes_total", aggregate] >= aggregated["stored_bytes"] > 0
    assert after["gradpipe_operations_running", ingest] == 0
    assert after["gradpipe_tasks_total", (("prefix", "gradpipe-commit"), ("state", "memory"))] >= 1


def test_failed_dumps_show_with_their_reasons(
    preloaded: Cluster, sample: SampleRun, tmp_path: Path
) -> None:
    dumps = tmp_path / "dumps"
    shutil.copytree(Path(sample.dump_path(0, sample.peers[0])).parent.parent, dumps)
    bad = dumps / Path(sample.dump_path(1, sample.peers[0])).relative_to(
        Path(sample.dump_path(0, sample.peers[0])).parent.parent
    )
    bad.write_bytes(bad.read_bytes()[:100])  # truncated
    job = _gradpipe(
        "ingest", str(tmp_path / "store"), str(dumps / "step={step}" / "peer={peer}.safetensors"),
        "--run", "partial", "--scheduler", preloaded.address,
    )  # fmt: skip
    out, err = job.communicate(timeout=120)
    assert job.returncode == 1, (out, err)
    op = _operation(preloaded.doc(), "ingest", "partial", "failed")
    assert op is not None, preloaded.doc()
    assert op["failed"] == 1
    [line] = op["failures"]
    assert line.startswith(f"step 1 peer {sample.peers[0]!r}: ")  # names are quoted
    assert str(bad) in line
    assert op["commit"] is not None  # the good dumps were committed
    page = preloaded.get("/gradpipe")
    assert '<span class="failed">failed</span>' in page
    assert html.escape(f"step 1 peer {sample.peers[0]!r}") in page


def test_register_plugin_on_a_running_scheduler(sample: SampleRun, tmp_path: Path) -> None:
    from gradpipe.dashboard.plugin import GradpipeDashboard

    with dask_cluster(tmp_path / "cluster", preload=None, workers=1) as cluster:
        store = gp.open_store(tmp_path / "store", mode="w")
        report = gp.ingest(store, sample.dump_pattern, run="early", client=cluster.client)
        assert report.ok, report.summary()
        with pytest.raises(urllib.error.HTTPError) as missing:
            cluster.get("/gradpipe")
        assert missing.value.code == 404

        cluster.client.register_plugin(GradpipeDashboard())
        cluster.client.register_plugin(GradpipeDashboard())  # idempotent: one dashboard
        doc = cluster.doc()
        # The ingest ran before the plugin: replayed from the scheduler's events.
        [early] = [op for op in doc["operations"] if op["run"] == "early"]
        assert (early["kind"], early["state"], early["commit"]) == ("ingest", "done", report.run_id)

        with gp.runner(cluster.client) as runner:
            agg = gp.aggregate(store, run="early", method="mean", runner=runner)
            gp.snapshot(store, "model", {"w": list(range(10))}, step=1)
            gp.restore(store, "model", runner=runner)
        doc = cluster.doc()
        kinds = [(op["kind"], op["state"]) for op in doc["operations"]]
        assert kinds == [("restore", "done"), ("aggregate", "done"), ("ingest", "done")]
        assert doc["operations"][1]["commit"] == agg.run_id
        assert "gradpipe_operations_total" in cluster.get("/metrics")
        assert ">restore<" in cluster.get("/gradpipe")


def test_a_dashboard_prefix_moves_the_page_with_dasks_own(
    sample: SampleRun, tmp_path: Path
) -> None:
    # `dask scheduler --dashboard-prefix /dask`: every route under the prefix, ours too.
    with dask_cluster(
        tmp_path / "cluster", preload="gradpipe.dashboard", workers=1, prefix="/dask"
    ) as cluster:
        store = gp.open_store(tmp_path / "store", mode="w")
        report = gp.ingest(store, sample.dump_pattern, run="prefixed", client=cluster.client)
        assert report.ok, report.summary()
        [op] = [op for op in cluster.doc()["operations"] if op["run"] == "prefixed"]
        assert (op["kind"], op["state"]) == ("ingest", "done")
        assert ">prefixed<" in cluster.get("/gradpipe")
        assert "gradpipe_operations_total" in cluster.get("/metrics")
        root = cluster.http.removesuffix("/dask")
        with pytest.raises(urllib.error.HTTPError) as missing:
            urllib.request.urlopen(root + "/gradpipe", timeout=10)
        assert missing.value.code == 404


# --- a browser ----------------------------------------------------------------------
def _chromium() -> str:
    found = shutil.which("chromium") or shutil.which("chromium-browser")
    if found is None:
        pytest.skip(
            "Chromium is not installed (Debian's package `chromium`; .ci/run installs it with "
            "apt-get when it can): the page is not drawn in a browser"
        )
    return found


def _browse(chromium: str, profile: Path, *args: str) -> subprocess.CompletedProcess[bytes]:
    flags = ["--headless", "--no-sandbox", "--disable-gpu", "--hide-scrollbars"]
    flags += ["--no-first-run", f"--user-data-dir={profile}", "--window-size=1400,900"]
    return subprocess.run([chromium, *flags, *args], capture_output=True, timeout=120, check=False)


def test_the_page_in_headless_chromium(
    preloaded: Cluster, sample: SampleRun, tmp_path: Path
) -> None:
    chromium = _chromium()
    store = gp.open_store(tmp_path / "store", mode="w")
    report = gp.ingest(store, sample.dump_pattern, run="browsed", client=preloaded.client)
    assert report.ok, report.summary()
    url = preloaded.http + "/gradpipe?refresh=0"

    dom = _browse(chromium, tmp_path / "profile", "--dump-dom", url)
    assert dom.returncode == 0, dom.stderr.decode()[-2000:]
    html = dom.stdout.decode()
    for text in ("<h1>gradpipe</h1>", "Operations", "Latest commits per run", ">browsed<",
                 '<span class="done">done</span>', report.run_id or "?"):  # fmt: skip
        assert text in html, text

    png = tmp_path / "gradpipe.png"
    shot = _browse(chromium, tmp_path / "profile", f"--screenshot={png}", url)
    assert shot.returncode == 0, shot.stderr.decode()[-2000:]
    from PIL import Image

    with Image.open(png) as image:
        assert image.format == "PNG"
        assert image.size == (1400, 900)
        colours = image.convert("RGB").getcolors(maxcolors=1 << 16)
    # Text, table stripes, the state colours and progress bars: far from a blank page.
    assert colours is None or len(colours) > 50
