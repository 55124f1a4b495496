"""TracIn-style influence of every stored (step, peer) on query gradients, from projections.

Pruthi et al. (2020) score a training example's influence on a test example as
``Σ_t η_t ⟨∇ℓ(test; θ_t), ∇ℓ(train; θ_t)⟩`` over checkpoints ``t``. gradpipe
keeps each peer's batch gradient at every step, so it scores *batches*:

    score[q, step, peer] = η_step · ⟨P g_q, P g_(step, peer)⟩

per layer and in total (the sum over layers), with ``P`` the seeded sign
projection of :mod:`gradpipe.core.sketch` (memoised per dump by
:mod:`gradpipe.analytics.projections`) and ``η`` the learning rate the dump
records (metadata ``lr`` or ``learning_rate``) or ``lr=``. Each score is an
unbiased estimate of ``η ⟨g_q, g⟩`` with standard deviation at most
``η |g_q| |g| √(2/k)`` (0.0156 of ``η |g_q| |g|`` at ``k = 8192``).

The query is either

- gradients by tensor name with a leading example axis: one fixed query per
  example, the same at every step (the "fixed-query" approximation: TracIn
  proper wants the query's gradient at each checkpoint), or
- a run name: its dumps are the query's gradients at each step (TracIn
  proper), one example per peer of that run.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import TYPE_CHECKING

import numpy as np
import xarray as xr

from gradpipe.analytics.layers import layers_of
from gradpipe.analytics.passes import PassOutcome, StepResult
from gradpipe.analytics.projections import projection_pass
from gradpipe.analytics.selection import Steps
from gradpipe.core.display import printable
from gradpipe.core.sketch import parse_sketch_size, sign_sketch_many
from gradpipe.errors import InvalidInputError, NotFoundError
from gradpipe.graph.runner import Runner

if TYPE_CHECKING:
    from gradpipe.storage.store import Store

__all__ = ["influence", "project_query"]

#: A learning rate: one for every step, or one per step.
LearningRate = float | Mapping[int, float] | None


def influence(
    store: Store,
    run: str,
    query: Mapping[str, np.ndarray] | str,
    *,
    k: int = 8192,
    seed: int = 0,
    s: int = 4,
    lr: LearningRate = None,
    steps: Steps = None,
    runner: Runner | None = None,
) -> xr.Dataset:
    """How much each stored (step, peer) gradient moved the loss of each query example.

    Parameters
    ----------
    store, run
        The store and the training run (its dumps are projected once and
        memoised; later queries read only the projections).
    query : mapping of str to array, or str
        Query gradients by tensor name, each with a leading example axis
        (``(n, *shape)``), or the name of a run whose dumps are the query's
        gradients at each step (one example per peer).
    k, seed, s
        The projection (:mod:`gradpipe.core.sketch`); the same for the run and
        the query.
    lr : float or mapping of step to float, optional
        The learning rate, where the dumps record none (metadata ``lr`` or
        ``learning_rate``). A dump with neither is an error.

    Returns
    -------
    xarray.Dataset
        ``score`` (dims ``(example, step, peer)``) and ``layer_score``
        (``(example, step, peer, layer)``); NaN where a peer has no dump.
    """
    _check_lr(lr)
    if not isinstance(query, str):
        _check_query(store, run, query)
    outcome = projection_pass(store, run, k=k, seed=seed, s=s, steps=steps, runner=runner)
    if isinstance(query, str):
        queries, examples = _query_run(store, query, outcome, k=k, seed=seed, s=s, runner=runner)
    else:
        fixed, examples = project_query(query, k=k, seed=seed, s=s)
        queries = {r.step: fixed for r in outcome.results}
    results = outcome.results
    peers = sorted({x for r in results for x in r.labels})  # the run's peer order
    layers = list(dict.fromkeys(x for r in results for x in r.tensors))
    scores = np.full((len(examples), len(results), len(peers), len(layers)), np.nan)
    for i, r in enumerate(results):
        etas = _learning_rates(r, lr)
        query_layers = queries.get(r.step)
        if query_layers is None:
            raise InvalidInputError(f"the query holds no gradient at step {r.step}")
        for p, peer in enumerate(r.labels):
            col = peers.index(peer)
            for j, layer in enumerate(r.tensors):
                stored = r.arrays["projection"][p, j].astype(np.float64)
                q = query_layers.get(layer)
                value = 0.0 if q is None else q @ stored  # a layer the query lacks adds 0
                scores[:, i, col, layers.index(layer)] = etas[p] * value
    ds = xr.Dataset(
        {
            "score": (("example", "step", "peer"), np.sum(scores, axis=-1)),
            "layer_score": (("example", "step", "peer", "layer"), scores),
        },
        coords={
            "example": np.array(examples, dtype=object),
            "step": np.array([r.step for r in results], np.int64),
            "peer": np.array(peers, dtype=object),
            "layer": np.array(layers, dtype=object),
        },
    )
    ds["score"].attrs["description"] = "lr * <P g_query, P g_(step, peer)>, summed over layers"
    ds.attrs = {
        "analysis": "influence",
        "run": run,
        "query": query if isinstance(query, str) else "arrays",
        "k": k,
        "seed": seed,
        "s": s,
        "error_bound": f"std <= lr * |g_query| * |g| * sqrt(2/k) = {math.sqrt(2 / k):.4g} * ...",
        **outcome.attrs(),
    }
    return ds


def _check_lr(lr: LearningRate) -> None:
    values = list(lr.values()) if isinstance(lr, Mapping) else [] if lr is None else [lr]
    for value in values:
        if (
            isinstance(value, bool)
            or not isinstance(value, int | float)
            or not math.isfinite(value)
        ):
            raise InvalidInputError(f"lr {printable(value)} must be a finite number")


def _check_query(store: Store, run: str, query: Mapping[str, np.ndarray]) -> None:
    """Every query tensor is one of the run's, of its shape (after the example axis)."""
    from gradpipe.storage.catalog import read_run

    _, manifest = read_run(store, run)
    for name, values in query.items():
        schema = manifest.schema.get(name)
        if schema is None:
            raise InvalidInputError(
                f"query tensor {printable(name)} is not a tensor of run {printable(run)}; "
                "a query holds gradients of the run's own tensors"
            )
        shape = tuple(np.shape(values))[1:]
        if shape != tuple(schema.shape):
            raise InvalidInputError(
                f"query tensor {printable(name)} has the shape {list(shape)} per example; the "
                f"run's is {list(schema.shape)} (the query needs a leading example axis)"
            )


def project_query(
    query: Mapping[str, np.ndarray], *, k: int, seed: int, s: int
) -> tuple[dict[str, np.ndarray], list[str]]:
    """Each layer's projection of the query, ``(examples, k)`` float64, and example labels."""
    k, s = parse_sketch_size(k, s)
    if not query:
        raise InvalidInputError("the query holds no gradients")
    names = list(query)
    counts = {np.asarray(query[n]).shape[0] if np.ndim(query[n]) else -1 for n in names}
    if len(counts) != 1 or -1 in counts:
        raise InvalidInputError(
            "every query tensor needs the same leading example axis, (examples, *shape)"
        )
    (n,) = counts
    out: dict[str, np.ndarray] = {}
    for name, layer in zip(names, layers_of(names), strict=True):
        values = np.asarray(query[name])
        if values.dtype.kind != "f" and values.dtype.name != "bfloat16":
            raise InvalidInputError(f"query tensor {printable(name)} is not a float array")
        flat = values.reshape(n, -1)
        acc = out.setdefault(layer, np.zeros((n, k)))
        sign_sketch_many(flat, seed=seed, tensor=name, offset=0, k=k, s=s, out=acc)
    return out, [f"q{i}" for i in range(n)]


def _query_run(
    store: Store,
    name: str,
    training: PassOutcome,
    *,
    k: int,
    seed: int,
    s: int,
    runner: Runner | None,
) -> tuple[dict[int, dict[str, np.ndarray]], list[str]]:
    """Per step, each layer's projections of the query run's dumps, ``(peers, k)``."""
    wanted = [r.step for r in training.results]
    try:
        outcome = projection_pass(store, name, k=k, seed=seed, s=s, steps=wanted, runner=runner)
    except InvalidInputError as exc:
        raise InvalidInputError(
            f"query run {printable(name)} must hold a gradient at every step scored: {exc}"
        ) from None
    examples = sorted({x for r in outcome.results for x in r.labels})
    if outcome.failures:
        failure = outcome.failures[0]
        raise InvalidInputError(
            f"query run {printable(name)}, step {failure.step} could not be projected: "
            f"{failure.reason}"
        )
    out: dict[int, dict[str, np.ndarray]] = {}
    for r in outcome.results:
        if r.labels != examples:
            raise InvalidInputError(
                f"query run {printable(name)}, step {r.step}: peers {r.labels} differ from "
                f"{examples}; every step needs the same query examples"
            )
        out[r.step] = {
            layer: r.arrays["projection"][:, j].astype(np.float64)
            for j, layer in enumerate(r.tensors)
        }
    return out, examples


def _learning_rates(result: StepResult, lr: LearningRate) -> np.ndarray:
    if isinstance(lr, Mapping):
        if result.step in lr:
            return np.full(len(result.labels), float(lr[result.step]))
    elif lr is not None:
        return np.full(len(result.labels), float(lr))
    recorded = result.arrays["lr"]
    missing = [x for x, v in zip(result.labels, recorded, strict=True) if math.isnan(v)]
    if missing:
        raise NotFoundError(
            f"step {result.step}, peer {printable(missing[0])}: the dump records no learning "
            "rate (metadata lr or learning_rate); pass lr= (a float or {step: lr})"
        )
    out: np.ndarray = recorded
    return out
