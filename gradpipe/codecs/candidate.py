"""The candidates of a codec evaluation: a registry name, or a lossy one chained to lossless ones.

A candidate is what ``gradpipe evaluate --codecs`` takes: a codec name of
:mod:`gradpipe.codecs.registry` (``bf16``, ``topk-0.01``...) or, as ``--codec``
stores them, a lossy name followed by lossless ones joined by ``+``
(``bitround-7+zstd``: BitRound only zeroes mantissa bits, a compressor after
it is what makes them smaller). A :class:`Candidate` knows which chunks it
applies to, the chain of codecs it uses on one, and the bound it states.

>>> Candidate.parse("bitround-7+zstd").lossy
True
>>> Candidate.parse("topk-0.01").skip_reason("int64", (10,))
'topk-0.01 does not encode int64 values (they would be stored exactly)'
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Final

import numpy as np
from numcodecs.abc import Codec
from numcodecs.compat import ensure_contiguous_ndarray

from gradpipe.codecs.registry import (
    CODEC_NAMES,
    CodecName,
    codec_for_chunk,
    error_bound,
    make_codec,
    parse_codec_name,
)
from gradpipe.core.codec_names import DEFAULT_CANDIDATES
from gradpipe.core.display import printable
from gradpipe.core.dtypes import dtype_name
from gradpipe.core.lossy import ErrorBound
from gradpipe.errors import InvalidInputError

__all__ = [
    "DEFAULT_CANDIDATES",
    "FEEDBACK_FAMILIES",
    "MATRIX_FAMILIES",
    "Candidate",
    "Coded",
    "parse_candidates",
]

#: Families simulated with error feedback across steps (GRACE gives them a memory).
FEEDBACK_FAMILIES: Final = frozenset({"topk", "powersgd"})
#: Families that approximate matrices: evaluated on tensors of two or more dimensions.
MATRIX_FAMILIES: Final = frozenset({"powersgd"})


@dataclass(frozen=True, slots=True)
class Coded:
    """One chunk through a candidate: the stored bytes, what decoding gave, the times."""

    head: Codec  # the first codec of the chain (the lossy one, if any)
    frame: bytes  # its own frame
    encoded_bytes: int  # what the whole chain stores
    decoded: np.ndarray
    encode_seconds: float
    decode_seconds: float


@dataclass(frozen=True, slots=True)
class Candidate:
    """A parsed candidate: its codec names, first one possibly lossy, the rest lossless."""

    name: str
    parts: tuple[CodecName, ...]

    @classmethod
    def parse(cls, text: str) -> Candidate:
        """Check a candidate (``"bf16"``, ``"bitround-7+zstd"``); raises InvalidInputError."""
        items = str(text).strip().split("+")
        parts = tuple(parse_codec_name(item.strip()) for item in items)
        if len(parts) > 1 and any(p.family == "default" for p in parts):
            raise InvalidInputError(
                f"codec {printable(text)}: 'default' is the lossless policy, it cannot be chained"
            )
        if any(p.lossy for p in parts[1:]):
            raise InvalidInputError(
                f"codec {printable(text)}: a lossy codec must come first, and only one; "
                "for example 'bf16+zstd'"
            )
        for part in parts:  # the parameter's range (topk-2) is the codec's to check
            make_codec(part.name)
        return cls("+".join(p.name for p in parts), parts)

    @property
    def head(self) -> CodecName:
        """The first codec: the lossy one, if any."""
        return self.parts[0]

    @property
    def lossy(self) -> bool:
        return self.head.lossy

    @property
    def family(self) -> str:
        return self.head.family

    @property
    def feedback(self) -> bool:
        """Whether the evaluation simulates it with error feedback across steps."""
        return self.family in FEEDBACK_FAMILIES

    def skip_reason(self, dtype: str, shape: tuple[int, ...]) -> str | None:
        """Why the candidate leaves a tensor of ``dtype`` and ``shape`` out; None if it applies."""
        if not self.lossy:
            return None
        base = make_codec(self.head.name)
        if base is None or base.for_tensor(dtype, shape) is None:
            return f"{self.name} does not encode {dtype} values (they would be stored exactly)"
        if self.family in MATRIX_FAMILIES and len(shape) < 2:
            return (
                f"{self.name} approximates matrices; {len(shape)}-D tensors are left out "
                "(stored exactly, as PowerSGD sends biases)"
            )
        return None

    def chain(self, chunk: np.ndarray, shape: tuple[int, ...]) -> list[Codec]:
        """The codecs it uses on ``chunk`` (1-D) of a tensor of ``shape``, first applied first."""
        dtype = dtype_name(chunk.dtype)
        codecs = []
        for part in self.parts:
            if part.family == "default":
                codecs.append(codec_for_chunk("default", chunk))
                continue
            codec = make_codec(part.name, dtype=dtype, shape=shape)
            if codec is None:  # pragma: no cover - only "default" makes none, handled above
                raise InvalidInputError(f"codec {printable(part.name)} has no codec object")
            codecs.append(codec)
        return codecs

    def bound(self, dtype: str, size: int) -> ErrorBound:
        """What it promises for ``size`` values of ``dtype`` (the lossy codec's bound)."""
        return error_bound(self.head.name, dtype=dtype, size=size)

    def code(self, chunk: np.ndarray, shape: tuple[int, ...]) -> Coded:
        """Encode ``chunk`` through the chain and decode it back, timing both."""
        codecs = self.chain(chunk, shape)
        # numcodecs' own codecs take buffers, and no bfloat16 one: an unsigned view
        # of the same width keeps the item size Blosc's shuffle works on.
        raw = self.head.family in ("zstd", "blosc") and chunk.dtype.kind in "fcV"
        values = chunk.view(f"<u{chunk.dtype.itemsize}") if raw else chunk
        start = time.perf_counter()
        frame = codecs[0].encode(values)
        data = frame
        for codec in codecs[1:]:
            data = codec.encode(data)
        encoded = _nbytes(data)
        middle = time.perf_counter()
        for codec in reversed(codecs):
            data = codec.decode(data)
        end = time.perf_counter()
        flat = ensure_contiguous_ndarray(data).reshape(-1)
        if flat.dtype != chunk.dtype:
            flat = flat.view(np.uint8).view(chunk.dtype)
        return Coded(codecs[0], bytes(frame), encoded, flat, middle - start, end - middle)


def _nbytes(data: object) -> int:
    return int(ensure_contiguous_ndarray(data).nbytes)


def parse_candidates(names: Sequence[str] | str | None) -> list[Candidate]:
    """The candidates named (a list, or one comma-separated string); the defaults for None.

    Duplicates are dropped, the first kept; an empty list is refused.

    >>> [c.name for c in parse_candidates("bf16, zstd,bf16")]
    ['bf16', 'zstd']
    """
    if names is None:
        names = DEFAULT_CANDIDATES
    items = names.split(",") if isinstance(names, str) else list(names)
    out: list[Candidate] = []
    for item in items:
        if not str(item).strip():
            continue
        candidate = Candidate.parse(item)
        if candidate.name not in [c.name for c in out]:
            out.append(candidate)
    if not out:
        raise InvalidInputError(f"no codecs to evaluate; name some of {', '.join(CODEC_NAMES)}")
    return out
