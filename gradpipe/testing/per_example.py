"""A tiny classifier with exact per-example gradients, for brute-force checks of GNS and influence.

The gradient noise scale (McCandlish et al. 2018, app. A.1; docs/design/017,
step 4) and influence figures are statistics of *per-example* gradients, which
real dumps never hold. This module makes a setting where they are known
exactly: a fixed finite population of ``n`` examples and a small float64 model
whose per-example gradients are computed analytically. Peers then draw their
batches i.i.d. uniformly *with replacement* from that population, so the
estimators' i.i.d. assumption holds exactly and the truth they estimate is the
population's own ``tr(Σ)`` and ``|G|²`` (:func:`true_noise_scale`).

Model: ``x → tanh(layer.0) → head → softmax``, a multinomial logistic
regression (``head``) on one hidden layer (``layer.0``), so per-layer figures
have two layers by gradpipe's default rule (``layer.0.*`` → ``layer.0``,
``head.*`` → ``head``). The loss of example ``i`` is its cross-entropy; a
batch's gradient is the mean of its examples' gradients. The parameters are
not trained: every step of :func:`write_peer_dumps` is a fresh draw at the
same parameters, so every step has the same true figures and averages over
steps test for bias.

>>> model = PerExampleModel()
>>> x, y = population(model, 50, seed=1)
>>> grads = per_example_gradients(model, x, y)
>>> grads["head.weight"].shape
(50, 3, 5)
>>> trace, g2 = true_noise_scale(model, x, y)
>>> trace > 0 and g2 > 0
True
"""

from __future__ import annotations

import math
import os
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path

import numpy as np
import numpy.typing as npt

from gradpipe.errors import InvalidInputError
from gradpipe.formats.safetensors import write_safetensors

__all__ = [
    "Gradients",
    "PerExampleModel",
    "PerExampleRun",
    "gns_estimates",
    "per_example_gradients",
    "per_example_losses",
    "population",
    "true_noise_scale",
    "write_peer_dumps",
]

#: Tensor name → array; per-example gradients carry a leading example axis.
Gradients = dict[str, npt.NDArray[np.float64]]

_FLOAT_KINDS = frozenset({np.dtype(np.float16), np.dtype(np.float32), np.dtype(np.float64)})
_TEACHER_SCALE = 2.0  # teacher logits' scale: labels are noisy but far from uniform


@dataclass(frozen=True)
class PerExampleModel:
    """Sizes and seed of the classifier; its parameters are drawn from ``seed``.

    Parameters
    ----------
    d_in, hidden, classes : int
        Input features, hidden units, classes (``classes >= 2``).
    seed : int
        Seed of the parameters (the data has its own, in :func:`population`).
    """

    d_in: int = 6
    hidden: int = 5
    classes: int = 3
    seed: int = 0

    def __post_init__(self) -> None:
        for name, least in (("d_in", 1), ("hidden", 1), ("classes", 2)):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < least:
                raise InvalidInputError(
                    f"PerExampleModel.{name} must be an integer >= {least}, got {value!r}"
                )

    @property
    def shapes(self) -> dict[str, tuple[int, ...]]:
        """Tensor name → shape, in model order."""
        return {
            "layer.0.weight": (self.hidden, self.d_in),
            "layer.0.bias": (self.hidden,),
            "head.weight": (self.classes, self.hidden),
            "head.bias": (self.classes,),
        }

    @cached_property
    def parameters(self) -> Mapping[str, npt.NDArray[np.float64]]:
        """The parameters (read-only float64 arrays), the same for the same seed."""
        rng = np.random.default_rng(self.seed)
        fan_in = {"layer.0.weight": self.d_in, "head.weight": self.hidden}
        params: Gradients = {}
        for name, shape in self.shapes.items():
            # Biases are not zero, so their gradients are not special cases of the weights'.
            scale = 1.0 / math.sqrt(fan_in[name]) if name in fan_in else 0.3
            array = rng.normal(0.0, scale, size=shape)
            array.setflags(write=False)
            params[name] = array
        return params


@dataclass(frozen=True, eq=False)
class PerExampleRun:
    """What :func:`write_peer_dumps` wrote, with the arrays behind it.

    Attributes
    ----------
    pattern : str
        ``<root>/step={step}/peer={peer}.safetensors``, for ``ingest``.
    steps, peers, batch_sizes, learning_rates
        Steps ``0 .. steps-1``; peer names ``p0, p1, ...``; ``b_p`` per peer;
        the ``lr`` written at each step.
    indices : list of list of ndarray
        ``indices[step][p]``: the population indices of peer ``p``'s batch.
    mean_gradients : list of list of Gradients
        ``mean_gradients[step][p]``: the arrays exactly as written (in the
        dump dtype), so formulas on them are what the store must reproduce.
    """

    pattern: str
    steps: list[int]
    peers: list[str]
    batch_sizes: tuple[int, ...]
    learning_rates: list[float]
    indices: list[list[npt.NDArray[np.int64]]]
    mean_gradients: list[list[dict[str, npt.NDArray[np.floating[npt.NBitBase]]]]]

    def dump_path(self, step: int, peer: str) -> str:
        """Path of the dump of ``peer`` at ``step``."""
        return self.pattern.format(step=step, peer=peer)


def population(
    model: PerExampleModel, n: int, seed: int
) -> tuple[npt.NDArray[np.float64], npt.NDArray[np.int64]]:
    """A fixed population of ``n`` examples: Gaussian features, labels from a noisy teacher.

    The teacher is a random linear softmax classifier; each label is *drawn*
    from its probabilities (not its argmax), so the labels are noisy and the
    per-example gradients vary even between near-identical inputs.

    Returns
    -------
    x : ndarray, float64, shape (n, d_in)
    y : ndarray, int64, shape (n,), values in ``[0, classes)``
    """
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        raise InvalidInputError(f"population size n must be an integer >= 1, got {n!r}")
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(n, model.d_in))
    teacher = rng.normal(0.0, _TEACHER_SCALE / math.sqrt(model.d_in), (model.classes, model.d_in))
    probs = _softmax(x @ teacher.T)
    # Inverse-CDF draw, one uniform per example: vectorised and seed-stable.
    u = rng.random(n)[:, None]
    y = np.minimum((np.cumsum(probs, axis=1) < u).sum(axis=1), model.classes - 1)
    return x, y.astype(np.int64)


def per_example_losses(
    model: PerExampleModel,
    x: npt.ArrayLike,
    y: npt.ArrayLike,
    *,
    parameters: Mapping[str, npt.ArrayLike] | None = None,
) -> npt.NDArray[np.float64]:
    """Cross-entropy of each example, shape ``(n,)``, at ``parameters`` (default: the model's)."""
    params = _parse_parameters(model, parameters)
    xs, ys = _parse_data(model, x, y)
    _, logits = _forward(params, xs)
    shifted = logits - logits.max(axis=1, keepdims=True)
    log_z = np.log(np.exp(shifted).sum(axis=1))
    result: npt.NDArray[np.float64] = log_z - shifted[np.arange(len(ys)), ys]
    return result


def per_example_gradients(
    model: PerExampleModel,
    x: npt.ArrayLike,
    y: npt.ArrayLike,
    *,
    parameters: Mapping[str, npt.ArrayLike] | None = None,
) -> Gradients:
    """Exact gradient of each example's cross-entropy, float64, shapes ``(n, *shape)``.

    The mean over examples is the gradient of the mean loss; no reduction is
    applied here. Backpropagation by hand: ``δz = softmax(z) − onehot(y)``,
    ``∂head.weight = δz hᵀ``, ``δa = (headᵀ δz)(1 − h²)``, ``∂layer.0.weight = δa xᵀ``.
    """
    params = _parse_parameters(model, parameters)
    xs, ys = _parse_data(model, x, y)
    hidden, logits = _forward(params, xs)
    dz = _softmax(logits)
    dz[np.arange(len(ys)), ys] -= 1.0
    da = (dz @ params["head.weight"]) * (1.0 - hidden * hidden)
    return {
        "layer.0.weight": da[:, :, None] * xs[:, None, :],
        "layer.0.bias": da,
        "head.weight": dz[:, :, None] * hidden[:, None, :],
        "head.bias": dz,
    }


def true_noise_scale(
    model: PerExampleModel,
    x: npt.ArrayLike,
    y: npt.ArrayLike,
    *,
    tensors: Collection[str] | None = None,
) -> tuple[float, float]:
    """The population's ``tr(Σ)`` and ``|G|²``, what :func:`gns_estimates` estimates.

    For one example drawn uniformly from the ``n`` (with replacement), the
    gradient's mean is ``G = (1/n) Σ_i g_i`` and its covariance's trace is
    ``tr(Σ) = (1/n) Σ_i |g_i − G|²`` (the population variance, 1/n, not 1/(n−1)).
    Sums over examples and elements are ``math.fsum``; ``tensors`` restricts
    both figures to some tensors (one layer's, say).

    Returns
    -------
    trace : float
        ``tr(Σ)``, summed over the chosen tensors' elements.
    g2 : float
        ``|G|²``.
    """
    grads = per_example_gradients(model, x, y)
    names = _parse_tensors(grads, tensors)
    flat = np.concatenate([grads[name].reshape(len(grads[name]), -1) for name in names], axis=1)
    n = flat.shape[0]
    mean = np.array([math.fsum(column) / n for column in flat.T])
    deviations = flat - mean
    trace = math.fsum((deviations * deviations).ravel()) / n
    return trace, math.fsum(mean * mean)


def gns_estimates(
    mean_grads: Sequence[Mapping[str, npt.ArrayLike]],
    batch_sizes: Sequence[int],
    *,
    tensors: Collection[str] | None = None,
) -> tuple[float, float]:
    """The combined unbiased GNS estimators of docs/design/017, step 4, from peers' mean gradients.

    With ``B = Σ_p b_p`` and ``G = Σ_p (b_p/B) g_p``::

        𝒮    = Σ_p b_p·|g_p − G|² / (P − 1)
        |𝒢|² = |G|² − 𝒮/B

    Both are unbiased for ``tr(Σ)`` and ``|G|²`` when ``g_p`` is the mean of
    ``b_p`` i.i.d. examples, for any (unequal) ``b_p``. Computed in float64,
    sums over elements by ``math.fsum``; ``tensors`` restricts them to some
    tensors (a layer's figures use its tensors only).

    Parameters
    ----------
    mean_grads : sequence of mappings of str to array
        One per peer (``P >= 2``), each with the same tensor names and shapes.
    batch_sizes : sequence of int
        ``b_p >= 1`` per peer.

    Returns
    -------
    S : float
        ``𝒮``, the estimate of ``tr(Σ)``.
    G2 : float
        ``|𝒢|²``, the estimate of ``|G|²`` (may be negative).
    """
    sizes = _parse_batch_sizes(batch_sizes)
    if len(mean_grads) != len(sizes):
        raise InvalidInputError(
            f"gns_estimates: {len(mean_grads)} peers' gradients but {len(sizes)} batch sizes"
        )
    if len(sizes) < 2:
        raise InvalidInputError("gns_estimates needs gradients of at least 2 peers")
    first = {name: np.asarray(value) for name, value in mean_grads[0].items()}
    names = _parse_tensors(first, tensors)
    stacked = []
    for p, grads in enumerate(mean_grads):
        if set(grads) != set(first):
            raise InvalidInputError(
                f"gns_estimates: peer {p} has tensors {sorted(grads)}, peer 0 has {sorted(first)}"
            )
        parts = []
        for name in names:
            array = np.asarray(grads[name], dtype=np.float64)
            if array.shape != first[name].shape:
                raise InvalidInputError(
                    f"gns_estimates: tensor {name!r} of peer {p} has shape {array.shape}, "
                    f"peer 0's has {first[name].shape}"
                )
            parts.append(array.ravel())
        stacked.append(np.concatenate(parts))
    g = np.stack(stacked)  # (P, D)
    b = np.array(sizes, dtype=np.float64)
    total = math.fsum(sizes)
    mean = (b / total) @ g
    d2 = [math.fsum(((g_p - mean) ** 2).tolist()) for g_p in g]
    s = math.fsum(b_p * d2_p for b_p, d2_p in zip(sizes, d2, strict=True)) / (len(sizes) - 1)
    return s, math.fsum((mean * mean).tolist()) - s / total


def write_peer_dumps(
    root: str | os.PathLike[str],
    model: PerExampleModel,
    x: npt.ArrayLike,
    y: npt.ArrayLike,
    *,
    steps: int,
    batch_sizes: Sequence[int],
    seed: int,
    dtype: npt.DTypeLike = np.float64,
) -> PerExampleRun:
    """Write each peer's mean batch gradient for ``steps`` steps, as safetensors dumps.

    At every step each peer ``p`` (named ``p0, p1, ...``) draws ``b_p`` indices
    i.i.d. uniformly *with replacement* from the population ``(x, y)`` and
    writes the mean of those examples' gradients to
    ``root/step={step}/peer={peer}.safetensors``, with metadata
    ``num_examples = b_p`` and ``lr = 0.1/(1 + step)``. ``dtype`` (float16, 32
    or 64) is the dumps' dtype; float64, the default, stores the means exactly.
    """
    sizes = _parse_batch_sizes(batch_sizes)
    if not sizes:
        raise InvalidInputError("write_peer_dumps needs at least one batch size")
    if isinstance(steps, bool) or not isinstance(steps, int) or steps < 1:
        raise InvalidInputError(f"write_peer_dumps: steps must be an integer >= 1, got {steps!r}")
    out_dtype = np.dtype(dtype)
    if out_dtype not in _FLOAT_KINDS:
        raise InvalidInputError(
            f"write_peer_dumps: dtype must be float16, float32 or float64, got {out_dtype}"
        )
    xs, ys = _parse_data(model, x, y)
    grads = per_example_gradients(model, xs, ys)
    rng = np.random.default_rng(seed)
    base = Path(root)
    peers = [f"p{p}" for p in range(len(sizes))]
    run = PerExampleRun(
        pattern=str(base / "step={step}" / "peer={peer}.safetensors"),
        steps=list(range(steps)),
        peers=peers,
        batch_sizes=sizes,
        learning_rates=[0.1 / (1 + step) for step in range(steps)],
        indices=[],
        mean_gradients=[],
    )
    for step in run.steps:
        (base / f"step={step}").mkdir(parents=True, exist_ok=True)
        step_indices: list[npt.NDArray[np.int64]] = []
        step_means: list[dict[str, npt.NDArray[np.floating[npt.NBitBase]]]] = []
        for peer, size in zip(peers, sizes, strict=True):
            idx = rng.integers(0, len(ys), size=size, dtype=np.int64)
            means = {name: g[idx].mean(axis=0).astype(out_dtype) for name, g in grads.items()}
            metadata = {"num_examples": str(size), "lr": repr(run.learning_rates[step])}
            write_safetensors(run.dump_path(step, peer), means, metadata)
            step_indices.append(idx)
            step_means.append(means)
        run.indices.append(step_indices)
        run.mean_gradients.append(step_means)
    return run


def _forward(
    params: Mapping[str, npt.NDArray[np.float64]], x: npt.NDArray[np.float64]
) -> tuple[npt.NDArray[np.float64], npt.NDArray[np.float64]]:
    hidden = np.tanh(x @ params["layer.0.weight"].T + params["layer.0.bias"])
    logits = hidden @ params["head.weight"].T + params["head.bias"]
    return hidden, logits


def _softmax(logits: npt.NDArray[np.float64]) -> npt.NDArray[np.float64]:
    e = np.exp(logits - logits.max(axis=1, keepdims=True))
    result: npt.NDArray[np.float64] = e / e.sum(axis=1, keepdims=True)
    return result


def _parse_parameters(
    model: PerExampleModel, parameters: Mapping[str, npt.ArrayLike] | None
) -> dict[str, npt.NDArray[np.float64]]:
    if parameters is None:
        return dict(model.parameters)
    if set(parameters) != set(model.shapes):
        raise InvalidInputError(
            f"parameters have tensors {sorted(parameters)}; the model has {sorted(model.shapes)}"
        )
    params = {name: np.asarray(value, dtype=np.float64) for name, value in parameters.items()}
    for name, shape in model.shapes.items():
        if params[name].shape != shape:
            raise InvalidInputError(
                f"parameter {name!r} has shape {params[name].shape}; the model's is {shape}"
            )
    return params


def _parse_data(
    model: PerExampleModel, x: npt.ArrayLike, y: npt.ArrayLike
) -> tuple[npt.NDArray[np.float64], npt.NDArray[np.int64]]:
    xs = np.asarray(x, dtype=np.float64)
    ys = np.asarray(y)
    if xs.ndim != 2 or xs.shape[1] != model.d_in:
        raise InvalidInputError(f"x must have shape (n, {model.d_in}), got {xs.shape}")
    if ys.shape != (xs.shape[0],) or ys.dtype.kind not in "iu":
        raise InvalidInputError(
            f"y must be integer labels of shape ({xs.shape[0]},), got {ys.dtype} {ys.shape}"
        )
    if ys.size and (ys.min() < 0 or ys.max() >= model.classes):
        raise InvalidInputError(
            f"labels must lie in [0, {model.classes}), got {ys.min()}..{ys.max()}"
        )
    return xs, ys.astype(np.int64)


def _parse_batch_sizes(batch_sizes: Sequence[int]) -> tuple[int, ...]:
    sizes = tuple(batch_sizes)
    for p, size in enumerate(sizes):
        if isinstance(size, bool) or not isinstance(size, int | np.integer) or size < 1:
            raise InvalidInputError(f"batch size of peer {p} must be an integer >= 1, got {size!r}")
    return tuple(int(size) for size in sizes)


def _parse_tensors(grads: Mapping[str, object], tensors: Collection[str] | None) -> list[str]:
    if tensors is None:
        return list(grads)
    names = list(dict.fromkeys(tensors))  # a name given twice counts once
    missing = sorted(set(names) - set(grads))
    if missing or not names:
        raise InvalidInputError(
            f"tensors {missing or '(none)'} not among the gradients' {sorted(grads)}"
        )
    return names
