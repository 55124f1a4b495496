"""The graph of one step's robust aggregate: median, trimmed mean, Krum, Multi-Krum, Bulyan.

Median and trimmed mean are coordinate-wise, one task per chunk of the output
grid reading that chunk of every peer::

    robust (chunk c: n peers' chunk c → one chunk)  → tensor → manifest

Krum, Multi-Krum and Bulyan first need the ``(n, n)`` squared distances over
*all* tensors, then select peers, then compute each chunk from the selected
peers only::

    distance (chunk c of every tensor: n peers → an (n, n) share)
        └── distsum (exact, bounded tree over every chunk of every tensor) ──┐
                                                            select (peers, scores)
    selected (chunk c: the selected peers' chunk c → one chunk) → tensor → manifest

A task holds one chunk of at most every peer (``n x chunk``): memory per task
is bounded by the chunk size times the peer count, never by the model size.
Each chunk is read twice by the selection methods (distances, then the result),
because keeping every peer's chunks until the selection is known would hold
the whole step.
"""

from __future__ import annotations

from collections.abc import Hashable
from typing import Any, Final

from gradpipe.aggregation.plan import (
    StepPlan,
    add_tensor_task,
    overlapping,
    sources_of,
    tree,
)
from gradpipe.aggregation.reduce import AggregationMethod
from gradpipe.aggregation.robust_tasks import (
    read_distances,
    robust_chunk,
    select_peers,
    selected_chunk,
    selection_params,
)
from gradpipe.aggregation.tasks import StepSpec, combine_norms
from gradpipe.core.chunking import chunk_ranges
from gradpipe.core.display import printable
from gradpipe.storage.store import Store

__all__ = ["COORDINATE_METHODS", "ROBUST_METHODS", "SELECTION_METHODS", "add_robust_step"]

#: Coordinate-wise methods: one chunk of every peer per task.
COORDINATE_METHODS: Final = frozenset({AggregationMethod.MEDIAN, AggregationMethod.TRIMMED_MEAN})
#: Methods that select peers from the pairwise distances first.
SELECTION_METHODS: Final = frozenset(
    {AggregationMethod.KRUM, AggregationMethod.MULTI_KRUM, AggregationMethod.BULYAN}
)
#: Every method this module builds.
ROBUST_METHODS: Final = COORDINATE_METHODS | SELECTION_METHODS


def add_robust_step(
    graph: dict[Hashable, Any],
    token: str,
    store: Store,
    s: int,
    plan: StepPlan,
    fan: int,
) -> tuple[list[Hashable], list[Hashable]]:
    """Add the tasks of plan number ``s`` (a robust method) to ``graph``.

    Returns the keys of its result tensors and of what it decided (the selection).
    """
    spec = plan.spec
    method = AggregationMethod(spec.method)
    weights = [i.weight for i in spec.inputs]
    selection = (
        _add_selection(graph, token, store, s, plan, fan) if method in SELECTION_METHODS else None
    )
    tensor_keys = []
    for t, tensor in enumerate(plan.tensors):
        sources = [sources_of(m) for m in tensor.peers]
        chunk_keys: list[Hashable] = []
        heads = _peer_heads(spec, tensor.name)
        head = f"aggregate {printable(spec.name)} of tensor {printable(tensor.name)}"
        for c, (start, stop) in enumerate(chunk_ranges(tensor.shape, tensor.chunk_shape)):
            parts = [overlapping(src, start, stop) for src in sources]
            contexts = [f"{h}, chunk {c}" for h in heads]
            context = f"{head} of step {spec.step}, chunk {c}"
            if selection is None:
                key = (f"gradpipe-aggregate-robust-{token}", s, t, c)
                graph[key] = (
                    robust_chunk,
                    spec.step,
                    store,
                    parts,
                    start,
                    stop,
                    tensor.dtype,
                    contexts,
                    spec.method,
                    float(spec.params.get("trim", 0.0)),
                    context,
                )
            else:
                key = (f"gradpipe-aggregate-selected-{token}", s, t, c)
                graph[key] = (
                    selected_chunk,
                    spec.step,
                    store,
                    parts,
                    start,
                    stop,
                    tensor.dtype,
                    contexts,
                    selection,
                    spec.method,
                    int(spec.params.get("byzantine", 0)),
                    weights,
                    context,
                )
            chunk_keys.append(key)
        tensor_keys.append(add_tensor_task(graph, token, (s, t), spec, tensor, chunk_keys))
    outcome: list[Any] = []
    if selection is not None:
        params_key = (f"gradpipe-aggregate-selection-{token}", s)
        graph[params_key] = (selection_params, spec.step, selection)
        outcome.append(params_key)
    return tensor_keys, outcome


def _add_selection(
    graph: dict[Hashable, Any], token: str, store: Store, s: int, plan: StepPlan, fan: int
) -> Hashable:
    """Krum's selection: every peer pair's distance summed over all chunks, then the choice."""
    spec = plan.spec
    leaves: list[Hashable] = []
    for t, tensor in enumerate(plan.tensors):
        sources = [sources_of(m) for m in tensor.peers]
        heads = _peer_heads(spec, tensor.name)
        for c, (start, stop) in enumerate(chunk_ranges(tensor.shape, tensor.chunk_shape)):
            key = (f"gradpipe-aggregate-distance-{token}", s, t, c)
            graph[key] = (
                read_distances,
                spec.step,
                store,
                [overlapping(src, start, stop) for src in sources],
                start,
                stop,
                tensor.dtype,
                [f"{h}, chunk {c}" for h in heads],
            )
            leaves.append(key)
    total = tree(
        graph, f"gradpipe-aggregate-distsum-{token}", (s,), leaves, combine_norms, spec.step, fan
    )
    selection = (f"gradpipe-aggregate-select-{token}", s)
    graph[selection] = (
        select_peers,
        spec.step,
        total,
        spec.method,
        int(spec.params["byzantine"]),
        int(spec.params.get("keep", 1)),
        [i.peer for i in spec.inputs],
    )
    return selection


def _peer_heads(spec: StepSpec, tensor: str) -> list[str]:
    """Each peer's context for ``tensor`` (", chunk C" is added per chunk): names escaped once."""
    shown = printable(tensor)
    return [f"tensor {shown} of step {spec.step}, peer {printable(i.peer)}" for i in spec.inputs]
