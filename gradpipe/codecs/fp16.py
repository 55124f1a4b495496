"""Lossy codec: float32 or float64 values rounded to float16, nearest even.

Halves float32. float16's range ends at 65504: a value of magnitude 65520 or
more becomes an infinity, and the frame counts how many did
(:meth:`FP16Codec.overflows`), because gradients scaled for mixed precision do
overflow there (that is what a loss scaler watches for). NaN stays NaN.

Body: ``overflows u8`` then the float16 values (``count × f2``).
"""

from __future__ import annotations

import struct
from typing import ClassVar, Final

import numpy as np

from gradpipe.codecs._lossy import LossyCodec
from gradpipe.codecs.ops.half_precision import to_fp16
from gradpipe.core.lossy import ErrorBound

__all__ = ["FP16Codec"]

_OVERFLOWS: Final = struct.Struct("<Q")


class FP16Codec(LossyCodec):
    """Round to float16 (nearest even); decode widens back to ``dtype``.

    Parameters
    ----------
    dtype : str
        ``"float32"`` or ``"float64"``.

    Examples
    --------
    >>> import numpy as np
    >>> codec = FP16Codec()
    >>> frame = codec.encode(np.float32([1.0, 1e5, 0.1]))
    >>> codec.decode(frame).tolist(), FP16Codec.overflows(frame)
    ([1.0, inf, 0.0999755859375], 1)
    """

    codec_id = "gradpipe_fp16"
    magic: ClassVar[bytes] = b"GPF6"
    dtypes: ClassVar[tuple[str, ...]] = ("float32", "float64")
    keeps_nonfinite: ClassVar[bool] = False

    @property
    def name(self) -> str:
        return "fp16"

    def error_bound(self, size: int | None = None) -> ErrorBound:
        """``|x̂ − x| ≤ 2^-11·|x|`` (normal range), ``2^-25`` (subnormals); overflow excepted."""
        return ErrorBound(
            "round to nearest even with an 11-bit significand: |x̂ − x| ≤ 2^-11·|x| for "
            "|x| ≥ 2^-14, ≤ 2^-25 below; |x| ≥ 65520 becomes an infinity (counted)",
            relative=2.0**-11,
            absolute=2.0**-25,
        )

    def _encode_body(self, values: np.ndarray) -> list[bytes]:
        half, overflows = to_fp16(values)
        return [_OVERFLOWS.pack(overflows), half.astype("<f2").tobytes()]

    def _decode_body(self, body: memoryview, count: int) -> np.ndarray:
        self._check_size(body, _OVERFLOWS.size + 2 * count)
        return np.frombuffer(body[_OVERFLOWS.size :], dtype="<f2")

    @staticmethod
    def overflows(frame: bytes) -> int:
        """How many finite values of the chunk became infinities."""
        (found,) = _OVERFLOWS.unpack_from(frame, 24)
        return int(found)
