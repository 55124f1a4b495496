from __future__ import annotations

import struct
import zlib
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
from gradpipe.core.dtypes import DTYPE_NAMES, dtype_name, is_float, parse_dtype
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


# Version 2 frames (sign move chosen per chunk, matching or literal-only planes).

V2_NAMES = ["float32", "bfloat16", "float16", "float64", "int32", "uint16"]


def realistic(name: str, kind: str, size: int, seed: int) -> np.ndarray:
    """Dense chunks shaped like training state: their exponents decide the layout."""
    rng = np.random.default_rng(seed)
    dtype = parse_dtype(name)
    if kind == "params":  # N(0, 0.02): the sign move pays
        values = rng.normal(0, 0.02, size)
    elif kind == "moment2":  # exp_avg_sq: positive, the sign plane is constant
        values = rng.lognormal(-17, 2, size)
    else:  # a low-rank gradient: exponent rows repeat with their signs
        rows = -(-size // 384)
        values = np.outer(rng.standard_normal(rows) * 1e-3, rng.standard_normal(384))
        values = values.ravel()[:size]
    if not is_float(dtype):
        return (values * 1e6).astype(dtype)
    return values.astype(dtype)


@pytest.mark.parametrize("name", V2_NAMES)
def test_backwards_compatibility_v2(
    name: str, chunk_maker: Maker, in_fixtures: Callable[[str, str], None]
) -> None:
    prefix = f"v2/{name}"
    in_fixtures(ByteGroupCodec.codec_id, prefix)
    word = f"<u{parse_dtype(name).itemsize}"
    arrays = [
        realistic(name, "params", 40_000, 30).view(word),
        realistic(name, "moment2", 40_000, 31).view(word),
        realistic(name, "gradient", 40_000, 32).view(word),
        chunk_maker(name, 600, 0.3, "special", 33).view(word),
        np.zeros(0, dtype=word),
    ]
    codecs = [ByteGroupCodec(name), ByteGroupCodec(name, level=7)]
    check_backwards_compatibility(ByteGroupCodec.codec_id, arrays, codecs, prefix=prefix)


def test_writes_version_2() -> None:
    encoded = ByteGroupCodec("float32").encode(np.ones(10, dtype="float32"))
    assert encoded[:5] == b"GPBG\x02"


@pytest.mark.parametrize("name", ["float32", "bfloat16"])
@pytest.mark.parametrize("kind", ["params", "moment2"])
def test_sign_move_is_chosen_per_chunk(name: str, kind: str) -> None:
    # The real gradients of benchmarks/transformer_data.py keep the sign in
    # place (flags 2); parameter-like and second-moment-like chunks move it.
    chunk = realistic(name, kind, 1 << 18, 40)
    codec = ByteGroupCodec(name)
    encoded = codec.encode(chunk)
    assert encoded[6] == 3
    assert codec.decode(encoded).tobytes() == chunk.tobytes()
    constant = np.full(1 << 18, 1.0, dtype=chunk.dtype)  # LayerNorm weights at init
    assert ByteGroupCodec(name).encode(constant)[6] == 2


@pytest.mark.parametrize("name", ["float32", "bfloat16"])
def test_layout_beats_either_fixed_choice(name: str) -> None:
    # Parameters want the sign moved, low-rank gradients want it left alone.
    chunks = [realistic(name, k, 1 << 18, 41) for k in ("params", "gradient")]
    sizes = [len(ByteGroupCodec(name).encode(c)) for c in chunks]
    plain = [len(Zstd(level=1).encode(c.view(f"<u{c.itemsize}"))) for c in chunks]
    assert all(s < 0.9 * p for s, p in zip(sizes, plain, strict=True))


@settings(max_examples=60, deadline=None)
@given(
    name=st.sampled_from(["float32", "bfloat16"]),
    kind=st.sampled_from(["params", "moment2", "gradient"]),
    size=st.integers(1, 70_000),
    seed=st.integers(0, 2**32 - 1),
    specials_at=st.lists(st.integers(0, 69_999), max_size=50),
)
def test_special_values_survive_either_layout(
    name: str,
    kind: str,
    size: int,
    seed: int,
    specials_at: list[int],
    specials: Callable[[str], np.ndarray],
) -> None:
    # Large enough to be judged on samples; NaN payloads, -0.0, infinities
    # and subnormals sprinkled where the layout decision does not see them.
    chunk = realistic(name, kind, size, seed)
    words = chunk.view(f"<u{chunk.itemsize}")
    pool = specials(name)
    for i, at in enumerate(specials_at):
        words[at % size] = pool[i % pool.size]
    codec = ByteGroupCodec(name)
    encoded = codec.encode(chunk)
    assert codec.decode(encoded).tobytes() == chunk.tobytes()
    out = np.empty_like(chunk)
    codec.decode(encoded, out=out)
    assert out.tobytes() == chunk.tobytes()


def forged_frame(name: str, count: int, declared: int) -> bytes:
    """A v2 frame with a valid CRC whose compressed planes claim ``declared`` bytes."""
    width = parse_dtype(name).itemsize
    # Zstandard frame header: single segment, 8-byte content size, no blocks.
    plane = b"\x28\xb5\x2f\xfd" + bytes([0xE0]) + declared.to_bytes(8, "little")
    flags = 2 if name in ("float32", "bfloat16") else 0
    header = struct.pack("<4sBBBxQ", b"GPBG", 2, width, flags, count * width)
    header += b"".join(struct.pack("<BQ", 1, len(plane)) for _ in range(width))
    return header + struct.pack("<I", zlib.crc32(header)) + plane * width


@pytest.mark.parametrize("name", ["float32", "bfloat16", "int64"])
def test_forged_size_raises_before_allocating(name: str) -> None:
    # 2**40 elements behind a few dozen bytes: refused, not allocated.
    with pytest.raises(IntegrityError, match="does not hold"):
        ByteGroupCodec(name).decode(forged_frame(name, 1 << 40, 1 << 40))
    # A plausible size with blocks missing: the frame is short, and says so.
    with pytest.raises(IntegrityError):
        ByteGroupCodec(name).decode(forged_frame(name, 100, 100))


def test_unknown_version_raises() -> None:
    encoded = bytearray(ByteGroupCodec("float32").encode(np.ones(10, dtype="float32")))
    encoded[4] = 3
    with pytest.raises(IntegrityError, match="version 3 is not supported"):
        ByteGroupCodec("float32").decode(encoded)


def test_flags_of_the_wrong_version_raise() -> None:
    # A v2 frame relabelled v1 (CRC recomputed): its flags mean nothing there.
    encoded = bytearray(ByteGroupCodec("float32").encode(np.ones(10, dtype="float32")))
    encoded[4] = 1
    end = frame_header_size("float32") - 4
    encoded[end : end + 4] = struct.pack("<I", zlib.crc32(bytes(encoded[:end])))
    with pytest.raises(IntegrityError, match="layout does not match"):
        ByteGroupCodec("float32").decode(encoded)


@pytest.mark.parametrize("name", ["float32", "bfloat16", "float64", "int32", "uint8"])
@pytest.mark.parametrize("kind", ["normal", "bits"])
def test_estimate_is_close_to_the_encoded_size(name: str, kind: str, chunk_maker: Maker) -> None:
    """The sampled estimate a writer chooses encodings by is within a few percent."""
    codec = ByteGroupCodec(name)
    chunk = chunk_maker(name, 200_000, 1.0, kind, 3)
    actual = len(codec.encode(chunk))
    assert abs(codec.estimate(chunk) - actual) <= 0.1 * actual
    small = chunk[:100]  # under one sample: judged whole
    assert abs(codec.estimate(small) - len(codec.encode(small))) <= 0.1 * len(codec.encode(small))
    empty = np.zeros(0, dtype=parse_dtype(name))
    assert codec.estimate(empty) == len(codec.encode(empty))


def test_estimate_tells_noise_from_structure() -> None:
    rng = np.random.default_rng(4)
    codec = ByteGroupCodec("float32")
    smooth = (rng.standard_normal(300_000) * 1e-3).astype("float32")
    noise = rng.integers(0, 2**32, 300_000, dtype=np.uint32).view("float32")
    assert codec.estimate(smooth) < 0.9 * codec.estimate(noise)
    assert codec.estimate(noise) >= noise.nbytes


@settings(max_examples=60, deadline=None)
@given(width=st.sampled_from([2, 4]), count=st.integers(0, 300), seed=st.integers(0, 2**32 - 1))
def test_sign_move_on_split_planes_equals_the_plane_move(width: int, count: int, seed: int) -> None:
    """The in-place move the encoder makes gives the same rows as ``move_sign`` (tails too)."""
    from gradpipe.codecs._planes import move_sign, move_sign_split, split_planes

    data = np.random.default_rng(seed).integers(0, 256, count * width, dtype=np.uint8)
    planes = split_planes(data, width)
    exponent, rest = move_sign(planes[-1].copy(), planes[-2].copy())
    low = planes[:-2].copy()
    move_sign_split(planes, data)
    assert planes[-1].tobytes() == exponent.tobytes()
    assert planes[-2].tobytes() == rest.tobytes()
    assert planes[:-2].tobytes() == low.tobytes()


@settings(max_examples=60, deadline=None)
@given(
    width=st.sampled_from([1, 2, 4, 8]), count=st.integers(0, 300), seed=st.integers(0, 2**32 - 1)
)
def test_planes_split_and_join_back(width: int, count: int, seed: int) -> None:
    from gradpipe.codecs._planes import join_planes, split_planes

    data = np.random.default_rng(seed).integers(0, 256, count * width, dtype=np.uint8)
    planes = split_planes(data, width)
    assert planes.shape == (width, count)
    assert planes.tobytes() == data.reshape(count, width).T.tobytes()
    dest = np.full(data.size, 0xAA, dtype=np.uint8)
    join_planes(list(planes), dest)
    assert dest.tobytes() == data.tobytes()
