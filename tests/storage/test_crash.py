"""SIGKILL a writer at random moments: the store stays readable at its last commit.

The writer loops: log ``begin SEED``, put a multi-chunk tensor generated from
SEED, move the ref to it, log ``done SEED ID``. Each log line is one
``write(2)`` on an ``O_APPEND`` file, so a kill leaves whole lines.

What is guaranteed after a kill, and asserted exactly:

- the ref's history, from where the round started, is the logged commits in
  order, optionally followed by *one* more: the put in flight whose ref move
  landed before the writer could log it (the kill fell between the swap and
  the log write);
- so the ref points at the last logged id, or at that in-flight tensor;
- whatever the ref points at reads back bit-exact;
- re-running the interrupted put completes it, reusing what it left;
- verify is clean, before and after ``gc(grace=0)``, and gc leaves no
  temporary file behind and no block that nothing reaches.
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

import gradpipe as gp
from gradpipe.core.ids import id_from_block_key
from gradpipe.errors import NotFoundError
from gradpipe.storage._local import TEMP_PREFIX
from gradpipe.storage.walk import walk_reachable

REF = "tags/crash"

_GENERATE = r"""
import numpy as np

def generate(seed, mib):
    rng = np.random.default_rng(seed)
    n = int(rng.integers(mib[0], mib[1] + 1)) * 2**18  # float32 elements
    data = rng.standard_normal(n, dtype=np.float32)
    if seed % 3 == 0:
        data[: n // 4] = 0  # whole zero chunks: stored as no block at all
    return data
"""

CHILD = (
    _GENERATE
    + r"""
import json, os, sys
import gradpipe as gp

cfg = json.loads(sys.argv[1])
store = gp.open_store(cfg["url"], mode="a")
log = os.open(cfg["log"], os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
seed = cfg["first_seed"]
while True:
    os.write(log, f"begin {seed}\n".encode())
    tensor_id = store.put_tensor(generate(seed, cfg["mib"]), chunk_bytes=cfg["chunk_bytes"])
    store.refs.set(cfg["ref"], tensor_id, message=f"seed {seed}")
    os.write(log, f"done {seed} {tensor_id}\n".encode())
    seed += 1
"""
)

namespace: dict[str, object] = {}
exec(_GENERATE, namespace)
generate = namespace["generate"]


def _read_log(path: Path) -> tuple[list[tuple[int, str]], int | None]:
    """(seed, id) of the logged commits, and the seed begun after the last one."""
    done: list[tuple[int, str]] = []
    in_flight = None
    if not path.exists():
        return done, None
    for line in path.read_text().splitlines(keepends=True):
        assert line.endswith("\n"), f"torn log line {line!r}"
        word, *rest = line.split()
        if word == "begin":
            in_flight = int(rest[0])
        else:
            assert word == "done"
            assert int(rest[0]) == in_flight
            done.append((in_flight, rest[1]))
            in_flight = None
    return done, in_flight


def _mib(store: gp.Store) -> list[int]:
    """Tensor sizes in MiB: large on local disk, smaller through moto."""
    return [8, 16] if store.url.startswith("/") else [2, 4]


def _kill_writer(store: gp.Store, log: Path, first_seed: int, delay: float, commits: int) -> None:
    cfg = {
        "url": store.url,
        "ref": REF,
        "log": str(log),
        "first_seed": first_seed,
        "mib": _mib(store),
        "chunk_bytes": 2**20,
    }
    proc = subprocess.Popen(
        [sys.executable, "-c", CHILD, json.dumps(cfg)],
        stderr=subprocess.PIPE,
    )
    try:
        # Wait for `commits` logged commits (0: for the first put to begin),
        # then let it run a little into the next put.
        deadline = time.monotonic() + 60
        while True:
            done, in_flight = _read_log(log)
            if len(done) >= commits and (commits or in_flight is not None):
                break
            if proc.poll() is not None:
                pytest.fail(f"writer died on its own: {proc.stderr.read().decode()}")
            assert time.monotonic() < deadline, "writer made no progress"
            time.sleep(0.005)
        time.sleep(delay)
        proc.send_signal(signal.SIGKILL)
    finally:
        proc.kill()
        proc.wait()
        proc.stderr.close()
    assert proc.returncode == -signal.SIGKILL


def _files(store: gp.Store) -> list[str]:
    return [info.key for info in store.backend.list("")]


def _check_after_kill(store: gp.Store, log: Path, history_before: int) -> int:
    done, in_flight = _read_log(log)
    report = gp.verify(store)
    assert report.ok, report.problems
    try:
        history = list(store.refs.history(REF))[::-1]  # oldest first
    except NotFoundError:
        history = []
    new = history[history_before:]
    logged = [tensor_id for _, tensor_id in done]
    assert [e.target for e in new[: len(logged)]] == logged, "a logged commit is missing"
    extra = new[len(logged) :]
    assert len(extra) <= 1, "more than one unlogged commit"
    if extra:
        # The swap landed, the kill came before the log line: it must be the
        # tensor in flight, complete.
        assert in_flight is not None
        expected_seed = in_flight
        assert extra[0].message == f"seed {in_flight}"
    elif done:
        expected_seed = done[-1][0]
    else:
        expected_seed = None
    if history:
        target = store.refs.get(REF)
        assert target == history[-1].target
        if expected_seed is not None:
            assert not extra or target == extra[0].target
            assert extra or target == logged[-1]
            got = store.get_tensor(target)
            want = generate(expected_seed, _mib(store))
            assert got.dtype == want.dtype
            np.testing.assert_array_equal(got.view(np.uint32), want.view(np.uint32))
    return len(history)


def _check_gc(store: gp.Store) -> None:
    gp.gc(store, grace=0)
    report = gp.verify(store, all_blocks=True)
    assert report.ok, report.problems
    assert report.unreferenced == 0
    leftovers = [k for k in _files(store) if k.rsplit("/", 1)[-1].startswith(TEMP_PREFIX)]
    assert leftovers == [], "gc left stale temporary files"
    blocks = {id_from_block_key(k) for k in _files(store) if k.startswith("blocks/")}
    assert None not in blocks
    assert blocks == set(walk_reachable(store).manifests) | set(walk_reachable(store).data)


@pytest.mark.slow
def test_sigkill_mid_put(store: gp.Store, tmp_path: Path) -> None:
    rng = random.Random(20261202)
    local = store.url.startswith("/")
    # (commits to wait for, delay): one kill inside the very first put.
    rounds = [(0, 0.05)] + [(1, rng.uniform(0, 0.4)) for _ in range(3 if local else 1)]
    history_len = 0
    for i, (commits, delay) in enumerate(rounds):
        log = tmp_path / f"log-{i}"
        _kill_writer(store, log, first_seed=1000 * (i + 1), delay=delay, commits=commits)
        reopened = gp.open_store(store.url, mode="a")
        history_len = _check_after_kill(reopened, log, history_len)
        _, in_flight = _read_log(log)
        if in_flight is not None:
            # Re-running the job finishes it: blocks the killed put left behind
            # are reused as they are, so they must be whole.
            data = generate(in_flight, _mib(store))
            tensor_id = reopened.put_tensor(data, chunk_bytes=2**20)
            reopened.refs.set(REF, tensor_id, message="resumed")
            history_len += 1
            assert gp.verify(reopened).ok
            got = reopened.get_tensor(tensor_id)
            np.testing.assert_array_equal(got.view(np.uint32), data.view(np.uint32))
        _check_gc(reopened)
    assert history_len >= len(rounds) - 1


def test_gc_removes_stale_temporary_files(tmp_path: Path) -> None:
    # What a writer killed mid-write leaves: a temp file beside blocks, and
    # beside a ref (the local backend swaps a ref by renaming a temp file).
    store = gp.open_store(tmp_path / "s", mode="w")
    tensor_id = store.put_tensor(np.arange(100, dtype="float32"))
    store.refs.set(REF, tensor_id)
    root = Path(store.backend.root)
    block_dir = next((root / "blocks").iterdir())
    stale = [block_dir / f"{TEMP_PREFIX}dead1", root / "refs" / "tags" / f"{TEMP_PREFIX}dead2"]
    fresh = block_dir / f"{TEMP_PREFIX}alive"
    old = time.time() - 3600
    for path in [*stale, fresh]:
        path.write_bytes(b"partial")
    for path in stale:
        os.utime(path, (old, old))
    lock = root / "refs" / "tags" / ".crash.lock"
    assert lock.exists()

    dry = gp.gc(store, grace=60, dry_run=True)
    assert dry.stray_deleted == 2
    assert all(p.exists() for p in stale)
    report = gp.gc(store, grace=60)
    assert report.stray_deleted == 2
    assert not any(p.exists() for p in stale)
    assert fresh.exists()  # may belong to a writer still running
    assert lock.exists()  # never delete a lock file someone may hold
    assert store.refs.list() == {REF: store.refs.entry(REF)}
    np.testing.assert_array_equal(store.get_tensor(tensor_id), np.arange(100, dtype="float32"))
