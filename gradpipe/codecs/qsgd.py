"""Lossy codec: QSGD stochastic quantisation, ``S`` levels per bucket, seeded.

The math and its bounds are in :mod:`gradpipe.codecs.ops.qsgd`. The random draws
come from a generator seeded with the codec's ``seed`` and the chunk's bytes
(their BLAKE3 hash): encoding the same chunk twice gives the same frame, so
the same block id, while different chunks get independent draws (one stream
for every chunk would make their rounding errors correlate, and not average
out in a sum of gradients). Decoding reads only the frame.

Body: ``levels u2, bucket u4, 2x``, then one float64 norm per bucket, then one
signed level per value (int8 for up to 127 levels, else int16).
"""

from __future__ import annotations

import struct
from typing import Any, ClassVar, Final

import numpy as np

from gradpipe.codecs._lossy import LossyCodec, parse_seed
from gradpipe.codecs.ops.qsgd import (
    dequantize_qsgd,
    parse_levels,
    qsgd_variance_bound,
    quantize_qsgd,
)
from gradpipe.core.ids import hash_bytes
from gradpipe.core.lossy import ErrorBound, unit_roundoff
from gradpipe.errors import IntegrityError, InvalidInputError

__all__ = ["DEFAULT_BUCKET", "QSGDCodec"]

#: Values per bucket: QSGD's paper uses 512 (one norm per 512 values).
DEFAULT_BUCKET: Final = 512
_HEAD: Final = struct.Struct("<HI2x")


class QSGDCodec(LossyCodec):
    """Quantise each bucket to ``levels`` levels of its norm, stochastically (unbiased).

    Parameters
    ----------
    levels : int
        s, the number of levels per sign (1 to 32767).
    dtype : str
        A float dtype.
    bucket : int
        d, values per bucket (one float64 norm each).
    seed : int
        Seed of the random rounding (with the chunk's hash).

    Examples
    --------
    >>> import numpy as np
    >>> codec = QSGDCodec(levels=4, seed=1)
    >>> x = np.float32([3.0, -4.0, 0.0, 0.0])
    >>> codec.decode(codec.encode(x)).tolist()
    [3.75, -3.75, 0.0, 0.0]
    """

    codec_id = "gradpipe_qsgd"
    magic: ClassVar[bytes] = b"GPQS"

    def __init__(
        self, levels: int = 16, dtype: str = "float32", bucket: int = DEFAULT_BUCKET, seed: int = 0
    ) -> None:
        super().__init__(dtype)
        self.levels = parse_levels(levels)
        if isinstance(bucket, bool) or not isinstance(bucket, int) or not 1 <= bucket < 2**32:
            raise InvalidInputError(f"QSGD bucket must be an integer >= 1, not {bucket!r}")
        self.bucket = bucket
        self.seed = parse_seed(seed)

    @property
    def name(self) -> str:
        return f"qsgd-{self.levels}"

    def _options(self) -> dict[str, Any]:
        return {"levels": self.levels, "bucket": self.bucket, "seed": self.seed}

    def error_bound(self, size: int | None = None) -> ErrorBound:
        """Unbiased; variance ``≤ min(d/s², √d/s)·‖x‖²``; each value within ``‖x‖₂/s``, plus
        the output's rounding: its unit roundoff times ``‖x‖₂`` and one subnormal step."""
        s, d = self.levels, self.bucket
        return ErrorBound(
            f"unbiased stochastic rounding to {s} levels of each {d}-value bucket's norm: "
            f"E‖x̂ − x‖² ≤ min(d/s², √d/s)·‖x‖² = {qsgd_variance_bound(s, d):.4g}·‖x‖², and "
            f"every value within ‖bucket‖₂/{s} ≤ ‖x‖₂/{s} (plus the output's rounding: its "
            "unit roundoff times ‖x‖₂, and one subnormal step)",
            linf=1 / s + unit_roundoff(self._dtype),
            # Subnormal outputs round on a grid of fixed steps, however small ‖x‖ is: up to
            # half a step each for the bucket norm and the decoded value (float64 rounds both).
            absolute=float(np.finfo(self._dtype).smallest_subnormal),
            unbiased=True,
            variance=qsgd_variance_bound(s, d),
        )

    def _encode_body(self, values: np.ndarray) -> list[bytes]:
        digest = int(hash_bytes(values.view(np.uint8))[-16:], 16)
        rng = np.random.default_rng([self.seed, digest])
        q, norms = quantize_qsgd(values.astype(np.float64), self.levels, self.bucket, rng)
        return [
            _HEAD.pack(self.levels, self.bucket),
            norms.astype("<f8").tobytes(),
            q.astype(q.dtype.newbyteorder("<")).tobytes(),
        ]

    def _decode_body(self, body: memoryview, count: int) -> np.ndarray:
        if body.nbytes < _HEAD.size:
            raise IntegrityError(f"{self.codec_id}: frame is truncated")
        levels, bucket = _HEAD.unpack_from(body)
        if levels != self.levels or bucket != self.bucket:
            raise IntegrityError(
                f"{self.codec_id}: frame has {levels} levels in buckets of {bucket}, the codec "
                f"{self.levels} in {self.bucket}"
            )
        buckets = -(-count // bucket)
        width = 1 if levels <= 127 else 2
        self._check_size(body, _HEAD.size + 8 * buckets + width * count)
        start = _HEAD.size + 8 * buckets
        norms = np.frombuffer(body[_HEAD.size : start], dtype="<f8")
        q = np.frombuffer(body[start:], dtype="<i1" if width == 1 else "<i2")
        return dequantize_qsgd(q, norms, levels, bucket)
