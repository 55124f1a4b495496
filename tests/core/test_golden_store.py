"""Stores written by older gradpipe (formats 1 to 3) stay readable, bit-exact, by this one."""

from __future__ import annotations

import importlib.util
import shutil
from pathlib import Path

import numpy as np
import pytest

import gradpipe as gp
from gradpipe.core.manifest import encode_manifest

FIXTURES = Path(__file__).parent.parent / "fixtures"


def _fixture_arrays(maker: str) -> dict[str, np.ndarray]:
    """``golden_arrays()`` of the fixture script ``tests/fixtures/<maker>.py``."""
    spec = importlib.util.spec_from_file_location(maker, FIXTURES / f"{maker}.py")
    assert spec is not None
    assert spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.golden_arrays()  # type: ignore[no-any-return]


def _golden_arrays() -> dict[str, np.ndarray]:
    return _fixture_arrays("make_store_v1")


@pytest.fixture
def golden(tmp_path: Path) -> gp.Store:
    # A copy: reading must not need to write, but a bug must not damage the fixture.
    shutil.copytree(FIXTURES / "store-v1", tmp_path / "store-v1")
    return gp.open_store(tmp_path / "store-v1", mode="r")


@pytest.mark.parametrize("name", sorted(_golden_arrays()))
def test_golden_tensors_read_bit_exact(golden: gp.Store, name: str) -> None:
    expected = _golden_arrays()[name]
    back = golden.get_tensor(golden.refs.get(f"tags/{name}"))
    assert back.dtype == expected.dtype
    assert back.shape == expected.shape
    assert back.tobytes() == expected.tobytes()


def test_golden_store_verifies_clean(golden: gp.Store) -> None:
    report = gp.verify(golden, all_blocks=True)
    assert report.ok, report.problems
    assert report.unreferenced == 0
    assert report.manifests == 2 * len(_golden_arrays())  # one tensor + one ref entry each


def test_golden_block_ids_are_stable(tmp_path: Path) -> None:
    """Writing the same arrays today gives the same block ids: content ids do not drift.

    Tensor ids also cover the float64 chunk statistics, whose last bits may
    change with the summation code; block ids are the hash of the bytes alone.
    """
    golden = gp.open_store(FIXTURES / "store-v1", mode="r")
    fresh = gp.open_store(tmp_path / "fresh", mode="w")
    for name, array in _golden_arrays().items():
        old = golden.tensor_info(golden.refs.get(f"tags/{name}"))
        new = fresh.tensor_info(fresh.put_tensor(array, chunk_bytes=512))
        assert new.blocks == old.blocks
        assert (new.dtype, new.shape, new.chunk_shape) == (old.dtype, old.shape, old.chunk_shape)
        assert [s.nonzero for s in new.stats] == [s.nonzero for s in old.stats]


# --- format 2: inline chunks, embedded tensor manifests, byte-group frame v2 --------------
def _golden_v2_arrays() -> dict[str, np.ndarray]:
    return _fixture_arrays("make_store_v2")


@pytest.fixture
def golden_v2(tmp_path: Path) -> gp.Store:
    shutil.copytree(FIXTURES / "store-v2", tmp_path / "store-v2")
    return gp.open_store(tmp_path / "store-v2", mode="r")


def test_golden_v2_reads_bit_exact(golden_v2: gp.Store) -> None:
    arrays = _golden_v2_arrays()
    dump = gp.open_run(golden_v2, "r").dump(3, "a")
    assert dump.metadata == {"num_examples": "32"}
    kinds = {"inline": 0, "stored": 0}
    for name, expected in arrays.items():
        named = golden_v2.get_tensor(golden_v2.refs.get(f"tags/{name}"))
        ingested = dump.read(name)
        for back in (named, ingested):
            assert back.dtype == expected.dtype, name
            assert back.shape == expected.shape, name
            assert back.tobytes() == expected.tobytes(), name
        info = dump.info(name)
        kinds["inline"] += len(info.inline)
        kinds["stored"] += len(list(info.data_children()))
    assert kinds["inline"] > 0  # the fixture covers both places a chunk can live
    assert kinds["stored"] > 0


def test_golden_v2_verifies_clean(golden_v2: gp.Store) -> None:
    report = gp.verify(golden_v2, all_blocks=True)
    assert report.ok, report.problems
    assert report.unreferenced == 0


# --- format 3: a run with aggregates in one manifest, written before run shards -----------
@pytest.fixture
def golden_v3(tmp_path: Path) -> gp.Store:
    shutil.copytree(FIXTURES / "store-v3", tmp_path / "store-v3")
    return gp.open_store(tmp_path / "store-v3", mode="r")


def test_golden_v3_run_reads_bit_exact(golden_v3: gp.Store) -> None:
    spec = importlib.util.spec_from_file_location("make_store_v3", FIXTURES / "make_store_v3.py")
    assert spec is not None
    assert spec.loader is not None
    maker = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(maker)
    run = gp.open_run(golden_v3, "r")
    expected = maker.golden_dumps()
    assert sorted((e.step, e.peer) for e in run) == sorted(expected)
    for (step, peer), tensors in expected.items():
        dump = run.dump(step, peer)
        assert dump.metadata == {"num_examples": str(maker.num_examples(peer))}
        for name, array in tensors.items():
            back = dump.read(name)
            assert back.tobytes() == array.tobytes(), (step, peer, name)
    assert [(a.step, a.name) for a in run.aggregates] == [(s, "fedavg") for s in range(4)]
    assert all(run.aggregate("fedavg", step=s).stale is None for s in range(4))


def test_golden_v3_run_manifest_keeps_its_id(golden_v3: gp.Store) -> None:
    """A run that fits one shard is encoded exactly as before shards: same bytes, same id."""
    run_id = golden_v3.refs.get("runs/r")
    manifest = golden_v3.get_manifest(run_id)
    assert encode_manifest(manifest) == bytes(golden_v3.get_raw(run_id))
    assert b'"format":3' in encode_manifest(manifest)


def test_golden_v3_verifies_clean(golden_v3: gp.Store) -> None:
    report = gp.verify(golden_v3, all_blocks=True)
    assert report.ok, report.problems
    assert report.unreferenced == 1  # the run's manifest before the aggregate was recorded
