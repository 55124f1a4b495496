"""What every lossy gradpipe codec shares: its frame, non-finite values, its bound.

A lossy codec is a numcodecs codec whose decode gives other values than were
encoded, within the bound its :meth:`LossyCodec.error_bound` states. Its
config names the element dtype; :meth:`LossyCodec.for_tensor` makes the copy
for one tensor (its dtype, and for PowerSGD its shape), or None where the
codec does not apply (integers and bools are stored exactly).

Frame layout (little-endian), common to all of them::

    magic      4s   one per codec (b"GPBF", b"GPF6", ...)
    version    u1   1
    (pad)      3x
    count      u8   number of elements
    nonfinite  u8   number of non-finite inputs kept apart (codecs that do math)
    indices    nonfinite × u8      their positions
    values     nonfinite × item    their original bytes
    body       the codec's own header and payload

Decoding must give the same bits on every machine: a lossy chunk's block id
is the hash of its *decoded* bytes (so it never equals the original's unless
the codec happened to be exact on it), and every read checks it. So decoders
use elementwise numpy and exact integer products, never a BLAS sum of floats.
"""

from __future__ import annotations

import struct
from abc import abstractmethod
from collections.abc import Sequence
from typing import Any, ClassVar, Final, Self

import numpy as np
from numcodecs.abc import Codec
from numcodecs.compat import ensure_contiguous_ndarray, ndarray_copy

from gradpipe.codecs.bytegroup import check_out_size
from gradpipe.core.dtypes import dtype_name, is_float, parse_dtype
from gradpipe.core.lossy import ErrorBound
from gradpipe.errors import IntegrityError, InvalidInputError

__all__ = ["LossyCodec", "bind_chain", "check_chain", "parse_seed"]

_PREFIX: Final = struct.Struct("<4sBxxxQQ")
_VERSION: Final = 1


def parse_seed(value: object) -> int:
    """A random seed: an integer from 0 to 2^63 − 1."""
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value < 2**63:
        raise InvalidInputError(f"seed must be an integer from 0 to 2**63 - 1, not {value!r}")
    return value


class LossyCodec(Codec):  # type: ignore[misc]  # numcodecs is untyped
    """Base of the lossy codecs (see the module docstring).

    Subclasses set ``codec_id``, ``magic``, ``dtypes`` and implement
    :meth:`_encode_body`, :meth:`_decode_body`, :meth:`error_bound` and
    :attr:`name`; those that keep non-finite values apart set
    ``keeps_nonfinite``.
    """

    codec_id: ClassVar[str]
    magic: ClassVar[bytes]
    #: Element dtypes the codec accepts.
    dtypes: ClassVar[tuple[str, ...]] = ("float16", "bfloat16", "float32", "float64")
    #: Lossy codecs say so (storage checks this attribute).
    lossy: ClassVar[bool] = True
    #: Whether non-finite inputs are kept apart, exactly, before the codec's math.
    keeps_nonfinite: ClassVar[bool] = True

    def __init__(self, dtype: str = "float32") -> None:
        self._dtype = parse_dtype(dtype)
        self.dtype = dtype_name(self._dtype)
        if self.dtype not in self.dtypes:
            raise InvalidInputError(
                f"{self.codec_id} encodes {', '.join(self.dtypes)} values, not {self.dtype}"
            )

    # --- what subclasses provide --------------------------------------------------
    @property
    @abstractmethod
    def name(self) -> str:
        """The codec's name in the registry (``"bf16"``, ``"topk-0.1"``...)."""

    @abstractmethod
    def error_bound(self, size: int | None = None) -> ErrorBound:
        """What the codec promises for a chunk of ``size`` values (some bounds depend on it)."""

    @abstractmethod
    def _encode_body(self, values: np.ndarray) -> list[bytes]:
        """The body of a frame for 1-D finite values of ``dtype``."""

    @abstractmethod
    def _decode_body(self, body: memoryview, count: int) -> np.ndarray:
        """``count`` decoded values (any float dtype; cast to ``dtype`` by the caller)."""

    def _options(self) -> dict[str, Any]:
        """The config entries after ``id`` and ``dtype``."""
        return {}

    # --- shared -------------------------------------------------------------------
    def for_tensor(self, dtype: str, shape: tuple[int, ...]) -> Self | None:
        """This codec configured for a tensor of ``dtype`` and ``shape``; None if it does not apply.

        Integer and bool tensors, and float dtypes the codec does not take, are
        stored exactly by the caller.
        """
        if dtype not in self.dtypes or not is_float(parse_dtype(dtype)):
            return None
        return type(self)(**{**self._options(), "dtype": dtype})

    def get_config(self) -> dict[str, Any]:
        return {"id": self.codec_id, "dtype": self.dtype, **self._options()}

    def __repr__(self) -> str:
        args = ", ".join(f"{k}={v!r}" for k, v in {"dtype": self.dtype, **self._options()}.items())
        return f"{type(self).__name__}({args})"

    def _values(self, buf: object) -> np.ndarray:
        data = ensure_contiguous_ndarray(buf).reshape(-1).view(np.uint8)
        if data.size % self._dtype.itemsize:
            raise InvalidInputError(
                f"{self.codec_id}: {data.size} bytes is not a whole number of {self.dtype} "
                f"elements ({self._dtype.itemsize} bytes each)"
            )
        values: np.ndarray = data.view(self._dtype)
        return values

    def encode(self, buf: object) -> bytes:
        """Encode a buffer of little-endian ``dtype`` elements into a frame."""
        values = self._values(buf)
        nonfinite = np.empty(0, dtype=np.int64)
        if self.keeps_nonfinite:
            mask = ~np.isfinite(values)
            if mask.any():
                nonfinite = np.flatnonzero(mask)
                values = values.copy()
                values[mask] = 0
        prefix = _PREFIX.pack(self.magic, _VERSION, values.size, nonfinite.size)
        kept = self._values(buf)[nonfinite].tobytes()
        body = self._encode_body(values)
        return b"".join([prefix, nonfinite.astype("<u8").tobytes(), kept, *body])

    def decode(self, buf: object, out: object = None) -> np.ndarray:
        """Decode a frame made by :meth:`encode`; ``out`` receives the values if given."""
        frame = memoryview(ensure_contiguous_ndarray(buf).reshape(-1).view(np.uint8))
        count, indices, kept, body = self._split(frame)
        check_out_size(out, count * self._dtype.itemsize, self.codec_id)
        values = np.asarray(self._decode_body(body, count))
        if values.shape != (count,):
            raise IntegrityError(
                f"{self.codec_id}: frame decodes to {values.size} of {count} values"
            )
        result = values.astype(self._dtype)
        if indices.size:
            result[indices] = kept
        decoded: np.ndarray = ndarray_copy(result, out)
        return decoded

    def _split(self, frame: memoryview) -> tuple[int, np.ndarray, np.ndarray, memoryview]:
        if frame.nbytes < _PREFIX.size:
            raise IntegrityError(f"{self.codec_id}: frame of {frame.nbytes} bytes is truncated")
        magic, version, count, nonfinite = _PREFIX.unpack_from(frame)
        if magic != self.magic:
            raise IntegrityError(f"{self.codec_id}: not a {self.codec_id} frame (magic {magic!r})")
        if version != _VERSION:
            raise IntegrityError(
                f"{self.codec_id}: frame version {version} is not supported (this gradpipe "
                f"reads version {_VERSION}); upgrade gradpipe"
            )
        item = self._dtype.itemsize
        start = _PREFIX.size
        end = start + nonfinite * (8 + item)
        if nonfinite > count or end > frame.nbytes:
            raise IntegrityError(f"{self.codec_id}: frame of {frame.nbytes} bytes is truncated")
        indices = np.frombuffer(frame[start : start + 8 * nonfinite], dtype="<u8")
        if indices.size and int(indices.max()) >= count:
            raise IntegrityError(f"{self.codec_id}: non-finite positions fall outside the chunk")
        kept = np.frombuffer(frame[start + 8 * nonfinite : end], dtype=self._dtype)
        return count, indices.astype(np.int64), kept, frame[end:]

    def _check_size(self, body: memoryview, expected: int) -> None:
        if body.nbytes != expected:
            raise IntegrityError(
                f"{self.codec_id}: frame body is {body.nbytes} bytes, its header says {expected}"
            )


def check_chain(codecs: Sequence[Codec] | None) -> bool:
    """Whether a codec chain is lossy; raises if its lossy codec is not alone and first."""
    lossy = [i for i, c in enumerate(codecs or ()) if getattr(c, "lossy", False)]
    if lossy and lossy != [0]:
        names = ", ".join(c.codec_id for c in codecs or ())
        raise InvalidInputError(
            f"codec chain [{names}]: a lossy codec must come first, and only one; "
            "for example 'bf16+zstd'"
        )
    return bool(lossy)


def bind_chain(
    codecs: Sequence[Codec] | None, dtype: str, shape: tuple[int, ...]
) -> tuple[list[Codec] | None, LossyCodec | None]:
    """A codec chain for one tensor, and its lossy codec if it has one that applies.

    A lossy codec must come first (it takes values; what follows it takes its
    frame) and alone. It is configured for the tensor's dtype and shape
    (:meth:`LossyCodec.for_tensor`); on a tensor it does not apply to
    (integers, bools) it is left out, and the rest of the chain, or the
    lossless policy if nothing is left, stores the tensor exactly.

    >>> from gradpipe.codecs.topk import TopKCodec
    >>> bind_chain([TopKCodec(0.1)], "float64", (10,))
    ([TopKCodec(dtype='float64', fraction=0.1)], TopKCodec(dtype='float64', fraction=0.1))
    >>> bind_chain([TopKCodec(0.1)], "int64", (10,))
    (None, None)
    """
    if codecs is None:
        return None, None
    chain = list(codecs)
    if not check_chain(chain):
        return chain, None
    bound = chain[0].for_tensor(dtype, shape)
    if bound is None:
        return (chain[1:] or None), None
    return [bound, *chain[1:]], bound
