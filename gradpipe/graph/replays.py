"""Reading snapshot versions written with optimizer replay, as a Dask graph.

The tasks are :class:`~gradpipe.storage.replays.ReplayGraph`'s (one per chunk, named by
its id, shared by the versions read together); this adds one task per array assembling
it from its chunks, and runs the graph on a runner.
"""

from __future__ import annotations

from collections.abc import Hashable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np
from dask.base import tokenize

from gradpipe.core.manifest import manifest_id
from gradpipe.graph.chains import assemble_chunks
from gradpipe.storage.replays import ReplayGraph, SnapshotVersion
from gradpipe.storage.store import Store

if TYPE_CHECKING:
    from gradpipe.graph.runner import Runner

__all__ = ["build_snapshot_graph", "read_snapshot_arrays"]

_TENSOR = "gradpipe-restore-tensor"


def build_snapshot_graph(
    store: Store, versions: Mapping[str, SnapshotVersion], wanted: Sequence[tuple[str, str]]
) -> tuple[dict[Hashable, Any], list[Hashable]]:
    """The graph reading arrays ``wanted`` (pairs of version id and array key); their keys.

    ``versions`` holds every version a read may replay through: each wanted one and its
    ancestors, as deep as their replays go.
    """
    builder = ReplayGraph(store, versions)
    keys: list[Hashable] = []
    for t, (version_id, key) in enumerate(wanted):
        manifest = versions[version_id].tensor(key)
        parts = [builder.chunk(version_id, key, i) for i in range(len(manifest.blocks))]
        name = (f"{_TENSOR}-{tokenize(manifest_id(manifest))}", t)
        ranges = manifest.chunk_ranges()
        builder.graph[name] = (assemble_chunks, manifest.dtype, manifest.shape, ranges, parts)
        keys.append(name)
    return builder.graph, keys


def read_snapshot_arrays(
    store: Store,
    versions: Mapping[str, SnapshotVersion],
    wanted: Sequence[tuple[str, str]],
    *,
    runner: Runner,
) -> list[np.ndarray]:
    """The arrays ``wanted``, computed on ``runner`` (see :func:`build_snapshot_graph`)."""
    graph, keys = build_snapshot_graph(store, versions, wanted)
    return runner.get(graph, keys, name="gradpipe-restore")
