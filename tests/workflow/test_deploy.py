"""``docker/compose.yaml``, natively: its commands, run as it would run them, end to end.

No Docker engine runs on the test machines, so the compose file is checked with
``docker-compose config`` where that is installed, and its services' very commands
and environment are run here as processes: the loopback S3 server, the bucket and
trainer jobs, a ``dask scheduler``, two ``dask worker``s and the nightly job.
Service names become ``127.0.0.1`` and fixed ports free ones; nothing else changes.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

import gradpipe as gp
from gradpipe.testing.s3server import S3Server

REPO = Path(__file__).resolve().parents[2]
COMPOSE = REPO / "docker" / "compose.yaml"
BIN = Path(sys.executable).parent

pytestmark = pytest.mark.slow


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def test_docker_compose_accepts_the_file() -> None:
    compose = shutil.which("docker-compose")
    if compose is None:
        pytest.skip("docker-compose is not installed (.ci/run installs Debian's)")
    done = subprocess.run(
        [compose, "-f", str(COMPOSE), "config", "-q"], capture_output=True, text=True, check=False
    )
    assert done.returncode == 0, done.stderr


class Native:
    """The compose file's services as commands on this machine."""

    def __init__(self, s3: S3Server, tmp: Path) -> None:
        self.doc: Any = yaml.safe_load(COMPOSE.read_text())
        self.scheduler_port, self.dashboard_port = _free_port(), _free_port()
        self.names = {
            "http://s3:5000": s3.endpoint_url,
            "tcp://scheduler:8786": f"tcp://127.0.0.1:{self.scheduler_port}",
        }
        self.tmp = tmp
        self.procs: list[subprocess.Popen[bytes]] = []

    def _word(self, word: str) -> str:
        for name, here in self.names.items():
            word = word.replace(name, here)
        return {"8786": str(self.scheduler_port), ":8787": f":{self.dashboard_port}"}.get(
            word, word
        )

    def argv(self, service: str) -> list[str]:
        words = [self._word(w) for w in self.doc["services"][service]["command"]]
        if words[0] == "python":
            words[0] = sys.executable
        elif (BIN / words[0]).exists():
            words[0] = str(BIN / words[0])
        return words

    def env(self, service: str) -> dict[str, str]:
        own = {
            k: self._word(str(v)) for k, v in self.doc["services"][service]["environment"].items()
        }
        return {**os.environ, **own, "PYTHONPATH": str(REPO)}

    def run(self, service: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            self.argv(service),
            env=self.env(service),
            cwd=REPO,
            capture_output=True,
            text=True,
            timeout=600,
            check=False,
        )

    def start(self, service: str) -> None:
        log = (self.tmp / f"{service}.log").open("wb")
        self.procs.append(
            subprocess.Popen(
                self.argv(service),
                env=self.env(service),
                cwd=self.tmp,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        )

    def healthy(self, timeout: float = 120) -> None:
        url = f"http://127.0.0.1:{self.dashboard_port}/health"
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            with contextlib.suppress(OSError), urllib.request.urlopen(url, timeout=5) as reply:
                if reply.read() == b"ok":
                    return
            time.sleep(0.5)
        raise TimeoutError(f"the scheduler never answered {url}")

    def stop(self) -> None:
        for proc in self.procs:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGTERM)
        for proc in self.procs:
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(timeout=15)
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)


@pytest.fixture
def native(tmp_path: Path) -> Iterator[Native]:
    with S3Server(process=True) as s3:
        here = Native(s3, tmp_path)
        try:
            yield here
        finally:
            here.stop()


def test_the_compose_services_run_the_nightly_job_natively(native: Native) -> None:
    for job in ("bucket", "trainer"):
        done = native.run(job)
        assert done.returncode == 0, f"{job}: {done.stdout}\n{done.stderr}"
    native.start("scheduler")
    native.healthy()  # the compose file's healthcheck
    native.start("worker-1")
    native.start("worker-2")
    from distributed import Client

    with Client(native.names["tcp://scheduler:8786"], timeout=60) as client:
        client.wait_for_workers(2, timeout=120)
    first = native.run("job")
    assert first.returncode == 0, f"{first.stdout}\n{first.stderr}"
    doc = json.loads(first.stdout)
    assert [s["state"] for s in doc["stages"]] == ["ok"] * len(doc["stages"])
    ingest = doc["stages"][0]["report"]
    assert ingest["ingested"] == 4 * 3  # the trainer's 4 steps x 3 peers
    store = gp.open_store("s3://gradpipe/archive", storage_options=_s3_options(native.env("job")))
    assert gp.verify(store).ok
    assert [i.step for i in gp.snapshot_log(store, "model")] == [1, 2, 3]  # pruned to 3
    again = json.loads(native.run("job").stdout)  # the next night: nothing new
    assert again["ok"] is True
    assert again["stages"][0]["report"]["ingested"] == 0


def _s3_options(env: dict[str, str]) -> dict[str, Any]:
    return {
        "endpoint_url": env["AWS_ENDPOINT_URL_S3"],
        "key": env["AWS_ACCESS_KEY_ID"],
        "secret": env["AWS_SECRET_ACCESS_KEY"],
    }
