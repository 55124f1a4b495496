"""Lossy codec: float32 or float64 values rounded to bfloat16, nearest even.

Halves float32 (quarters float64). bfloat16 keeps float32's exponent range,
so only values within half a unit of its largest finite value overflow (to
infinity, counted in the frame); NaN stays NaN. The rounding is in
:mod:`gradpipe.codecs.ops.half_precision`.

Body: ``overflows u8`` then the bfloat16 words (``count × u2``).
"""

from __future__ import annotations

import struct
from typing import ClassVar, Final

import numpy as np

from gradpipe.codecs._lossy import LossyCodec
from gradpipe.codecs.ops.half_precision import bf16_bits, from_bf16_bits
from gradpipe.core.lossy import ErrorBound

__all__ = ["BF16Codec"]

_OVERFLOWS: Final = struct.Struct("<Q")


class BF16Codec(LossyCodec):
    """Round to bfloat16 (nearest even); decode widens back to ``dtype``.

    Parameters
    ----------
    dtype : str
        ``"float32"`` or ``"float64"``.

    Examples
    --------
    >>> import numpy as np
    >>> codec = BF16Codec()
    >>> codec.decode(codec.encode(np.float32([1.0, 3.14159, -1e-3]))).tolist()
    [1.0, 3.140625, -0.00099945068359375]
    """

    codec_id = "gradpipe_bf16"
    magic: ClassVar[bytes] = b"GPBF"
    dtypes: ClassVar[tuple[str, ...]] = ("float32", "float64")
    keeps_nonfinite: ClassVar[bool] = False

    @property
    def name(self) -> str:
        return "bf16"

    def error_bound(self, size: int | None = None) -> ErrorBound:
        """``|x̂ − x| ≤ 2^-8·|x|`` (normal values), ``2^-134`` (subnormals); overflow excepted."""
        return ErrorBound(
            "round to nearest even with an 8-bit significand: |x̂ − x| ≤ 2^-8·|x| for normal "
            "values, ≤ 2^-134 for subnormals; values beyond bfloat16's largest (3.39e38) "
            "become infinities (counted)",
            relative=2.0**-8,
            absolute=2.0**-134,
        )

    def _encode_body(self, values: np.ndarray) -> list[bytes]:
        bits = bf16_bits(values)
        overflows = int(np.count_nonzero(((bits & 0x7FFF) == 0x7F80) & np.isfinite(values)))
        return [_OVERFLOWS.pack(overflows), bits.astype("<u2").tobytes()]

    def _decode_body(self, body: memoryview, count: int) -> np.ndarray:
        self._check_size(body, _OVERFLOWS.size + 2 * count)
        bits = np.frombuffer(body[_OVERFLOWS.size :], dtype="<u2")
        return from_bf16_bits(bits, self._dtype)

    @staticmethod
    def overflows(frame: bytes) -> int:
        """How many finite values of the chunk became infinities."""
        start = 24  # after the common prefix: bf16 frames keep no values apart
        (found,) = _OVERFLOWS.unpack_from(frame, start)
        return int(found)
