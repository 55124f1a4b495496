from __future__ import annotations

from collections.abc import Callable

import numcodecs
import numpy as np
import pytest

import gradpipe.codecs
from gradpipe.codecs import (
    SPARSE_MAX_DENSITY,
    ByteGroupCodec,
    SparseCodec,
    choose_codec,
    default_codec_config,
)
from gradpipe.core.dtypes import DTYPE_NAMES, parse_dtype
from gradpipe.errors import InvalidInputError

Maker = Callable[[str, int, float, str, int], np.ndarray]


def test_public_api() -> None:
    # Sorted as ruff's RUF022 sorts: constants, classes, functions.
    assert gradpipe.codecs.__all__ == [
        "DELTA_KINDS",
        "SPARSE_MAX_DENSITY",
        "BF16Codec",
        "BitRoundCodec",
        "ByteGroupCodec",
        "DeltaCodec",
        "FP16Codec",
        "PowerSGDCodec",
        "ProjectionCodec",
        "QSGDCodec",
        "SparseCodec",
        "TopKCodec",
        "choose_codec",
        "default_codec_config",
    ]


@pytest.mark.parametrize("name", DTYPE_NAMES)
def test_mostly_zero_chunk_is_sparse(name: str, chunk_maker: Maker) -> None:
    chunk = chunk_maker(name, 100_000, 0.005, "rows", 0)
    codec = choose_codec(chunk)
    assert codec == SparseCodec(name)


@pytest.mark.parametrize("name", DTYPE_NAMES)
def test_dense_chunk_is_dense(name: str, chunk_maker: Maker) -> None:
    chunk = chunk_maker(name, 100_000, 1.0, "bits", 1)
    assert choose_codec(chunk) == ByteGroupCodec(name)


def test_all_zero_and_empty_chunks() -> None:
    assert isinstance(choose_codec(np.zeros(1000, dtype="float32")), SparseCodec)
    assert isinstance(choose_codec(np.zeros(0, dtype="float32")), ByteGroupCodec)


def test_negative_zero_counts_as_nonzero() -> None:
    assert isinstance(choose_codec(np.full(1000, -0.0, dtype="float32")), ByteGroupCodec)


def test_threshold_is_inclusive() -> None:
    chunk = np.ones(1000, dtype="float32")
    at = int(SPARSE_MAX_DENSITY * chunk.size)
    assert isinstance(choose_codec(chunk, nonzero=at), SparseCodec)
    assert isinstance(choose_codec(chunk, nonzero=at + 1), ByteGroupCodec)


def test_given_count_is_trusted_not_recomputed() -> None:
    # The caller's statistics are the source of truth: no second pass.
    assert isinstance(choose_codec(np.ones(1000, dtype="float32"), nonzero=3), SparseCodec)
    assert isinstance(choose_codec(np.zeros(1000, dtype="float32"), nonzero=999), ByteGroupCodec)


@pytest.mark.parametrize("nonzero", [-1, 1001, True])
def test_impossible_count_is_rejected(nonzero: int) -> None:
    with pytest.raises(InvalidInputError, match="nonzero must be a count"):
        choose_codec(np.ones(1000, dtype="float32"), nonzero=nonzero)


def test_unsupported_dtype_is_rejected() -> None:
    with pytest.raises(InvalidInputError, match="unsupported dtype"):
        choose_codec(np.zeros(10, dtype="complex64"))


def test_level_is_passed_on() -> None:
    assert choose_codec(np.zeros(10, dtype="float32"), level=5).level == 5
    assert choose_codec(np.ones(10, dtype="float32"), level=5).level == 5


@pytest.mark.parametrize("name", ["float32", "bfloat16", "uint8"])
def test_chosen_codec_round_trips_by_config(name: str, chunk_maker: Maker) -> None:
    # What the storage layer does: encode with the chosen codec, keep its
    # config in the block header, later decode with the codec from the config.
    for density in (0.0, 0.01, 0.9):
        chunk = chunk_maker(name, 5000, density, "normal", 2)
        codec = choose_codec(chunk)
        encoded = codec.encode(chunk)
        decoded = numcodecs.get_codec(codec.get_config()).decode(encoded)
        assert decoded.tobytes() == chunk.tobytes()


@pytest.mark.parametrize(
    ("dtype", "name"),
    [("bfloat16", "bfloat16"), (parse_dtype("bfloat16"), "bfloat16"), (np.float32, "float32")],
)
def test_default_codec_config(dtype: str | np.dtype | type, name: str) -> None:
    config = default_codec_config(dtype)
    assert config == {"id": "gradpipe_bytegroup", "dtype": name, "level": 1}
    assert numcodecs.get_codec(config) == ByteGroupCodec(name)
