"""Lossy codec: numcodecs' BitRound, keeping ``K`` mantissa bits, for gradpipe's stores.

The rounding is numcodecs' own (:class:`numcodecs.BitRound`, Klöwer et al.
2021): round to nearest, ties to even, on the integer view of the floats.
This codec adds what a store needs around it: the dtype in the config, a
frame, and NaNs kept as they were (BitRound carries a NaN whose payload lies in
the dropped bits into an infinity, or, with ``K = 0``, into ``-0.0``).

The output has the input's width; its trailing zero bits are what a lossless
codec after it (``bitround-K+zstd``) compresses.
"""

from __future__ import annotations

from typing import Any, ClassVar

import numpy as np
from numcodecs import BitRound

from gradpipe.codecs._lossy import LossyCodec
from gradpipe.core.lossy import ErrorBound
from gradpipe.errors import InvalidInputError

__all__ = ["BitRoundCodec"]

_MANTISSA = {"float16": 10, "float32": 23, "float64": 52}
_MIN_EXPONENT = {"float16": -14, "float32": -126, "float64": -1022}


class BitRoundCodec(LossyCodec):
    """Keep ``keepbits`` of the mantissa bits, rounding to nearest even.

    Parameters
    ----------
    keepbits : int
        Mantissa bits kept: 0 to 10 (float16), 23 (float32) or 52 (float64).
    dtype : str
        ``"float16"``, ``"float32"`` or ``"float64"``.

    Examples
    --------
    >>> import numpy as np
    >>> codec = BitRoundCodec(keepbits=3)
    >>> codec.decode(codec.encode(np.float32([1.0, 1.2, -3.3]))).tolist()
    [1.0, 1.25, -3.25]
    """

    codec_id = "gradpipe_bitround"
    magic: ClassVar[bytes] = b"GPBR"
    dtypes: ClassVar[tuple[str, ...]] = ("float16", "float32", "float64")
    keeps_nonfinite: ClassVar[bool] = False

    def __init__(self, keepbits: int = 7, dtype: str = "float32") -> None:
        super().__init__(dtype)
        most = _MANTISSA[self.dtype]
        if isinstance(keepbits, bool) or not isinstance(keepbits, int) or not 0 <= keepbits <= most:
            raise InvalidInputError(
                f"bitround keeps 0 to {most} mantissa bits of {self.dtype}, not {keepbits!r}"
            )
        self.keepbits = keepbits
        self._rounder = BitRound(keepbits)

    @property
    def name(self) -> str:
        return f"bitround-{self.keepbits}"

    def _options(self) -> dict[str, Any]:
        return {"keepbits": self.keepbits}

    def error_bound(self, size: int | None = None) -> ErrorBound:
        """``|x̂ − x| ≤ 2^-(K+1)·|x|`` (normal values), half a kept step for subnormals."""
        k = self.keepbits
        if k == _MANTISSA[self.dtype]:
            return ErrorBound(f"keeps all {k} mantissa bits: bit-exact", exact=True)
        absolute = 2.0 ** (_MIN_EXPONENT[self.dtype] - k - 1)
        return ErrorBound(
            f"round to nearest even keeping {k} mantissa bits: |x̂ − x| ≤ 2^-{k + 1}·|x| for "
            f"normal values, ≤ 2^{_MIN_EXPONENT[self.dtype] - k - 1} for subnormals; the "
            "largest values may round up to infinity",
            relative=2.0 ** -(k + 1),
            absolute=absolute,
        )

    def _encode_body(self, values: np.ndarray) -> list[bytes]:
        native = values.astype(values.dtype.newbyteorder("="), copy=False)
        rounded = np.asarray(self._rounder.encode(native)).view(native.dtype)
        nan = np.isnan(native)
        if nan.any():
            rounded = np.where(nan, native, rounded)
        return [rounded.astype(self._dtype).tobytes()]

    def _decode_body(self, body: memoryview, count: int) -> np.ndarray:
        self._check_size(body, count * self._dtype.itemsize)
        return np.frombuffer(body, dtype=self._dtype)
