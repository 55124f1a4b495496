"""Codecs by name: what ``gradpipe evaluate`` and ``--codec`` names stand for.

The names and their families are the table of :mod:`gradpipe.core.codec_names`; each
family's class is imported on first use, like numcodecs' own registry: a codec is never known
because some module happened to be imported first.

>>> make_codec("topk-0.1", dtype="float32")
TopKCodec(dtype='float32', fraction=0.1)
>>> parse_codec_name("qsgd-4").lossy
True
"""

from __future__ import annotations

import importlib
import math
from dataclasses import dataclass
from typing import Any

import numpy as np
from numcodecs.abc import Codec

from gradpipe.core.codec_names import CODEC_FAMILIES, CODEC_NAMES
from gradpipe.core.display import printable
from gradpipe.core.lossy import ErrorBound
from gradpipe.errors import InvalidInputError

__all__ = [
    "CODEC_FAMILIES",
    "CODEC_NAMES",
    "CodecName",
    "codec_for_chunk",
    "error_bound",
    "make_codec",
    "parse_codec_name",
]


@dataclass(frozen=True, slots=True)
class CodecName:
    """A parsed codec name: its family, its parameter (if any) and whether it is lossy."""

    name: str
    family: str
    param: int | float | None
    lossy: bool


def parse_codec_name(name: str) -> CodecName:
    """Check a codec name (``"bf16"``, ``"topk-0.01"``...); raises :class:`InvalidInputError`.

    The parameter's range is checked by the codec itself, in :func:`make_codec`.
    """
    family_name, sep, text = str(name).partition("-")
    family = CODEC_FAMILIES.get(family_name)
    if family is None:
        raise InvalidInputError(
            f"unknown codec {printable(name)}; codecs are {', '.join(CODEC_NAMES)}"
        )
    if family.kind is None:
        if sep:
            raise InvalidInputError(
                f"codec {printable(family_name)} takes no parameter, not {printable(name)}"
            )
        return CodecName(family_name, family_name, None, family.lossy)
    if not sep:
        expected = next(n for n in CODEC_NAMES if n.startswith(f"{family_name}-"))
        raise InvalidInputError(f"codec {printable(name)} needs its parameter: {expected}")
    try:
        param: int | float = family.kind(text)
    except ValueError:
        raise InvalidInputError(
            f"codec {printable(name)}: {printable(text)} is not "
            f"{'an integer' if family.kind is int else 'a number'}"
        ) from None
    if isinstance(param, float) and not math.isfinite(param):
        raise InvalidInputError(f"codec {printable(name)}: the parameter must be finite")
    return CodecName(f"{family_name}-{text}", family_name, param, family.lossy)


def make_codec(
    name: str, *, dtype: str = "float32", shape: tuple[int, ...] | None = None
) -> Codec | None:
    """The codec a name stands for, for values of ``dtype`` (and a tensor's ``shape``).

    Returns None for ``default``: the store's lossless policy, which picks a
    codec per chunk (see :func:`codec_for_chunk`). A lossy codec for a dtype
    it does not take (integers) raises :class:`InvalidInputError`.
    """
    parsed = parse_codec_name(name)
    family = CODEC_FAMILIES[parsed.family]
    if family.target is None:
        return None
    module_name, _, attr = family.target.partition(":")
    cls = getattr(importlib.import_module(module_name), attr)
    kwargs: dict[str, Any] = {}
    if family.takes_dtype:
        kwargs["dtype"] = dtype
    if family.keyword is not None:
        kwargs[family.keyword] = parsed.param
    try:
        codec: Codec = cls(**kwargs)
    except (TypeError, ValueError) as exc:
        raise InvalidInputError(f"codec {printable(name)}: {exc}") from None
    if shape is not None and getattr(codec, "lossy", False):
        bound = codec.for_tensor(dtype, tuple(shape))
        if bound is None:
            raise InvalidInputError(f"codec {printable(name)} does not encode {dtype} values")
        codec = bound
    return codec


def codec_for_chunk(name: str, chunk: np.ndarray, shape: tuple[int, ...] | None = None) -> Codec:
    """The codec ``name`` uses on one chunk (``default``: the one the lossless policy picks)."""
    from gradpipe.codecs.policy import choose_codec
    from gradpipe.core.dtypes import dtype_name

    dtype = dtype_name(chunk.dtype)
    codec = make_codec(name, dtype=dtype, shape=shape)
    return choose_codec(chunk) if codec is None else codec


def error_bound(name: str, *, dtype: str = "float32", size: int | None = None) -> ErrorBound:
    """What codec ``name`` promises on a chunk of ``size`` values (lossless: bit-exact)."""
    if not parse_codec_name(name).lossy:
        return ErrorBound.lossless()
    codec = make_codec(name, dtype=dtype)
    bound: ErrorBound = codec.error_bound(size)  # type: ignore[union-attr]
    return bound
