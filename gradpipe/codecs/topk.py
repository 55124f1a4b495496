"""Lossy codec: top-k sparsification, keeping the fraction ``F`` of largest magnitude.

Per chunk of ``n`` values it keeps ``k = ⌈F·n⌉`` values exactly (in their
dtype) and their positions, as a bitmap or a list of indices, whichever is
smaller (a bitmap costs ``n/8`` bytes, indices ``4k``: the bitmap wins above
F = 1/32). Decoding puts them back among zeros. The bound, and why it needs
``k`` rounded up, is in :mod:`gradpipe.codecs.ops.sparsify`; so is the error-feedback
step an evaluator runs across training steps.

Body: ``k u8, method u1 (0 indices, 1 bitmap), 7x``, the positions (``k × u4``
or ``⌈n/8⌉`` bitmap bytes), then the ``k`` values.
"""

from __future__ import annotations

import struct
from typing import Any, ClassVar, Final

import numpy as np

from gradpipe.codecs._lossy import LossyCodec
from gradpipe.codecs.ops.sparsify import parse_fraction, topk_bound, topk_count, topk_indices
from gradpipe.core.lossy import ErrorBound
from gradpipe.errors import IntegrityError

__all__ = ["TopKCodec"]

_HEAD: Final = struct.Struct("<QB7x")
_INDICES: Final = 0
_BITMAP: Final = 1


class TopKCodec(LossyCodec):
    """Keep the ``fraction`` of values of largest magnitude, zero the rest.

    Parameters
    ----------
    fraction : float
        F in (0, 1]: ``⌈F·n⌉`` values of each chunk of ``n`` are kept.
    dtype : str
        A float dtype.

    Examples
    --------
    >>> import numpy as np
    >>> codec = TopKCodec(fraction=0.5)
    >>> codec.decode(codec.encode(np.float32([0.1, -3.0, 2.0, 0.5]))).tolist()
    [0.0, -3.0, 2.0, 0.0]
    """

    codec_id = "gradpipe_topk"
    magic: ClassVar[bytes] = b"GPTK"

    def __init__(self, fraction: float = 0.01, dtype: str = "float32") -> None:
        super().__init__(dtype)
        self.fraction = parse_fraction(fraction)

    @property
    def name(self) -> str:
        return f"topk-{self.fraction:g}"

    def _options(self) -> dict[str, Any]:
        return {"fraction": self.fraction}

    def error_bound(self, size: int | None = None) -> ErrorBound:
        """``‖x̂ − x‖₂ ≤ sqrt(1 − k/n)·‖x‖₂ ≤ sqrt(1 − F)·‖x‖₂``, kept values exact."""
        bound = topk_bound(size, self.fraction) if size else (1 - self.fraction) ** 0.5
        return ErrorBound(
            f"keeps k = ⌈{self.fraction:g}·n⌉ values exactly and drops the n − k smallest, "
            "whose squares sum to at most (n − k)/n of the total: ‖x̂ − x‖₂ ≤ "
            f"sqrt(1 − k/n)·‖x‖₂ ≤ sqrt(1 − {self.fraction:g})·‖x‖₂ (against the vector "
            "encoded: with error feedback, the gradient plus its residual)",
            l2=bound,
        )

    def _encode_body(self, values: np.ndarray) -> list[bytes]:
        n = values.size
        keep = topk_indices(values.astype(np.float64), topk_count(n, self.fraction))
        k = keep.size
        if -(-n // 8) < 4 * k:
            mask = np.zeros(n, dtype=bool)
            mask[keep] = True
            where = np.packbits(mask, bitorder="little").tobytes()
            method = _BITMAP
        else:
            where = keep.astype("<u4").tobytes()
            method = _INDICES
        return [_HEAD.pack(k, method), where, values[keep].tobytes()]

    def _decode_body(self, body: memoryview, count: int) -> np.ndarray:
        if body.nbytes < _HEAD.size:
            raise IntegrityError(f"{self.codec_id}: frame is truncated")
        k, method = _HEAD.unpack_from(body)
        item = self._dtype.itemsize
        where_bytes = -(-count // 8) if method == _BITMAP else 4 * k
        if k > count or method not in (_INDICES, _BITMAP):
            raise IntegrityError(f"{self.codec_id}: corrupt frame header")
        self._check_size(body, _HEAD.size + where_bytes + k * item)
        where = body[_HEAD.size : _HEAD.size + where_bytes]
        if method == _BITMAP:
            bits = np.unpackbits(np.frombuffer(where, np.uint8), count=count, bitorder="little")
            positions = np.flatnonzero(bits)
        else:
            positions = np.frombuffer(where, dtype="<u4").astype(np.int64)
        if positions.size != k or (k and int(positions.max()) >= count):
            raise IntegrityError(f"{self.codec_id}: kept positions do not match the frame")
        out = np.zeros(count, dtype=self._dtype)
        out[positions] = np.frombuffer(body[_HEAD.size + where_bytes :], dtype=self._dtype)
        return out
