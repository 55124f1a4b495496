"""Redraw docs/images/dashboard.png: the /gradpipe page of a real scheduler, in headless Chromium.

    python docs/images/dashboard_screenshot.py [OUT.png]

Starts ``dask scheduler --preload gradpipe.dashboard`` and two one-thread
workers on loopback, then runs, with ``--scheduler``: an ingest of the demo's
sample run (``gradpipe.demo.DEMO_CONFIG``: 4 peers x 6 steps, ~120 MiB of
safetensors dumps), FedAvg and median aggregates of it, an ingest of a copy
with one truncated dump (it fails, with its reason), and a second ingest held
at its lease by a gc lock while the picture is taken (it shows as running).
Needs Debian's ``chromium``.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import gradpipe as gp
from gradpipe.demo import DEMO_CONFIG
from gradpipe.testing import write_sample_run

BIN = Path(sys.executable).parent


def main(out: Path) -> None:
    root = Path(tempfile.mkdtemp(prefix="gradpipe-shot-"))
    procs: list[subprocess.Popen[bytes]] = []
    try:
        info = root / "scheduler.json"
        procs.append(_spawn("dask", "scheduler", "--host", "127.0.0.1", "--port", "0",
                            "--dashboard-address", "127.0.0.1:0", "--scheduler-file", str(info),
                            "--preload", "gradpipe.dashboard"))  # fmt: skip
        while not info.exists() or not info.read_text():
            time.sleep(0.2)
        time.sleep(0.2)
        identity = json.loads(info.read_text())
        address, port = identity["address"], identity["services"]["dashboard"]
        for _ in range(2):
            procs.append(_spawn("dask", "worker", address, "--nthreads", "1", "--no-dashboard",
                                "--host", "127.0.0.1"))  # fmt: skip
        sample = write_sample_run(root / "demo", DEMO_CONFIG)
        store = str(root / "archive")
        _gradpipe("ingest", store, sample.dump_pattern, "--run", "demo", "--scheduler", address)
        for method in ("fedavg", "median"):
            _gradpipe("aggregate", store, "--run", "demo", "--method", method, "--scheduler", address)
        bad = root / "bad"
        shutil.copytree(root / "demo" / "dumps", bad)
        victim = sorted(bad.glob("step=0003/*.safetensors"))[1]
        victim.write_bytes(victim.read_bytes()[:4096])
        pattern = str(bad / "step={step}" / "peer={peer}.safetensors")
        _gradpipe("ingest", store, pattern, "--run", "exp2", "--scheduler", address, ok=False)
        held = gp.open_store(store, mode="a")
        with held.lock.exclusive("hold an ingest at its lease for the picture"):
            job = subprocess.Popen([str(BIN / "gradpipe"), "ingest", store, sample.dump_pattern,
                                    "--run", "exp3", "--scheduler", address],
                                   stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)  # fmt: skip
            time.sleep(8)  # its inspect graph runs, then it waits for the lock
            chromium = shutil.which("chromium") or shutil.which("chromium-browser") or "chromium"
            subprocess.run(
                [chromium, "--headless", "--no-sandbox", "--disable-gpu", "--hide-scrollbars",
                 f"--user-data-dir={root / 'profile'}", "--window-size=1400,820",
                 f"--screenshot={out}", f"http://127.0.0.1:{port}/gradpipe?refresh=0"],
                check=True, capture_output=True,
            )  # fmt: skip
        job.wait(timeout=300)
        print(f"wrote {out}")
    finally:
        for proc in reversed(procs):
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGTERM)
            proc.wait(timeout=30)
        shutil.rmtree(root, ignore_errors=True)


def _spawn(*args: str) -> subprocess.Popen[bytes]:
    return subprocess.Popen([str(BIN / args[0]), *args[1:]], stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL, start_new_session=True)  # fmt: skip


def _gradpipe(*args: str, ok: bool = True) -> None:
    done = subprocess.run([str(BIN / "gradpipe"), *args], capture_output=True, check=False)
    if (done.returncode == 0) != ok:
        raise RuntimeError(f"gradpipe {' '.join(args)}: {done.stderr.decode()}")


if __name__ == "__main__":
    main(Path(sys.argv[1] if len(sys.argv) > 1 else "docs/images/dashboard.png").absolute())
