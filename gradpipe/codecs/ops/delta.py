"""Delta math: one chunk against the same chunk of a parent tensor (pure, no I/O).

Three encodings, the first two bit-exact for every dtype and every value:

- **XOR of the bit patterns** (the default for chains): ``delta = target ^ base``
  on the unsigned words of the dtype. Bytes that did not change become zero,
  and the exponent and high mantissa bits of values that moved little cancel,
  which the codecs then compress. NaN payloads, -0.0 and subnormals survive.
- **Integer difference of the bit patterns**: ``delta = target - base`` in
  wrapping unsigned arithmetic on the words. Also exact; smaller than XOR when
  values drift by a few units in the last place across a binade boundary.
- **Sparse arithmetic delta** (the Rust prototype's ``index + value where |Δ| > threshold``):
  float subtraction, kept only where the change is larger than ``threshold``.
  The Rust prototype subtracts in the tensor's own precision, where float32
  ``(2**-26 - 1) + 1 == 0``; here differences are taken in float64, which is
  exact for float32, float16 and bfloat16 chunks, but float64 chunks can still
  round and any ``threshold > 0`` drops changes. So its result says whether it
  is exact and records the largest error it leaves. Never the default.

Everything works on flat, C-ordered chunks of one dtype; the storage layer
chooses, per chunk, whether a full or a delta block is smaller.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from gradpipe.errors import InvalidInputError

__all__ = [
    "SparseDelta",
    "apply_int_delta",
    "apply_sparse_delta",
    "apply_xor_delta",
    "int_delta",
    "sparse_delta",
    "xor_delta",
]


def _words(array: np.ndarray, what: str) -> np.ndarray:
    """The chunk as unsigned words of its item size (a view: no copy)."""
    flat = np.ascontiguousarray(array).reshape(-1)
    size = flat.dtype.itemsize
    if size not in (1, 2, 4, 8):
        raise InvalidInputError(f"{what}: no delta for {size}-byte items ({flat.dtype})")
    return flat.view(np.dtype(f"<u{size}"))


def _pair(target: np.ndarray, base: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    if target.dtype != base.dtype or target.size != base.size:
        raise InvalidInputError(
            f"a delta needs chunks of one dtype and size: target {target.dtype} x {target.size}, "
            f"base {base.dtype} x {base.size}"
        )
    return _words(target, "target"), _words(base, "base")


def xor_delta(target: np.ndarray, base: np.ndarray) -> np.ndarray:
    """``target ^ base`` on the bit patterns, as unsigned words (zero where unchanged)."""
    t, b = _pair(target, base)
    out: np.ndarray = np.bitwise_xor(t, b)
    return out


def apply_xor_delta(delta: np.ndarray, base: np.ndarray) -> np.ndarray:
    """The target back from :func:`xor_delta`, in ``base``'s dtype, bit-exact."""
    d, b = _pair(delta.view(base.dtype) if delta.dtype != base.dtype else delta, base)
    out: np.ndarray = np.bitwise_xor(d, b).view(base.dtype)
    return out


def int_delta(target: np.ndarray, base: np.ndarray) -> np.ndarray:
    """``target - base`` on the bit patterns, wrapping, as unsigned words."""
    t, b = _pair(target, base)
    out: np.ndarray = np.subtract(t, b)  # unsigned: wraps modulo 2**bits, never overflows
    return out


def apply_int_delta(delta: np.ndarray, base: np.ndarray) -> np.ndarray:
    """The target back from :func:`int_delta`, in ``base``'s dtype, bit-exact."""
    d, b = _pair(delta.view(base.dtype) if delta.dtype != base.dtype else delta, base)
    out: np.ndarray = np.add(d, b).view(base.dtype)
    return out


@dataclass(frozen=True)
class SparseDelta:
    """The prototype's sparse arithmetic delta: positions and float64 changes above a threshold.

    ``exact`` is True only when applying it gives back every bit of the
    target; ``max_abs_error`` is the largest ``|target - reconstruction|``
    (NaN where a NaN could not be carried).
    """

    indices: np.ndarray  # int64 positions of the kept changes
    values: np.ndarray  # float64 target - base at those positions
    threshold: float
    exact: bool
    max_abs_error: float


def sparse_delta(target: np.ndarray, base: np.ndarray, *, threshold: float = 0.0) -> SparseDelta:
    """Keep ``target - base`` where ``|target - base| > threshold`` (float chunks only).

    Twice the dense size on a dense update (an index and a value per element),
    and lossy as soon as one change is dropped or rounds: measured and said in
    the result, never hidden.
    """
    if target.dtype.kind != "f" and target.dtype.name != "bfloat16":
        raise InvalidInputError(f"the sparse arithmetic delta is for floats, not {target.dtype}")
    if not threshold >= 0:
        raise InvalidInputError(f"threshold must be >= 0, got {threshold!r}")
    _pair(target, base)
    t = np.ascontiguousarray(target).reshape(-1).astype(np.float64)
    b = np.ascontiguousarray(base).reshape(-1).astype(np.float64)
    with np.errstate(invalid="ignore", over="ignore"):
        change = t - b
        keep = ~(np.abs(change) <= threshold)  # NaN changes are kept
    indices = np.flatnonzero(keep).astype(np.int64)
    values = change[indices]
    back = apply_sparse_delta(SparseDelta(indices, values, threshold, False, 0.0), base)
    same = _words(back, "reconstruction") == _words(np.ascontiguousarray(target), "target")
    exact = bool(same.all())
    with np.errstate(invalid="ignore"):
        errors = np.abs(back.astype(np.float64) - t)
    finite = errors[np.isfinite(errors)]
    max_error = float(finite.max()) if finite.size else 0.0
    if np.isnan(errors).any() and not exact:
        max_error = float("nan")
    return SparseDelta(indices, values, float(threshold), exact, max_error)


def apply_sparse_delta(delta: SparseDelta, base: np.ndarray) -> np.ndarray:
    """``base + values`` at ``indices``, rounded to ``base``'s dtype (lossy, see above)."""
    flat = np.ascontiguousarray(base).reshape(-1)
    if delta.indices.size and (delta.indices.min() < 0 or delta.indices.max() >= flat.size):
        raise InvalidInputError(
            f"sparse delta indices fall outside a chunk of {flat.size} elements"
        )
    out = flat.copy()
    with np.errstate(invalid="ignore", over="ignore"):
        moved = flat[delta.indices].astype(np.float64) + delta.values
        out[delta.indices] = moved.astype(flat.dtype)
    return out
