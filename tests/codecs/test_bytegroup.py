from __future__ import annotations

from collections.abc import Callable

import numcodecs
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from numcodecs import Zstd
from numcodecs.tests import common
from numcodecs.tests.common import (
    check_backwards_compatibility,
    check_config,
    check_encode_decode,
    check_repr,
)

from gradpipe.codecs import ByteGroupCodec, SparseCodec
from gradpipe.core.dtypes import DTYPE_NAMES, dtype_name, parse_dtype
from gradpipe.errors import IntegrityError, InvalidInputError

Maker = Callable[[str, int, float, str, int], np.ndarray]

codecs = [
    *(ByteGroupCodec(name) for name in DTYPE_NAMES),
    ByteGroupCodec("float32", level=-5),
    ByteGroupCodec("bfloat16", level=9),
]


def frame_header_size(name: str) -> int:
    # magic, version, width, flags, pad, nbytes; (method, length) per plane; crc32
    return 16 + 9 * parse_dtype(name).itemsize + 4


@pytest.mark.parametrize("name", DTYPE_NAMES)
def test_encode_decode(name: str, chunk_maker: Maker) -> None:
    codec = ByteGroupCodec(name)
    arrays = [
        chunk_maker(name, 1000, 1.0, "normal", 0),
        chunk_maker(name, 1000, 0.5, "normal", 1).reshape(10, 100),
        chunk_maker(name, 1000, 0.9, "bits", 2).reshape(100, 10, order="F"),
        np.zeros(0, dtype=parse_dtype(name)),
    ]
    for arr in arrays:
        check_encode_decode(arr, codec)


@pytest.mark.parametrize("codec", codecs, ids=repr)
def test_config(codec: ByteGroupCodec) -> None:
    check_config(codec)


def test_repr(monkeypatch: pytest.MonkeyPatch) -> None:
    # check_repr evaluates the statement in numcodecs' own namespace.
    monkeypatch.setattr(common, "ByteGroupCodec", ByteGroupCodec, raising=False)
    check_repr("ByteGroupCodec(dtype='bfloat16', level=3)")


@pytest.mark.parametrize("name", DTYPE_NAMES)
def test_backwards_compatibility(
    name: str, chunk_maker: Maker, in_fixtures: Callable[[str, str], None]
) -> None:
    in_fixtures(ByteGroupCodec.codec_id, name)
    # Saved as unsigned words: np.save cannot describe bfloat16.
    word = f"<u{parse_dtype(name).itemsize}"
    arrays = [
        chunk_maker(name, 600, 1.0, "normal", 10).view(word),
        chunk_maker(name, 600, 0.3, "special", 11).view(word),
        chunk_maker(name, 64, 1.0, "bits", 12).view(word),
        np.zeros(0, dtype=word),
    ]
    codecs = [ByteGroupCodec(name), ByteGroupCodec(name, level=7)]
    check_backwards_compatibility(ByteGroupCodec.codec_id, arrays, codecs, prefix=name)


def test_get_codec() -> None:
    config = {"id": "gradpipe_bytegroup", "dtype": "bfloat16", "level": 4}
    assert numcodecs.get_codec(config) == ByteGroupCodec("bfloat16", level=4)


@settings(max_examples=300, deadline=None)
@given(data=st.data())
def test_round_trip_is_bit_exact(
    data: st.DataObject, chunk_strategy: Callable[[], st.SearchStrategy[np.ndarray]]
) -> None:
    chunk = data.draw(chunk_strategy())
    codec = ByteGroupCodec(dtype_name(chunk.dtype))
    encoded = codec.encode(chunk)
    decoded = codec.decode(encoded)
    assert decoded.dtype == chunk.dtype
    assert decoded.tobytes() == chunk.tobytes()
    out = np.full_like(chunk, 1)
    assert codec.decode(encoded, out=out) is out
    assert out.tobytes() == chunk.tobytes()


@pytest.mark.parametrize("name", ["float32", "bfloat16", "float64", "int64"])
def test_large_chunk_round_trip(name: str, chunk_maker: Maker) -> None:
    # 8 MiB: planes span many Zstandard blocks and exceed the level-1 window.
    chunk = chunk_maker(name, (8 << 20) // parse_dtype(name).itemsize, 0.99, "normal", 3)
    codec = ByteGroupCodec(name)
    encoded = codec.encode(chunk)
    assert codec.decode(encoded).tobytes() == chunk.tobytes()
    assert len(encoded) < 0.9 * chunk.nbytes


@pytest.mark.parametrize("name", ["float32", "bfloat16"])
def test_grouping_beats_plain_zstd_on_gradients(name: str, chunk_maker: Maker) -> None:
    chunk = chunk_maker(name, 1 << 18, 1.0, "normal", 4)
    grouped = len(ByteGroupCodec(name).encode(chunk))
    plain = len(Zstd(level=1).encode(chunk.view(f"<u{chunk.itemsize}")))
    assert grouped < 0.95 * plain


@pytest.mark.parametrize("name", DTYPE_NAMES)
def test_incompressible_planes_are_stored_raw(name: str, chunk_maker: Maker) -> None:
    chunk = chunk_maker(name, 5000, 1.0, "bits", 5)
    encoded = ByteGroupCodec(name).encode(chunk)
    assert len(encoded) == chunk.nbytes + frame_header_size(name)


@pytest.mark.parametrize(
    ("dtype", "level"),
    [("complex64", 1), ("float128", 1), ("float32", 23), ("float32", True), ("float32", "1")],
)
def test_invalid_parameters(dtype: str, level: int) -> None:
    with pytest.raises(InvalidInputError):
        ByteGroupCodec(dtype, level=level)


def test_partial_element_is_rejected() -> None:
    with pytest.raises(InvalidInputError, match="not a whole number of float32"):
        ByteGroupCodec("float32").encode(b"\x00" * 10)


def test_out_of_the_wrong_size_is_rejected() -> None:
    codec = ByteGroupCodec("float32")
    encoded = codec.encode(np.arange(10, dtype="float32"))
    with pytest.raises(InvalidInputError, match="out holds 44 bytes"):
        codec.decode(encoded, out=np.empty(11, dtype="float32"))


@pytest.fixture
def mixed_frame(chunk_maker: Maker) -> tuple[np.ndarray, bytes]:
    """A float32 frame with both raw (mantissa) and compressed (exponent) planes."""
    chunk = chunk_maker("float32", 500, 1.0, "normal", 6)
    encoded = ByteGroupCodec("float32").encode(chunk)
    methods = [encoded[16 + 9 * k] for k in range(4)]
    assert methods == [0, 0, 0, 1]
    return chunk, encoded


def test_truncated_frame_raises(mixed_frame: tuple[np.ndarray, bytes]) -> None:
    _, encoded = mixed_frame
    codec = ByteGroupCodec("float32")
    for size in range(len(encoded)):
        with pytest.raises(IntegrityError):
            codec.decode(encoded[:size])
    with pytest.raises(IntegrityError, match="plane table says"):
        codec.decode(encoded + b"\x00")


def test_damaged_header_raises(mixed_frame: tuple[np.ndarray, bytes]) -> None:
    _, encoded = mixed_frame
    codec = ByteGroupCodec("float32")
    for position in range(frame_header_size("float32")):
        damaged = bytearray(encoded)
        damaged[position] ^= 0xFF
        with pytest.raises(IntegrityError):
            codec.decode(damaged)


def test_damaged_compressed_plane_raises(mixed_frame: tuple[np.ndarray, bytes]) -> None:
    chunk, encoded = mixed_frame
    start = frame_header_size("float32") + 3 * chunk.size
    damaged = encoded[:start] + bytes(len(encoded) - start)
    with pytest.raises(IntegrityError, match="plane 3"):
        ByteGroupCodec("float32").decode(damaged)


def test_frame_of_another_codec_raises() -> None:
    chunk = np.linspace(-1, 1, 100, dtype="float32")
    with pytest.raises(IntegrityError, match="configured for float16"):
        ByteGroupCodec("float16").decode(ByteGroupCodec("float32").encode(chunk))
    # Same width, other layout: float32 frames have their sign bit rotated.
    with pytest.raises(IntegrityError, match="layout does not match dtype int32"):
        ByteGroupCodec("int32").decode(ByteGroupCodec("float32").encode(chunk))
    with pytest.raises(IntegrityError, match="not a byte-group frame"):
        ByteGroupCodec("float32").decode(SparseCodec("float32").encode(chunk))


@given(st.binary(max_size=200))
def test_garbage_raises(garbage: bytes) -> None:
    with pytest.raises(IntegrityError):
        ByteGroupCodec("float32").decode(garbage)
