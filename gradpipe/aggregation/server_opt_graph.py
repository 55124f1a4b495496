"""The builder of the server-optimizer graph: one server step as tasks per chunk.

For every parameter tensor of the snapshot, on its chunk grid (the grid of
the snapshot's parameters, which every later version keeps)::

    gradpipe-chunk (params) gradpipe-chunk (m) gradpipe-chunk (v)   read by content
              └───────────── gradpipe-server-step ─────────┘         + the update's chunk
                                   │                                  step, write the chunks
    gradpipe-server-tensor (params.w)  (server_optimizer.m.w) ...    one per new array

The stored chunks are read by the content-keyed tasks of
:mod:`gradpipe.graph.chains`: a delta chunk is rebuilt from the task of its
keyframe, and the step task writes its new chunk as a delta against that same
task's result, so no keyframe is read twice. The update (an aggregate, on its
own grid) and state stored on another grid are read by overlap inside the
step task. No task holds more than a few chunks.
"""

from __future__ import annotations

import uuid
from collections.abc import Hashable
from dataclasses import dataclass
from typing import Any

from dask.base import tokenize

from gradpipe.aggregation.plan import overlapping, sources_of
from gradpipe.aggregation.server_opt import ServerOptimizerConfig
from gradpipe.aggregation.server_opt_tasks import (
    ChunkJob,
    ChunkOutput,
    StateInput,
    server_chunk,
    server_tensor,
)
from gradpipe.core.display import printable
from gradpipe.core.tensor_manifest import TensorManifest
from gradpipe.graph.chains import add_chunk_read, chunk_key
from gradpipe.storage.chains import parent_chunks
from gradpipe.storage.store import Store
from gradpipe.storage.versioner import ChunkVersioner, ParentChunk

__all__ = ["NewArray", "ServerPlan", "TensorStep", "build_server_graph"]


@dataclass(frozen=True)
class NewArray:
    """One array of the new snapshot: its key and role, and the version it follows."""

    key: str  # its array key in the new snapshot
    role: str  # "params" or a state name
    dtype: str
    parent: TensorManifest | None  # the same key in the previous snapshot
    parent_id: str | None

    def aligned(self, shape: tuple[int, ...], chunk_shape: tuple[int, ...]) -> bool:
        """Whether its parent is on the step's grid, of its dtype: chunks are versioned 1:1."""
        p = self.parent
        return p is not None and (p.dtype, p.shape, p.chunk_shape) == (
            self.dtype,
            shape,
            chunk_shape,
        )


@dataclass(frozen=True)
class TensorStep:
    """One parameter tensor: what the step reads and writes of it."""

    name: str
    shape: tuple[int, ...]
    params: TensorManifest  # in the previous snapshot; its grid is the step's
    update: TensorManifest | None  # the aggregate's tensor; None: carried over unchanged
    state: dict[str, TensorManifest]  # the stored state by name; empty: it starts here
    outputs: tuple[NewArray, ...]  # "params" first, then the state

    @property
    def chunk_shape(self) -> tuple[int, ...]:
        return self.params.chunk_shape


@dataclass(frozen=True)
class ServerPlan:
    """A server step to compute: the tensors, the optimizer and its round."""

    step: int
    snapshot: str
    tensors: tuple[TensorStep, ...]
    config: ServerOptimizerConfig
    t: int  # the round this step makes, 1-based
    interval: int  # the chain's keyframe interval


def build_server_graph(
    store: Store, plan: ServerPlan
) -> tuple[dict[Hashable, Any], list[tuple[str, Hashable]]]:
    """The graph of one server step (not computed) and, per new array, its key and task key.

    Each task key's result is a :class:`~gradpipe.aggregation.tasks.TensorOut`:
    the array's manifest, its blocks written, and what writing them did.
    """
    # A step writes blocks: a fresh token per call, so a failed attempt's keys
    # are never taken for this one's on a cluster that remembers them.
    token = tokenize(store.url, plan.snapshot, plan.step, plan.t, uuid.uuid4().hex)
    graph: dict[Hashable, Any] = {}
    out: list[tuple[str, Hashable]] = []
    where = f"snapshot {printable(plan.snapshot)}"
    versioner = ChunkVersioner(store, kind="int", threshold=0.0, interval=plan.interval)
    for j, tensor in enumerate(plan.tensors):
        ranges = tensor.params.chunk_ranges()
        aligned = {
            name: (m.shape, m.chunk_shape) == (tensor.shape, tensor.chunk_shape)
            for name, m in tensor.state.items()
        }
        parents = {
            o.role: parent_chunks(o.parent, interval=plan.interval)
            if o.parent is not None and o.aligned(tensor.shape, tensor.chunk_shape)
            else None
            for o in tensor.outputs
        }
        update = sources_of(tensor.update) if tensor.update is not None else None
        state_sources = {n: sources_of(m) for n, m in tensor.state.items() if not aligned[n]}
        step_keys: list[Hashable] = []
        context = f"{where}, tensor {printable(tensor.name)}"  # once per tensor, not per chunk
        for c, (start, stop) in enumerate(ranges):
            params_key = add_chunk_read(graph, store, tensor.params, c, f"{context} params")
            state_keys: list[Hashable | None] = []
            state: list[StateInput] = []
            for name, manifest in tensor.state.items():
                if aligned[name]:
                    state.append(StateInput(name, manifest.dtype, None))
                    state_keys.append(
                        add_chunk_read(graph, store, manifest, c, f"{context} state {name}")
                    )
                else:
                    found = tuple(overlapping(state_sources[name], start, stop))
                    state.append(StateInput(name, manifest.dtype, found))
            outputs = []
            keyframes: list[Hashable | None] = []
            for o in tensor.outputs:
                own: list[ParentChunk] | None = parents[o.role]
                pc = own[c] if own is not None else None
                outputs.append(ChunkOutput(o.role, o.dtype, pc))
                # The keyframe is read by the graph already: the parent's chunk is an input.
                keyframes.append(chunk_key(pc.keyframe) if pc and pc.keyframe else None)
            job = ChunkJob(
                step=plan.step,
                tensor=tensor.name,
                index=c,
                start=start,
                stop=stop,
                dtype=tensor.params.dtype,
                update=None if update is None else tuple(overlapping(update, start, stop)),
                update_dtype=tensor.update.dtype if tensor.update is not None else "float32",
                state=tuple(state),
                outputs=tuple(outputs),
                config=plan.config,
                t=plan.t,
                where=context,
            )
            key = (f"gradpipe-server-step-{token}", j, c)
            graph[key] = (server_chunk, versioner, job, params_key, state_keys, keyframes)
            step_keys.append(key)
        for r, o in enumerate(tensor.outputs):
            key = (f"gradpipe-server-tensor-{token}", j, r)
            graph[key] = (
                server_tensor,
                o.role,
                o.dtype,
                tensor.shape,
                tensor.chunk_shape,
                o.parent_id,
                plan.interval,
                step_keys,
            )
            out.append((o.key, key))
    return graph, out
