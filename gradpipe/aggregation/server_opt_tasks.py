"""The tasks of the server-optimizer graph: one chunk of one parameter tensor at a time.

The graph is built by :mod:`gradpipe.aggregation.server_opt_graph`; its task keys are::

    gradpipe-chunk           a stored chunk of the snapshot, by content   shared
    gradpipe-server-step     read the update's chunk, step, write         per chunk
    gradpipe-server-tensor   one array's manifest of the new snapshot     per array

A step task holds one chunk of the parameters, of the update and of each
state array, their float64 copies and the new values: a small multiple of
the chunk size, whatever the model's size. It writes each new chunk as the
next version of the snapshot's chunk (:func:`~gradpipe.storage.chains.write_chunk_version`),
a delta against its keyframe when that is smaller, the keyframe's bytes
coming from the task that read them. Tasks raise: a server step is one
snapshot, committed whole or not at all.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from gradpipe.aggregation.server_opt import ServerOptimizerConfig, init_server_state, server_step
from gradpipe.aggregation.tasks import ChunkSource, TensorOut, _read
from gradpipe.core.dtypes import is_float, parse_dtype
from gradpipe.errors import InvalidInputError
from gradpipe.storage.blocks import WriteStats
from gradpipe.storage.chains import version_manifest, write_chunk_version
from gradpipe.storage.versioner import ChunkVersioner, KeyframeValues, ParentChunk, VersionChunk

__all__ = [
    "ChunkJob",
    "ChunkOutput",
    "StateInput",
    "StepChunk",
    "server_chunk",
    "server_tensor",
]


@dataclass(frozen=True, slots=True)
class StateInput:
    """One state array of the chunk: given as a graph input, or read here by overlap."""

    name: str  # "momentum", "m", "v"
    dtype: str
    sources: tuple[ChunkSource, ...] | None  # None: the task's input (the same grid)


@dataclass(frozen=True, slots=True)
class ChunkOutput:
    """One array of the new snapshot at this chunk, and its parent's chunk."""

    role: str  # "params" or a state name
    dtype: str
    parent: ParentChunk | None


@dataclass(frozen=True)
class ChunkJob:
    """Everything one step task needs but the chunks it reads: small, no arrays."""

    step: int
    tensor: str
    index: int
    start: int
    stop: int
    dtype: str  # the parameters'
    update: tuple[ChunkSource, ...] | None  # the aggregate's chunks that overlap; None: no update
    update_dtype: str
    state: tuple[StateInput, ...]  # empty: the optimizer's state starts here
    outputs: tuple[ChunkOutput, ...]
    config: ServerOptimizerConfig
    t: int  # the round, 1-based
    where: str  # names the snapshot and the tensor (escaped once per tensor) in messages


@dataclass(frozen=True)
class StepChunk:
    """One chunk of every new array: how it is stored, and what writing it did."""

    chunks: dict[str, tuple[VersionChunk, WriteStats]]


def _typed(data: np.ndarray | None, dtype: str, size: int) -> np.ndarray:
    """A chunk's logical bytes as ``dtype`` (zeros for an all-zero chunk, which has no task)."""
    if data is None:
        return np.zeros(size, dtype=parse_dtype(dtype))
    return data.view(parse_dtype(dtype))


def server_chunk(
    versioner: ChunkVersioner,
    job: ChunkJob,
    params: np.ndarray | None,
    state: list[np.ndarray | None],
    keyframes: list[np.ndarray | None],
) -> StepChunk:
    """One server step on chunk ``job.index``: compute, check, and write every new array's chunk.

    ``versioner`` carries the store and the client's settings (inline size,
    codec level, keyframe interval), so workers decide as the client would.
    ``params`` and the entries of ``state`` given on the same grid are the
    chunks' bytes (None: all-zero); ``keyframes`` the bytes of each output's
    keyframe (None: no delta is tried).
    """
    store = versioner.store
    size = job.stop - job.start
    where = f"{job.where}, chunk {job.index}"
    x = _typed(params, job.dtype, size)
    given = iter(state)
    current = {
        s.name: (
            _typed(next(given), s.dtype, size)
            if s.sources is None
            else _read(store, s.sources, job.start, job.stop, s.dtype, f"{where}, state {s.name}")
        )
        for s in job.state
    }
    if not current:  # the first round: the optimizer's state starts here
        current = init_server_state(x, job.config)
    values = {"params": x, **current}
    if job.update is not None:
        g = _read(store, job.update, job.start, job.stop, job.update_dtype, f"{where}, update")
        # An overflow is reported below, naming the tensor and chunk, not warned about.
        with np.errstate(over="ignore", invalid="ignore"):
            new, after = server_step(x, g, current, job.config, t=job.t)
        values = {"params": new, **after}
        _check_finite(values, job, where)
    out: dict[str, tuple[VersionChunk, WriteStats]] = {}
    for output, keyframe in zip(job.outputs, keyframes, strict=True):
        array = np.ascontiguousarray(values[output.role]).reshape(-1)
        if array.dtype != parse_dtype(output.dtype):  # the plan's invariant
            raise TypeError(f"{where}: {output.role} is {array.dtype}, planned {output.dtype}")
        base = None if keyframe is None else _typed(keyframe, output.dtype, size)
        stats = WriteStats()
        chunk = write_chunk_version(
            versioner,
            array,
            output.parent,
            _given(base),
            stats=stats,
            where=f"{where}, {output.role}",
        )
        out[output.role] = (chunk, stats)
    return StepChunk(out)


def _given(base: np.ndarray | None) -> KeyframeValues:
    """The keyframe finder of a step task: the keyframe's bytes came from the graph."""

    def find(parent: ParentChunk) -> np.ndarray | None:
        return base

    return find


def _check_finite(values: dict[str, np.ndarray], job: ChunkJob, where: str) -> None:
    """Refuse a step that leaves NaN or infinity in the parameters or the state."""
    for role, array in values.items():
        if not is_float(array.dtype):
            continue
        bad = array.size - int(np.count_nonzero(np.isfinite(array)))
        if bad:
            raise InvalidInputError(
                f"server update of step {job.step}: {where}: the step leaves {bad} non-finite "
                f"values in {role} (overflow: lower the server learning rate, or check the "
                "aggregate and the snapshot's values); nothing was committed"
            )


def server_tensor(
    role: str,
    dtype: str,
    shape: tuple[int, ...],
    chunk_shape: tuple[int, ...],
    parent_id: str | None,
    interval: int,
    chunks: list[StepChunk],
) -> TensorOut:
    """The manifest of one array of the new snapshot from its chunks, in chunk order."""
    stats = WriteStats()
    picked = []
    for chunk in chunks:
        version, written = chunk.chunks[role]
        picked.append(version)
        stats.add(written)
    manifest = version_manifest(
        dtype, shape, chunk_shape, picked, parent_id=parent_id, interval=interval
    )
    return TensorOut(manifest, stats)
