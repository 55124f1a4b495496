"""What a diff compares: text naming dumps, aggregates, snapshots or runs, as named tensor sets.

The forms (run names never hold ``:`` or ``/``, which the grammar splits on):

============================  ==================================================
``b3:<hex>``                  any stored dump, aggregate, snapshot or tensor
``RUN`` or ``runs/RUN``       a whole run, paired by (step, peer)
``RUN@STEP``                  a step's dumps, paired by peer
``RUN@STEP/PEER``             one dump
``RUN:NAME``                  an aggregate at every step, paired by step
``RUN:NAME@STEP``             one aggregate
``snapshots/NAME``            a snapshot chain, paired by step
``snapshots/NAME@STEP``       one version (``@latest``: the newest)
``tensors/NAME``              a tensor stored under a name (``put_tensor(..., name=)``)
============================  ==================================================

``runs/`` reads what follows literally as a run name, for a run called ``a@1``.
A peer named with ``@`` is fine (``run@3/rank@0``); an aggregate whose name ends in
``@`` and digits is named by its id.
A single object against a single object pairs their tensors by name, whatever
their kinds (a dump against an aggregate, say).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np

from gradpipe.core.aggregate_manifest import AggregateManifest
from gradpipe.core.display import printable
from gradpipe.core.ids import parse_id
from gradpipe.core.run_manifest import DumpManifest
from gradpipe.core.snapshot_manifest import SnapshotManifest
from gradpipe.core.tensor_manifest import TensorManifest, resolve_tensor
from gradpipe.errors import InvalidInputError, NotFoundError
from gradpipe.snapshots.chain import find_snapshot, snapshot_tensor, snapshot_versions
from gradpipe.snapshots.restore import read_arrays
from gradpipe.storage.catalog import named_tensors, read_run

if TYPE_CHECKING:
    from gradpipe.storage.store import Store

__all__ = ["Side", "TensorSet", "parse_object"]

#: Where a tensor set sits in its side: ``(step, peer)``, ``(peer,)``, ``(step,)`` or ``()``.
Position = tuple[int | str, ...]


@dataclass
class TensorSet:
    """The named tensors of one dump, aggregate, snapshot version or tensor.

    ``whole(name)`` reads a tensor whole: how a snapshot version written with
    optimizer replay is read (its chunks rebuild through the previous version).
    """

    label: str
    tensors: dict[str, TensorManifest]
    whole: Callable[[str], np.ndarray] | None = None


@dataclass
class Side:
    """One side of a diff: tensor sets by position, and what the positions are."""

    text: str
    dims: tuple[str, ...]
    sets: dict[Position, TensorSet] = field(default_factory=dict)


def parse_object(store: Store, text: str) -> Side:
    """Resolve ``text`` (see the module's table) to the tensor sets it names."""
    if not isinstance(text, str) or not text:
        raise InvalidInputError("a diff compares two objects named as text")
    if text.startswith(("b3:", "tensors/")):
        named = text.startswith("tensors/")
        return _by_id(store, store.refs.get(text) if named else text, label=text)
    if text.startswith("snapshots/"):
        return _snapshots(store, text, text.removeprefix("snapshots/"))
    if text.startswith("runs/"):
        return _run(store, text, text.removeprefix("runs/"))
    if ":" in text:
        run, _, rest = text.partition(":")
        name, step = _at_step(rest)
        return _aggregates(store, text, run, name, step)
    head, slash, peer = text.partition("/")  # a run or peer name never holds "/"
    run, at, step_text = head.rpartition("@")
    if at and step_text.isdigit():
        return _step(store, text, run, int(step_text), peer if slash else None)
    return _run(store, text, text)


def _at_step(text: str) -> tuple[str, int | None]:
    head, at, tail = text.rpartition("@")
    if at and tail.isdigit():
        return head, int(tail)
    return text, None


def _tensors(
    store: Store, manifest: DumpManifest | AggregateManifest, where: str
) -> dict[str, TensorManifest]:
    found = named_tensors(store, manifest.tensors, manifest.embedded, where=where)
    return {name: resolve_tensor(t) for name, t in found.items()}


def _by_id(store: Store, text: str, *, label: str | None = None) -> Side:
    object_id = parse_id(text)
    manifest = store.get_manifest(object_id, context=label or text)
    side = Side(label or text, ())
    if isinstance(manifest, DumpManifest | AggregateManifest):
        side.sets[()] = TensorSet(text, _tensors(store, manifest, text))
    elif isinstance(manifest, SnapshotManifest):
        side.sets[()] = _version(store, object_id, manifest)
    elif isinstance(manifest, TensorManifest):
        side.sets[()] = TensorSet(text, {"tensor": manifest})
    else:
        raise InvalidInputError(
            f"{text} is a {manifest.type} manifest; a diff compares dumps, aggregates, "
            "snapshots and tensors"
        )
    return side


def _run(store: Store, text: str, run: str) -> Side:
    _, manifest = read_run(store, run)
    side = Side(text, ("step", "peer"))
    dumps = list(manifest.dumps)
    found = store.get_typed_many([e.dump for e in dumps], DumpManifest, context=f"run {run}")
    for entry, dump in zip(dumps, found, strict=True):
        label = f"{run}@{entry.step}/{entry.peer}"
        side.sets[(entry.step, entry.peer)] = TensorSet(label, _tensors(store, dump, label))
    return side


def _step(store: Store, text: str, run: str, step: int, peer: str | None) -> Side:
    _, manifest = read_run(store, run)
    entries = [e for e in manifest.step_dumps(step) if peer is None or e.peer == peer]
    if not entries:
        what = f"step {step}" + ("" if peer is None else f", peer {printable(peer)}")
        raise NotFoundError(f"run {printable(run)} has no dump at {what}")
    side = Side(text, () if peer is not None else ("peer",))
    found = store.get_typed_many([e.dump for e in entries], DumpManifest, context=text)
    for entry, dump in zip(entries, found, strict=True):
        position: Position = () if peer is not None else (entry.peer,)
        label = f"{run}@{step}/{entry.peer}"
        side.sets[position] = TensorSet(label, _tensors(store, dump, label))
    return side


def _aggregates(store: Store, text: str, run: str, name: str, step: int | None) -> Side:
    _, manifest = read_run(store, run)
    entries = [a for a in manifest.aggregates if a.name == name and step in (None, a.step)]
    if not entries:
        at = "" if step is None else f" at step {step}"
        raise NotFoundError(f"run {printable(run)} has no aggregate {printable(name)}{at}")
    side = Side(text, () if step is not None else ("step",))
    found = store.get_typed_many([a.aggregate for a in entries], AggregateManifest, context=text)
    for entry, aggregate in zip(entries, found, strict=True):
        label = f"{run}:{name}@{entry.step}"
        position: Position = () if step is not None else (entry.step,)
        side.sets[position] = TensorSet(label, _tensors(store, aggregate, label))
    return side


def _snapshots(store: Store, text: str, rest: str) -> Side:
    name, at, tail = rest.rpartition("@")
    if at and (tail.isdigit() or tail == "latest"):
        step = None if tail == "latest" else int(tail)
        snapshot_id, manifest = find_snapshot(store, name, step)
        side = Side(text, ())
        side.sets[()] = _version(store, snapshot_id, manifest)
        return side
    side = Side(text, ("step",))
    for snapshot_id, manifest in snapshot_versions(store, rest):
        if (manifest.step,) not in side.sets:  # the newest version of a step
            side.sets[(manifest.step,)] = _version(store, snapshot_id, manifest)
    if not side.sets:
        raise NotFoundError(f"snapshot {printable(rest)} has no versions")
    return side


def _version(store: Store, snapshot_id: str, manifest: SnapshotManifest) -> TensorSet:
    tensors = {key: snapshot_tensor(store, manifest, key) for key in manifest.tensors}
    label = f"snapshots/{manifest.name}@{manifest.step}"

    def whole(key: str) -> np.ndarray:
        return read_arrays(store, snapshot_id, manifest, [key])[key]

    return TensorSet(label, tensors, whole if manifest.needs_previous else None)
