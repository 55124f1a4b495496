"""Lossy codec: the Rust prototype's sparse random projection plus ternary quantisation.

**Not a reconstructing codec.** A random projection to ``k < n`` dimensions
cannot give the vector back; :meth:`ProjectionCodec.decode` returns the
transpose estimate ``Aᵀ·ŷ`` (the Rust prototype's ``decompress_ternary``), unbiased
before quantisation but with a relative L2 error near ``sqrt(n/k)``. What the
sketch keeps is norms and inner products: the frame stores the sketch's exact
norm ``‖Ax‖₂`` (:meth:`ProjectionCodec.norm`, within the Johnson–Lindenstrauss
bound of ``‖x‖₂``), and :meth:`ProjectionCodec.inner` estimates ``⟨a, b⟩``
from two frames. The projection, its segments and the bound are in
:mod:`gradpipe.codecs.ops.projection`.

Body: ``ratio f8, seed u8, segment u8, k u4, 4x, scale f8, norm f8``, then the
ternary codes, four per byte (``t + 1`` in two bits, first code lowest).
"""

from __future__ import annotations

import math
import struct
from typing import Any, ClassVar, Final

import numpy as np

from gradpipe.codecs._lossy import LossyCodec, parse_seed
from gradpipe.codecs.ops.projection import (
    jl_epsilon,
    project,
    quantize_ternary,
    segment_layout,
    transpose_project,
)
from gradpipe.codecs.ops.sparsify import parse_fraction
from gradpipe.core.lossy import ErrorBound
from gradpipe.errors import IntegrityError, InvalidInputError

__all__ = ["DEFAULT_SEGMENT", "ProjectionCodec", "pack_ternary", "unpack_ternary"]

#: Values per projected segment: k = 410 rows at ratio 0.1, an ε of 0.34 for
#: the norm of a 1 Mi-value chunk at 95% (with 64 rows, 1024 would give none).
DEFAULT_SEGMENT: Final = 4096
#: Probability that the stated Johnson–Lindenstrauss bound fails.
JL_DELTA: Final = 0.05
_HEAD: Final = struct.Struct("<dQQI4xdd")


def pack_ternary(t: np.ndarray) -> bytes:
    """Ternary codes (-1, 0, 1) as two bits each, four per byte."""
    codes = (np.asarray(t, dtype=np.int8).reshape(-1) + 1).astype(np.uint8)
    padded = np.zeros(-(-codes.size // 4) * 4, dtype=np.uint8)
    padded[: codes.size] = codes
    quads = padded.reshape(-1, 4)
    packed = quads[:, 0] | (quads[:, 1] << 2) | (quads[:, 2] << 4) | (quads[:, 3] << 6)
    return packed.astype(np.uint8).tobytes()


def unpack_ternary(data: bytes | memoryview, count: int) -> np.ndarray:
    """Inverse of :func:`pack_ternary` (int8); raises on a code that is not ternary."""
    packed = np.frombuffer(data, dtype=np.uint8)
    quads = np.stack([(packed >> s) & 3 for s in (0, 2, 4, 6)], axis=1).reshape(-1)[:count]
    if np.any(quads == 3):
        raise IntegrityError("gradpipe_projection: a packed code is not ternary")
    return quads.astype(np.int8) - 1


class ProjectionCodec(LossyCodec):
    """Sparse random projection to ``ratio`` of the dimension, then ternary codes.

    Parameters
    ----------
    ratio : float
        The Rust prototype's ratio in (0, 1]: each segment of L values is projected to
        ``max(⌈L·ratio⌉, 64)`` values.
    dtype : str
        A float dtype.
    seed : int
        Seed of the projection matrix (the Rust prototype's default, 42).
    segment : int
        L, values per projected segment.

    Examples
    --------
    >>> import numpy as np
    >>> x = np.random.default_rng(0).standard_normal(4096).astype("float32")
    >>> codec = ProjectionCodec(ratio=0.1)
    >>> frame = codec.encode(x)
    >>> len(frame) < x.nbytes // 50, bool(abs(codec.norm(frame) / np.linalg.norm(x) - 1) < 0.2)
    (True, True)
    """

    codec_id = "gradpipe_projection"
    magic: ClassVar[bytes] = b"GPRP"

    def __init__(
        self,
        ratio: float = 0.1,
        dtype: str = "float32",
        seed: int = 42,
        segment: int = DEFAULT_SEGMENT,
    ) -> None:
        super().__init__(dtype)
        self.ratio = parse_fraction(ratio, what="projection ratio")
        self.seed = parse_seed(seed)
        if isinstance(segment, bool) or not isinstance(segment, int) or segment < 1:
            raise InvalidInputError(f"projection segment must be an integer >= 1, not {segment!r}")
        self.segment = segment

    @property
    def name(self) -> str:
        return f"projection-{self.ratio:g}"

    def _options(self) -> dict[str, Any]:
        return {"ratio": self.ratio, "seed": self.seed, "segment": self.segment}

    def sketch_size(self, size: int) -> int:
        """Ternary codes stored for a chunk of ``size`` values (k per segment, all segments)."""
        _, k, m = segment_layout(size, self.ratio, self.segment)
        return k * m

    def error_bound(self, size: int | None = None) -> ErrorBound:
        """No bound on values (decode is an estimate); the JL bound on the stored norm."""
        length, k, m = segment_layout(size or self.segment, self.ratio, self.segment)
        epsilon = jl_epsilon(k, points=m, delta=JL_DELTA)
        return ErrorBound(
            f"a random projection does not reconstruct: decode is the transpose estimate "
            f"Aᵀŷ, unbounded per value. The stored sketch norm ‖Ax‖₂ keeps ‖x‖₂²  within "
            f"1 ± {epsilon:.3g} with probability ≥ {1 - JL_DELTA:g} (Johnson–Lindenstrauss, "
            f"k = {k} per segment of {length}, {m} segment(s))",
            reconstructs=False,
            norm_epsilon=epsilon,
            norm_delta=JL_DELTA,
        )

    def _encode_body(self, values: np.ndarray) -> list[bytes]:
        sketch = project(values, self.ratio, seed=self.seed, segment=self.segment)
        _, k, _ = segment_layout(values.size, self.ratio, self.segment)
        t, scale = quantize_ternary(sketch)
        norm = math.sqrt(float(np.einsum("ij,ij->", sketch, sketch)))
        head = _HEAD.pack(self.ratio, self.seed, self.segment, k, scale, norm)
        return [head, pack_ternary(t)]

    def _parse(self, body: memoryview, count: int) -> tuple[np.ndarray, float, float]:
        if body.nbytes < _HEAD.size:
            raise IntegrityError(f"{self.codec_id}: frame is truncated")
        ratio, seed, segment, k, scale, norm = _HEAD.unpack_from(body)
        if (ratio, seed, segment) != (self.ratio, self.seed, self.segment):
            raise IntegrityError(
                f"{self.codec_id}: frame was made with ratio {ratio}, seed {seed}, segment "
                f"{segment}; the codec has {self.ratio}, {self.seed}, {self.segment}"
            )
        codes = self.sketch_size(count)
        if k != segment_layout(count, ratio, segment)[1]:
            raise IntegrityError(f"{self.codec_id}: corrupt frame header")
        self._check_size(body, _HEAD.size + -(-codes // 4))
        return unpack_ternary(body[_HEAD.size :], codes), scale, norm

    def _decode_body(self, body: memoryview, count: int) -> np.ndarray:
        t, scale, _ = self._parse(body, count)
        return transpose_project(t, scale, count, self.ratio, seed=self.seed, segment=self.segment)

    def _frame_body(self, frame: bytes | memoryview) -> tuple[np.ndarray, float, float]:
        view = memoryview(frame).cast("B")
        count, indices, _, body = self._split(view)
        if indices.size:
            raise InvalidInputError(
                f"{self.codec_id}: the chunk held non-finite values, its sketch has no norm"
            )
        return self._parse(body, count)

    def sketch(self, frame: bytes | memoryview) -> np.ndarray:
        """The dequantised sketch ``scale·t`` of a frame (float64, the prototype's ``data``)."""
        t, scale, _ = self._frame_body(frame)
        return t.astype(np.float64) * scale

    def norm(self, frame: bytes | memoryview) -> float:
        """``‖Ax‖₂``: the estimate of ``‖x‖₂`` the Johnson–Lindenstrauss bound covers."""
        return self._frame_body(frame)[2]

    def inner(self, a: bytes | memoryview, b: bytes | memoryview) -> float:
        """Estimate of ``⟨x_a, x_b⟩`` from two frames of equally long chunks.

        The cosine of the two ternary sketches times the two stored norms:
        the norms are within the JL bound, the cosine adds the ternary
        quantisation's error on top of the projection's (measured, not bounded).
        """
        ta, _, na = self._frame_body(a)
        tb, _, nb = self._frame_body(b)
        if ta.size != tb.size:
            raise InvalidInputError(
                f"{self.codec_id}: inner product of sketches of {ta.size} and {tb.size} codes"
            )
        ua, ub = ta.astype(np.float64), tb.astype(np.float64)
        norms = math.sqrt(float(ua @ ua) * float(ub @ ub))
        return 0.0 if norms == 0 else float(ua @ ub) / norms * na * nb
