"""Reading snapshot versions written with optimizer replay, as a Dask graph.

A replay chunk of version *t* is rebuilt by a task that depends on the previous version's
chunks of the parameter's state (each rebuilt the same way, at most the replay interval
deep), on the gradient's elements of the chunk and, for the parameter itself, on version
*t*'s moments (rebuilt first: the prediction goes on from the exact moments). Every chunk
task is named by the chunk's logical id (:func:`~gradpipe.graph.chains.chunk_key`), like
the tasks of delta chains, so versions read together share their ancestors' work, and
every task checks its result against its id. Chunks that are not replayed are read as
:mod:`gradpipe.graph.chains` reads them.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np
from dask.base import tokenize

from gradpipe.core.chain import ReplayLink
from gradpipe.core.dtypes import dtype_name, parse_dtype
from gradpipe.core.manifest import manifest_id
from gradpipe.core.replay import roles, work_dtype
from gradpipe.core.replay_record import ReplayTarget
from gradpipe.core.snapshot_manifest import SnapshotManifest
from gradpipe.core.tensor_manifest import TensorManifest, require_self_contained
from gradpipe.errors import IntegrityError
from gradpipe.graph.chains import add_chunk_read, assemble_chunks, chunk_key
from gradpipe.storage.replays import gradient_range, predict_chunk, rebuild_replay_chunk
from gradpipe.storage.store import Store

if TYPE_CHECKING:
    from gradpipe.graph.runner import Runner

__all__ = ["SnapshotVersion", "build_snapshot_graph", "read_snapshot_arrays"]

_GRADIENT = "gradpipe-restore-gradient"
_TENSOR = "gradpipe-restore-tensor"


@dataclass(frozen=True)
class SnapshotVersion:
    """A version as the graph reads it: its manifest, and how to find its tensors.

    ``tensor(key)`` is the manifest of array ``key``; ``gradient(name)`` that of the
    gradient its replay applied to parameter ``name`` (raising NotFoundError naming the
    gradient when it is gone). ``context`` names the version in errors.
    """

    id: str
    manifest: SnapshotManifest
    tensor: Callable[[str], TensorManifest]
    gradient: Callable[[str], TensorManifest]
    context: str


def build_snapshot_graph(
    store: Store, versions: Mapping[str, SnapshotVersion], wanted: Sequence[tuple[str, str]]
) -> tuple[dict[Hashable, Any], list[Hashable]]:
    """The graph reading arrays ``wanted`` (pairs of version id and array key); their keys.

    ``versions`` holds every version a read may replay through: each wanted one and its
    ancestors, as deep as their replays go.
    """
    builder = _Builder(store, versions)
    keys: list[Hashable] = []
    for t, (version_id, key) in enumerate(wanted):
        version = versions[version_id]
        manifest = version.tensor(key)
        parts = [builder.chunk(version_id, key, i) for i in range(len(manifest.blocks))]
        name = (f"{_TENSOR}-{tokenize(manifest_id(manifest))}", t)
        builder.graph[name] = (
            assemble_chunks, manifest.dtype, manifest.shape, manifest.chunk_ranges(), parts
        )  # fmt: skip
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


class _Builder:
    """Adds each chunk's tasks once (keys are chunk ids); remembers the gradient ranges."""

    def __init__(self, store: Store, versions: Mapping[str, SnapshotVersion]) -> None:
        self.store, self.versions = store, versions
        self.graph: dict[Hashable, Any] = {}
        self.targets = {v: self._targets(v) for v in versions}

    def _targets(self, version_id: str) -> dict[str, ReplayTarget]:
        replay = self.versions[version_id].manifest.replay
        return {} if replay is None else replay.targets()

    def _version(self, version_id: str | None, where: str) -> SnapshotVersion:
        version = None if version_id is None else self.versions.get(version_id)
        if version is None:
            raise IntegrityError(
                f"{where}: replays from version {version_id}, which is not in the snapshot's "
                "chain; run `gradpipe verify`"
            )
        return version

    def chunk(self, version_id: str, key: str, i: int) -> Hashable | None:
        """The key of chunk ``i`` of array ``key`` of a version (None: all zero)."""
        version = self.versions[version_id]
        manifest = version.tensor(key)
        where = f"{version.context}, {key}, chunk {i}"
        link = manifest.replays.get(i)
        if link is None:
            return add_chunk_read(self.graph, self.store, manifest, i, where)
        block = manifest.blocks[i]
        assert block is not None  # a replayed chunk is never all zero
        done = chunk_key(block)
        if done in self.graph:
            return done
        previous = self._version(version.manifest.previous, where)
        if link.source == "previous":  # the previous version's chunk, the same bytes
            found = self.chunk(previous.id, key, i)
            if found != done:
                raise IntegrityError(
                    f"{where}: says it is the previous version's chunk, which is another; "
                    "run `gradpipe verify`"
                )
            return done
        target = self.targets[version_id].get(key)
        if target is None:
            raise IntegrityError(f"{where}: is replayed, but its snapshot names no optimizer step")
        self._replay(version, manifest, i, link, target, previous, where)
        return done

    def _replay(
        self,
        version: SnapshotVersion,
        manifest: TensorManifest,
        i: int,
        link: ReplayLink,
        target: ReplayTarget,
        previous: SnapshotVersion,
        where: str,
    ) -> None:
        needed = roles(target.group.step)
        arrays = target.arrays
        start, stop = manifest.chunk_ranges()[i]
        before = [self.chunk(previous.id, arrays[r], i) for r in needed]
        moments = [r for r in needed if r != "param"] if target.role == "param" else []
        known = [self.chunk(version.id, arrays[r], i) for r in moments]
        grad = self._gradient(version, target.grad_name, start, stop, where)
        spec = _ReplaySpec(
            store=self.store,
            link=link,
            block=manifest.blocks[i] or "",
            dtype=manifest.dtype,
            target=target,
            roles=needed,
            moments=tuple(moments),
            where=where,
        )
        self.graph[chunk_key(spec.block)] = (_replay_task, spec, before, grad, known)

    def _gradient(
        self, version: SnapshotVersion, name: str, start: int, stop: int, where: str
    ) -> Hashable:
        gradient = version.gradient(name)
        require_self_contained(gradient, f"{where}, gradient {name}")
        key = (_GRADIENT, tokenize(manifest_id(gradient), start, stop))
        if key in self.graph:
            return key
        chunks, ranges = [], []
        for j, (lo, hi) in enumerate(gradient.chunk_ranges()):
            if lo < stop and start < hi:
                chunk_where = f"{where}, gradient {name}"
                chunks.append(add_chunk_read(self.graph, self.store, gradient, j, chunk_where))
                ranges.append((lo, hi))
        self.graph[key] = (gradient_range, gradient.dtype, chunks, ranges, start, stop)
        return key


@dataclass(frozen=True)
class _ReplaySpec:
    """What a replay task needs besides its inputs (picklable: it travels to workers)."""

    store: Store
    link: ReplayLink
    block: str
    dtype: str
    target: ReplayTarget
    roles: tuple[str, ...]
    moments: tuple[str, ...]
    where: str


def _replay_task(
    spec: _ReplaySpec,
    before: list[np.ndarray | None],
    grad: np.ndarray,
    known: list[np.ndarray | None],
) -> np.ndarray:
    """One replayed chunk's logical bytes (uint8), checked against its id."""
    group = spec.target.group
    dtype = parse_dtype(spec.dtype)
    predicted = predict_chunk(
        group.step,
        group.scalars.get(dtype_name(work_dtype(dtype)), {}),
        spec.target.role,
        previous=dict(zip(spec.roles, before, strict=True)),
        grad=grad,
        known=dict(zip(spec.moments, known, strict=True)),
        dtype=dtype,
    )
    return rebuild_replay_chunk(
        spec.store, spec.link, predicted, block=spec.block, where=spec.where
    )
