"""``gradpipe snapshot`` killed with SIGKILL at any moment: the previous snapshot is intact.

A state file of ~24 MiB in small chunks makes a snapshot that writes for
about a second. The command is killed as soon as its first new block appears,
and at seeded fractions of an uninterrupted snapshot's wall time. After each
kill: the ref names the previous snapshot or the complete new one (never a
part), every snapshot of the chain restores bit-exact, ``verify`` is clean,
and the same command run again completes the chain, recording the step once
also when the kill came after the commit landed.
"""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
from safetensors.numpy import save_file

import gradpipe as gp
from gradpipe.snapshots.api import find_snapshot

BIN = Path(sys.executable).parent
SEED = int(os.environ.get("GRADPIPE_TEST_SEED", "20241203"))
ENV = {
    **os.environ,
    "DASK_GRADPIPE__CHUNK_BYTES": str(64 << 10),
    "DASK_GRADPIPE__INLINE_BYTES": "0",
}


def _state_files(root: Path) -> list[Path]:
    rng = np.random.default_rng(0)
    w = rng.standard_normal((1536, 4096)).astype("float32")
    paths = []
    for step in range(2):
        path = root / f"state{step}.safetensors"
        save_file({"layer.weight": w, "layer.bias": np.full(16, step, "float32")}, str(path))
        paths.append(path)
        w = w + (rng.standard_normal(w.shape) * 1e-4).astype("float32")
    return paths


def _snapshot_cmd(store: Path, path: Path, step: int) -> list[str]:
    return [str(BIN / "gradpipe"), "snapshot", str(store), "ckpt", str(path), "--step", str(step)]


def _ref(store: Path) -> bytes:
    path = store / "refs" / "snapshots" / "ckpt"
    return path.read_bytes() if path.exists() else b""


def _blocks(store: Path) -> int:
    return sum(len(files) for _, _, files in os.walk(store / "blocks"))


def _kill_at(command: list[str], store: Path, moment: float | str) -> None:
    """Run ``command`` and SIGKILL it: as soon as a new block lands ("first block"), as soon
    as the ref moved ("landed"), or after ``moment`` seconds."""
    before, ref = _blocks(store), _ref(store)
    proc = subprocess.Popen(command, env=ENV)
    if moment == "first block":
        while _blocks(store) == before and proc.poll() is None:
            time.sleep(0.001)
    elif moment == "landed":
        while _ref(store) == ref and proc.poll() is None:
            time.sleep(0.001)
    else:
        assert isinstance(moment, float)
        time.sleep(moment)
    proc.send_signal(signal.SIGKILL)
    proc.wait()


@pytest.mark.slow
def test_sigkill_mid_snapshot_leaves_the_previous_one(tmp_path: Path) -> None:
    files = _state_files(tmp_path)
    want = [_read(p) for p in files]
    timing_store = tmp_path / "timing"
    gp.open_store(str(timing_store), mode="w")  # gradpipe snapshot never creates a store
    subprocess.run(_snapshot_cmd(timing_store, files[0], 0), check=True, env=ENV)
    start = time.perf_counter()
    subprocess.run(_snapshot_cmd(timing_store, files[1], 1), check=True, env=ENV)
    wall = time.perf_counter() - start
    rng = random.Random(SEED)
    # "first block": as soon as a new block lands; "landed": as soon as the ref moved.
    moments: list[float | str] = ["first block", "landed"]
    moments += [rng.uniform(0.2, 1.0) * wall for _ in range(4)]
    for n, moment in enumerate(moments):
        store_path = tmp_path / f"store{n}"
        gp.open_store(str(store_path), mode="w")
        subprocess.run(_snapshot_cmd(store_path, files[0], 0), check=True, env=ENV)
        _kill_at(_snapshot_cmd(store_path, files[1], 1), store_path, moment)
        what = f"kill {n} at {moment} s of {wall:.2f} s (seed {SEED})"
        store = gp.open_store(store_path, mode="r")
        steps = [v.step for v in gp.snapshot_log(store, "ckpt")]
        assert steps in ([0], [0, 1]), what
        if moment == "landed":
            assert steps == [0, 1], what
        for step in steps:
            got = gp.restore(store, "ckpt", step=step)
            assert sorted(got) == sorted(want[step]), what
            for name, arr in want[step].items():
                assert got[name].tobytes() == arr.tobytes(), what
        assert gp.verify(store).ok, what
        again = subprocess.run(
            [*_snapshot_cmd(store_path, files[1], 1), "--json"],
            check=True,
            env=ENV,
            capture_output=True,
            text=True,
        )
        store = gp.open_store(store_path, mode="r")
        assert [v.step for v in gp.snapshot_log(store, "ckpt")] == [0, 1], what  # once
        assert json.loads(again.stdout)["written"] is (steps == [0]), what
        got = gp.restore(store, "ckpt")
        assert got["layer.weight"].tobytes() == want[1]["layer.weight"].tobytes(), what
        assert gp.verify(store).ok, what


def _read(path: Path) -> dict[str, np.ndarray]:
    from safetensors.numpy import load_file

    return load_file(str(path))


# The same, for a version written with optimizer replay (issue 21): a child process saves
# step 1 against step 0 with the gradient recorded, and is killed at any moment.
_REPLAY_CHILD = """
import sys, numpy as np, gradpipe as gp
from gradpipe.core.replay import OptimizerStep
from gradpipe.snapshots.save import write_snapshot
store, path, step = sys.argv[1], sys.argv[2], int(sys.argv[3])
with np.load(path) as f:
    arrays = {k: f[k] for k in f.files}
grad = {"w": arrays.pop("grad")}
groups = [{"step": OptimizerStep("adam", lr=1e-3, step=step + 1),
           "params": {"w": {"param": "w", "exp_avg": "m", "exp_avg_sq": "v"}}}]
done = write_snapshot(gp.open_store(store, mode="r+"), "ckpt", arrays, step=step,
                      gradient=grad, optimizer=groups)
print(done.written)
"""


def _replay_states(root: Path) -> list[Path]:
    from gradpipe.core.replay import OptimizerStep, replay

    rng = np.random.default_rng(1)
    w = rng.standard_normal((768, 4096)).astype("float32")
    m, v = np.zeros_like(w), np.zeros_like(w)
    paths = []
    for step in range(2):
        grad = (rng.standard_normal(w.shape) * 1e-2).astype("float32")
        new = replay(OptimizerStep("adam", lr=1e-3, step=step + 1), {
            "param": w, "exp_avg": m, "exp_avg_sq": v}, grad)  # fmt: skip
        w, m, v = new["param"], new["exp_avg"], new["exp_avg_sq"]
        w.reshape(-1)[::97] += np.float32(1e-6)  # a trainer that rounds otherwise, here and there
        path = root / f"replay{step}.npz"
        np.savez(path, w=w, m=m, v=v, grad=grad)
        paths.append(path)
    return paths


def _replay_cmd(store: Path, path: Path, step: int) -> list[str]:
    return [sys.executable, "-c", _REPLAY_CHILD, str(store), str(path), str(step)]


@pytest.mark.slow
def test_sigkill_mid_replay_snapshot_leaves_the_previous_one(tmp_path: Path) -> None:
    files = _replay_states(tmp_path)
    want = []
    for path in files:
        with np.load(path) as f:
            want.append({k: f[k] for k in ("w", "m", "v")})
    rng = random.Random(SEED)
    moments: list[float | str] = ["first block", "landed"]
    moments += [rng.uniform(0.5, 3.0) for _ in range(3)]
    for n, moment in enumerate(moments):
        store_path = tmp_path / f"store{n}"
        gp.open_store(str(store_path), mode="w")
        subprocess.run(_replay_cmd(store_path, files[0], 0), check=True, env=ENV)
        _kill_at(_replay_cmd(store_path, files[1], 1), store_path, moment)
        what = f"kill {n} at {moment} (seed {SEED})"
        store = gp.open_store(store_path, mode="r")
        steps = [v.step for v in gp.snapshot_log(store, "ckpt")]
        assert steps in ([0], [0, 1]), what
        for step in steps:
            got = gp.restore(store, "ckpt", step=step)
            assert all(got[k].tobytes() == want[step][k].tobytes() for k in want[step]), what
        assert gp.verify(store).ok, what
        subprocess.run(_replay_cmd(store_path, files[1], 1), check=True, env=ENV)
        store = gp.open_store(store_path, mode="r")
        assert [v.step for v in gp.snapshot_log(store, "ckpt")] == [0, 1], what
        _, head = find_snapshot(store, "ckpt")
        assert head.replay is not None, what
        got = gp.restore(store, "ckpt")
        assert all(got[k].tobytes() == want[1][k].tobytes() for k in want[1]), what
        assert gp.verify(store).ok, what
        gp.gc(gp.open_store(store_path, mode="r+"), grace=0)  # the killed run's orphans go
        assert gp.verify(gp.open_store(store_path, mode="r")).ok, what
