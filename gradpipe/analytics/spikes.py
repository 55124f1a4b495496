"""Spikes in a series of norms: a robust z-score over a trailing window of steps.

For each series (a peer's total, layer or tensor norm, or an aggregate's) and
step ``t``, on ``x = log(l2_norm)`` (scale-free), over the ``window`` recorded
steps before ``t`` (``t`` excluded)::

    m_t   = median(x_{t-W} ... x_{t-1})
    MAD_t = median(|x_i - m_t|)
    z_t   = (x_t - m_t) / (1.4826 * MAD_t)

``1.4826 = 1/Φ⁻¹(3/4)`` makes the MAD estimate σ for normal data. A step is a
spike when ``z_t > threshold`` (and, two-sided, when ``z_t < -threshold``).
``z`` is NaN while fewer than ``⌈W/2⌉`` usable steps precede. The MAD is
floored at :data:`MAD_FLOOR` (a relative change of one part in a million): a flat
window would otherwise make the last bit of a norm an infinite z. A cell that holds a
NaN or an infinity is flagged ``nonfinite`` instead, gets no z, and is left out
of later windows, as are zero and missing norms (``log 0`` says nothing of scale).
"""

from __future__ import annotations

import math
import warnings
from typing import Final

import numpy as np

from gradpipe.core.display import printable
from gradpipe.errors import InvalidInputError

__all__ = ["MAD_FLOOR", "MAD_TO_SIGMA", "robust_z"]

#: 1/Φ⁻¹(3/4): scales a median absolute deviation to a standard deviation.
MAD_TO_SIGMA: Final = 1.482602218505602
#: The smallest MAD of ``log(norm)`` used: norms a millionth apart count as equal-ish.
MAD_FLOOR: Final = 1e-6


def robust_z(norms: np.ndarray, usable: np.ndarray, *, window: int) -> np.ndarray:
    """Robust z-scores of ``log(norms)`` along axis 0 (steps), each series apart.

    ``usable`` marks the cells that count (finite, non-zero, recorded); the
    others get NaN and stay out of every window.
    """
    if isinstance(window, bool) or not isinstance(window, int) or window < 3:
        raise InvalidInputError(
            f"spike window {printable(window)} must be an integer >= 3 (a median and a "
            "deviation from it need two steps or more)"
        )
    x = np.full(norms.shape, np.nan)
    with np.errstate(divide="ignore", invalid="ignore"):
        np.log(norms, out=x, where=usable)
    z = np.full(norms.shape, np.nan)
    needed = math.ceil(window / 2)
    for t in range(1, norms.shape[0]):
        past = x[max(0, t - window) : t]
        enough = np.count_nonzero(~np.isnan(past), axis=0) >= needed
        if not enough.any():
            continue
        with np.errstate(invalid="ignore"), warnings.catch_warnings():
            warnings.simplefilter("ignore", RuntimeWarning)  # "All-NaN slice": NaN is meant
            median = np.nanmedian(past, axis=0)
            mad = np.nanmedian(np.abs(past - median), axis=0)
            scaled = (x[t] - median) / (MAD_TO_SIGMA * np.maximum(mad, MAD_FLOOR))
        z[t] = np.where(enough & ~np.isnan(x[t]), scaled, np.nan)
    return z
