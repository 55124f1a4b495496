"""Re-running an ingest is free; changed files need ``replace``; new steps append; writers race."""

from __future__ import annotations

import os
import threading
import types
import uuid
from pathlib import Path

import fsspec
import numpy as np
import pytest

import gradpipe as gp
from gradpipe.formats.safetensors import read_safetensors
from gradpipe.ingestion.api import IngestReport, ingest
from gradpipe.runs import open_run
from gradpipe.testing.training import SampleRun, TrainingConfig, write_sample_run

CONFIG = TrainingConfig(vocab_size=2000, embed_dim=8, hidden=16, peers=3, steps=2)


@pytest.fixture(scope="module")
def sample(tmp_path_factory: pytest.TempPathFactory) -> SampleRun:
    """A small real training run: 2 steps x 3 peers of safetensors dumps (read only)."""
    return write_sample_run(tmp_path_factory.mktemp("sample"), CONFIG)


def copy_run(sample: SampleRun, root: Path, steps: list[int] | None = None) -> str:
    """Copy (some steps of) the sample's dumps to ``root``; return their pattern."""
    for step in steps if steps is not None else sample.steps:
        for peer in sample.peers:
            src = Path(sample.dump_path(step, peer))
            dst = root / src.relative_to(sample.directory)
            dst.parent.mkdir(parents=True, exist_ok=True)
            dst.write_bytes(src.read_bytes())
    return str(root / Path(sample.dump_pattern).relative_to(sample.directory))


def source(sample: SampleRun, step: int, peer: str) -> dict[str, np.ndarray]:
    return read_safetensors(sample.dump_path(step, peer))[0]


def check_run(
    kit: types.ModuleType, store: gp.Store, run: str, want: dict[tuple[int, str], dict]
) -> None:
    recorded = open_run(store, run)
    assert {(e.step, e.peer) for e in recorded} == set(want)
    for (step, peer), tensors in want.items():
        got = recorded.dump(step, peer).read_all()
        assert sorted(got) == sorted(tensors)
        for name, arr in tensors.items():
            kit.assert_bit_exact(got[name], arr, f"{step} {peer} {name}")


def test_rerun_is_a_no_op(sample: SampleRun, store: gp.Store, tmp_path: Path) -> None:
    pattern = copy_run(sample, tmp_path / "d")
    n = len(sample.steps) * len(sample.peers)
    first = ingest(store, pattern, run="r")
    assert (first.ingested, first.skipped, first.ok) == (n, 0, True)
    assert first.writes.blocks_written > 0
    history = len(list(store.refs.history("runs/r")))
    again = ingest(store, pattern, run="r")
    assert again.ok
    assert (again.ingested, again.skipped) == (0, n)
    assert again.writes.blocks_written == 0
    assert again.writes.stored_bytes == 0
    assert again.raw_bytes == 0
    assert again.run_id == first.run_id == open_run(store, "r").id
    assert len(list(store.refs.history("runs/r"))) == history  # no new commit


def test_rerun_does_not_read_tensor_data(
    sample: SampleRun, kit: types.ModuleType, tmp_path: Path
) -> None:
    """A recorded file is skipped on its fingerprint: bytes changed behind size+mtime go unread."""
    pattern = copy_run(sample, tmp_path / "d")
    store = gp.open_store(str(tmp_path / "store"), mode="w")
    first = ingest(store, pattern, run="r")
    assert first.ok
    for step in sample.steps:
        for peer in sample.peers:
            path = Path(pattern.format(step=f"{step:04d}", peer=peer))
            stat = path.stat()
            data = bytearray(path.read_bytes())
            data[-64:] = b"\xff" * 64  # tensor bytes, same size
            with path.open("r+b") as f:
                f.write(data)
            os.utime(path, ns=(stat.st_atime_ns, stat.st_mtime_ns))
            assert path.read_bytes() != Path(sample.dump_path(step, peer)).read_bytes()
    again = ingest(store, pattern, run="r")
    assert (again.ingested, again.skipped, again.ok) == (0, 6, True)
    assert again.run_id == first.run_id
    check_run(
        kit,
        store,
        "r",
        {(s, p): source(sample, s, p) for s in sample.steps for p in sample.peers},
    )


def test_changed_file_needs_replace(
    sample: SampleRun, kit: types.ModuleType, tmp_path: Path
) -> None:
    pattern = copy_run(sample, tmp_path / "d")
    store = gp.open_store(str(tmp_path / "store"), mode="w")
    first = ingest(store, pattern, run="r")
    old_dump = open_run(store, "r").dump(1, "peer2").id

    path = Path(pattern.format(step="0001", peer="peer2"))
    tensors, meta = read_safetensors(path)
    changed = {k: (v * 2 if v.dtype.kind == "f" else v) for k, v in tensors.items()}
    path.write_bytes(kit.safetensors_bytes(changed, meta))
    stat = path.stat()
    os.utime(path, ns=(stat.st_atime_ns, stat.st_mtime_ns + 10**9))  # surely a new mtime

    refused = ingest(store, pattern, run="r")
    assert not refused.ok
    assert (refused.ingested, refused.skipped) == (0, 5)
    [failure] = refused.failures
    assert (failure.step, failure.peer, failure.path) == (1, "peer2", str(path))
    assert "replace" in failure.reason
    assert refused.run_id == first.run_id
    kit.assert_bit_exact(
        open_run(store, "r").dump(1, "peer2").read("dense1.weight"),
        source(sample, 1, "peer2")["dense1.weight"],
    )

    replaced = ingest(store, pattern, run="r", replace=True)
    assert replaced.ok, replaced.summary()
    assert (replaced.ingested, replaced.skipped) == (1, 5)  # only the changed file is read
    assert replaced.run_id != first.run_id
    run = open_run(store, "r")
    assert len(run) == 6
    assert run.dump(1, "peer2").id != old_dump
    want = {(s, p): source(sample, s, p) for s in sample.steps for p in sample.peers}
    want[1, "peer2"] = changed
    check_run(kit, store, "r", want)
    assert ingest(store, pattern, run="r").skipped == 6


@pytest.mark.parametrize("where", ["local", "s3"])
def test_new_steps_append(
    where: str,
    sample: SampleRun,
    kit: types.ModuleType,
    tmp_path: Path,
    request: pytest.FixtureRequest,
) -> None:
    """Dumps that appear later (written by another process) are found and appended."""
    if where == "local":
        root, store_url = str(tmp_path / "d"), str(tmp_path / "store")
    else:
        request.getfixturevalue("s3")
        prefix = f"s3://gradpipe-test/{uuid.uuid4().hex[:8]}"
        root, store_url = f"{prefix}/d", f"{prefix}/store"
    # Another writer (the training job): not the filesystem instance ingest uses.
    writer = fsspec.filesystem("file" if where == "local" else "s3", skip_instance_cache=True)

    def upload(step: int) -> None:
        for peer in sample.peers:
            src = Path(sample.dump_path(step, peer))
            dst = f"{root}/{src.relative_to(sample.directory)}"
            if where == "local":
                writer.makedirs(str(Path(dst).parent), exist_ok=True)
            writer.pipe_file(dst, src.read_bytes())

    pattern = f"{root}/{Path(sample.dump_pattern).relative_to(sample.directory)}"
    store = gp.open_store(store_url, mode="w")
    upload(0)
    first = ingest(store, pattern, run="r")
    assert (first.ingested, first.skipped) == (3, 0)
    old = {(e.step, e.peer): e.dump for e in open_run(store, "r")}
    upload(1)
    second = ingest(store, pattern, run="r")
    assert (second.ingested, second.skipped, second.ok) == (3, 3, True)
    run = open_run(store, "r")
    assert run.steps == [0, 1]
    assert run.grid() == {0: sample.peers, 1: sample.peers}
    assert {(e.step, e.peer): e.dump for e in run if (e.step, e.peer) in old} == old
    check_run(
        kit, store, "r", {(s, p): source(sample, s, p) for s in sample.steps for p in sample.peers}
    )


def test_concurrent_ingests_both_land(
    sample: SampleRun, kit: types.ModuleType, store: gp.Store, tmp_path: Path
) -> None:
    """Two ingests of different steps into one run, at once: both commits land, none lost."""
    patterns = [copy_run(sample, tmp_path / f"d{step}", [step]) for step in sample.steps]
    barrier = threading.Barrier(len(patterns))
    reports: list[IngestReport] = []
    errors: list[BaseException] = []

    def work(pattern: str) -> None:
        try:
            barrier.wait()
            reports.append(ingest(store, pattern, run="r", workers=1))
        except BaseException as exc:  # reported by the assertion below
            errors.append(exc)

    threads = [threading.Thread(target=work, args=(p,)) for p in patterns]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
    assert [r.ok for r in reports] == [True, True]
    assert sorted(r.ingested for r in reports) == [3, 3]
    run = open_run(store, "r")
    assert run.grid() == {0: sample.peers, 1: sample.peers}
    # One commit per ingest, each on top of the other (the loser retried its swap).
    history = list(store.refs.history("runs/r"))
    assert len(history) == 2
    assert history[0].target == run.id
    assert {r.run_id for r in reports} == {e.target for e in history}
    check_run(
        kit, store, "r", {(s, p): source(sample, s, p) for s in sample.steps for p in sample.peers}
    )


def test_ingest_racing_one_of_the_same_files_adds_no_commit(
    sample: SampleRun, tmp_path: Path
) -> None:
    """The loser of two ingests of the same files finds its dumps recorded: it writes no entry."""
    from gradpipe.testing.faults import Fault, faulty_store

    pattern = copy_run(sample, tmp_path / "d")
    inner = gp.open_store(str(tmp_path / "store"), mode="w")
    other: list[IngestReport] = []

    def the_other_ingest() -> None:  # runs to the end while ours is about to swap
        thread = threading.Thread(target=lambda: other.append(ingest(inner, pattern, run="r")))
        thread.start()
        thread.join()

    store, backend = faulty_store(
        inner, Fault("swap", "refs/runs/r", calls={1}, lose=None, action=the_other_ingest)
    )
    ours = ingest(store, pattern, run="r", workers=1)
    assert len(backend.fired("swap")) == 1
    n = len(sample.steps) * len(sample.peers)
    assert [r.ingested for r in other] == [n]
    assert ours.ok
    assert ours.run_id == other[0].run_id == open_run(inner, "r").id
    # Our swap lost the race; the run then already held exactly our dumps.
    assert [e.target for e in inner.refs.history("runs/r")] == [other[0].run_id]
