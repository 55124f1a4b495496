"""Small chunks inside their tensor manifest, tensor manifests inside their dump (format 2)."""

from __future__ import annotations

import types
from pathlib import Path

import dask.config
import numpy as np
import pytest

import gradpipe as gp
from gradpipe.core.ids import hash_bytes
from gradpipe.core.manifest import decode_manifest, encode_manifest
from gradpipe.core.run_manifest import DumpManifest
from gradpipe.core.tensor_manifest import TensorManifest
from gradpipe.errors import IntegrityError, InvalidInputError
from gradpipe.formats.safetensors import write_safetensors
from gradpipe.ingestion.api import ingest
from gradpipe.runs import open_run
from gradpipe.storage.tensors import chunk_frames


def _objects(root: Path) -> int:
    return sum(1 for p in (root / "blocks").rglob("*") if p.is_file())


def _transformer_like(seed: int) -> dict[str, np.ndarray]:
    """Many small vectors beside a few matrices, as a transformer's gradients are."""
    rng = np.random.default_rng(seed)
    out = {"embed.weight": rng.standard_normal((512, 64)).astype(np.float32)}
    for i in range(4):
        out[f"layer.{i}.attn.weight"] = rng.standard_normal((64, 64)).astype(np.float32)
        out[f"layer.{i}.attn.bias"] = rng.standard_normal(64).astype(np.float32)
        out[f"layer.{i}.norm.weight"] = np.ones(64, np.float32) + 1e-3 * i
        out[f"layer.{i}.norm.bias"] = np.zeros(64, np.float32)
        out[f"layer.{i}.mlp.bias"] = rng.standard_normal(256).astype(np.float32)
    return out


def test_a_dump_is_one_object_plus_its_large_chunks(tmp_path: Path, kit: types.ModuleType) -> None:
    tensors = _transformer_like(0)
    (tmp_path / "d").mkdir()
    write_safetensors(tmp_path / "d" / "step=1.safetensors", tensors, {"num_examples": "8"})
    root = tmp_path / "s"
    store = gp.open_store(root, mode="w")
    with dask.config.set({"gradpipe.chunk-bytes": 16384}):
        report = ingest(store, str(tmp_path / "d" / "step={step}.safetensors"), run="r")
    assert report.ok
    dump = open_run(store, "r").dump(1, "0")
    big = {n for n, a in tensors.items() if a.nbytes > 8192}
    stored = [b for name in dump.names for b in dump.info(name).data_children()]
    # Only the chunks of the two large tensors are objects of their own.
    assert {n for n in dump.names if list(dump.info(n).data_children())} <= big
    assert report.writes.inline_chunks == 12  # the 4 LayerNorm biases are zero: no block at all
    assert report.writes.zero_chunks == 4
    assert report.writes.blocks_written == len(set(stored)) + 1  # + the dump manifest
    # + the run manifest and the run ref's history entry
    assert _objects(root) == len(set(stored)) + 3
    kit.assert_all_bit_exact(dump.read_all(), tensors)
    assert gp.verify(store).ok
    # The lazy path reads inline chunks too.
    lazy = dump.read("layer.0.mlp.bias", lazy=True)
    kit.assert_bit_exact(lazy.compute(), tensors["layer.0.mlp.bias"])
    # Re-ingesting the same data from another file writes no data block.
    write_safetensors(tmp_path / "d" / "step=2.safetensors", tensors, {"num_examples": "8"})
    with dask.config.set({"gradpipe.chunk-bytes": 16384}):
        again = ingest(store, str(tmp_path / "d" / "step={step}.safetensors"), run="r")
    assert again.ingested == 1
    assert again.writes.blocks_written == 1  # its dump manifest (its source path differs)


def test_inline_bytes_0_stores_every_chunk_as_a_block(tmp_path: Path, no_inline: None) -> None:
    store = gp.open_store(tmp_path / "s", mode="w")
    tensor_id = store.put_tensor(np.arange(10, dtype=np.float32), name="v")
    manifest = store.tensor_info(tensor_id)
    assert manifest.inline == {}
    assert list(manifest.data_children()) == [manifest.blocks[0]]


def test_inline_frames_are_checked_on_every_read(tmp_path: Path) -> None:
    store = gp.open_store(tmp_path / "s", mode="w")
    data = np.arange(100, dtype=np.float32)
    tensor_id = store.put_tensor(data, name="v")
    manifest = store.tensor_info(tensor_id)
    [frame] = manifest.inline.values()
    assert chunk_frames(store, manifest) == [frame]
    damaged = bytearray(frame)
    damaged[-1] ^= 0x01
    bad = TensorManifest(
        manifest.dtype,
        manifest.shape,
        manifest.chunk_shape,
        manifest.blocks,
        manifest.stats,
        {0: bytes(damaged)},
    )
    bad_id = store.put_manifest(bad)
    store.refs.set("tensors/v", bad_id)
    with pytest.raises(IntegrityError, match="chunk 0"):
        store.get_tensor(bad_id)
    report = gp.verify(store)
    # Reported under the manifest that holds the bad frame, never under the block id:
    # the same content may be stored elsewhere as a good object.
    assert [(p.kind, p.id) for p in report.problems] == [("corrupt inline", bad_id)]
    assert "chunk 0" in report.problems[0].context
    assert manifest.blocks[0] in report.problems[0].context


def test_embedded_manifest_must_hash_to_its_id(tmp_path: Path) -> None:
    store = gp.open_store(tmp_path / "s", mode="w")
    real = TensorManifest.from_dict(
        store.tensor_info(store.put_tensor(np.ones(4, np.float32))).to_dict()
    )
    fake_id = hash_bytes(b"not this manifest")
    dump = DumpManifest("r", 0, "p", (("w", fake_id),), embedded={fake_id: real})
    dump_id = store.put_manifest(dump)
    store.refs.set("dumps/x", dump_id)
    [problem] = gp.verify(store).problems
    assert (problem.kind, problem.id) == ("corrupt inline", dump_id)
    assert fake_id in problem.detail


def test_manifest_validation(tmp_path: Path) -> None:
    store = gp.open_store(tmp_path / "s", mode="w")
    manifest = store.tensor_info(store.put_tensor(np.zeros(2, np.float32)))
    assert manifest.blocks == (None,)
    with pytest.raises(InvalidInputError, match="no block"):
        TensorManifest(
            "float32", (2,), (2,), manifest.blocks, manifest.stats, {0: b"frame of a zero chunk"}
        )
    with pytest.raises(InvalidInputError, match="not one of the dump's"):
        DumpManifest("r", 0, "p", (), embedded={hash_bytes(b"x"): manifest})
    doc = encode_manifest(manifest).replace(b'"shape"', b'"inline":{"0":"@@"},"shape"')
    with pytest.raises(IntegrityError):
        decode_manifest(doc)


def test_a_dump_tensor_id_given_to_get_tensor_says_where_it_lives(tmp_path: Path) -> None:
    (tmp_path / "d").mkdir()
    write_safetensors(tmp_path / "d" / "step=1.safetensors", {"w": np.ones(3, np.float32)}, {})
    store = gp.open_store(tmp_path / "s", mode="w")
    assert ingest(store, str(tmp_path / "d" / "step={step}.safetensors"), run="r").ok
    tensor_id = open_run(store, "r").dump(1, "0").manifest.tensor_ids["w"]
    with pytest.raises(gp.NotFoundError, match=r"inside the dump's manifest.*\.dump\(step"):
        store.get_tensor(tensor_id)


def test_delete_corrupt_never_deletes_a_good_block_named_in_a_bad_inline_frame(
    tmp_path: Path,
) -> None:
    store = gp.open_store(tmp_path / "s", mode="w")
    data = np.arange(100, dtype=np.float32)
    with dask.config.set({"gradpipe.inline-bytes": 0}):
        good = store.put_tensor(data, name="good")  # the chunk as an object of its own
    inline = store.tensor_info(store.put_tensor(data))  # the same chunk, inline
    [frame] = inline.inline.values()
    damaged = bytearray(frame)
    damaged[-1] ^= 0x01
    bad = TensorManifest(
        inline.dtype,
        inline.shape,
        inline.chunk_shape,
        inline.blocks,
        inline.stats,
        {0: bytes(damaged)},
    )
    store.refs.set("tensors/bad", store.put_manifest(bad))
    report = gp.verify(store, delete_corrupt=True)
    assert [p.kind for p in report.problems] == ["corrupt inline"]
    assert report.deleted_corrupt == []
    assert store.get_tensor(good).tobytes() == data.tobytes()


def test_manifests_are_written_in_the_oldest_format_that_holds_them(tmp_path: Path) -> None:
    store = gp.open_store(tmp_path / "s", mode="w")
    with dask.config.set({"gradpipe.inline-bytes": 0}):
        plain = store.put_tensor(np.arange(100, dtype=np.float32), name="plain")
    inline = store.put_tensor(np.arange(100, dtype=np.float32), name="inline")
    assert b'"format":1' in bytes(store.get_raw(plain))
    assert b'"format":2' in bytes(store.get_raw(inline))
    entry = hash_bytes(store.backend.read_versioned("refs/tensors/plain").data)  # type: ignore[union-attr]
    assert b'"format":1' in bytes(store.get_raw(entry))  # ref entries need nothing new


def test_embedded_ids_do_not_depend_on_the_readers_format(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A later gradpipe (a higher FORMAT_VERSION) still finds every embedded id right."""
    import shutil

    import gradpipe.core.manifest as manifest_module

    fixtures = Path(__file__).parent.parent / "fixtures" / "store-v2"
    shutil.copytree(fixtures, tmp_path / "v2")
    monkeypatch.setattr(manifest_module, "FORMAT_VERSION", manifest_module.FORMAT_VERSION + 1)
    assert gp.verify(gp.open_store(tmp_path / "v2"), all_blocks=True).ok


def test_gc_keeps_inline_and_stored_chunks_of_a_dump(tmp_path: Path, kit: types.ModuleType) -> None:
    tensors = _transformer_like(1)
    (tmp_path / "d").mkdir()
    write_safetensors(tmp_path / "d" / "step=1.safetensors", tensors, {})
    store = gp.open_store(tmp_path / "s", mode="w")
    with dask.config.set({"gradpipe.chunk-bytes": 16384}):
        assert ingest(store, str(tmp_path / "d" / "step={step}.safetensors"), run="r").ok
    store.put_tensor(np.ones(50_000, np.float32))  # garbage for gc to take
    report = gp.gc(store, grace=0)
    assert report.deleted >= 1
    dump = open_run(store, "r").dump(1, "0")
    assert any(dump.info(n).inline for n in dump.names)
    assert any(list(dump.info(n).data_children()) for n in dump.names)
    kit.assert_all_bit_exact(dump.read_all(), tensors)
    assert gp.verify(store, all_blocks=True).ok
