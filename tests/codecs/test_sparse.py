from __future__ import annotations

import zlib
from collections.abc import Callable

import numcodecs
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from numcodecs.tests import common
from numcodecs.tests.common import (
    check_backwards_compatibility,
    check_config,
    check_encode_decode,
    check_repr,
)

from gradpipe.codecs import ByteGroupCodec, SparseCodec
from gradpipe.codecs.sparse import nonzero_mask
from gradpipe.core.dtypes import DTYPE_NAMES, dtype_name, parse_dtype
from gradpipe.errors import IntegrityError, InvalidInputError

Maker = Callable[[str, int, float, str, int], np.ndarray]

HEADER = 36  # magic, version, width, method, pad, count, nonzero, bitmap length, crc32

codecs = [
    *(SparseCodec(name) for name in DTYPE_NAMES),
    SparseCodec("float32", level=-5),
    SparseCodec("bfloat16", level=9),
]


@pytest.mark.parametrize("name", DTYPE_NAMES)
def test_encode_decode(name: str, chunk_maker: Maker) -> None:
    codec = SparseCodec(name)
    arrays = [
        chunk_maker(name, 1000, 0.01, "normal", 0),
        chunk_maker(name, 1000, 0.5, "rows", 1).reshape(10, 100),
        chunk_maker(name, 1000, 1.0, "bits", 2).reshape(100, 10, order="F"),
        np.zeros(1000, dtype=parse_dtype(name)),
        np.zeros(0, dtype=parse_dtype(name)),
    ]
    for arr in arrays:
        check_encode_decode(arr, codec)


@pytest.mark.parametrize("codec", codecs, ids=repr)
def test_config(codec: SparseCodec) -> None:
    check_config(codec)


def test_repr(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(common, "SparseCodec", SparseCodec, raising=False)
    check_repr("SparseCodec(dtype='float16', level=2)")


@pytest.mark.parametrize("name", DTYPE_NAMES)
def test_backwards_compatibility(
    name: str, chunk_maker: Maker, in_fixtures: Callable[[str, str], None]
) -> None:
    in_fixtures(SparseCodec.codec_id, name)
    word = f"<u{parse_dtype(name).itemsize}"
    arrays = [
        chunk_maker(name, 1600, 0.05, "rows", 20).view(word),
        chunk_maker(name, 600, 0.3, "special", 21).view(word),
        chunk_maker(name, 64, 1.0, "bits", 22).view(word),
        np.zeros(100, dtype=word),
        np.zeros(0, dtype=word),
    ]
    codecs = [SparseCodec(name), SparseCodec(name, level=7)]
    check_backwards_compatibility(SparseCodec.codec_id, arrays, codecs, prefix=name)


def test_get_codec() -> None:
    config = {"id": "gradpipe_sparse", "dtype": "float32", "level": 3}
    codec = numcodecs.get_codec(config)
    assert codec == SparseCodec("float32", level=3)
    assert isinstance(codec, SparseCodec)


@settings(max_examples=300, deadline=None)
@given(data=st.data())
def test_round_trip_is_bit_exact(
    data: st.DataObject, chunk_strategy: Callable[[], st.SearchStrategy[np.ndarray]]
) -> None:
    chunk = data.draw(chunk_strategy())
    codec = SparseCodec(dtype_name(chunk.dtype))
    encoded = codec.encode(chunk)
    decoded = codec.decode(encoded)
    assert decoded.dtype == chunk.dtype
    assert decoded.tobytes() == chunk.tobytes()
    out = bytearray(b"\x01" * chunk.nbytes)
    codec.decode(encoded, out=out)
    assert bytes(out) == chunk.tobytes()


@pytest.mark.parametrize("count", [1, 7, 8, 9, 1000, 4097])
@pytest.mark.parametrize("density", [0.0, 0.003, 0.1, 0.3, 0.9, 1.0])
def test_decode_scatters_exactly_the_marked_elements(count: int, density: float) -> None:
    # Both ways of finding the marked elements (the sparse bitmap bytes only,
    # or the whole unpacked mask) and both buffers (a new array, the caller's).
    rng = np.random.default_rng(count)
    chunk = np.where(rng.random(count) < density, rng.normal(size=count), 0).astype("float32")
    encoded = SparseCodec("float32").encode(chunk)
    assert SparseCodec("float32").decode(encoded).tobytes() == chunk.tobytes()
    out = np.full(count, np.nan, dtype="float32")
    assert SparseCodec("float32").decode(encoded, out=out) is out
    assert out.tobytes() == chunk.tobytes()


def test_bits_past_the_last_element_are_ignored() -> None:
    from gradpipe.codecs.sparse import _RAW, _bitmap_indices

    bitmap = np.array([0b1000_0001, 0b1111_0010], dtype=np.uint8)  # 12 elements: 4 bits unused
    assert _bitmap_indices(bitmap, _RAW, 12).tolist() == [0, 7, 9]
    assert bitmap.tolist() == [0b1000_0001, 0b1111_0010]  # the frame is not written to


@settings(max_examples=1000, deadline=None)
@given(data=st.data())
def test_costs_at_most_the_bitmap_beyond_the_values_it_keeps(
    data: st.DataObject, chunk_strategy: Callable[[], st.SearchStrategy[np.ndarray]]
) -> None:
    # The seed's (index, value) pairs doubled a dense update; here a frame is its header, a
    # bitmap of at most one bit per element, and the kept values coded as a dense chunk.
    # (Against the whole chunk's dense frame, Zstandard's own choices on planes of a few
    # hundred bytes also differ, by up to 45 bytes a plane either way: hypothesis found an
    # int64 chunk of 207 values 308 bytes over. test_dense_update_costs_at_most_the_bitmap
    # compares with the dense frame at a real chunk size.)
    chunk = data.draw(chunk_strategy())
    name = dtype_name(chunk.dtype)
    frame = SparseCodec(name).encode(chunk)
    kept = chunk[nonzero_mask(chunk.view(f"<u{chunk.itemsize}"))]
    values = ByteGroupCodec(name).encode(kept)
    assert frame.endswith(bytes(values))
    assert 0 <= len(frame) - HEADER - len(values) <= -(-chunk.size // 8)


@pytest.mark.parametrize("name", ["float32", "bfloat16"])
@pytest.mark.parametrize("density", [0.5, 0.9, 0.99, 1.0])
def test_dense_update_costs_at_most_the_bitmap(
    name: str, density: float, chunk_maker: Maker
) -> None:
    # A dense update at a realistic chunk size: the bitmap is the whole
    # overhead (1 bit per element: 3.1% of float32, 6.3% of bfloat16).
    chunk = chunk_maker(name, (1 << 22) // parse_dtype(name).itemsize, density, "normal", 9)
    sparse = len(SparseCodec(name).encode(chunk))
    dense = len(ByteGroupCodec(name).encode(chunk))
    assert sparse <= dense + chunk.size / 8 + HEADER


@pytest.mark.parametrize("name", DTYPE_NAMES)
def test_negative_zero_is_not_zero(name: str, specials: Callable[[str], np.ndarray]) -> None:
    chunk = np.zeros(64, dtype=parse_dtype(name))
    chunk.view(f"<u{chunk.itemsize}")[[5, 40]] = specials(name)[1]
    encoded = SparseCodec(name).encode(chunk)
    assert int.from_bytes(encoded[16:24], "little") == 2  # nonzero count in the header
    assert SparseCodec(name).decode(encoded).tobytes() == chunk.tobytes()


def test_embedding_gradient_is_small(chunk_maker: Maker) -> None:
    # 1% of 64-wide rows nonzero, as an embedding gradient over a large vocabulary.
    rows = np.random.default_rng(7).random(16384) < 0.01
    values = chunk_maker("float32", 1 << 20, 1.0, "normal", 7).reshape(16384, 64)
    chunk = np.where(rows[:, None], values, np.float32(0)).ravel()
    sparse = len(SparseCodec("float32").encode(chunk))
    dense = len(ByteGroupCodec("float32").encode(chunk))
    assert sparse < chunk.nbytes / 80
    assert sparse < dense


@pytest.mark.parametrize("nonzero", ["none", "all"])
def test_trivial_bitmap_is_omitted(nonzero: str) -> None:
    chunk = np.zeros(4096, dtype="float32") if nonzero == "none" else np.ones(4096, "float32")
    encoded = SparseCodec("float32").encode(chunk)
    assert encoded[6] == 2  # bitmap method: omitted
    assert int.from_bytes(encoded[24:32], "little") == 0  # bitmap length
    assert SparseCodec("float32").decode(encoded).tobytes() == chunk.tobytes()


def test_invalid_parameters() -> None:
    with pytest.raises(InvalidInputError):
        SparseCodec("complex128")
    with pytest.raises(InvalidInputError):
        SparseCodec("float32", level=99)
    with pytest.raises(InvalidInputError, match="not a whole number of float64"):
        SparseCodec("float64").encode(b"\x00" * 12)


@pytest.fixture
def sparse_frame(chunk_maker: Maker) -> bytes:
    """A frame with a Zstandard-compressed bitmap and some values."""
    chunk = chunk_maker("float32", 4000, 0.02, "rows", 8)
    encoded = SparseCodec("float32").encode(chunk)
    assert encoded[6] == 1  # bitmap method: Zstandard
    return encoded


def test_truncated_frame_raises(sparse_frame: bytes) -> None:
    codec = SparseCodec("float32")
    for size in range(len(sparse_frame)):
        with pytest.raises(IntegrityError):
            codec.decode(sparse_frame[:size])


def test_damaged_header_raises(sparse_frame: bytes) -> None:
    codec = SparseCodec("float32")
    for position in range(HEADER):
        damaged = bytearray(sparse_frame)
        damaged[position] ^= 0xFF
        with pytest.raises(IntegrityError):
            codec.decode(damaged)


def test_damaged_bitmap_raises(sparse_frame: bytes) -> None:
    length = int.from_bytes(sparse_frame[24:32], "little")
    damaged = sparse_frame[:HEADER] + bytes(length) + sparse_frame[HEADER + length :]
    with pytest.raises(IntegrityError, match="bitmap"):
        SparseCodec("float32").decode(damaged)


def test_bitmap_disagreeing_with_values_raises() -> None:
    # A well-formed frame (valid CRC) whose bitmap marks 2 elements but
    # whose header and values say 1: spliced from two real frames.
    one = np.zeros(800, dtype="float32")
    one[3] = 1.0
    two = one.copy()
    two[9] = 2.0
    a, b = SparseCodec("float32").encode(one), SparseCodec("float32").encode(two)
    length_a = int.from_bytes(a[24:32], "little")
    length_b = int.from_bytes(b[24:32], "little")
    header = a[:24] + b[24:32]
    spliced = (
        header
        + zlib.crc32(header).to_bytes(4, "little")
        + b[HEADER : HEADER + length_b]
        + a[HEADER + length_a :]
    )
    with pytest.raises(IntegrityError, match="bitmap marks 2 elements"):
        SparseCodec("float32").decode(spliced)


def test_frame_of_another_codec_raises() -> None:
    chunk = np.zeros(100, dtype="float32")
    with pytest.raises(IntegrityError, match="not a sparse frame"):
        SparseCodec("float32").decode(ByteGroupCodec("float32").encode(chunk))
    with pytest.raises(IntegrityError, match="configured for float64"):
        SparseCodec("float64").decode(SparseCodec("float32").encode(chunk))


@given(st.binary(max_size=200))
def test_garbage_raises(garbage: bytes) -> None:
    with pytest.raises(IntegrityError):
        SparseCodec("float32").decode(garbage)
