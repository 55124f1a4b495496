"""Tensor manifests kept inside a dump (or aggregate, or snapshot) decode when first used."""

from __future__ import annotations

import pickle
from pathlib import Path

import numpy as np
import pytest
import xarray as xr
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

import gradpipe as gp
from gradpipe.core.encoding import to_json_bytes
from gradpipe.core.ids import hash_bytes
from gradpipe.core.manifest import decode_manifest, encode_manifest
from gradpipe.core.run_manifest import DumpManifest
from gradpipe.core.tensor_manifest import LazyTensors, TensorManifest, TensorRef
from gradpipe.errors import IntegrityError
from gradpipe.storage.blocks import encode_block
from gradpipe.storage.walk import Problem, _parse


def _store(tmp_path: Path) -> tuple[gp.Store, str]:
    store = gp.open_store(tmp_path / "store", mode="w")
    for step in range(2):
        path = tmp_path / f"step={step}" / "peer=p.npz"
        path.parent.mkdir()
        np.savez(path, w=np.arange(12, dtype=np.float32) + step, b=np.ones(3, np.float32))
    report = gp.ingest(store, str(tmp_path / "step={step}" / "peer={peer}.npz"), run="r")
    assert report.ok, report.summary()
    [entry] = [e for e in gp.open_run(store, "r") if e.step == 0]
    return store, entry.dump


def _with_a_malformed_chunk_list(store: gp.Store, dump_id: str) -> tuple[bytes, str]:
    """The dump's JSON with tensor ``w``'s chunk list broken (its grid intact), and w's id."""
    good = store.get_typed(dump_id, DumpManifest)
    doc = {"type": "dump", "format": 2, **good.to_dict()}
    tensor_id = good.tensor_ids["w"]
    doc["embedded"][tensor_id]["chunks"]["block"] = ["not an id"]
    return to_json_bytes(doc), tensor_id


def test_a_stored_dump_decodes_its_tensors_only_when_asked(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    store, dump_id = _store(tmp_path)
    dump = store.get_typed(dump_id, DumpManifest)
    assert isinstance(dump.embedded, LazyTensors)
    decoded: list[str] = []
    original = TensorManifest.from_dict.__func__  # type: ignore[attr-defined]

    def counting(cls: type[TensorManifest], data: dict[str, object]) -> TensorManifest:
        decoded.append(str(data["dtype"]))
        return original(cls, data)  # type: ignore[no-any-return]

    monkeypatch.setattr(TensorManifest, "from_dict", classmethod(counting))
    ds = xr.open_dataset(tmp_path / "store", engine="gradpipe", run="r")
    assert decoded == []  # opening needs the grids only
    ref = dump.embedded.ref(dump.tensor_ids["w"])
    assert ref is not None
    assert (ref.dtype, ref.shape) == ("float32", (12,))
    assert dump.tensor_ids["w"] in dump.embedded
    assert decoded == []
    np.testing.assert_array_equal(ds["w"].isel(step=1, peer=0).values, np.arange(12) + 1)
    assert decoded == ["float32"]  # the one tensor read
    manifest = dump.embedded[dump.tensor_ids["w"]]
    assert manifest is dump.embedded[dump.tensor_ids["w"]]  # decoded once
    assert decode_manifest(encode_manifest(dump)) == dump  # equal to its eager decoding


def test_a_ref_pickles_as_its_stored_form(tmp_path: Path) -> None:
    store, dump_id = _store(tmp_path)
    dump = store.get_typed(dump_id, DumpManifest)
    assert isinstance(dump.embedded, LazyTensors)
    ref = dump.embedded.ref(dump.tensor_ids["b"])
    assert ref is not None
    ref.manifest()
    copy = pickle.loads(pickle.dumps(ref))
    assert isinstance(copy, TensorRef)
    assert copy._decoded is None
    assert copy.manifest() == ref.manifest()
    assert pickle.loads(pickle.dumps(dump)) == dump


def test_a_malformed_embedded_tensor_is_found_by_reads_and_walks(tmp_path: Path) -> None:
    # A writer's bug (or a hostile user) stores a dump whose JSON hashes right but one of
    # whose tensors is malformed: its grid parses, its chunk list does not.
    store, dump_id = _store(tmp_path)
    data, tensor_id = _with_a_malformed_chunk_list(store, dump_id)
    bad = decode_manifest(data)  # the grid is fine: reading the dump works
    assert isinstance(bad, DumpManifest)
    with pytest.raises(IntegrityError, match=f"tensor {tensor_id}.*malformed"):
        bad.embedded[tensor_id]
    # gc and verify walk every manifest they read in full: theirs is a problem report
    frame = encode_block(data)
    found = _parse(hash_bytes(data), "a test", frame, None)
    assert isinstance(found, Problem)
    assert found.kind == "corrupt", found
    assert tensor_id in found.detail


@pytest.mark.parametrize(
    ("shape", "chunk_shape", "match"),
    [
        ([1.5], [1], "malformed shape"),
        ([4.0], [4], "malformed shape"),  # a float equal to an int is not one
        ([True], [1], "malformed shape"),
        ([4], [], "malformed|chunk"),
        ([4], [0], "chunk"),
        ([-3], [1], "shape|negative|dimension"),
    ],
)
def test_a_malformed_grid_fails_the_read_of_the_dump(
    shape: list[object], chunk_shape: list[object], match: str
) -> None:
    tensor_id = "b3:" + "ab" * 32
    doc = {
        "type": "dump",
        "format": 2,
        "run": "r",
        "step": 0,
        "peer": "p",
        "tensors": [["w", tensor_id]],
        "metadata": {},
        "source": {},
        "embedded": {tensor_id: {"dtype": "float32", "shape": shape, "chunk_shape": chunk_shape}},
    }
    with pytest.raises(IntegrityError, match=match):
        decode_manifest(to_json_bytes(doc))


def test_a_malformed_tensor_read_through_a_dataset_names_its_dump(tmp_path: Path) -> None:
    from xarray.core.indexing import BasicIndexer

    from gradpipe.xarray.array import TensorStack

    store, dump_id = _store(tmp_path)
    data, tensor_id = _with_a_malformed_chunk_list(store, dump_id)
    bad = decode_manifest(data)
    assert isinstance(bad, DumpManifest)
    assert isinstance(bad.embedded, LazyTensors)
    ref = bad.embedded.ref(tensor_id)
    stack = TensorStack(
        store,
        [ref],
        lead=(1,),
        dtype="float32",
        shape=(12,),
        labels=["run 'r', step 0, peer 'p'"],
        name="w",
        token="t",
    )
    with pytest.raises(IntegrityError, match=r"tensor 'w' of run 'r', step 0, peer 'p'.*malformed"):
        stack[BasicIndexer((0, slice(None)))]


def test_concurrent_reads_decode_a_tensor_once(monkeypatch: pytest.MonkeyPatch) -> None:
    # The chunks of one tensor are read by concurrent dask tasks: each must get the
    # manifest, decoded once, never a half-made one or a "malformed" from a cleared form.
    import threading
    import time

    from gradpipe.core.chunk_stats import ChunkStats

    stats = (ChunkStats(count=4, nonzero=3), ChunkStats(count=2, nonzero=0))
    raw = TensorManifest("float32", (6,), (4,), ("b3:" + "ab" * 32, None), stats).to_dict()
    ref = TensorRef("b3:" + "cd" * 32, raw)
    calls: list[int] = []
    original = TensorManifest.from_dict.__func__  # type: ignore[attr-defined]

    def slow(cls: type[TensorManifest], data: dict[str, object]) -> TensorManifest:
        calls.append(1)
        time.sleep(0.05)  # every thread arrives while the first decodes
        return original(cls, data)  # type: ignore[no-any-return]

    monkeypatch.setattr(TensorManifest, "from_dict", classmethod(slow))
    barrier = threading.Barrier(8)
    got: list[object] = []

    def read() -> None:
        barrier.wait()
        got.append(ref.manifest())

    threads = [threading.Thread(target=read) for _ in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert len(calls) == 1
    assert len(got) == 8
    assert all(m is got[0] for m in got)
    assert pickle.loads(pickle.dumps(ref)).manifest() == got[0]


@settings(max_examples=40, deadline=None)
@given(
    values=hnp.arrays(
        np.float32,
        hnp.array_shapes(min_dims=1, max_dims=2, min_side=1, max_side=40),
        elements=st.floats(width=32, allow_nan=True, allow_infinity=True),
    ),
    chunk_bytes=st.integers(4, 256),
)
def test_chunk_stats_decode_the_stats_columns_alone(values: np.ndarray, chunk_bytes: int) -> None:
    manifest = gp.open_store("memory://", mode="w").write_tensor(values, chunk_bytes=chunk_bytes)
    ref = TensorRef("b3:" + "0" * 64, manifest.to_dict())
    assert ref.chunk_stats() == manifest.stats
    assert ref._decoded is None  # nothing else was decoded, nor kept
    ref.manifest()
    assert ref.chunk_stats() == manifest.stats


def test_malformed_chunk_stats_name_the_tensor(tmp_path: Path) -> None:
    store, dump_id = _store(tmp_path)
    raw, tensor_id = _with_a_malformed_chunk_list(store, dump_id)
    doc = decode_manifest(raw)
    assert isinstance(doc, DumpManifest)
    ref = doc.embedded.ref(tensor_id)
    assert ref is not None
    ref._raw["chunks"]["sumsq"] = []  # type: ignore[index]
    with pytest.raises(IntegrityError, match=f"tensor {tensor_id}.*chunk statistics"):
        ref.chunk_stats()
