"""Shared data for the codec tests: chunks that stress bit-exactness."""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
from hypothesis import strategies as st

from gradpipe.core.dtypes import DTYPE_NAMES, is_float, parse_dtype

FIXTURES = Path(__file__).parent / "fixtures"

#: (exponent bits, mantissa bits) of each float dtype.
FLOAT_LAYOUT = {"float16": (5, 10), "bfloat16": (8, 7), "float32": (8, 23), "float64": (11, 52)}


def special_words(name: str) -> np.ndarray:
    """Bit patterns a float codec must not touch: signed zeros, NaN payloads, subnormals."""
    width = parse_dtype(name).itemsize
    word = np.dtype(f"<u{width}")
    bits = 8 * width
    if not is_float(parse_dtype(name)):
        top = (1 << bits) - 1
        return np.array([0, 1, top, top >> 1, 1 << (bits - 1)], dtype=word)
    exp_bits, man_bits = FLOAT_LAYOUT[name]
    sign = 1 << (bits - 1)
    exp_mask = ((1 << exp_bits) - 1) << man_bits
    quiet = 1 << (man_bits - 1)
    values = [
        0,
        sign,  # -0.0
        exp_mask,  # +inf
        exp_mask | sign,  # -inf
        exp_mask | quiet,  # canonical quiet NaN
        exp_mask | quiet | 0b101,  # quiet NaN with a payload
        exp_mask | 1,  # signalling NaN
        sign | exp_mask | quiet | 3,  # negative NaN with a payload
        1,  # smallest subnormal
        sign | ((1 << man_bits) - 1),  # largest negative subnormal
    ]
    return np.array(values, dtype=word)


def make_chunk(name: str, size: int, density: float, kind: str, seed: int) -> np.ndarray:
    """A chunk of ``size`` elements, about ``density`` of them nonzero bit patterns."""
    dtype = parse_dtype(name)
    word = np.dtype(f"<u{dtype.itemsize}")
    rng = np.random.default_rng(seed)
    if kind == "bits":
        values = rng.integers(0, np.iinfo(word).max, size, dtype=word, endpoint=True)
    elif kind == "special":
        values = rng.choice(special_words(name), size)
    elif is_float(dtype):  # "normal": what gradients look like
        values = (rng.standard_normal(size) * 1e-3).astype(dtype).view(word)
    else:
        values = rng.integers(-100, 100, size).astype(word)
    if kind == "rows":
        mask = np.repeat(rng.random(-(-size // 8)) < density, 8)[:size]
    else:
        mask = rng.random(size) < density
    return np.where(mask, values, word.type(0)).astype(word).view(dtype)


@st.composite
def chunks(draw: st.DrawFn, names: tuple[str, ...] = DTYPE_NAMES) -> np.ndarray:
    """Hypothesis strategy: chunks of every stored dtype and sparsity pattern."""
    name = draw(st.sampled_from(names))
    size = draw(st.integers(0, 3000))
    if draw(st.booleans()):
        # Arbitrary bytes: every bit pattern, including ones no generator thinks of.
        raw = draw(st.binary(max_size=size * parse_dtype(name).itemsize))
        raw = raw[: len(raw) - len(raw) % parse_dtype(name).itemsize]
        return np.frombuffer(raw, dtype=parse_dtype(name)).copy()
    density = draw(st.sampled_from([0.0, 1.0, 0.001, 0.01, 0.3, 0.7, 0.999]))
    kind = draw(st.sampled_from(["bits", "special", "normal", "rows"]))
    chunk = make_chunk(name, size, density, kind, draw(st.integers(0, 2**32 - 1)))
    if size and draw(st.booleans()):
        # Exactly one nonzero element, somewhere: the sparsest chunk there is.
        chunk = np.zeros_like(chunk)
        lone = draw(st.sampled_from(list(special_words(name)[1:])))
        chunk.view(f"<u{chunk.itemsize}")[draw(st.integers(0, size - 1))] = lone
    return chunk


@pytest.fixture(scope="session")
def chunk_strategy() -> Callable[..., st.SearchStrategy[np.ndarray]]:
    """The :func:`chunks` strategy (a fixture, so test modules need not import conftest)."""
    return chunks


@pytest.fixture(scope="session")
def chunk_maker() -> Callable[[str, int, float, str, int], np.ndarray]:
    """The :func:`make_chunk` function."""
    return make_chunk


@pytest.fixture(scope="session")
def specials() -> Callable[[str], np.ndarray]:
    """The :func:`special_words` function."""
    return special_words


@pytest.fixture
def in_fixtures(monkeypatch: pytest.MonkeyPatch) -> Callable[[str, str], None]:
    """Run numcodecs' check_backwards_compatibility in tests/codecs/fixtures.

    numcodecs' helper writes any fixture that is missing and then checks it,
    which would make a lost fixture pass silently; the returned function fails
    instead unless GRADPIPE_WRITE_FIXTURES=1 asks for new ones.
    """
    FIXTURES.mkdir(exist_ok=True)
    monkeypatch.chdir(FIXTURES)

    def require(codec_id: str, prefix: str) -> None:
        path = FIXTURES / "fixture" / codec_id / prefix
        if not path.is_dir() and os.environ.get("GRADPIPE_WRITE_FIXTURES") != "1":
            pytest.fail(f"missing fixture {path}; set GRADPIPE_WRITE_FIXTURES=1 to write it")

    return require
