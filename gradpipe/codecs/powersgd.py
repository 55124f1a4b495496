"""Lossy codec: PowerSGD's rank-R approximation of each chunk, viewed as a matrix.

A chunk of a tensor of shape ``(d0, d1, …)`` is viewed as PowerSGD views the
tensor: rows of ``columns = d1·d2·…`` values (gradpipe's chunks are whole
rows unless one row is larger than a chunk). A chunk that is not a whole
number of rows, a vector (``columns`` 0 or 1, or one row), and a matrix too
small for factors to be smaller (``R·(rows + cols) ≥ rows·cols``) are stored
exactly, as PowerSGD sends biases uncompressed. The math is in
:mod:`gradpipe.codecs.ops.lowrank`; the factors are kept as float32.

Body: ``rows u8, cols u8, rank u4, method u1 (0 exact, 1 factors), 3x``, then
the values as they are, or ``P`` (rows × r) and ``Q`` (cols × r) as float32.
"""

from __future__ import annotations

import math
import struct
from typing import Any, ClassVar, Final, Self

import numpy as np

from gradpipe.codecs._lossy import LossyCodec, parse_seed
from gradpipe.codecs.ops.lowrank import (
    low_rank_factors,
    low_rank_product,
    parse_rank,
    worth_factoring,
)
from gradpipe.core.lossy import ErrorBound
from gradpipe.errors import IntegrityError, InvalidInputError

__all__ = ["PowerSGDCodec"]

_HEAD: Final = struct.Struct("<QQIB3x")
_EXACT: Final = 0
_FACTORS: Final = 1
#: Allowance over ``‖x‖₂`` for the float32 rounding of the factors.
_ROUNDING: Final = 2.0**-16


class PowerSGDCodec(LossyCodec):
    """Rank-``rank`` approximation ``P·Qᵀ`` of each chunk's matrix view.

    Parameters
    ----------
    rank : int
        R, the rank of the approximation.
    dtype : str
        A float dtype.
    columns : int
        Values per row of the matrix view (the product of the tensor's
        dimensions after the first); 0 stores every chunk exactly.
    seed : int
        Seed of the random start of the power iteration.
    iterations : int
        Power iterations (PowerSGD does one per step, warm-started).

    Examples
    --------
    >>> import numpy as np
    >>> m = np.outer(np.arange(1, 9), np.arange(1, 17)).astype("float32")
    >>> codec = PowerSGDCodec(rank=1, columns=16)
    >>> bool(np.allclose(codec.decode(codec.encode(m)).reshape(8, 16), m, rtol=1e-5))
    True
    """

    codec_id = "gradpipe_powersgd"
    magic: ClassVar[bytes] = b"GPPS"

    def __init__(
        self,
        rank: int = 4,
        dtype: str = "float32",
        columns: int = 0,
        seed: int = 0,
        iterations: int = 1,
    ) -> None:
        super().__init__(dtype)
        self.rank = parse_rank(rank)
        if isinstance(columns, bool) or not isinstance(columns, int) or columns < 0:
            raise InvalidInputError(f"PowerSGD columns must be an integer >= 0, not {columns!r}")
        if isinstance(iterations, bool) or not isinstance(iterations, int) or iterations < 1:
            raise InvalidInputError(
                f"PowerSGD iterations must be an integer >= 1, not {iterations!r}"
            )
        self.columns = columns
        self.seed = parse_seed(seed)
        self.iterations = iterations

    @property
    def name(self) -> str:
        return f"powersgd-{self.rank}"

    def _options(self) -> dict[str, Any]:
        return {
            "rank": self.rank,
            "columns": self.columns,
            "seed": self.seed,
            "iterations": self.iterations,
        }

    def for_tensor(self, dtype: str, shape: tuple[int, ...]) -> Self | None:
        """The codec for a tensor: ``columns`` from its shape (0 for vectors)."""
        codec = super().for_tensor(dtype, shape)
        if codec is None:
            return None
        codec.columns = math.prod(shape[1:]) if len(shape) >= 2 else 0
        return codec

    def error_bound(self, size: int | None = None) -> ErrorBound:
        """``‖x̂ − x‖₂ ≤ ‖x‖₂``: a projection of the rows (up to float32 rounding)."""
        return ErrorBound(
            f"rank-{self.rank} P·Pᵀ·M, an orthogonal projection of the matrix's columns: "
            "‖x̂ − x‖₂ ≤ ‖x‖₂ (plus 2^-16 for the float32 factors); how close to the best "
            f"rank-{self.rank} error depends on the spectrum (measured); vectors are exact",
            l2=1 + _ROUNDING,
        )

    def _shape(self, count: int) -> tuple[int, int] | None:
        cols = self.columns
        if cols <= 1 or count % cols:
            return None
        rows = count // cols
        return (rows, cols) if worth_factoring(rows, cols, self.rank) else None

    def _encode_body(self, values: np.ndarray) -> list[bytes]:
        shape = self._shape(values.size)
        if shape is None:
            return [_HEAD.pack(values.size, 1, 0, _EXACT), values.tobytes()]
        rows, cols = shape
        matrix = values.astype(np.float64).reshape(rows, cols)
        p, q = low_rank_factors(matrix, self.rank, seed=self.seed, iterations=self.iterations)
        head = _HEAD.pack(rows, cols, p.shape[1], _FACTORS)
        return [head, p.astype("<f4").tobytes(), q.astype("<f4").tobytes()]

    def _decode_body(self, body: memoryview, count: int) -> np.ndarray:
        if body.nbytes < _HEAD.size:
            raise IntegrityError(f"{self.codec_id}: frame is truncated")
        rows, cols, rank, method = _HEAD.unpack_from(body)
        if method == _EXACT:
            self._check_size(body, _HEAD.size + count * self._dtype.itemsize)
            return np.frombuffer(body[_HEAD.size :], dtype=self._dtype)
        if method != _FACTORS or rows * cols != count or not 1 <= rank <= min(rows, cols):
            raise IntegrityError(f"{self.codec_id}: corrupt frame header")
        self._check_size(body, _HEAD.size + 4 * rank * (rows + cols))
        split = _HEAD.size + 4 * rank * rows
        p = np.frombuffer(body[_HEAD.size : split], dtype="<f4").reshape(rows, rank)
        q = np.frombuffer(body[split:], dtype="<f4").reshape(cols, rank)
        return low_rank_product(p, q).reshape(-1)
