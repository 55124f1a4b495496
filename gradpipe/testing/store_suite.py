"""The store conformance suite: every backend runs the same tests.

Subclass :class:`StoreTests` in a test module and provide a ``store`` fixture
returning a new, empty, writable store (zarr's ``StoreTests`` and fsspec's
abstract tests are the model)::

    class TestLocalStore(StoreTests):
        @pytest.fixture
        def store(self, tmp_path):
            return gp.open_store(tmp_path / "s", mode="w")
"""

from __future__ import annotations

import math

import numpy as np
import pytest

from gradpipe.core.dtypes import DTYPE_NAMES, parse_dtype
from gradpipe.core.ids import block_key
from gradpipe.errors import ConflictError, InvalidInputError, NotFoundError
from gradpipe.storage.store import Store

__all__ = ["StoreTests", "special_values"]


def special_values(dtype_name: str, size: int = 1000, seed: int = 0) -> np.ndarray:
    """An array of ``dtype_name`` mixing random bit patterns with edge cases.

    Floats get NaNs with payloads, -0.0, subnormals and infinities; every
    bit pattern is legal data for the store, which must keep it exactly.
    """
    dtype = parse_dtype(dtype_name)
    rng = np.random.default_rng(seed)
    if dtype == np.bool_:
        return rng.random(size) < 0.3
    raw = rng.integers(0, 256, size * dtype.itemsize, dtype=np.uint8).view(dtype).copy()
    if dtype.kind in "iu":
        return raw
    unsigned = np.dtype(f"u{dtype.itemsize}")
    bits = raw.view(unsigned)
    top = np.array(1, unsigned) << np.array(8 * dtype.itemsize - 1, unsigned)
    bits[::7] = top  # -0.0
    bits[1::11] = 1  # the smallest subnormal
    bits[2::13] = ~np.array(0, unsigned)  # a NaN with a full payload
    raw[3::17] = np.array(np.inf).astype(dtype)
    return raw


class StoreTests:
    """Behaviour every store must have, whatever its backend."""

    @pytest.mark.parametrize("dtype", DTYPE_NAMES)
    def test_round_trip_every_dtype_bit_exact(self, store: Store, dtype: str) -> None:
        array = special_values(dtype, 5000).reshape(50, 100)
        tensor_id = store.put_tensor(array, chunk_bytes=1024)
        back = store.get_tensor(tensor_id)
        assert back.dtype == array.dtype
        assert back.shape == array.shape
        assert back.tobytes() == array.tobytes()

    @pytest.mark.parametrize("shape", [(), (0,), (3, 0, 2), (1,), (7, 1, 5), (2, 3, 4, 5)])
    def test_round_trip_shapes(self, store: Store, shape: tuple[int, ...]) -> None:
        array = np.arange(math.prod(shape), dtype=np.float32).reshape(shape) - 3.5
        back = store.get_tensor(store.put_tensor(array, chunk_bytes=16))
        assert back.shape == shape
        np.testing.assert_array_equal(back, array)

    def test_big_endian_and_strided_input_is_stored_as_values(self, store: Store) -> None:
        array = np.arange(200, dtype=">f8").reshape(10, 20)[:, ::2]
        back = store.get_tensor(store.put_tensor(array))
        assert back.dtype == np.dtype("<f8")
        np.testing.assert_array_equal(back, array)

    def test_ids_depend_on_content_not_codec_or_chunking_of_blocks(self, store: Store) -> None:
        array = special_values("float32", 4096)
        first = store.put_tensor(array)
        assert store.put_tensor(array.copy()) == first
        from numcodecs import Zstd

        assert store.put_tensor(array, codecs=[Zstd(level=5)]) == first

    def test_second_put_writes_no_block(self, store: Store) -> None:
        array = special_values("float32", 100_000)
        store.put_tensor(array, chunk_bytes=64 * 1024)
        written = store.write_stats.blocks_written
        store.put_tensor(array, chunk_bytes=64 * 1024)
        assert store.write_stats.blocks_written == written

    def test_zero_chunks_take_no_block(self, store: Store) -> None:
        array = np.zeros((64, 256), np.float32)
        array[10] = 1.0
        array[40, 3] = -0.0  # bits are not zero: must be kept
        manifest = store.write_tensor(array, chunk_bytes=256 * 4 * 8)
        assert sum(b is not None for b in manifest.blocks) == 2
        assert store.write_stats.zero_chunks == len(manifest.blocks) - 2
        back = store.read_tensor(manifest)
        assert back.tobytes() == array.tobytes()

    def test_chunk_stats_match_numpy(self, store: Store) -> None:
        rng = np.random.default_rng(1)
        array = rng.standard_normal(30_000).astype(np.float32)
        array[::100] = 0.0
        array[5] = np.nan
        array[6] = -np.inf
        stats = store.tensor_info(store.put_tensor(array, chunk_bytes=4096)).summary()
        finite = array[np.isfinite(array)].astype(np.float64)
        assert stats.count == array.size
        assert stats.nan == 1
        assert stats.inf == 1
        assert stats.nonzero == np.count_nonzero(array)
        assert stats.min == -np.inf
        assert stats.max == float(np.nanmax(array))
        assert math.isclose(stats.sum, finite.sum(), rel_tol=1e-9, abs_tol=1e-9)
        assert math.isclose(stats.sumsq, float(finite @ finite), rel_tol=1e-9)

    def test_missing_tensor_is_not_found(self, store: Store) -> None:
        with pytest.raises(NotFoundError, match="b3:0000"):
            store.get_tensor("b3:" + "0" * 64)
        with pytest.raises(KeyError):
            store.get_tensor("b3:" + "0" * 64)

    def test_malformed_id_is_invalid_input(self, store: Store) -> None:
        with pytest.raises(InvalidInputError, match="not a gradpipe id"):
            store.get_tensor("../../etc/passwd")

    def test_unsupported_dtype_is_refused_before_writing(self, store: Store) -> None:
        before = list(store.backend.list("blocks"))
        with pytest.raises(InvalidInputError, match="complex"):
            store.put_tensor(np.ones(4, np.complex64))
        assert list(store.backend.list("blocks")) == before

    def test_has_blocks_and_raw_blocks(self, store: Store) -> None:
        block_id = store.put_raw(b"hello")
        assert bytes(store.get_raw(block_id)) == b"hello"
        assert store.has_blocks([block_id, "b3:" + "1" * 64]) == [True, False]
        assert store.backend.read(block_key(block_id)) != b"hello"  # framed, self-describing

    def test_ref_set_get_history_and_delete(self, store: Store) -> None:
        a = store.put_tensor(np.ones(3))
        b = store.put_tensor(np.zeros(3) + 2)
        store.refs.set("tags/x", a, message="first")
        store.refs.set("tags/x", b, expected=a)
        assert store.refs.get("tags/x") == b
        history = list(store.refs.history("tags/x"))
        assert [e.target for e in history] == [b, a]
        assert history[1].message == "first"
        store.refs.set("tags/x", None)
        assert "tags/x" not in store.refs.list()
        with pytest.raises(NotFoundError):
            store.refs.get("tags/x")
        assert [e.target for e in store.refs.history("tags/x")] == [None, b, a]
        assert [e.target for e in store.refs.history("tags/x", limit=2)] == [None, b]
        assert isinstance(store.refs.history("tags/x"), list)  # printable, reusable

    def test_ref_compare_and_swap_conflicts(self, store: Store) -> None:
        a = store.put_tensor(np.ones(3))
        b = store.put_tensor(np.zeros(3))
        store.refs.set("tags/y", a, expected=None)
        with pytest.raises(ConflictError):
            store.refs.set("tags/y", b, expected=None)
        with pytest.raises(ConflictError):
            store.refs.set("tags/y", b, expected=b)
        assert store.refs.get("tags/y") == a

    def test_refs_list_by_kind(self, store: Store) -> None:
        a = store.put_tensor(np.ones(3))
        store.refs.set("tags/one", a)
        store.refs.set("runs/two", a)
        assert list(store.refs.list()) == ["runs/two", "tags/one"]
        assert list(store.refs.list("tags")) == ["tags/one"]
