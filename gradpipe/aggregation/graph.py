"""The builder of the aggregate graph: stored chunks in, one reduced chunk per chunk out.

For every step, tensor and chunk of the output grid (the first peer's grid)::

    read(peers 0..7)  read(peers 8..15) ...           one task per (group, chunk):
                                                      ≤ split_every peers' chunks
         └── combine ──┘ ... └── combine ──┘          ≤ split_every each, peer order,
                    └──── ... ────┘                   while more than split_every remain
                        write                         finish ≤ split_every partials,
                                                      encode, write a block
    tensor (per tensor) → manifest (per step) → commit (one per call)

With at most ``split_every`` peers (and no DP noise), one ``reduce`` task per
chunk reads every peer's chunk, reduces, rounds and writes: no float64
partial of the chunk is ever built, stored or passed between tasks.

With ``clip_norm``, each peer's leaves wait for its clipping factor: one
``norm`` task per stored chunk of the peer, combined exactly
(:class:`~gradpipe.aggregation.exact.ExactSum`) by a bounded tree, then ``scale``.
Each chunk is then read twice (once for the norm, once for the sum): the
factor must multiply every term before it is summed (one rounding), and
keeping every chunk in memory until the norm is known would not be out of core.

The tree groups contiguous peer ranges, so by :mod:`gradpipe.aggregation.reduce`
the result is the same bits for every ``split_every``, scheduler and worker
count. Tasks hold at most ``split_every`` peers' chunks or partials of one chunk.

Keys are tokenised from everything that defines the work (the store, the
inputs' dump ids and weights, the method and parameters, the grid), so equal
work gets equal keys; the commit's key also carries a token of the call, so
two calls never share a commit.
"""

from __future__ import annotations

import uuid
from collections.abc import Hashable, Sequence
from dataclasses import dataclass
from typing import Any

from dask.base import tokenize

from gradpipe.aggregation.clip import add_aggregate_clip
from gradpipe.aggregation.plan import (
    DEFAULT_SPLIT_EVERY,
    StepPlan,
    TensorPlan,
    add_tensor_task,
    overlapping,
    parse_split_every,
    sources_of,
    tree,
    tree_levels,
)
from gradpipe.aggregation.reduce import weight_shift
from gradpipe.aggregation.robust_graph import ROBUST_METHODS, add_robust_step
from gradpipe.aggregation.robust_tasks import (
    clip_round,
    clip_round_params,
    round_scale,
    write_noised_chunk,
)
from gradpipe.aggregation.tasks import (
    CommitGuard,
    combine_norms,
    combine_partials,
    commit_aggregates,
    read_partial,
    read_sq_norm,
    reduce_chunk,
    store_aggregate,
    write_chunk,
)
from gradpipe.core.chunking import chunk_ranges
from gradpipe.core.display import printable
from gradpipe.errors import InvalidInputError
from gradpipe.storage.store import Store

__all__ = [
    "DEFAULT_SPLIT_EVERY",
    "StepPlan",
    "TensorPlan",
    "add_tensor_task",
    "build_aggregate_graph",
    "overlapping",
    "parse_split_every",
    "sources_of",
    "tree",
    "tree_levels",
]


def build_aggregate_graph(
    store: Store,
    plans: Sequence[StepPlan],
    *,
    clip_norm: float | None = None,
    split_every: int | None = None,
    message: str = "aggregate",
    lease: str | None = None,
    guard: CommitGuard | None = None,
) -> tuple[dict[Hashable, Any], str]:
    """The graph that computes, stores and commits the aggregates of ``plans`` (not computed).

    The output key's result is an
    :class:`~gradpipe.aggregation.tasks.AggregateCommit`. ``lease`` is the
    key of the writer's lease the commit publishes under; ``guard`` what the
    commit checks before recording each step (the rounds claim).
    """
    fan = parse_split_every(split_every)
    token = tokenize(
        store.url,
        [
            (p.spec.key, [(t.name, t.chunk_shape) for t in p.tensors], p.decided, p.clip_start)
            for p in plans
        ],
        clip_norm,
        fan,
    )
    graph: dict[Hashable, Any] = {}
    step_keys: list[Hashable] = []
    previous_round: Hashable | None = None  # adaptive clipping: the previous step's round
    for s, plan in enumerate(plans):
        if plan.spec.method in ROBUST_METHODS:
            robust_tensors, decided = add_robust_step(graph, token, store, s, plan, fan)
            step_keys.append(
                _add_step_manifest(graph, token, store, s, plan, robust_tensors, decided, fan)
            )
            continue
        step = _ReducibleStep.build(graph, token, store, s, plan, fan, clip_norm, previous_round)
        previous_round = step.round if step.private else previous_round
        tensor_keys = []
        for t, tensor in enumerate(plan.tensors):
            sources = [sources_of(m) for m in tensor.peers]
            chunk_keys = [
                _add_chunk(graph, token, step, t, sources, c, span)
                for c, span in enumerate(chunk_ranges(tensor.shape, tensor.chunk_shape))
            ]
            tensor_keys.append(add_tensor_task(graph, token, (s, t), plan.spec, tensor, chunk_keys))
        step_keys.append(
            _add_step_manifest(graph, token, store, s, plan, tensor_keys, step.outcome, fan)
        )
    commit_key = f"gradpipe-aggregate-commit-{tokenize(token, uuid.uuid4().hex)}"
    run = plans[0].spec.run if plans else ""
    graph[commit_key] = (commit_aggregates, store, run, step_keys, message, lease, guard)
    return graph, commit_key


@dataclass(frozen=True)
class _ReducibleStep:
    """What every chunk task of one step of a reducible method shares."""

    store: Store
    s: int
    plan: StepPlan
    fan: int
    names: list[str]
    weights: list[float]
    scales: list[Any]  # per peer: 1.0, or the key of its clip scale
    shift: int  # one power of two for every partial of the step
    groups: list[tuple[int, int]]  # the peers each read task reduces
    outcome: list[Any]  # what the step's manifest records beside its tensors
    private: bool
    clip: Any  # dp-fedavg: the clip norm, or the key of the adaptive round
    round: Hashable | None
    shown_peers: list[str]  # names escaped once per step, not per chunk
    shown_aggregate: str

    @classmethod
    def build(
        cls,
        graph: dict[Hashable, Any],
        token: str,
        store: Store,
        s: int,
        plan: StepPlan,
        fan: int,
        clip_norm: float | None,
        previous_round: Hashable | None,
    ) -> _ReducibleStep:
        spec = plan.spec
        n = len(spec.inputs)
        scales: list[Any] = [1.0] * n
        outcome: list[Any] = [plan.decided] if plan.decided else []
        private = spec.method == "dp-fedavg"
        clip: Any = None
        round_key = previous_round
        if private:
            clip, round_key = _clip_graph(graph, token, store, s, plan, fan, previous_round)
            if isinstance(clip, tuple):
                params_key = (f"gradpipe-aggregate-clipparams-{token}", s)
                graph[params_key] = (clip_round_params, spec.step, clip)
                outcome.append(params_key)
            scales = [_scale_graph(graph, token, store, s, plan, p, clip, fan) for p in range(n)]
        elif clip_norm is not None:
            scales = [
                _scale_graph(graph, token, store, s, plan, p, clip_norm, fan) for p in range(n)
            ]
        names = [i.peer for i in spec.inputs]
        weights = [i.weight for i in spec.inputs]
        return cls(
            store,
            s,
            plan,
            fan,
            names,
            weights,
            scales,
            weight_shift(weights),
            [(lo, min(n, lo + fan)) for lo in range(0, n, fan)],
            outcome,
            private,
            clip,
            round_key,
            [printable(name) for name in names],
            printable(spec.name),
        )


def _add_chunk(
    graph: dict[Hashable, Any],
    token: str,
    step: _ReducibleStep,
    t: int,
    sources: list[Any],
    c: int,
    span: tuple[int, int],
) -> Hashable:
    """The tasks of chunk ``c`` of tensor ``t``: read and reduce the peers, then write; its key.

    ``sources`` are each peer's stored chunks of the tensor (:func:`sources_of`).
    """
    spec, tensor, s = step.plan.spec, step.plan.tensors[t], step.s
    start, stop = span
    n = len(step.names)
    shown_tensor = printable(tensor.name)
    where = f"tensor {shown_tensor} of step {spec.step}, chunk {c}"
    peer_sources = [overlapping(peer, start, stop) for peer in sources]
    contexts = [
        f"tensor {shown_tensor} of step {spec.step}, peer {peer}, chunk {c}"
        for peer in step.shown_peers
    ]
    context = f"aggregate {step.shown_aggregate} of {where}"
    if len(step.groups) == 1 and not step.private:
        # Every peer fits one task: read, reduce and write it there.
        reduce_key = (f"gradpipe-aggregate-reduce-{token}", s, t, c)
        graph[reduce_key] = (
            reduce_chunk,
            spec.step,
            step.store,
            peer_sources,
            start,
            stop,
            tensor.dtype,
            contexts,
            context,
            step.names,
            step.weights,
            step.scales,
            spec.method,
        )
        return reduce_key
    leaves: list[Hashable] = []
    for g, (lo, hi) in enumerate(step.groups):
        key = (f"gradpipe-aggregate-read-{token}", s, t, c, g)
        graph[key] = (
            read_partial,
            spec.step,
            step.store,
            peer_sources[lo:hi],
            start,
            stop,
            tensor.dtype,
            contexts[lo:hi],
            where,
            step.names[lo:hi],
            lo,
            step.weights[lo:hi],
            step.scales[lo:hi],
            step.shift,
        )
        leaves.append(key)
    # The last level of the tree is the write task's: finish takes the partials.
    roots = tree_levels(
        graph,
        f"gradpipe-aggregate-combine-{token}",
        (s, t, c),
        leaves,
        combine_partials,
        spec.step,
        step.fan,
    )
    write_key = (f"gradpipe-aggregate-write-{token}", s, t, c)
    if step.private:
        graph[write_key] = (
            write_noised_chunk,
            spec.step,
            step.store,
            roots,
            n,
            context,
            int(step.plan.decided.get("seed", spec.params.get("seed", 0))),
            noise_tensor(spec.step, tensor.name),
            start,
            step.clip,
            float(step.plan.decided["update_noise_multiplier"]),
        )
    else:
        graph[write_key] = (write_chunk, spec.step, step.store, roots, spec.method, n, context)
    return write_key


def _add_step_manifest(
    graph: dict[Hashable, Any],
    token: str,
    store: Store,
    s: int,
    plan: StepPlan,
    tensor_keys: list[Hashable],
    outcome: list[Any],
    fan: int,
) -> Hashable:
    """The step's manifest task, after clipping the result if asked (``clip_aggregate``)."""
    spec = plan.spec
    if spec.params.get("clip_aggregate") is not None:
        tensor_keys, clipped = add_aggregate_clip(graph, token, store, s, plan, tensor_keys, fan)
        outcome = [*outcome, clipped]
    key = (f"gradpipe-aggregate-manifest-{token}", s)
    graph[key] = (store_aggregate, spec.step, store, spec, tensor_keys, outcome)
    return key


def noise_tensor(step: int, tensor: str) -> str:
    """What DP-FedAvg keys a tensor's noise by, beside the seed: fresh noise every step."""
    return f"{step}/{tensor}"


def _clip_graph(
    graph: dict[Hashable, Any],
    token: str,
    store: Store,
    s: int,
    plan: StepPlan,
    fan: int,
    previous: Hashable | None,
) -> tuple[Any, Hashable | None]:
    """DP-FedAvg's clip norm for plan ``s``: a number, or the key of its adaptive round.

    Returns it and the round the next step chains from.
    """
    spec = plan.spec
    if not spec.params.get("adaptive_clip"):
        return float(spec.params["clip_norm"]), None
    totals = [_norm_graph(graph, token, store, s, plan, p, fan) for p in range(len(spec.inputs))]
    start: Any = plan.clip_start if plan.clip_start is not None else previous
    if start is None:  # gradpipe.aggregate chains only consecutive steps
        raise InvalidInputError(f"step {spec.step}: adaptive clipping has no clip norm to start")
    key = (f"gradpipe-aggregate-clipround-{token}", s)
    graph[key] = (
        clip_round,
        spec.step,
        start,
        totals,
        float(spec.params["target_quantile"]),
        float(spec.params["clip_lr"]),
        float(plan.decided["count_stddev"]),
        int(plan.decided.get("seed", spec.params.get("seed", 0))),
    )
    return key, key


def _norm_graph(
    graph: dict[Hashable, Any],
    token: str,
    store: Store,
    s: int,
    plan: StepPlan,
    p: int,
    fan: int,
) -> Any:
    """The tasks of peer ``p``'s squared norm over its stored chunks; its key (0.0: empty)."""
    step = plan.spec.step
    peer = printable(plan.spec.inputs[p].peer)
    leaves: list[Hashable] = []
    for t, tensor in enumerate(plan.tensors):
        head = f"tensor {printable(tensor.name)} of step {step}, peer {peer}"
        for c, source in enumerate(sources_of(tensor.peers[p])):
            key = (f"gradpipe-aggregate-norm-{token}", s, p, t, c)
            context = f"{head}, chunk {c}"
            graph[key] = (read_sq_norm, step, store, source, tensor.dtype, context)
            leaves.append(key)
    if not leaves:  # a peer whose tensors are all empty: a zero norm, never clipped
        return 0.0
    return tree(
        graph, f"gradpipe-aggregate-normsum-{token}", (s, p), leaves, combine_norms, step, fan
    )


def _scale_graph(
    graph: dict[Hashable, Any],
    token: str,
    store: Store,
    s: int,
    plan: StepPlan,
    p: int,
    clip_norm: Any,
    fan: int,
) -> Hashable:
    """The tasks of peer ``p``'s clipping factor (a norm over its stored chunks); its key.

    ``clip_norm``: a number, or the key of an adaptive clipping round.
    """
    total = _norm_graph(graph, token, store, s, plan, p, fan)
    scale_key = (f"gradpipe-aggregate-scale-{token}", s, p)
    graph[scale_key] = (round_scale, plan.spec.step, total, clip_norm)
    return scale_key
