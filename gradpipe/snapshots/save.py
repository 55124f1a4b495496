"""Saving a snapshot: the state's arrays written as the next versions of the chain's, one CAS.

A snapshot splits the state into its skeleton and its arrays
(:mod:`gradpipe.core.state`) and writes every array as the next version of
the same array in the previous snapshot of that name
(:func:`~gradpipe.storage.chains.write_version`): parameters are stored as
deltas about half their size, with a full keyframe every K versions. The
whole snapshot is one manifest, published by one compare-and-swap of the ref
``snapshots/<name>``: a crash at any point leaves the previous snapshot as it
was, and a second writer that lost the race rebuilds against the winner.
A snapshot whose step's newest version already holds the same state (a job
killed after its commit landed, run again) writes nothing
(:mod:`gradpipe.snapshots.content`).

Given the gradient its optimizer step applied and the optimizer, a version
stores its parameters and moments as residuals against the step replayed from
the previous version (:mod:`gradpipe.snapshots.replay_plan`, design note 016):
mostly nothing at all.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator, Mapping
from concurrent.futures import FIRST_EXCEPTION, ThreadPoolExecutor, wait
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import TYPE_CHECKING, Any, Final, Literal

import numpy as np

from gradpipe.config import get_bytes
from gradpipe.core.chain import DEFAULT_KEYFRAME_INTERVAL
from gradpipe.core.display import PATH_LIMIT, printable
from gradpipe.core.dtypes import canonical_dtype
from gradpipe.core.ids import hash_bytes
from gradpipe.core.manifest import manifest_id
from gradpipe.core.names import parse_name
from gradpipe.core.replay_record import ReplayRecord
from gradpipe.core.snapshot_manifest import SnapshotManifest
from gradpipe.core.state import (
    FlatState,
    flatten_state,
)
from gradpipe.core.tensor_manifest import TensorManifest
from gradpipe.errors import ConflictError, IntegrityError, InvalidInputError
from gradpipe.snapshots.cache import VersionCache, owned_bytes, owner
from gradpipe.snapshots.chain import chain_head, read_version, snapshot_ref, snapshot_tensor
from gradpipe.snapshots.content import holds_state, written_content
from gradpipe.snapshots.replay_plan import DEFAULT_REPLAY_INTERVAL, ReplayPlan
from gradpipe.snapshots.replay_write import (
    gradient_record,
    plan_replay,
    remember_values,
    replay_request,
)
from gradpipe.storage._pools import read_threads
from gradpipe.storage.chains import ChainParent, write_version

if TYPE_CHECKING:
    from gradpipe.storage.store import Store

__all__ = ["SnapshotWrite", "commit_snapshot", "snapshot", "write_snapshot"]

#: Rebuilds after losing the race for the ref to another writer of the same name.
_MAX_ATTEMPTS: Final = 8


# The keyframe chunks of the last snapshot this process wrote of each name: the next
# snapshot's deltas are taken against them without reading them back (gradpipe.snapshots.cache).
_KEYFRAMES = VersionCache()


def _remember(
    store: Store,
    name: str,
    snapshot_id: str,
    *,
    written: _Tensors,
    arrays: Mapping[str, np.ndarray],
    known: Mapping[str, np.ndarray],
) -> None:
    """Keep the keyframe chunks snapshot ``snapshot_id`` uses (its own, or ``known``).

    Its own are the private copies the tensors were written from (``written.copies``), or,
    where none were made, copies of the caller's ``arrays`` checked against their block ids.
    """
    limit = _KEYFRAMES.forget(store, name)  # the old copy first: one budget per process
    kept: dict[str, np.ndarray] = {}
    copied = 0  # bytes of new copies of the caller's arrays: stop making them past the limit
    for keyframe, values in _keyframes(written, arrays, known):
        if keyframe in kept:
            continue
        kept[keyframe] = values
        if written.copies is None and values.base is None:
            copied += values.nbytes
            if copied > limit:
                break
    kept = _compact(kept)
    if owned_bytes(kept.values()) > limit:
        kept = {}  # too large to keep: the next snapshot reads its keyframes
    _KEYFRAMES.keep(store, name, snapshot_id, kept)


def _keyframes(
    written: _Tensors, arrays: Mapping[str, np.ndarray], known: Mapping[str, np.ndarray]
) -> Iterator[tuple[str, np.ndarray]]:
    """``(block id, values)`` of every keyframe chunk the written tensors use, where at hand.

    From ``written.copies``, the values each tensor was written from, a full chunk's values
    are its block's with no second hash, and they are kept as views; from the caller's
    ``arrays``, each is copied and kept only if it still has its block's id.
    """
    copies = written.copies
    for key, tensor_id in written.tensors.items():
        manifest = written.embedded[tensor_id]
        flat = (copies[key] if copies is not None else arrays[key]).reshape(-1)
        for i, (start, stop) in enumerate(manifest.chunk_ranges()):
            block, links = manifest.blocks[i], manifest.deltas.get(i)
            if block is None or i in manifest.inline or i in manifest.replays:
                continue  # a replayed chunk is never a keyframe
            if links:
                if links[-1].base in known:
                    yield links[-1].base, known[links[-1].base]
            elif copies is not None:
                yield block, flat[start:stop]
            else:
                copy = np.array(flat[start:stop], copy=True)
                # The caller's arrays may have changed since they were hashed (a
                # training thread): a copy that is not the keyframe is not kept.
                if hash_bytes(copy.view(np.uint8)) == block:
                    yield block, copy


def _compact(kept: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """``kept`` with the views of arrays it mostly does not use copied out.

    A view keeps its whole array alive: the chunks of a tensor that are no keyframe any
    more, or the carried keyframes of a previous snapshot's copy, would otherwise hold
    memory the budget does not see. An array at least half used stays whole.
    """
    by_owner: dict[int, list[str]] = {}
    for block, values in kept.items():
        by_owner.setdefault(id(owner(values)), []).append(block)
    for blocks in by_owner.values():
        whole = owner(kept[blocks[0]])
        if whole is not kept[blocks[0]] and 2 * sum(kept[b].nbytes for b in blocks) < whole.nbytes:
            for block in blocks:
                kept[block] = kept[block].copy()
    return kept


def _recalled(store: Store, name: str, snapshot_id: str | None) -> dict[str, np.ndarray]:
    found = _KEYFRAMES.recall(store, name, snapshot_id)
    return {} if found is None else found[0]


@dataclass(frozen=True)
class SnapshotWrite:
    """What :func:`write_snapshot` did: the version that holds the state, and whether it is new.

    ``written`` is False when the step's newest version already held the same
    state, loss and metadata (``found == "recorded"``), or, with
    ``newer_only``, when the chain was at that step or later already
    (``found == "not newer"``); ``id`` is then that version's. With a gradient,
    ``replayed`` counts the parameters written against an optimizer replay and
    ``skipped`` says why the others were not.
    """

    id: str
    written: bool
    found: Literal["", "recorded", "not newer"] = ""
    replayed: int = 0
    skipped: Mapping[str, str] = field(default_factory=dict)


def snapshot(
    store: Store,
    name: str,
    state: Mapping[Any, Any],
    *,
    step: int,
    loss: float | None = None,
    metadata: Mapping[str, str] | None = None,
    delta: str = "int",
    threshold: float = 0.0,
    keyframe_interval: int = DEFAULT_KEYFRAME_INTERVAL,
    newer_only: bool = False,
    gradient: Any = None,
    optimizer: Any = None,
    replay_interval: int = DEFAULT_REPLAY_INTERVAL,
) -> str:
    """Save ``state`` as the next snapshot of ``name``; returns its id.

    Saving a step again with the state, loss and metadata its newest version
    holds writes nothing and returns that version's id (a job killed after its
    commit landed may run again); another state at the same step is a new
    version of the step, which :func:`restore` then returns. The step's newest
    version is looked for back from the head while the steps are not below it:
    after the chain went back to an earlier step (training resumed from an
    older snapshot), its steps are retaken and recorded anew.
    :func:`write_snapshot` also says whether it wrote.

    Parameters
    ----------
    store : Store
        A writable store.
    name : str
        The chain: each snapshot is written against the previous one of the
        same name.
    state : dict
        Nested dicts, lists and tuples of numpy arrays, numpy scalars, str,
        bytes, int, float, bool and None (parameters, optimizer state, RNG
        state, a config...). :func:`restore` gives back exactly this.
    step : int
        The training step (>= 0); ``restore(step=...)`` finds it.
    loss : float, optional
        Kept for ``gradpipe log``.
    metadata : mapping of str to str, optional
        Free-form string fields.
    delta : {"int", "xor", "sparse"}
        How a changed chunk is stored against its previous version (int and
        xor are bit-exact; sparse with ``threshold > 0`` is lossy and says so).
    keyframe_interval : int
        A full copy of each chunk every this many snapshots.
    newer_only : bool
        Write nothing if the newest snapshot of ``name`` is already at ``step``
        or later, and return its id: a job that runs again, or two copies of
        it racing, write each step once. Checked against the head every
        compare-and-swap is made from, so the loser of a race sees the winner's.
    gradient : str, Aggregate or mapping of str to array, optional
        The gradient the optimizer step before this snapshot applied, by parameter name:
        an aggregate of a run kept in the store (``"RUN:NAME@STEP"`` or
        ``gp.open_run(store, run).aggregate(name, step=...)``), or arrays, recorded with
        the snapshot. With ``optimizer``, parameters and moments are stored as residuals
        against that step replayed from the previous snapshot, which is mostly nothing:
        it pays when the gradients are kept anyway (design note 016). Restores are
        unchanged for callers.
    optimizer : str or list of groups, optional
        ``"adam"``, ``"adamw"`` or ``"sgd"`` for a state shaped as ``{"model":
        model.state_dict(), "optimizer": optimizer.state_dict()}``, or the groups (see
        :func:`gradpipe.snapshots.replay_plan.parse_optimizer`).
    replay_interval : int
        A replayed chunk is stored self-contained again every this many snapshots, so a
        restore replays at most ``replay_interval - 1`` steps.

    Raises
    ------
    InvalidInputError
        For a state gradpipe cannot keep exactly (naming the entry).
    ConflictError
        When other writers of the same name kept winning the race.
    """
    return write_snapshot(
        store,
        name,
        state,
        step=step,
        loss=loss,
        metadata=metadata,
        delta=delta,
        threshold=threshold,
        keyframe_interval=keyframe_interval,
        newer_only=newer_only,
        gradient=gradient,
        optimizer=optimizer,
        replay_interval=replay_interval,
    ).id


def write_snapshot(
    store: Store,
    name: str,
    state: Mapping[Any, Any],
    *,
    step: int,
    loss: float | None = None,
    metadata: Mapping[str, str] | None = None,
    delta: str = "int",
    threshold: float = 0.0,
    keyframe_interval: int = DEFAULT_KEYFRAME_INTERVAL,
    newer_only: bool = False,
    gradient: Any = None,
    optimizer: Any = None,
    replay_interval: int = DEFAULT_REPLAY_INTERVAL,
) -> SnapshotWrite:
    """:func:`snapshot`, saying whether it wrote a version or found the state recorded.

    Both checks are made against the head every compare-and-swap is made
    from, so of writers of the same state and step racing, one writes it and
    the others find it.
    """
    parse_name(name, what="snapshot name")
    if isinstance(step, bool) or not isinstance(step, int) or step < 0:
        raise InvalidInputError(f"snapshot step must be an integer >= 0, not {printable(step)}")
    meta = {str(k): str(v) for k, v in (metadata or {}).items()}
    flat = flatten_state(state)
    ref = snapshot_ref(name)
    options = {"delta": delta, "threshold": threshold, "keyframe_interval": keyframe_interval}
    with store.writing(f"snapshot {name}"):
        replay = replay_request(
            store, state, gradient, optimizer, interval=replay_interval, delta=delta
        )
        for _ in range(_MAX_ATTEMPTS):
            # Read the previous snapshot inside the lease: gc cannot run until
            # the lease ends, so the blocks the new version links to stay.
            head_id = chain_head(store, name)
            head = None if head_id is None else read_version(store, head_id, name)
            if newer_only and head_id is not None and head is not None and head.step >= step:
                return SnapshotWrite(head_id, written=False, found="not newer")
            recorded = _recorded(store, name, (head_id, head), step, (flat, loss, meta))
            if recorded is not None:
                return SnapshotWrite(recorded, written=False, found="recorded")
            plan = None
            if replay is not None and head is not None and head_id is not None:
                plan = plan_replay(store, name, flat, (head_id, head), replay)
            written = _write(store, name, flat, head, head_id=head_id, options=options, plan=plan)
            record: ReplayRecord | None = None
            gradient_tensors: dict[str, TensorManifest] = {}
            by_key = {k: written.embedded[t] for k, t in written.tensors.items()}
            if plan is not None and replay is not None:
                record, gradient_tensors = gradient_record(
                    store, name, plan, replay.gradient, by_key
                )
            known = _recalled(store, name, head_id)
            try:
                snapshot_id = commit_snapshot(
                    store,
                    name,
                    previous=head_id,
                    step=step,
                    tree=flat.to_dict(),
                    tensors=written.tensors,
                    embedded={**written.embedded, **gradient_tensors},
                    loss=loss,
                    metadata=meta,
                    content=written_content(flat, loss, meta, by_key),
                    replay=record,
                )
            except ConflictError:
                continue  # another snapshot of this name landed first: chain on it (or find it)
            if delta != "sparse":  # a lossy version stores other values than it was given
                _remember(
                    store, name, snapshot_id, written=written, arrays=flat.arrays, known=known
                )
                if replay is not None:
                    remember_values(
                        store,
                        name,
                        snapshot_id,
                        written=by_key,
                        arrays=flat.arrays,
                        plan=plan,
                        request=replay,
                        copies=written.copies,
                    )
            if plan is None:
                return SnapshotWrite(snapshot_id, written=True)
            replayed = sum(len(g.params) for g in plan.groups)
            return SnapshotWrite(
                snapshot_id, written=True, replayed=replayed, skipped=dict(plan.skipped)
            )
    raise ConflictError(
        f"snapshot {printable(name)}: other writers moved {printable(ref, limit=PATH_LIMIT)} "
        f"{_MAX_ATTEMPTS} times in a row; retry"
    )


def commit_snapshot(
    store: Store,
    name: str,
    *,
    previous: str | None,
    step: int,
    tree: dict[str, Any],
    tensors: Mapping[str, str],
    embedded: Mapping[str, TensorManifest],
    loss: float | None = None,
    metadata: Mapping[str, str] | None = None,
    content: str | None = None,
    replay: ReplayRecord | None = None,
) -> str:
    """Store a snapshot manifest over written tensors and move ``snapshots/<name>`` to it.

    ``previous`` is the head the tensors were written against; the ref moves
    only if it still points there (one compare-and-swap), else
    :class:`ConflictError` and nothing is visible. The caller holds the
    store's writing lease from its first block write to here. ``content`` is
    the state's content id (:mod:`gradpipe.snapshots.content`), if known.
    """
    manifest = SnapshotManifest(
        name=name,
        step=step,
        time=datetime.now(UTC).isoformat(timespec="microseconds"),
        previous=previous,
        state=tree,
        tensors=dict(tensors),
        embedded=dict(embedded),
        loss=None if loss is None else float(loss),
        metadata=dict(metadata or {}),
        content=content,
        replay=replay,
    )
    snapshot_id = store.put_manifest(manifest)
    store.refs.set(
        snapshot_ref(name), snapshot_id, expected=previous, message=f"snapshot step {step}"
    )
    return snapshot_id


def _recorded(
    store: Store,
    name: str,
    head: tuple[str | None, SnapshotManifest | None],
    step: int,
    given: tuple[FlatState, float | None, Mapping[str, str]],
) -> str | None:
    """The id of the newest version at ``step`` if it holds the ``given`` state, else None.

    Looked for back from ``head`` while the steps are not below ``step``, so a
    snapshot of a new step reads no other manifest; a chain that went back to
    an earlier step since (a resumed run) retakes its later steps.
    """
    snapshot_id, manifest = head
    seen: set[str] = set()
    while snapshot_id is not None and manifest is not None and manifest.step >= step:
        if manifest.step == step:
            tensors = {k: snapshot_tensor(store, manifest, k) for k in manifest.tensors}
            return snapshot_id if holds_state(manifest, tensors, *given) else None
        if snapshot_id in seen:
            raise IntegrityError(f"snapshot {printable(name)}: its history loops at {snapshot_id}")
        seen.add(snapshot_id)
        snapshot_id = manifest.previous
        manifest = None if snapshot_id is None else read_version(store, snapshot_id, name)
    return None


@dataclass(frozen=True)
class _Tensors:
    tensors: dict[str, str]
    embedded: dict[str, TensorManifest]
    # The values each array was written from, where private copies were made (see _write).
    copies: dict[str, np.ndarray] | None = None


#: Tensors of several chunks written at once by one snapshot (each fans out over every core).
_LARGE_IN_FLIGHT: Final = 2


def _write(
    store: Store,
    name: str,
    flat: FlatState,
    head: SnapshotManifest | None,
    *,
    head_id: str | None,
    options: Mapping[str, Any],
    plan: ReplayPlan | None = None,
) -> _Tensors:
    """Every array of ``flat`` written against the same array of ``head``.

    The arrays ``plan`` replays are written from its private copies, with its predictors.
    When the state fits the room the keyframe caches leave in their budget (and the deltas
    are exact), every other array is written from a private copy made chunk by chunk as it
    is encoded: the version is of the values as they were then, whatever a training thread
    does to the arrays, and the copies are what the next snapshot deltas against. (Made
    while the previous snapshot's keyframes are still held, so the room, not the budget, is
    what bounds them.)
    """
    parents = {}
    if head is not None:
        parents = {k: head.embedded[t] for k, t in head.tensors.items() if k in flat.arrays}
    keyframes = _recalled(store, name, head_id)
    shown = printable(name)
    predictors = plan.predictors() if plan is not None else {}
    copies: dict[str, np.ndarray] | None = None
    state_bytes = sum(a.nbytes for a in flat.arrays.values())
    if options.get("delta") != "sparse" and state_bytes <= _KEYFRAMES.room():
        copies = {}

    def write(key: str, *, parallel: bool) -> TensorManifest:
        parent = None
        if key in parents and head is not None:
            parent = ChainParent(parents[key], head.tensors[key], keyframes=keyframes)
        where = f"snapshot {shown}, {printable(key)}"
        if plan is not None and key in plan.values:  # the copy the next write predicts from
            if copies is not None:
                values = plan.values[key]
                copies[key] = np.ascontiguousarray(values, dtype=canonical_dtype(values.dtype))
            return write_version(
                store,
                plan.values[key],
                parent,
                where=where,
                parallel=parallel,
                predict=predictors.get(key),
                replay_depth=plan.depth if key in predictors else 0,
                **options,
            )
        array = flat.arrays[key]
        copy_to = None
        if copies is not None:
            copy_to = copies[key] = np.empty(array.shape, canonical_dtype(array.dtype))
        return write_version(
            store, array, parent, where=where, parallel=parallel, copy_to=copy_to, **options
        )

    # Every tensor is written side by side with the others, one thread each; a
    # tensor of several chunks also encodes its chunks side by side (on the
    # process's encode pool), so no tensor waits at a barrier of another. Small
    # tensors are queued first, so threads waiting for a turn at a large one
    # (at most two at a time: each holds a few windows of frames, whatever the
    # number of cores) never hold them up. The first error stops what has not
    # started. The encoders release the GIL.
    one_chunk = get_bytes("chunk-bytes")
    large = threading.BoundedSemaphore(_LARGE_IN_FLIGHT)

    def is_large(key: str) -> bool:
        return bool(flat.arrays[key].nbytes > one_chunk)

    def write_one(key: str) -> tuple[str, TensorManifest]:
        # The id (a JSON encoding and a hash) is taken here, beside other tensors' encoding.
        if not is_large(key):
            manifest = write(key, parallel=False)
        else:
            with large:
                manifest = write(key, parallel=True)
        return manifest_id(manifest), manifest

    pool = ThreadPoolExecutor(read_threads(), thread_name_prefix="gradpipe-snapshot")
    try:
        futures = {k: pool.submit(write_one, k) for k in sorted(flat.arrays, key=is_large)}
        done, _ = wait(futures.values(), return_when=FIRST_EXCEPTION)
        for key in flat.arrays:  # the first error in the state's order, if any
            if futures[key] in done and (error := futures[key].exception()) is not None:
                raise error  # the finally cancels what has not started
        written = [futures[k].result() for k in flat.arrays]
    finally:
        pool.shutdown(wait=True, cancel_futures=True)
    tensors: dict[str, str] = {}
    embedded: dict[str, TensorManifest] = {}
    for key, (tensor_id, manifest) in zip(flat.arrays, written, strict=True):
        tensors[key] = tensor_id
        embedded[tensor_id] = manifest
    return _Tensors(tensors, embedded, copies)
