"""Clipping an aggregate to an L2 norm (``clip_aggregate``), chunk by chunk.

The Rust prototype's coordinator clips the aggregated gradient (``clip_gradient_norm``).
The norm is over every tensor of the step's result, so it is known only once
every chunk is written; holding the chunks until then would not be out of
core. The result is therefore written first, then::

    norm (one written chunk → its exact squared-norm share)   per chunk
        └── normsum (exact, bounded tree over every chunk of every tensor)
                    clipscale  min(1, C / norm)
    rescale (chunk × factor in float64, rounded once, written)  per chunk
    clipped (the tensor's manifest)                              per tensor

A factor of 1 keeps every chunk as written. When the aggregate is clipped, the
unclipped blocks are left unreferenced (gc reclaims them): one extra write and
two extra reads of the aggregate, which is ``1/n`` of the step's input. The
norm is summed exactly (:class:`~gradpipe.aggregation.exact.ExactSum`), so the result
is the same bits whatever the tree, scheduler or worker count.
"""

from __future__ import annotations

from collections.abc import Hashable
from typing import Any

import numpy as np

from gradpipe.aggregation.exact import ExactSum
from gradpipe.aggregation.plan import StepPlan, TensorPlan, sources_of, tree
from gradpipe.aggregation.privacy import apply_scale, clip_scale, sq_norm_partial
from gradpipe.aggregation.tasks import (
    ChunkOut,
    TensorOut,
    _isolated,
    combine_norms,
)
from gradpipe.core.chunking import chunk_ranges
from gradpipe.core.display import printable
from gradpipe.core.dtypes import is_float, parse_dtype
from gradpipe.errors import InvalidInputError
from gradpipe.graph.arrays import load_chunk
from gradpipe.storage.blocks import WriteStats
from gradpipe.storage.store import Store
from gradpipe.storage.tensors import ChunkRecord, build_tensor_manifest, write_chunks

__all__ = ["add_aggregate_clip"]


def add_aggregate_clip(
    graph: dict[Hashable, Any],
    token: str,
    store: Store,
    s: int,
    plan: StepPlan,
    tensor_keys: list[Hashable],
    fan: int,
) -> tuple[list[Hashable], Hashable]:
    """Add the tasks that clip plan ``s``'s written result tensors to ``clip_aggregate``.

    Returns the keys of the clipped tensors and of what the clipping decided
    (the aggregate's norm and the factor), for the aggregate's params.
    """
    spec = plan.spec
    step = spec.step
    clip = float(spec.params["clip_aggregate"])
    leaves: list[Hashable] = []
    for t, (tensor, key) in enumerate(zip(plan.tensors, tensor_keys, strict=True)):
        head = _where(spec.name, tensor.name, step)
        for c in range(_chunks(tensor)):
            leaf = (f"gradpipe-aggregate-resultnorm-{token}", s, t, c)
            graph[leaf] = (
                result_sq_norm,
                step,
                store,
                key,
                c,
                f"{head}, chunk {c}",
            )
            leaves.append(leaf)
    total: Any = 0.0
    if leaves:
        total = tree(
            graph,
            f"gradpipe-aggregate-resultnormsum-{token}",
            (s,),
            leaves,
            combine_norms,
            step,
            fan,
        )
    factor = (f"gradpipe-aggregate-clipscale-{token}", s)
    graph[factor] = (aggregate_scale, step, total, clip)
    decided = (f"gradpipe-aggregate-clipped-{token}", s)
    graph[decided] = (clip_params, step, total, factor)
    clipped: list[Hashable] = []
    for t, (tensor, key) in enumerate(zip(plan.tensors, tensor_keys, strict=True)):
        chunk_keys: list[Hashable] = []
        head = _where(spec.name, tensor.name, step)
        for c in range(_chunks(tensor)):
            chunk = (f"gradpipe-aggregate-rescale-{token}", s, t, c)
            where = f"{head}, chunk {c}"
            graph[chunk] = (rescale_chunk, step, store, key, c, factor, where)
            chunk_keys.append(chunk)
        out = (f"gradpipe-aggregate-cliptensor-{token}", s, t)
        graph[out] = (clipped_tensor, step, key, chunk_keys)
        clipped.append(out)
    return clipped, decided


def _where(name: str, tensor: str, step: int) -> str:
    # Once per tensor: its chunks' contexts add ", chunk C" (names escaped once, not per chunk).
    return f"aggregate {printable(name)} of tensor {printable(tensor)} of step {step}"


def _chunk(store: Store, out: TensorOut, c: int, where: str) -> np.ndarray:
    source = sources_of(out.manifest)[c]
    shape = (source.stop - source.start,)
    return load_chunk(
        store, source.block, out.manifest.dtype, shape, where, source.frame, source.links
    )


@_isolated
def result_sq_norm(step: int, store: Store, out: TensorOut, c: int, where: str) -> ExactSum:
    """Chunk ``c`` of a written result tensor: its share of the aggregate's squared norm."""
    if not is_float(parse_dtype(out.manifest.dtype)):
        raise InvalidInputError(
            f"{where}: clip_aggregate needs floating-point tensors, this one is "
            f"{out.manifest.dtype} (aggregate without --clip-aggregate)"
        )
    return sq_norm_partial(_chunk(store, out, c, where))


@_isolated
def aggregate_scale(step: int, total: ExactSum | float, clip: float) -> float:
    """``min(1, C / norm)`` of the aggregate."""
    return clip_scale(total, clip)


@_isolated
def clip_params(step: int, total: ExactSum | float, factor: float) -> dict[str, float]:
    """What the aggregate records of its clipping: its norm before, and the factor."""
    sq = float(total.to_array()) if isinstance(total, ExactSum) else float(total)
    return {"aggregate_norm": float(np.sqrt(sq)), "aggregate_clip_scale": factor}


@_isolated
def rescale_chunk(
    step: int, store: Store, out: TensorOut, c: int, factor: float, where: str
) -> ChunkOut:
    """Chunk ``c`` scaled by ``factor`` (rounded once) and written; as written if 1."""
    manifest = out.manifest
    if factor == 1.0:
        record = ChunkRecord(manifest.blocks[c], manifest.stats[c], manifest.inline.get(c))
        return ChunkOut(record, WriteStats())
    scaled = apply_scale(_chunk(store, out, c, where), factor)
    stats = WriteStats()
    [record] = write_chunks(store, [scaled.reshape(-1)], stats=stats, where=where)
    return ChunkOut(record, stats)


@_isolated
def clipped_tensor(step: int, out: TensorOut, chunks: list[ChunkOut]) -> TensorOut:
    """The clipped tensor's manifest; its stats count the unclipped writes too."""
    stats = WriteStats()
    stats.add(out.stats)
    for chunk in chunks:
        stats.add(chunk.stats)
    m = out.manifest
    return TensorOut(
        build_tensor_manifest(m.dtype, m.shape, m.chunk_shape, [c.record for c in chunks]), stats
    )


def _chunks(tensor: TensorPlan) -> int:
    return sum(1 for _ in chunk_ranges(tensor.shape, tensor.chunk_shape))
