"""The plan of an aggregate graph and the helpers its builders share.

:mod:`gradpipe.aggregation.graph` builds the reducible methods' graph, and the modules it
delegates to (:mod:`gradpipe.aggregation.robust_graph` for the coordinate and selection methods,
:mod:`gradpipe.aggregation.clip` for ``clip_aggregate``) build on these: the plan of a
step, the sources of a peer's tensor, the tensor task and bounded trees. Kept apart so
that those modules import this one, not each other.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from dataclasses import dataclass, field
from typing import Any

from gradpipe.aggregation.options import DEFAULT_SPLIT_EVERY, parse_split_every
from gradpipe.aggregation.tasks import ChunkSource, StepSpec, tensor_manifest
from gradpipe.core.tensor_manifest import TensorManifest, require_self_contained

__all__ = [
    "DEFAULT_SPLIT_EVERY",
    "StepPlan",
    "TensorPlan",
    "add_tensor_task",
    "overlapping",
    "parse_split_every",
    "sources_of",
    "tree",
    "tree_levels",
]


def add_tensor_task(
    graph: dict[Hashable, Any],
    token: str,
    index: tuple[int, int],
    spec: StepSpec,
    tensor: TensorPlan,
    chunk_keys: Sequence[Hashable],
) -> Hashable:
    """Add the task that builds one result tensor's manifest from its written chunks; its key."""
    key = (f"gradpipe-aggregate-tensor-{token}", *index)
    graph[key] = (
        tensor_manifest,
        spec.step,
        tensor.dtype,
        tensor.shape,
        tensor.chunk_shape,
        chunk_keys,
    )
    return key


@dataclass(frozen=True)
class TensorPlan:
    """One tensor of a step: its dtype and shape, and every peer's stored manifest (peer order)."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    peers: tuple[TensorManifest, ...]

    @property
    def chunk_shape(self) -> tuple[int, ...]:
        """The output grid: the first peer's."""
        return self.peers[0].chunk_shape


@dataclass(frozen=True)
class StepPlan:
    """The aggregate of one step to compute: its definition and its tensors."""

    spec: StepSpec
    tensors: tuple[TensorPlan, ...]
    #: Decided when planning, recorded in the aggregate's params (DP-FedAvg: a seed picked).
    decided: dict[str, Any] = field(default_factory=dict)
    #: Adaptive clipping: the clip norm this step starts from; None: the previous plan's next.
    clip_start: float | None = None


def sources_of(manifest: TensorManifest) -> list[ChunkSource]:
    """The stored chunks of a peer's tensor, as tasks take them."""
    require_self_contained(manifest, "an aggregate's input")
    return [
        ChunkSource(block, start, stop, manifest.inline.get(i), manifest.deltas.get(i, ()))
        for i, (block, (start, stop)) in enumerate(
            zip(manifest.blocks, manifest.chunk_ranges(), strict=True)
        )
    ]


def overlapping(sources: list[ChunkSource], start: int, stop: int) -> list[ChunkSource]:
    """The chunks of ``sources`` that hold some of the flat elements ``[start, stop)``."""
    return [s for s in sources if s.start < stop and s.stop > start]


def tree(
    graph: dict[Hashable, Any],
    name: str,
    where: tuple[Any, ...],
    leaves: list[Hashable],
    func: Any,
    step: int,
    split_every: int,
) -> Hashable:
    """A bounded tree of ``func`` over ``leaves`` in order (contiguous groups); its root key."""
    return tree_levels(graph, name, where, leaves, func, step, split_every, until=1)[0]


def tree_levels(
    graph: dict[Hashable, Any],
    name: str,
    where: tuple[Any, ...],
    leaves: list[Hashable],
    func: Any,
    step: int,
    split_every: int,
    *,
    until: int | None = None,
) -> list[Hashable]:
    """The levels of :func:`tree` until at most ``until`` (default ``split_every``) keys remain.

    Returns those keys, in order: what the task above the tree takes.
    """
    level, depth = leaves, 0
    while len(level) > (split_every if until is None else until):
        nxt: list[Hashable] = []
        for g, lo in enumerate(range(0, len(level), split_every)):
            key = (name, *where, depth, g)
            graph[key] = (func, step, list(level[lo : lo + split_every]))
            nxt.append(key)
        level, depth = nxt, depth + 1
    return level
