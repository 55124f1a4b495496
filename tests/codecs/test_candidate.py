"""Evaluation candidates: names and chains, what they apply to, and their bounds on random data."""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from gradpipe.cli._app import build_parser
from gradpipe.codecs.candidate import DEFAULT_CANDIDATES, Candidate, parse_candidates
from gradpipe.core.codec_names import CODEC_NAMES
from gradpipe.errors import InvalidInputError
from gradpipe.evaluation.fidelity import bound_usage

LOSSY = [
    "bf16",
    "fp16",
    "bitround-5",
    "bitround-7+zstd",
    "bf16+blosc",
    "topk-0.05",
    "qsgd-8",
    "powersgd-2",
]


def test_the_command_line_lists_the_codec_table() -> None:
    assert [c.name for c in parse_candidates(None)] == list(DEFAULT_CANDIDATES)
    for command, option in (("evaluate", "--codecs"), ("ingest", "--codec")):
        text = _option_help(command, option)
        lossless = ("default", "zstd", "blosc")
        names = [n for n in CODEC_NAMES if command == "evaluate" or n not in lossless]
        for name in names:
            assert name in text, (command, name)
    assert ", ".join(DEFAULT_CANDIDATES) in _option_help("evaluate", "--codecs")


def _option_help(command: str, option: str) -> str:
    import argparse

    [sub] = [a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction)]
    [action] = [a for a in sub.choices[command]._actions if option in a.option_strings]
    return " ".join((action.help or "").split())


def test_names_and_chains() -> None:
    chain = Candidate.parse(" bitround-7 + zstd ")
    assert chain.name == "bitround-7+zstd"
    assert (chain.lossy, chain.family, chain.feedback) == (True, "bitround", False)
    assert Candidate.parse("topk-0.01").feedback
    assert not Candidate.parse("zstd").lossy
    assert [c.name for c in parse_candidates(["zstd", "bf16", "zstd"])] == ["zstd", "bf16"]
    for bad, words in [
        ("nope", "unknown codec 'nope'; codecs are default, zstd, blosc, bf16"),
        ("topk-2", "top-k fraction must be a number in (0, 1]"),
        ("qsgd-x", "'x' is not an integer"),
        ("zstd+bf16", "a lossy codec must come first"),
        ("blosc+default", "cannot be chained"),
        ("", "no codecs to evaluate"),
    ]:
        with pytest.raises(InvalidInputError) as caught:
            parse_candidates(bad)
        assert words in str(caught.value)


def test_what_a_candidate_applies_to() -> None:
    assert Candidate.parse("default").skip_reason("int32", (4,)) is None
    assert Candidate.parse("zstd").skip_reason("bool", (4,)) is None
    assert "does not encode bfloat16" in (
        Candidate.parse("fp16").skip_reason("bfloat16", (4,)) or ""
    )
    assert Candidate.parse("topk-0.1").skip_reason("bfloat16", (4,)) is None
    assert "1-D tensors are left out" in (
        Candidate.parse("powersgd-2").skip_reason("float32", (4,)) or ""
    )
    assert Candidate.parse("powersgd-2").skip_reason("float32", (4, 4)) is None


@pytest.mark.parametrize("name", ["default", "zstd", "blosc"])
@pytest.mark.parametrize(
    "dtype", ["float32", "float64", "int64", "uint8", np.dtype(ml_dtypes.bfloat16)]
)
def test_lossless_candidates_give_the_bytes_back(name: str, dtype: object) -> None:
    x = (np.random.default_rng(1).standard_normal(3000) * 100).astype(dtype)
    coded = Candidate.parse(name).code(x, x.shape)
    assert coded.decoded.dtype == x.dtype
    assert coded.decoded.tobytes() == x.tobytes()
    assert coded.encoded_bytes > 0
    assert coded.encode_seconds >= 0
    assert coded.decode_seconds >= 0


@st.composite
def gradients(draw: st.DrawFn) -> np.ndarray:
    """A 2-D float32 gradient chunk: scaled normals with some zeros and extremes."""
    rows, cols = draw(st.integers(1, 24)), draw(st.integers(2, 40))
    scale = draw(st.sampled_from([1e-8, 1e-3, 1.0, 1e3]))
    base = draw(hnp.arrays(np.float32, (rows, cols), elements=st.floats(-4, 4, width=32)))
    zeros = draw(st.floats(0, 0.9))
    mask = np.random.default_rng(draw(st.integers(0, 99))).random(base.shape) < zeros
    return np.where(mask, 0, base * np.float32(scale)).astype(np.float32)


@pytest.mark.parametrize("name", LOSSY)
@given(x=gradients())
@settings(max_examples=40, deadline=None)
def test_a_lossy_candidate_keeps_its_bound(name: str, x: np.ndarray) -> None:
    candidate = Candidate.parse(name)
    coded = candidate.code(x.reshape(-1), x.shape)
    bound = candidate.bound("float32", x.size)
    assert bound.holds(x.reshape(-1), coded.decoded)
    used = bound_usage(bound, x.reshape(-1), coded.decoded)
    assert used is not None
    assert used <= 1 + 1e-9
