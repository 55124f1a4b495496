"""Chunks of snapshot versions stored against an optimizer replay: predicted, rebuilt.

The writer and every reader predict a chunk with the same function,
:func:`predict_chunk`: the optimizer step (:func:`gradpipe.core.replay.replay`) on the
previous version's chunks of the parameter's state, the gradient's elements of the chunk
and the step's recorded scalars, with this version's moments known exactly when the
parameter itself is predicted (they are rebuilt first). :func:`rebuild_replay_chunk` then
checks the prediction against the id the writer recorded (a reader whose arithmetic drifted
says so: the stored blocks are intact) and applies the residual (docs/design/016).

:class:`ReplayGraph` lays out the tasks that rebuild chunks of a version: a replayed chunk
depends on the previous version's chunks of its parameter (rebuilt the same way, at most
the replay interval deep), on the gradient's elements of the chunk and, for the parameter
itself, on the version's moments. A stored chunk's task is named by its id and a replayed
chunk's by (version, array, chunk), so versions read together share their ancestors' work;
each task checks its result against the chunk's id. Restores run it on a Dask runner
(:mod:`gradpipe.graph.replays`); ``verify`` runs it chunk by chunk.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from gradpipe.codecs.delta import DeltaCodec
from gradpipe.core.aggregate_manifest import AggregateManifest
from gradpipe.core.chain import ReplayLink
from gradpipe.core.display import printable
from gradpipe.core.dtypes import dtype_name, parse_dtype
from gradpipe.core.ids import hash_bytes
from gradpipe.core.manifest import manifest_id
from gradpipe.core.replay import (
    OptimizerStep,
    decay,
    replay,
    roles,
    scalars_from_json,
    work_dtype,
)
from gradpipe.core.replay_record import ReplayTarget
from gradpipe.core.run_manifest import DumpManifest
from gradpipe.core.snapshot_manifest import SnapshotManifest
from gradpipe.core.tensor_manifest import TensorManifest, require_self_contained
from gradpipe.errors import IntegrityError, NotFoundError
from gradpipe.storage.reads import ChunkRead, decode_chunks

if TYPE_CHECKING:
    from gradpipe.storage.store import Store

__all__ = [
    "GradientSource",
    "PredictionDriftError",
    "ReplayGraph",
    "SnapshotVersion",
    "chunk_key",
    "combine_gradients",
    "gradient_range",
    "predict_chunk",
    "predict_decay",
    "rebuild_replay_chunk",
    "snapshot_version",
]

_CHUNK = "gradpipe-restore-chunk"
_REPLAYED = "gradpipe-restore-replayed"
_GRADIENT = "gradpipe-restore-gradient"


class PredictionDriftError(IntegrityError):
    """A reader's prediction is not the writer's: its arithmetic drifted (no block is bad)."""


def chunk_key(block: str) -> Hashable:
    """The key of the task whose result is chunk ``block``'s logical bytes (uint8)."""
    return (_CHUNK, block)


def predict_chunk(
    step: OptimizerStep,
    scalars: Mapping[str, str],
    role: str,
    *,
    previous: Mapping[str, np.ndarray | None],
    grad: np.ndarray,
    known: Mapping[str, np.ndarray | None],
    dtype: np.dtype,
) -> np.ndarray:
    """The predicted values of one chunk of ``role`` (an array of ``dtype``).

    ``previous`` and ``known`` map roles to the chunk's values, None for an all-zero chunk
    (which takes no block); ``scalars`` are the step's, as recorded (hex bit patterns).
    """
    count = grad.size

    def values(chunk: np.ndarray | None) -> np.ndarray:
        return np.zeros(count, dtype=dtype) if chunk is None else chunk.view(dtype)

    before = {r: values(v) for r, v in previous.items()}
    exact = {r: values(v) for r, v in known.items()}
    out = replay(
        step,
        before,
        grad,
        known=exact or None,
        scalars=scalars_from_json(scalars, dtype),
        only=(role,),
    )
    return np.ascontiguousarray(out[role])


def rebuild_replay_chunk(
    store: Store,
    link: ReplayLink,
    predicted: np.ndarray,
    *,
    block: str,
    where: str,
) -> np.ndarray:
    """Chunk ``block``'s logical bytes: its residual applied to ``predicted``, checked.

    Raises :class:`IntegrityError` when the result is not ``block``:
    :class:`PredictionDriftError` when the prediction is not the writer's (the reader's
    arithmetic drifted: the stored blocks are intact), else the residual is bad.
    """
    predicted_bytes = np.ascontiguousarray(predicted).view(np.uint8)
    if link.block is None:
        out = predicted_bytes.copy()
    else:
        residual = store.get_raw(link.block, context=f"{where}, replay residual")
        out = np.empty(predicted_bytes.nbytes, dtype=np.uint8)
        codec = DeltaCodec(link.kind, dtype_name(predicted.dtype)).bind(predicted)
        codec.decode(residual, out=out)
    if hash_bytes(out) == block:
        return out  # right, so the prediction was the writer's too: one hash a chunk
    if hash_bytes(predicted_bytes) != link.predicted:
        raise PredictionDriftError(
            f"{where}: the optimizer replay predicts other values than the writer's "
            f"(numpy {np.__version__}; the arithmetic rule is design note 016's). The stored "
            "blocks are intact; read it with the gradpipe and numpy that wrote it"
        )
    raise IntegrityError(
        f"{where}: its replay residual rebuilds other bytes than chunk {block}; "
        "run `gradpipe verify`"
    )


def gradient_range(
    dtype: str,
    chunks: list[np.ndarray | None],
    ranges: list[tuple[int, int]],
    start: int,
    stop: int,
) -> np.ndarray:
    """Elements ``start:stop`` of a gradient tensor from its chunks that cover them.

    ``chunks`` are those chunks' logical bytes (None: all zero) and ``ranges`` their element
    ranges; a gradient need not be chunked as the state is.
    """
    typed = parse_dtype(dtype)
    out = np.zeros(stop - start, dtype=typed)
    for chunk, (lo, hi) in zip(chunks, ranges, strict=True):
        a, b = max(lo, start), min(hi, stop)
        if chunk is not None and a < b:
            out[a - start : b - start] = chunk.view(typed)[a - lo : b - lo]
    return out


@dataclass(frozen=True)
class SnapshotVersion:
    """A version as a replay reads it: its manifest, and how to find its tensors.

    ``tensor(key)`` is the manifest of array ``key``; ``gradient(name)`` that of the
    gradient its replay applied to parameter ``name`` (raising NotFoundError naming the
    gradient when it is gone). ``context`` names the version in errors.
    """

    id: str
    manifest: SnapshotManifest
    tensor: Callable[[str], TensorManifest]
    gradient: Callable[[str], GradientSource]
    context: str


@dataclass(frozen=True)
class GradientSource:
    """A parameter's gradient as stored: one tensor, or one per peer and the rule combining them."""

    tensors: tuple[TensorManifest, ...]
    combine: str | None = None  # None: the one tensor is the gradient


def snapshot_version(store: Store, snapshot_id: str, manifest: SnapshotManifest) -> SnapshotVersion:
    """``manifest`` as :class:`SnapshotVersion`: tensors embedded or read, gradient found."""
    context = f"snapshot {printable(manifest.name)} at step {manifest.step}"

    def tensor(key: str) -> TensorManifest:
        tensor_id = manifest.tensors[key]
        found = manifest.embedded.get(tensor_id)
        if found is not None:
            return found
        return store.get_typed(tensor_id, TensorManifest, context=f"{context}, {printable(key)}")

    return SnapshotVersion(
        snapshot_id, manifest, tensor, _gradient_finder(store, manifest, context), context
    )


def _gradient_finder(
    store: Store, manifest: SnapshotManifest, where: str
) -> Callable[[str], GradientSource]:
    """Each parameter's gradient, as the replay version ``manifest`` names it."""
    ref = None if manifest.replay is None else manifest.replay.gradient
    sets: list[AggregateManifest | DumpManifest] = []

    def tensor_sets() -> list[AggregateManifest | DumpManifest]:
        assert ref is not None
        if not sets:
            wanted: list[tuple[str, type[AggregateManifest] | type[DumpManifest]]] = []
            if ref.aggregate is not None:
                wanted.append((ref.aggregate, AggregateManifest))
            wanted += [(dump_id, DumpManifest) for _, dump_id in ref.dumps]
            found = []  # kept only whole: a later lookup must not combine fewer peers
            for manifest_id_, kind in wanted:
                try:
                    found.append(store.get_typed(manifest_id_, kind, context=where))
                except NotFoundError:
                    raise NotFoundError(
                        f"{where} is stored as an optimizer replay of gradient "
                        f"{ref.describe()} ({manifest_id_}), which is not in the store: "
                        "compute it again (same inputs and options: same id) or restore "
                        "another version"
                    ) from None
            sets.extend(found)
        return sets

    def find(name: str) -> GradientSource:
        if ref is None:
            raise IntegrityError(f"{where} is replayed, but names no gradient")
        if ref.recorded:
            tensor_id = ref.recorded.get(name)
            recorded = None if tensor_id is None else manifest.embedded.get(tensor_id)
            if recorded is None:
                raise NotFoundError(
                    f"{where}: its recorded gradient has no tensor {printable(name)}"
                )
            return GradientSource((recorded,))
        found = []
        for tensors in tensor_sets():
            tensor_id = dict(tensors.tensors).get(name)
            if tensor_id is None:
                raise NotFoundError(
                    f"{where}: gradient {ref.describe()} has no tensor {printable(name)}"
                )
            embedded = tensors.embedded.get(tensor_id)
            found.append(
                embedded
                if embedded is not None
                else store.get_typed(tensor_id, TensorManifest, context=f"{where}, {name}")
            )
        return GradientSource(tuple(found), ref.combine or None)

    return find


def combine_gradients(parts: Sequence[np.ndarray], rule: str | None) -> np.ndarray:
    """The gradient a step applied from its peers' (in the run's order), by ``rule``.

    Computed in float32 (float64 for float64 gradients), as a trainer's all-reduce would:
    ``sum-then-scale`` adds them up then divides by their number, ``scale-then-sum``
    divides each first (DDP's way). One part and no rule: that part.
    """
    if rule is None:
        return parts[0]
    dtype = np.float64 if parts[0].dtype == np.float64 else np.float32
    count = dtype(len(parts))
    total = np.zeros(parts[0].shape, dtype=dtype)
    with np.errstate(all="ignore"):
        for part in parts:
            total += part / count if rule == "scale-then-sum" else part
        if rule == "sum-then-scale":
            total /= count
    return total


class ReplayGraph:
    """Adds each chunk's tasks once to a Dask graph of plain tuples (keys: a stored chunk's id,
    a replayed chunk's place).

    ``versions`` holds every version a read may replay through: each one read and its
    ancestors, as deep as their replays go.
    """

    def __init__(self, store: Store, versions: Mapping[str, SnapshotVersion]) -> None:
        self.store, self.versions = store, versions
        self.graph: dict[Hashable, Any] = {}
        self._targets: dict[str, dict[str, ReplayTarget]] = {}

    def chunk(self, version_id: str, key: str, i: int) -> Hashable | None:
        """The key of chunk ``i`` of array ``key`` of a version (None: all zero)."""
        version = self.versions[version_id]
        manifest = version.tensor(key)
        block = manifest.blocks[i]
        if block is None:
            return None
        where = f"{version.context}, {printable(key)}, chunk {i}"
        link = manifest.replays.get(i)
        if link is None:  # a stored chunk: named by its id, shared by whatever reads it
            done = chunk_key(block)
            if done not in self.graph:
                start, stop = manifest.chunk_ranges()[i]
                read = ChunkRead(
                    block, np.empty(0), where, manifest.inline.get(i), manifest.deltas.get(i, ())
                )
                self.graph[done] = (_read_chunk, self.store, read, manifest.dtype, stop - start)
            return done
        # A replayed chunk is named by where it is (equal bytes elsewhere, a gradient or
        # another array, may be what it is rebuilt from: one key would make a cycle).
        done = (_REPLAYED, version_id, key, i)
        if done in self.graph:
            return done
        previous = self._version(version.manifest.previous, where)
        if link.source == "previous":  # the previous version's chunk: the same bytes
            if previous.tensor(key).blocks[i] != block:
                raise IntegrityError(
                    f"{where}: says it is the previous version's chunk, which is another; "
                    "run `gradpipe verify`"
                )
            return self.chunk(previous.id, key, i)
        target = self.targets(version_id).get(key)
        if target is None:
            raise IntegrityError(f"{where}: is replayed, but its snapshot names no optimizer step")
        if link.source == "decay":  # a moment without the gradient: its previous times decay
            factor = target.group.decay.get(dtype_name(work_dtype(parse_dtype(manifest.dtype))))
            if factor is None or target.role not in factor:
                raise IntegrityError(f"{where}: its snapshot records no decay for it")
            start, stop = manifest.chunk_ranges()[i]
            spec = _DecaySpec(
                self.store, link, block, manifest.dtype, stop - start, factor[target.role], where
            )
            self.graph[done] = (_decay_task, spec, self.chunk(previous.id, key, i))
            return done
        self.graph[done] = self._replay(version, manifest, i, (link, target), previous)
        return done

    def targets(self, version_id: str) -> dict[str, ReplayTarget]:
        """Each replayed array's group, parameter and role in a version."""
        found = self._targets.get(version_id)
        if found is None:
            replay = self.versions[version_id].manifest.replay
            found = self._targets[version_id] = {} if replay is None else replay.targets()
        return found

    def _version(self, version_id: str | None, where: str) -> SnapshotVersion:
        version = None if version_id is None else self.versions.get(version_id)
        if version is None:
            raise IntegrityError(
                f"{where}: replays from version {version_id}, which is not in the snapshot's "
                "chain; run `gradpipe verify`"
            )
        return version

    def _replay(
        self,
        version: SnapshotVersion,
        manifest: TensorManifest,
        i: int,
        how: tuple[ReplayLink, ReplayTarget],
        previous: SnapshotVersion,
    ) -> tuple[Any, ...]:
        """The task rebuilding chunk ``i`` (its inputs' tasks added to the graph)."""
        link, target = how
        needed = roles(target.group.step)
        arrays = target.arrays
        start, stop = manifest.chunk_ranges()[i]
        block = manifest.blocks[i] or ""
        where = f"{version.context}, {printable(arrays[target.role])}, chunk {i}"
        before = [self.chunk(previous.id, arrays[r], i) for r in needed]
        moments = [r for r in needed if r != "param"] if target.role == "param" else []
        known = [self.chunk(version.id, arrays[r], i) for r in moments]
        grad = self._gradient(version, target.grad_name, (start, stop), where)
        spec = _ReplaySpec(self.store, link, block, manifest.dtype, target, tuple(moments), where)
        return (_replay_task, spec, before, grad, known)

    def _gradient(
        self, version: SnapshotVersion, name: str, span: tuple[int, int], where: str
    ) -> Hashable:
        start, stop = span
        source = version.gradient(name)
        ids = [manifest_id(t) for t in source.tensors]
        key = (_GRADIENT, *ids, source.combine, start, stop)
        if key in self.graph:
            return key
        parts = []
        for gradient in source.tensors:
            require_self_contained(gradient, f"{where}, gradient {printable(name)}")
            part = (_GRADIENT, manifest_id(gradient), start, stop)
            if part not in self.graph:
                self.graph[part] = self._gradient_part(gradient, name, span, where)
            parts.append(part)
        self.graph[key] = (combine_gradients, parts, source.combine)
        return key

    def _gradient_part(
        self, gradient: TensorManifest, name: str, span: tuple[int, int], where: str
    ) -> tuple[Any, ...]:
        """The task of one gradient tensor's elements ``span`` (its covering chunks added)."""
        start, stop = span
        chunks: list[Hashable | None] = []
        ranges: list[tuple[int, int]] = []
        for j, (lo, hi) in enumerate(gradient.chunk_ranges()):
            block = gradient.blocks[j]
            if lo < stop and start < hi:
                ranges.append((lo, hi))
                if block is None:
                    chunks.append(None)
                    continue
                read = ChunkRead(
                    block, np.empty(0), f"{where}, gradient {printable(name)}, chunk {j}",
                    gradient.inline.get(j), gradient.deltas.get(j, ()),
                )  # fmt: skip
                chunks.append(chunk_key(block))
                self.graph.setdefault(
                    chunk_key(block), (_read_chunk, self.store, read, gradient.dtype, hi - lo)
                )
        return (gradient_range, gradient.dtype, chunks, ranges, start, stop)


def _read_chunk(store: Store, read: ChunkRead, dtype: str, count: int) -> np.ndarray:
    """A stored chunk's logical bytes (uint8): a full block, inline, or a delta chain."""
    out = np.empty(count, dtype=parse_dtype(dtype))
    decode_chunks(store, [ChunkRead(read.block_id, out, read.context, read.frame, read.links)])
    return out.view(np.uint8)


@dataclass(frozen=True)
class _ReplaySpec:
    """What a replay task needs besides its inputs (picklable: it travels to workers)."""

    store: Store
    link: ReplayLink
    block: str
    dtype: str
    target: ReplayTarget
    moments: tuple[str, ...]
    where: str


@dataclass(frozen=True)
class _DecaySpec:
    """What a decay task needs besides the previous chunk (picklable)."""

    store: Store
    link: ReplayLink
    block: str
    dtype: str
    count: int  # elements of the chunk
    factor: str  # the decay factor's bit pattern (hex)
    where: str


def predict_decay(
    previous: np.ndarray | None, factor: str, dtype: np.dtype, count: int
) -> np.ndarray:
    """A moment chunk predicted from its previous values (None: all zero) and decay factor."""
    values = np.zeros(count, dtype=dtype) if previous is None else previous.view(dtype)
    [scalar] = scalars_from_json({"f": factor}, dtype).values()
    return decay(values, scalar)


def _decay_task(spec: _DecaySpec, previous: np.ndarray | None) -> np.ndarray:
    """One decay-predicted chunk's logical bytes (uint8), checked against its id."""
    predicted = predict_decay(previous, spec.factor, parse_dtype(spec.dtype), spec.count)
    return rebuild_replay_chunk(
        spec.store, spec.link, predicted, block=spec.block, where=spec.where
    )


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
        previous=dict(zip(roles(group.step), before, strict=True)),
        grad=grad,
        known=dict(zip(spec.moments, known, strict=True)),
        dtype=dtype,
    )
    return rebuild_replay_chunk(
        spec.store, spec.link, predicted, block=spec.block, where=spec.where
    )
