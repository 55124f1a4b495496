"""Delta codecs: a chunk encoded against the same chunk of its parent version.

A delta codec is a numcodecs codec whose config names the kind of delta
(``{"id": "gradpipe_delta", "kind": "int", "dtype": "float32"}``) and whose
instance is bound to the parent chunk (its *base*) before use: the base is
data, not configuration, so it never enters the config. ``encode(target)``
gives the delta's logical bytes and ``decode(delta, out=)`` the target back.
The delta bytes are stored as an ordinary block (named by the hash of the delta
bytes and compressed by the lossless policy like any chunk), so every store
integrity check applies to them unchanged; see docs/design/008.

Kinds (the math is in :mod:`gradpipe.codecs.ops.delta`):

- ``int``: wrapping difference of the bit patterns, bit-exact for every dtype.
  The default: measured ~10% smaller than XOR on parameters (design note 008).
- ``xor``: XOR of the bit patterns, bit-exact for every dtype.
- ``sparse``: the Rust prototype's index + value delta where ``|target - base| >
  threshold``, in float64; lossy when values are dropped or round, so a chain
  using it records that and its largest error. Never the default.
"""

from __future__ import annotations

import struct
from typing import Any, ClassVar, Final

import numpy as np
from numcodecs.abc import Codec

from gradpipe.codecs.ops.delta import (
    SparseDelta,
    apply_int_delta,
    apply_sparse_delta,
    apply_xor_delta,
    int_delta,
    sparse_delta,
    xor_delta,
)
from gradpipe.core.buffers import byte_view
from gradpipe.core.display import printable
from gradpipe.core.dtypes import dtype_name, is_float, parse_dtype
from gradpipe.errors import IntegrityError, InvalidInputError

__all__ = ["DELTA_KINDS", "LOSSLESS_DELTA_KINDS", "DeltaCodec", "parse_delta_kind"]

#: Every delta kind, the default first.
DELTA_KINDS: Final = ("int", "xor", "sparse")
#: Kinds that always give the target back bit-exactly.
LOSSLESS_DELTA_KINDS: Final = ("int", "xor")

_SPARSE_HEADER: Final = struct.Struct("<4sQ")
_SPARSE_MAGIC: Final = b"GPSD"


def parse_delta_kind(kind: object) -> str:
    """``kind`` if it is a delta kind, else :class:`InvalidInputError` listing them."""
    if kind not in DELTA_KINDS:
        raise InvalidInputError(
            f"delta kind must be one of {', '.join(DELTA_KINDS)} (int is the lossless default), "
            f"not {printable(kind)}"
        )
    return str(kind)


class DeltaCodec(Codec):  # type: ignore[misc]
    """Encode a chunk as its delta against a base chunk (see the module docstring).

    Parameters
    ----------
    kind : str
        ``"int"``, ``"xor"`` or ``"sparse"``.
    dtype : str
        The chunks' dtype (a gradpipe dtype name).
    threshold : float
        For ``sparse`` only: changes of at most this size are dropped.

    Examples
    --------
    >>> import numpy as np
    >>> base = np.arange(8, dtype="float32")
    >>> target = base + np.float32(0.5)
    >>> codec = DeltaCodec("int", "float32").bind(base)
    >>> codec.decode(codec.encode(target)).tobytes() == target.tobytes()
    True
    """

    codec_id: ClassVar[str] = "gradpipe_delta"

    def __init__(self, kind: str = "int", dtype: str = "float32", threshold: float = 0.0) -> None:
        self.kind = parse_delta_kind(kind)
        self._dtype = parse_dtype(dtype)
        self.dtype = dtype_name(self._dtype)
        if not float(threshold) >= 0:
            raise InvalidInputError(f"sparse delta threshold must be >= 0, not {threshold!r}")
        if kind != "sparse" and threshold:
            raise InvalidInputError(
                f"a threshold applies to the sparse delta only, not {printable(kind)}"
            )
        if kind == "sparse" and not is_float(self._dtype):
            raise InvalidInputError(f"the sparse delta is for float tensors, not {self.dtype}")
        self.threshold = float(threshold)
        self._base: np.ndarray | None = None
        #: After encoding with ``sparse``: whether it was exact, and its largest error.
        self.exact = True
        self.max_abs_error = 0.0

    @property
    def lossless(self) -> bool:
        """Whether decoding always gives the target back bit-exactly."""
        return self.kind in LOSSLESS_DELTA_KINDS

    def bind(self, base: np.ndarray) -> DeltaCodec:
        """A copy of this codec bound to ``base`` (the parent chunk, as 1-D ``dtype``)."""
        flat = np.ascontiguousarray(base).reshape(-1)
        if flat.dtype != self._dtype:
            flat = flat.view(self._dtype)
        bound = DeltaCodec(self.kind, self.dtype, self.threshold)
        bound._base = flat
        return bound

    def _bound_base(self) -> np.ndarray:
        if self._base is None:
            raise InvalidInputError(
                "a delta codec needs its base chunk: call bind(base) before encode or decode"
            )
        return self._base

    def encode(self, buf: object) -> np.ndarray:
        """The delta of ``buf`` (the target chunk) against the bound base."""
        base = self._bound_base()
        target = byte_view(buf).view(self._dtype)
        if self.kind == "int":
            return int_delta(target, base)
        if self.kind == "xor":
            return xor_delta(target, base)
        found = sparse_delta(target, base, threshold=self.threshold)
        self.exact, self.max_abs_error = found.exact, found.max_abs_error
        header = _SPARSE_HEADER.pack(_SPARSE_MAGIC, found.indices.size)
        body = [header, found.indices.astype("<i8").tobytes(), found.values.astype("<f8").tobytes()]
        return np.frombuffer(b"".join(body), dtype=np.uint8)

    def decode(self, buf: object, out: object = None) -> np.ndarray:
        """The target back from a delta made by :meth:`encode` against the same base."""
        base = self._bound_base()
        data = byte_view(buf)
        if self.kind == "sparse":
            result = apply_sparse_delta(_parse_sparse(data, base.size), base)
            if out is None:
                return result
            target = _out_bytes(out, result.nbytes, self.codec_id)
            target[:] = result.view(np.uint8)
            return np.asarray(out)
        if data.nbytes != base.nbytes:
            raise IntegrityError(
                f"{self.codec_id}: delta of {data.nbytes} bytes against a base of "
                f"{base.nbytes} bytes"
            )
        word = np.dtype(f"<u{base.dtype.itemsize}")
        words = data.view(word)
        if out is None:
            apply = apply_int_delta if self.kind == "int" else apply_xor_delta
            return apply(words, base)
        # Straight into ``out`` (which may be the base itself: ufuncs read each
        # element before writing it), without a temporary the size of the chunk.
        target = _out_bytes(out, base.nbytes, self.codec_id).view(word)
        ufunc = np.add if self.kind == "int" else np.bitwise_xor
        ufunc(base.view(word), words, out=target)
        return np.asarray(out)

    def get_config(self) -> dict[str, Any]:
        config: dict[str, Any] = {"id": self.codec_id, "kind": self.kind, "dtype": self.dtype}
        if self.kind == "sparse":
            config["threshold"] = self.threshold
        return config

    def __repr__(self) -> str:
        extra = f", threshold={self.threshold!r}" if self.kind == "sparse" else ""
        return f"DeltaCodec(kind={self.kind!r}, dtype={self.dtype!r}{extra})"


def _out_bytes(out: object, nbytes: int, codec_id: str) -> np.ndarray:
    target: np.ndarray = byte_view(out)
    if target.nbytes != nbytes:
        raise InvalidInputError(
            f"{codec_id}: out holds {target.nbytes} bytes, the chunk is {nbytes}"
        )
    return target


def _parse_sparse(data: np.ndarray, size: int) -> SparseDelta:
    """The indices and values of a stored sparse delta, checked against the chunk size."""
    if data.nbytes < _SPARSE_HEADER.size:
        raise IntegrityError(f"sparse delta of {data.nbytes} bytes is truncated")
    magic, count = _SPARSE_HEADER.unpack_from(data.tobytes()[: _SPARSE_HEADER.size])
    if magic != _SPARSE_MAGIC or count > size:
        raise IntegrityError("sparse delta has a damaged header")
    start = _SPARSE_HEADER.size
    if data.nbytes != start + 16 * count:
        raise IntegrityError(f"sparse delta of {data.nbytes} bytes does not hold {count} changes")
    indices = data[start : start + 8 * count].view("<i8")
    values = data[start + 8 * count :].view("<f8")
    if count and (indices.min() < 0 or indices.max() >= size):
        raise IntegrityError(f"sparse delta indices fall outside a chunk of {size} elements")
    return SparseDelta(indices, values, 0.0, False, 0.0)
