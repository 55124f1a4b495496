"""A snapshot write with optimizer replay: the request, the plan, the record, the cache.

:func:`write_snapshot <gradpipe.snapshots.save.write_snapshot>` calls these around its
usual write: :func:`replay_request` once (what ``gradient=`` and ``optimizer=`` name),
:func:`plan_replay` per attempt (against the head it writes after), :func:`gradient_record`
before the commit (recorded gradients are written then) and :func:`remember_values` after
it. A process keeps the values of the replayed arrays of the last version it wrote of each
name, so the next version predicts without reading anything back; another process, or
values that would take more than ``gradpipe.snapshot-cache-bytes``, reads them from the
store (design note 016).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from gradpipe.core.display import printable
from gradpipe.core.ids import hash_bytes
from gradpipe.core.manifest import manifest_id
from gradpipe.core.replay_record import GradientRef, ReplayRecord
from gradpipe.core.snapshot_manifest import SnapshotManifest
from gradpipe.core.state import FlatState
from gradpipe.core.tensor_manifest import TensorManifest
from gradpipe.errors import InvalidInputError
from gradpipe.snapshots.cache import VersionCache, owner
from gradpipe.snapshots.chain import snapshot_tensor
from gradpipe.snapshots.gradient import GivenGradient, given_gradient
from gradpipe.snapshots.replay_plan import (
    OptimizerGroup,
    ReplayPlan,
    parse_optimizer,
    parse_replay_interval,
)
from gradpipe.snapshots.restore import read_arrays
from gradpipe.storage.chains import write_version

if TYPE_CHECKING:
    from gradpipe.storage.store import Store

__all__ = [
    "ReplayRequest",
    "gradient_record",
    "plan_replay",
    "remember_values",
    "replay_request",
]


@dataclass(frozen=True)
class ReplayRequest:
    """What ``gradient=`` and ``optimizer=`` asked for, resolved once per write."""

    groups: list[OptimizerGroup]
    gradient: GivenGradient | None  # None: the moments predicted from their decay alone
    interval: int

    @property
    def keys(self) -> set[str]:
        """Every array some parameter's replay involves."""
        return {k for g in self.groups for by_role in g.params.values() for k in by_role.values()}

    @property
    def lrs(self) -> dict[str, float]:
        """Each parameter's learning rate as given (a hint for the next save's probe)."""
        return {name: g.step.lr for g in self.groups for name in g.params}


def replay_request(
    store: Store,
    state: Mapping[Any, Any],
    gradient: Any,
    optimizer: Any,
    *,
    interval: int,
    delta: str,
) -> ReplayRequest | None:
    """The replay a write was asked for (None: none).

    Called inside the writer's lease: an aggregate or dumps it names cannot be collected
    between being found and being committed as the snapshot's children.
    """
    interval = parse_replay_interval(interval)
    if gradient is None and optimizer is None:
        return None
    if optimizer is None:
        raise InvalidInputError(
            "optimizer replay needs optimizer= (its kind and hyperparameters) with gradient= "
            "(what the step applied); without gradient=, optimizer= alone predicts the "
            "moments from their decay"
        )
    if delta == "sparse":  # a lossy moment would make the parameters' prediction another
        raise InvalidInputError(
            "optimizer replay is exact: it does not go with delta='sparse' (a lossy delta)"
        )
    groups = parse_optimizer(optimizer, state)
    given = None if gradient is None else given_gradient(store, gradient)
    return ReplayRequest(groups, given, interval)


# The values of the replayed arrays of the last version this process wrote of each name,
# noted with the learning rates it was given (hints for the next write's probe).
_PREVIOUS = VersionCache()


def plan_replay(
    store: Store,
    name: str,
    flat: FlatState,
    head: tuple[str, SnapshotManifest],
    request: ReplayRequest,
) -> ReplayPlan:
    """The replay of a version written after ``head``: checked, probed, ready to predict."""
    head_id, manifest = head
    wanted = [k for k in sorted(request.keys) if k in manifest.tensors]
    head_tensors = {k: snapshot_tensor(store, manifest, k) for k in wanted}
    held, hints = _PREVIOUS.recall(store, name, head_id) or ({}, {})

    def previous(keys: list[str]) -> Mapping[str, np.ndarray]:
        missing = [k for k in keys if k not in held]
        read = read_arrays(store, head_id, manifest, missing) if missing else {}
        return {**held, **read}

    plan = ReplayPlan.build(
        request.groups,
        flat.arrays,
        head_tensors,
        previous=previous,
        gradient=request.gradient,
        interval=request.interval,
        head_depth=manifest.replay_depth,
    )
    variant = None
    if manifest.replay is not None and manifest.replay.groups:
        variant = manifest.replay.groups[0].step.variant
    plan.probe(variant, hints)
    return plan


def gradient_record(
    store: Store,
    name: str,
    plan: ReplayPlan,
    given: GivenGradient | None,
    written: Mapping[str, TensorManifest],
) -> tuple[ReplayRecord | None, dict[str, TensorManifest]]:
    """The manifest's replay record, and the recorded gradient's tensors to embed.

    None when no chunk of the ``written`` tensors was replayed from the step (every one
    stored self-contained, or read through the previous version). A recorded gradient is
    written here (each tensor in full: gradients of consecutive steps do not delta), only
    for the parameters the plan replays.
    """
    stepped = any(
        link.source in ("step", "decay")
        for k in plan.keys
        if k in written
        for link in written[k].replays.values()
    )
    if not plan.groups or not stepped:  # "previous" links need no gradient
        return None, {}
    if given is None:
        return plan.record(None), {}
    if given.ref is not None:
        return plan.record(given.ref), {}
    names = sorted({n for g in plan.groups for n in g.params})
    recorded: dict[str, str] = {}
    embedded: dict[str, TensorManifest] = {}
    for grad_name in names:
        where = f"snapshot {printable(name)}, gradient {printable(grad_name)}"
        tensor = write_version(store, plan.grad_array(grad_name), None, where=where)
        tensor_id = manifest_id(tensor)
        recorded[grad_name] = tensor_id
        embedded[tensor_id] = tensor
    return plan.record(GradientRef(recorded=recorded, label="recorded")), embedded


def remember_values(
    store: Store,
    name: str,
    snapshot_id: str,
    *,
    written: Mapping[str, TensorManifest],
    arrays: Mapping[str, np.ndarray],
    plan: ReplayPlan | None,
    request: ReplayRequest,
    copies: Mapping[str, np.ndarray] | None = None,
) -> None:
    """Keep the replayed arrays' values of version ``snapshot_id`` for the next write.

    The plan's copies and the writer's private ``copies`` are what was written; any other
    array is copied and kept only if its every chunk still has the id it was written with (a
    training thread may have moved it). Arrays another cache holds already cost no room.
    """
    limit = _PREVIOUS.forget(store, name)  # the old copy first: one budget per process
    held = VersionCache.held_owners()
    kept: dict[str, np.ndarray] = {}
    for array_key in sorted(request.keys & set(written)):
        values = plan.values.get(array_key) if plan is not None else None
        if values is None and copies is not None and array_key in copies:
            values = copies[array_key].reshape(arrays[array_key].shape)
        if values is None:
            values = _checked_copy(arrays[array_key], written[array_key])
        if values is None:
            continue
        if id(owner(values)) not in held:
            limit -= owner(values).nbytes
        if limit < 0:
            return  # too large to keep: the next write reads the values back
        kept[array_key] = values
    _PREVIOUS.keep(store, name, snapshot_id, kept, request.lrs)


def _checked_copy(array: np.ndarray, manifest: TensorManifest) -> np.ndarray | None:
    copy = np.array(array, copy=True, order="C")
    flat = copy.reshape(-1)
    for block, (start, stop) in zip(manifest.blocks, manifest.chunk_ranges(), strict=True):
        chunk = flat[start:stop].view(np.uint8)
        if (block is None and chunk.any()) or (block is not None and hash_bytes(chunk) != block):
            return None
    return copy
