"""Delta chains: every version reads back bit-exact, depth stays bounded, gc keeps chains whole."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import dask.config
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import gradpipe as gp
from gradpipe.codecs.delta import DeltaCodec
from gradpipe.core.ids import block_key
from gradpipe.errors import IntegrityError, InvalidInputError, NotFoundError
from gradpipe.storage.chains import ChainParent, write_version
from gradpipe.storage.tensors import read_tensor
from gradpipe.testing.store_suite import special_values

# Small chunks so a tensor of a few KiB has several, and none of them is inline.
SMALL = {"gradpipe.chunk-bytes": 1024, "gradpipe.inline-bytes": 0}


@pytest.fixture
def small_chunks() -> Iterator[None]:
    with dask.config.set(SMALL):
        yield


def _store(tmp_path: Path) -> gp.Store:
    return gp.open_store(f"file://{tmp_path}/store", mode="w")


def write_chain(
    store: gp.Store, versions: list[np.ndarray], **options: object
) -> list[tuple[str, gp.TensorManifest]]:
    """Each version written against the one before; (id, manifest) of each."""
    out: list[tuple[str, gp.TensorManifest]] = []
    parent = None
    for array in versions:
        manifest = write_version(store, array, parent, **options)  # type: ignore[arg-type]
        manifest_id = store.put_manifest(manifest)
        out.append((manifest_id, manifest))
        parent = ChainParent(manifest, manifest_id, array, trusted=True)
    return out


def _ages(manifest: gp.TensorManifest) -> tuple[int, ...]:
    assert manifest.chain is not None
    return manifest.chain.ages


def drift(base: np.ndarray, rng: np.random.Generator, fraction: float, scale: float) -> np.ndarray:
    """``base`` with a fraction of its elements nudged (a training step, roughly)."""
    out = base.copy()
    flat = out.reshape(-1)
    mask = rng.random(flat.size) < fraction
    flat[mask] += (rng.standard_normal(int(mask.sum())) * scale).astype(out.dtype)
    return out


def test_parameters_drifting_chain_and_read_back(tmp_path: Path, small_chunks: None) -> None:
    store = _store(tmp_path)
    rng = np.random.default_rng(0)
    versions = [rng.standard_normal(4096).astype("float32")]
    for _ in range(9):
        versions.append(drift(versions[-1], rng, 1.0, 1e-4))
    written = write_chain(store, versions, keyframe_interval=4)
    # Every delta is against its keyframe: a read decodes at most two blocks per chunk.
    assert [m.depth for _, m in written] == [0, 1, 1, 1, 0, 1, 1, 1, 0, 1]
    assert [max(_ages(m)) for _, m in written] == [0, 1, 2, 3, 0, 1, 2, 3, 0, 1]
    keyframes = {
        link.base for _, m in written[1:4] for links in m.deltas.values() for link in links
    }
    assert keyframes == {b for b in written[0][1].blocks if b is not None}
    for (manifest_id, manifest), want in zip(written, versions, strict=True):
        assert manifest.format_needed() == 3
        got = read_tensor(store, store.get_typed(manifest_id, gp.TensorManifest))
        assert got.tobytes() == want.tobytes()
    deltas = [m.chain for _, m in written if m.depth]
    assert all(c is not None and c.stored_bytes < c.full_bytes for c in deltas)
    assert written[1][1].chain is not None
    assert written[1][1].chain.parent == written[0][0]


def test_unchanged_version_adds_no_block(tmp_path: Path, small_chunks: None) -> None:
    store = _store(tmp_path)
    rng = np.random.default_rng(1)
    first = rng.standard_normal(4096).astype("float32")
    second = drift(first, rng, 1.0, 1e-4)
    written = write_chain(store, [first, second])
    before = store.write_stats.blocks_written
    third = write_version(store, second, ChainParent(written[1][1], written[1][0], second))
    assert store.write_stats.blocks_written == before
    assert third.chain is not None
    assert third.chain.stored_bytes == 0
    assert third.deltas == written[1][1].deltas
    assert third.blocks == written[1][1].blocks


def test_uncorrelated_versions_stay_full(tmp_path: Path, small_chunks: None) -> None:
    """Gradients of consecutive steps: a delta does not pay, so every chunk is a keyframe."""
    store = _store(tmp_path)
    rng = np.random.default_rng(2)
    versions = [rng.standard_normal(4096).astype("float32") for _ in range(3)]
    written = write_chain(store, versions)
    assert [m.depth for _, m in written] == [0, 0, 0]
    for _, manifest in written:
        assert manifest.chain is not None
        assert manifest.chain.stored_bytes == manifest.chain.full_bytes


def test_new_shape_or_dtype_starts_over(tmp_path: Path, small_chunks: None) -> None:
    store = _store(tmp_path)
    rng = np.random.default_rng(3)
    first = rng.standard_normal(4096).astype("float32")
    written = write_chain(store, [first])
    for other in (first.reshape(64, 64) + 1e-4, first.astype("float64")):
        manifest = write_version(store, other, ChainParent(written[0][1], written[0][0], first))
        assert manifest.depth == 0
        assert read_tensor(store, manifest).tobytes() == np.ascontiguousarray(other).tobytes()


def test_untrusted_values_that_differ_from_the_parent_are_not_used(
    tmp_path: Path, small_chunks: None
) -> None:
    """An ingest's previous file changed since it was stored: the keyframe is read instead."""
    store = _store(tmp_path)
    rng = np.random.default_rng(4)
    first = rng.standard_normal(4096).astype("float32")
    second = drift(first, rng, 1.0, 1e-4)
    written = write_chain(store, [first])
    wrong = first + 1.0
    for values in (wrong, first, None):
        manifest = write_version(store, second, ChainParent(written[0][1], written[0][0], values))
        assert manifest.depth == 1
        assert read_tensor(store, manifest).tobytes() == second.tobytes()


@pytest.mark.parametrize("kind", ["int", "xor"])
def test_lossless_kinds(tmp_path: Path, small_chunks: None, kind: str) -> None:
    store = _store(tmp_path)
    rng = np.random.default_rng(5)
    versions = [rng.standard_normal(4096).astype("float32")]
    versions += [drift(versions[-1], rng, 1.0, 1e-4) for _ in range(3)]
    written = write_chain(store, versions, delta=kind)
    assert {link.kind for _, m in written for links in m.deltas.values() for link in links} == {
        kind
    }
    for (_, manifest), want in zip(written, versions, strict=True):
        assert read_tensor(store, manifest).tobytes() == want.tobytes()
        assert manifest.chain is not None
        assert not manifest.chain.lossy


def test_sparse_delta_is_lossy_and_says_so(tmp_path: Path, small_chunks: None) -> None:
    store = _store(tmp_path)
    rng = np.random.default_rng(6)
    first = rng.standard_normal(4096).astype("float32")
    second = first.copy()
    second[::50] += 0.5  # a few big changes: the sparse delta is far smaller than full
    second[1::50] += np.float32(1e-6)  # and some below the threshold, dropped
    written = write_chain(store, [first, second], delta="sparse", threshold=1e-3)
    manifest = written[1][1]
    assert manifest.depth == 1
    assert manifest.chain is not None
    assert manifest.chain.lossy
    assert 0 < manifest.chain.max_abs_error <= 1e-3
    got = read_tensor(store, manifest)
    assert np.max(np.abs(got - second)) <= 1e-3
    assert got.tobytes() != second.tobytes()
    # What the store holds is what reads return: verify is clean.
    store.refs.set("tensors/lossy", written[1][0])
    assert gp.verify(store).ok


def test_delta_codec_is_registered_and_needs_its_base() -> None:
    import numcodecs

    codec = numcodecs.get_codec({"id": "gradpipe_delta", "kind": "xor", "dtype": "float32"})
    assert isinstance(codec, DeltaCodec)
    with pytest.raises(InvalidInputError, match="bind"):
        codec.encode(np.zeros(4, "float32"))
    with pytest.raises(InvalidInputError, match="float tensors"):
        DeltaCodec("sparse", "int32")
    with pytest.raises(InvalidInputError, match="int is the lossless default"):
        DeltaCodec("subtract", "float32")


def test_gc_keeps_every_block_of_a_chain(tmp_path: Path, small_chunks: None) -> None:
    """Only the newest version is reachable from a ref: its keyframe and older deltas stay."""
    store = _store(tmp_path)
    rng = np.random.default_rng(7)
    versions = [rng.standard_normal(4096).astype("float32")]
    versions += [drift(versions[-1], rng, 1.0, 1e-4) for _ in range(5)]
    written = write_chain(store, versions, keyframe_interval=8)
    newest_id, newest = written[-1]
    assert newest.depth == 1
    assert max(_ages(newest)) == 5
    store.refs.set("tensors/newest", newest_id)
    report = gp.gc(store, grace=0)
    assert report.ok
    assert report.deleted > 0  # the older versions' manifests went
    assert read_tensor(store, store.get_typed(newest_id, gp.TensorManifest)).tobytes() == (
        versions[-1].tobytes()
    )
    assert gp.verify(store).ok


def test_damaged_and_missing_chain_blocks_are_named(tmp_path: Path, small_chunks: None) -> None:
    store = _store(tmp_path)
    rng = np.random.default_rng(8)
    first = rng.standard_normal(4096).astype("float32")
    written = write_chain(store, [first, drift(first, rng, 1.0, 1e-4)])
    manifest = written[1][1]
    link = manifest.deltas[0][0]
    key = block_key(link.block)
    frame = bytearray(store.backend.read(key))
    frame[-1] ^= 0xFF
    store.backend.delete_many([key])
    store.backend.write_many_if_absent([(key, bytes(frame))])
    with pytest.raises(IntegrityError, match="delta"):
        read_tensor(store, manifest, context="w")
    store.backend.delete_many([block_key(link.base)])
    with pytest.raises(NotFoundError, match="chunk 0"):
        read_tensor(store, manifest, context="w")
    store.refs.set("tensors/w", written[1][0])
    report = gp.verify(store)
    assert not report.ok
    assert {p.kind for p in report.problems} >= {"missing", "corrupt"}


_FLOATS = ("float32", "bfloat16", "float16", "float64")


@st.composite
def chains(draw: st.DrawFn) -> tuple[list[np.ndarray], int, str]:
    """A tensor over versions: random update sparsity and size, sign flips, special values."""
    dtype = draw(st.sampled_from((*_FLOATS, "int32", "uint8")))
    size = draw(st.integers(1, 3000))
    seed = draw(st.integers(0, 2**16))
    rng = np.random.default_rng(seed)
    first = special_values(dtype, size, seed=seed)
    versions = [first]
    for _ in range(draw(st.integers(1, 7))):
        edit = draw(st.sampled_from(("nudge", "flip", "special", "same", "zero", "bits")))
        fraction = draw(st.sampled_from((0.0, 0.01, 0.3, 1.0)))
        out = versions[-1].copy()
        words = out.view(f"<u{out.dtype.itemsize}")
        mask = rng.random(size) < fraction
        if edit == "nudge":
            words[mask] += np.asarray(1, words.dtype)  # the smallest step of the bit pattern
        elif edit == "flip" and out.dtype.kind in "fV":
            words[mask] ^= np.asarray(1 << (8 * out.dtype.itemsize - 1), words.dtype)
        elif edit == "special":
            out[mask] = special_values(dtype, size, seed=seed + 1)[mask]
        elif edit == "zero":
            words[mask] = 0
        elif edit == "bits":
            words[mask] = rng.integers(0, 2**8, int(mask.sum())).astype(words.dtype)
        versions.append(out)
    interval = draw(st.integers(1, 5))
    kind = draw(st.sampled_from(("int", "xor")))
    return versions, interval, kind


@settings(
    max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(case=chains())
def test_chains_are_bit_exact_and_bounded(tmp_path_factory: pytest.TempPathFactory, case) -> None:  # type: ignore[no-untyped-def]
    versions, interval, kind = case
    store = gp.open_store(f"file://{tmp_path_factory.mktemp('chain')}", mode="w")
    with dask.config.set({"gradpipe.chunk-bytes": 512, "gradpipe.inline-bytes": 16}):
        written = write_chain(store, versions, keyframe_interval=interval, delta=kind)
    for (manifest_id, manifest), want in zip(written, versions, strict=True):
        assert manifest.depth <= min(1, interval - 1)
        assert max(_ages(manifest), default=0) <= interval - 1
        stored = store.get_typed(manifest_id, gp.TensorManifest)
        assert stored == manifest
        assert read_tensor(store, stored).tobytes() == want.tobytes()
    store.refs.set("tensors/last", written[-1][0])
    gp.gc(store, grace=0)
    got = read_tensor(store, store.get_typed(written[-1][0], gp.TensorManifest))
    assert got.tobytes() == versions[-1].tobytes()


def test_verify_rebuilds_delta_chunks(tmp_path: Path, small_chunks: None) -> None:
    """A delta taken against other bytes than its keyframe: every block is sound, the chunk
    is not, and verify says so (under the manifest: there is no damaged block to delete)."""
    store = _store(tmp_path)
    rng = np.random.default_rng(9)
    first = rng.standard_normal(4096).astype("float32")
    second = drift(first, rng, 1.0, 1e-4)
    [(first_id, first_manifest)] = write_chain(store, [first])
    wrong = {}  # the keyframes, one value off: the delta is small, so it is kept
    for b, (lo, hi) in zip(first_manifest.blocks, first_manifest.chunk_ranges(), strict=True):
        values = first[lo:hi].copy()
        values[0] += 1
        wrong[b] = values
    parent = ChainParent(first_manifest, first_id, keyframes=wrong)
    bad = write_version(store, second, parent)
    assert bad.depth == 1
    bad_id = store.put_manifest(bad)
    store.refs.set("tensors/bad", bad_id)
    report = gp.verify(store)
    kinds = {(p.kind, p.id) for p in report.problems}
    assert kinds == {("bad delta", bad_id)}
    assert not report.ok
    with pytest.raises(IntegrityError, match="does not match its id"):
        read_tensor(store, bad)
    # A sound chain verifies clean.
    good = write_version(store, second, ChainParent(first_manifest, first_id, first))
    store.refs.set("tensors/bad", store.put_manifest(good))
    assert gp.verify(store).ok


def test_a_delta_estimated_to_lose_is_never_encoded(
    tmp_path: Path, small_chunks: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Unrelated versions (consecutive gradients): one encoding per chunk, not two."""
    from gradpipe.storage.versioner import ChunkVersioner

    store = _store(tmp_path)
    rng = np.random.default_rng(12)
    versions = [rng.standard_normal(4096).astype("float32") for _ in range(2)]
    first = write_chain(store, versions[:1])
    encoded: list[int] = []
    real = ChunkVersioner._encode

    def counting(self: ChunkVersioner, item: object) -> object:
        encoded.append(1)
        return real(self, item)  # type: ignore[arg-type]

    monkeypatch.setattr(ChunkVersioner, "_encode", counting)
    parent = ChainParent(first[0][1], first[0][0], versions[0], trusted=True)
    second = write_version(store, versions[1], parent)
    assert second.depth == 0
    assert len(encoded) == len(second.blocks) == 16
    got = read_tensor(store, store.get_typed(store.put_manifest(second), gp.TensorManifest))
    assert got.tobytes() == versions[1].tobytes()


def test_copy_to_receives_the_values_written(
    tmp_path: Path, small_chunks: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A version written through ``copy_to`` is of the copy, whatever happens to the source."""
    from gradpipe.storage.versioner import ChunkVersioner

    store = _store(tmp_path)
    rng = np.random.default_rng(13)
    source = rng.standard_normal((64, 64)).astype("float32")
    want = source.copy()
    copy = np.empty(source.size, np.float32)
    real = ChunkVersioner.chunk

    def then_changed(
        self: ChunkVersioner, values: np.ndarray, *args: object, **kw: object
    ) -> object:
        result = real(self, values, *args, **kw)  # type: ignore[arg-type]
        source.reshape(-1)[:] += 1  # a training thread moves the array meanwhile
        return result

    monkeypatch.setattr(ChunkVersioner, "chunk", then_changed)
    manifest = write_version(store, source, None, copy_to=copy, parallel=False)
    got = read_tensor(store, store.get_typed(store.put_manifest(manifest), gp.TensorManifest))
    assert got.tobytes() == copy.tobytes()
    assert copy[: 1024 // 4].tobytes() == want.reshape(-1)[: 1024 // 4].tobytes()
    assert gp.verify(store).ok
    with pytest.raises(InvalidInputError, match="copy_to"):
        write_version(store, want, None, copy_to=np.empty(want.size, np.float64))
    with pytest.raises(InvalidInputError, match="copy_to"):  # a reshape would copy it
        write_version(store, want, None, copy_to=np.empty((64, 64), np.float32, order="F"))
