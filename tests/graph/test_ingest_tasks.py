"""The ingest tasks one by one: a bad dump becomes a Failure of that dump, never an exception."""

from __future__ import annotations

from pathlib import Path

import fsspec
import numpy as np
import pytest

import gradpipe as gp
from gradpipe.core.run_manifest import TensorSchema
from gradpipe.formats.dump import DumpHeader
from gradpipe.ingestion.discover import DumpFile
from gradpipe.ingestion.plan import plan_units
from gradpipe.ingestion.tasks import (
    DumpResult,
    UnitResult,
    commit_run,
    encode_unit,
    inspect_dumps,
    read_unit,
    schema_conflict,
    write_dump,
)

FS = fsspec.filesystem("file")
CHUNK = 4096


@pytest.fixture
def store(tmp_path: Path) -> gp.Store:
    return gp.open_store(tmp_path / "store", mode="w")


@pytest.fixture
def dump(tmp_path: Path) -> DumpFile:
    path = tmp_path / "step=3.npy"
    np.save(path, np.arange(2000, dtype=np.float32))
    return DumpFile(3, "p1", str(path), path.stat().st_size, "fp")


def _header(dump: DumpFile) -> DumpHeader:
    [header] = inspect_dumps(FS, [dump])
    assert isinstance(header, DumpHeader)
    return header


def test_the_tasks_of_one_dump_write_it_end_to_end(store: gp.Store, dump: DumpFile) -> None:
    header = _header(dump)
    units = plan_units(header, chunk_bytes=CHUNK, unit_bytes=1 << 20)
    results = [
        encode_unit(store, dump, header, unit, read_unit(FS, dump, header, unit), CHUNK, None)
        for unit in units
    ]
    assert all(isinstance(r, UnitResult) for r in results)
    done = write_dump(store, dump, header, "r", results, CHUNK)
    assert isinstance(done, DumpResult)
    assert (done.entry.step, done.entry.peer, done.entry.fingerprint) == (3, "p1", "fp")
    assert done.raw_bytes == 2000 * 4
    committed = commit_run(store, "r", [dump], [done], "test", replace=False)
    assert committed.failures == []
    assert committed.run_id == store.refs.get("runs/r")
    got = gp.open_run(store, "r").read("step=3", step=3, peer="p1")
    assert got.tobytes() == np.arange(2000, dtype=np.float32).tobytes()


def test_inspect_keeps_order_and_isolates_a_bad_file(tmp_path: Path, dump: DumpFile) -> None:
    bad_path = tmp_path / "step=4.npy"
    bad_path.write_bytes(b"\x93NUMPY garbage")
    bad = DumpFile(4, "p1", str(bad_path), bad_path.stat().st_size, "fp4")
    good, failed = inspect_dumps(FS, [dump, bad])
    assert isinstance(good, DumpHeader)
    assert isinstance(failed, gp.Failure)
    assert (failed.path, failed.step, failed.peer) == (str(bad_path), 4, "p1")
    assert str(bad_path) in failed.reason


def test_a_read_that_fails_is_a_failure_of_its_dump(dump: DumpFile) -> None:
    header = _header(dump)
    [unit] = plan_units(header, chunk_bytes=CHUNK, unit_bytes=1 << 20)
    Path(dump.path).unlink()  # gone between inspect and read
    failed = read_unit(FS, dump, header, unit)
    assert isinstance(failed, gp.Failure)
    assert (failed.path, failed.step, failed.peer) == (dump.path, 3, "p1")
    assert dump.path in failed.reason


def test_an_upstream_failure_passes_through_and_writes_nothing(
    store: gp.Store, dump: DumpFile
) -> None:
    header = _header(dump)
    [unit] = plan_units(header, chunk_bytes=CHUNK, unit_bytes=1 << 20)
    upstream = gp.Failure(dump.path, 3, "p1", "could not read it")
    assert encode_unit(store, dump, header, unit, upstream, CHUNK, None) is upstream
    assert write_dump(store, dump, header, "r", [upstream], CHUNK) is upstream
    assert list(store.backend.list("blocks")) == []


def test_a_commit_of_failures_only_publishes_nothing(store: gp.Store, dump: DumpFile) -> None:
    failure = gp.Failure(dump.path, 3, "p1", "bad")
    result = commit_run(store, "r", [dump], [failure], "test", replace=False)
    assert (result.run_id, result.committed, result.failures) == (None, [], [failure])
    assert gp.list_runs(store) == []


def test_schema_conflict_names_tensor_dump_and_both_schemas() -> None:
    run = {"w": TensorSchema("float32", (3,))}
    assert schema_conflict(run, {"w": TensorSchema("float32", (3,))}, "step 1") is None
    assert schema_conflict(run, {"v": TensorSchema("int8", (1,))}, "step 1") is None
    why = schema_conflict(run, {"w": TensorSchema("float16", (3,))}, "step 2, peer 'p0'")
    assert why is not None
    assert "'w'" in why
    assert "step 2, peer 'p0'" in why
    assert "float16" in why
    assert "float32" in why
    assert "another run" in why  # says what to do
