"""Peer agreement and the gradient noise scale, derived from one step's stored peer figures.

The peers' pass (:mod:`gradpipe.analytics.peer_graph`) stores, per tensor, the
Gram matrix ``K``, each peer's squared distance ``d²`` to the weighted mean
``G``, ``|G|²`` and the sign counts. A layer's (or the whole gradient's) are
their sums over its tensors; everything here follows from those sums:

- ``cosine[p, q] = K_pq / √(K_pp K_qq)`` (NaN for a zero norm);
- ``sign_agreement[p, q] = 1 − disagree_pq / both_pq`` over elements non-zero in both;
- ``distance[p] = √d²_p``, ``mean_norm = |G|``;
- ``norm_ratio = |G| / Σ_p ŵ_p √K_pp`` (1: aligned, → 0: cancelling), with
  ``ŵ`` the normalised weights, and ``diversity = Σ_p ŵ_p K_pp / |G|²``;
- ``loo_cosine[p] = cos(g_p, G_{−p})``, against the weighted mean of the others;
- ``krum_score[p]``: Krum's score on ``D_pq = K_pp + K_qq − 2 K_pq`` (Blanchard et al. 2017);
- ``outlier[t, p]`` (:func:`outliers`, over all the steps analysed): a peer
  whose distance, relative to its step's median distance, or whose
  ``loo_cosine``, below its step's median, lies more than ``outlier_z`` robust
  standard deviations out. The scale (1.4826 times the median absolute
  deviation) is pooled over every (step, peer): one step's few peers give no
  stable scale (with 8 peers a per-step robust z exceeds 3.5 for some peer at
  7.5% of clean steps), the whole window does.

The gradient noise scale (McCandlish et al. 2018, appendix A.1), with each dump
the mean gradient of ``b_p`` i.i.d. examples and ``B = Σ b_p``::

    𝒮 = Σ_p b_p d²_p / (P − 1)        (unbiased for tr Σ)
    |𝒢|² = |G|² − 𝒮 / B              (unbiased for the true gradient's squared norm)
    B_simple = 𝒮 / |𝒢|²

which is the weighted combination of A.1's per-peer estimators with weights
``(1 − b_p/B)/(P − 1)``: still unbiased with unequal ``b_p``, and computed from
the direct ``d²`` (no cancellation).

A peer left out of a tensor's figures (a non-finite value, another shape) is
NaN in every group that holds the tensor; ``|G|²`` and the noise scale of such
a group are NaN too (its mean is over fewer peers).
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Sequence
from typing import Final

import numpy as np

from gradpipe.aggregation.robust import krum_scores
from gradpipe.analytics.norm_figures import exact_sum
from gradpipe.analytics.spikes import MAD_TO_SIGMA

__all__ = [
    "AGREEMENT_VARIABLES",
    "GNS_VARIABLES",
    "agreement_figures",
    "group_sums",
    "noise_scale_figures",
    "outliers",
]

AGREEMENT_VARIABLES: Final = {
    "cosine": "cosine similarity between the peers' gradients",
    "sign_agreement": "share of elements non-zero in both whose signs agree",
    "distance": "Euclidean distance to the weighted mean of the peers",
    "loo_cosine": "cosine with the weighted mean of the other peers",
    "krum_score": "Krum's score: sum of the n-f-2 smallest squared distances to the others",
    "outlier": "distance_z or cosine_z > outlier_z",
    "distance_z": "robust z of distance / the step's median distance - 1 (scale pooled)",
    "cosine_z": "robust z of the step's median loo_cosine - loo_cosine (scale pooled)",
    "mean_norm": "norm of the weighted mean of the peers",
    "norm_ratio": "norm of the mean / weighted mean of the norms (1: aligned)",
    "diversity": "weighted mean of the squared norms / squared norm of the mean",
}
GNS_VARIABLES: Final = {
    "trace_sigma": "unbiased estimate of tr(Σ), the per-example gradient variance (𝒮)",
    "true_grad_sq": "unbiased estimate of the true gradient's squared norm (|𝒢|²)",
    "b_simple": "simple noise scale 𝒮/|𝒢|² (McCandlish et al. 2018)",
    "batch": "examples of the step, B = Σ b_p",
}


def group_sums(
    arrays: dict[str, np.ndarray], members: Sequence[int]
) -> dict[str, np.ndarray] | None:
    """The peer figures of a group of tensors (indices ``members``): their sums.

    Only tensors with figures count (two peers or more: an integer tensor, or
    one only a peer holds, has none). A peer left out of one of those is NaN
    in the group; the group's ``|G|²`` is then NaN too (its means cover other
    peers). Float figures are summed exactly, counts as integers. None: no
    tensor of the group has figures.
    """
    idx = [i for i in members if not math.isnan(float(arrays["mean_sq"][i]))]
    if not idx:
        return None
    masked = ~arrays["included"][idx].all(axis=0)

    def exact(values: np.ndarray) -> np.ndarray:
        flat = values.reshape(len(idx), -1)
        out = np.array([_fsum(flat[:, i]) for i in range(flat.shape[1])])
        return out.reshape(values.shape[1:])

    gram = exact(np.nan_to_num(arrays["gram"][idx], nan=0.0))
    gram[masked, :] = np.nan
    gram[:, masked] = np.nan
    dist_sq = exact(np.nan_to_num(arrays["dist_sq"][idx], nan=0.0))
    dist_sq[masked] = np.nan
    mean_sq = _fsum(arrays["mean_sq"][idx]) if not masked.any() else math.nan
    return {
        "gram": gram,
        "dist_sq": dist_sq,
        "mean_sq": np.array(mean_sq),
        "disagree": arrays["disagree"][idx].sum(axis=0),
        "both": arrays["both"][idx].sum(axis=0),
        "identical": np.array(bool(arrays["identical"][idx].all())),
    }


def _fsum(values: np.ndarray) -> float:
    items = values.tolist()
    if any(math.isnan(v) for v in items):
        return math.nan
    return exact_sum(items)


def _ratio(num: float, den: float) -> float:
    """``num / den``, NaN where it has no value (a zero or NaN denominator)."""
    return num / den if den != 0 and not math.isnan(den) else math.nan


def agreement_figures(
    sums: dict[str, np.ndarray], weights: np.ndarray, *, byzantine: int
) -> dict[str, np.ndarray]:
    """Agreement figures of one group at one step (see the module's docstring).

    Figures of several peers (leave-one-out cosines, Krum scores) are computed
    over the peers the group includes; the others are NaN.
    """
    gram, dist_sq, mean_sq = sums["gram"], sums["dist_sq"], float(sums["mean_sq"])
    ok = ~np.isnan(np.diagonal(gram))
    norms = np.sqrt(np.diagonal(gram))
    with np.errstate(divide="ignore", invalid="ignore"):
        cosine = gram / np.outer(norms, norms)
        sign_agreement = 1.0 - sums["disagree"] / sums["both"]
        distance = np.sqrt(dist_sq)
    share = weights[ok] / weights[ok].sum() if ok.any() else weights[ok]
    mean_norm = math.sqrt(mean_sq) if mean_sq >= 0 else math.nan
    loo = np.full(len(ok), np.nan)
    krum = np.full(len(ok), np.nan)
    if ok.sum() >= 2:
        sub = gram[np.ix_(ok, ok)]
        loo[ok] = _leave_one_out_cosine(sub, weights[ok])
        if ok.sum() >= 2 * byzantine + 3:  # Krum's own condition (Blanchard et al. 2017)
            krum[ok] = _krum(sub, byzantine)
    return {
        "cosine": cosine,
        "sign_agreement": sign_agreement,
        "distance": distance,
        "loo_cosine": loo,
        "krum_score": krum,
        "mean_norm": np.array(mean_norm),
        "norm_ratio": np.array(_ratio(mean_norm, float(share @ norms[ok]))),
        "diversity": np.array(_ratio(float(share @ np.diagonal(gram)[ok]), mean_sq)),
    }


def _leave_one_out_cosine(gram: np.ndarray, weights: np.ndarray) -> np.ndarray:
    """``cos(g_p, G_{−p})`` from ``K``, with ``G_{−p}`` the weighted mean of the others."""
    kw = gram @ weights
    wkw = float(weights @ kw)
    diag = np.diagonal(gram)
    rest = weights.sum() - weights
    with np.errstate(divide="ignore", invalid="ignore"):
        dot = (kw - weights * diag) / rest
        others_sq = (wkw - 2 * weights * kw + weights**2 * diag) / rest**2
        out: np.ndarray = dot / np.sqrt(diag * np.maximum(others_sq, 0.0))
    return np.where(np.isfinite(out), out, np.nan)


def outliers(
    distance: np.ndarray, loo_cosine: np.ndarray, *, outlier_z: float
) -> dict[str, np.ndarray]:
    """``distance_z``, ``cosine_z`` and ``outlier`` of figures of dims ``(step, [group,] peer)``.

    Each group (layer, tensor) has its own scale, pooled over its steps and peers.
    """
    with np.errstate(divide="ignore", invalid="ignore"), warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # all-NaN steps: NaN is meant
        relative = distance / np.nanmedian(distance, axis=-1, keepdims=True) - 1.0
        below = np.nanmedian(loo_cosine, axis=-1, keepdims=True) - loo_cosine
    distance_z, cosine_z = np.full(distance.shape, np.nan), np.full(distance.shape, np.nan)
    for group in np.ndindex(*distance.shape[1:-1]):  # one scale per group
        cell = (slice(None), *group, slice(None))
        distance_z[cell] = _pooled_z(relative[cell])
        cosine_z[cell] = _pooled_z(below[cell])
    with np.errstate(invalid="ignore"):
        outlier = (distance_z > outlier_z) | (cosine_z > outlier_z)
    return {"distance_z": distance_z, "cosine_z": cosine_z, "outlier": outlier}


def _pooled_z(deviations: np.ndarray) -> np.ndarray:
    """Deviations from a median in units of 1.4826 x their median absolute value, pooled."""
    finite = np.abs(deviations[np.isfinite(deviations)])
    if finite.size < 4:
        return np.full(deviations.shape, np.nan)
    scale = MAD_TO_SIGMA * float(np.median(finite))
    if scale == 0:
        return np.where(deviations > 0, np.inf, np.where(deviations < 0, -np.inf, 0.0))
    out: np.ndarray = deviations / scale
    return out


def _krum(gram: np.ndarray, byzantine: int) -> np.ndarray:
    diag = np.diagonal(gram)
    dist = np.maximum(diag[:, None] + diag[None, :] - 2 * gram, 0.0)
    np.fill_diagonal(dist, 0.0)
    if np.isnan(dist).any() or gram.shape[0] < 2:
        return np.full(gram.shape[0], np.nan)
    return krum_scores(dist, byzantine)


def noise_scale_figures(sums: dict[str, np.ndarray], batch: np.ndarray) -> dict[str, float]:
    """The noise scale of one group at one step from its peers' batch sizes ``batch``.

    NaN where the group has a masked peer (its mean covers other peers than
    its distances), fewer than two peers, or identical ones (all-reduced dumps).
    """
    p = len(batch)
    total = float(batch.sum())
    dist_sq = sums["dist_sq"]
    if p < 2 or np.isnan(dist_sq).any() or bool(sums["identical"]):
        return {"trace_sigma": math.nan, "true_grad_sq": math.nan, "b_simple": math.nan}
    trace = exact_sum((batch * dist_sq).tolist()) / (p - 1)
    true_sq = float(sums["mean_sq"]) - trace / total
    ratio = trace / true_sq if true_sq > 0 else math.nan
    return {"trace_sigma": trace, "true_grad_sq": true_sq, "b_simple": ratio}
