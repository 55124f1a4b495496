"""Restoring snapshots: a version's state, bit-exact, or a state file written from it.

The arrays of a version are read chunk by chunk, deltas resolved against their
keyframes (:func:`~gradpipe.storage.tensors.read_tensors`), and put back into the
skeleton (:mod:`gradpipe.core.state`). A version written with optimizer replay is
read as one Dask graph over it and the versions its replays go back through
(:mod:`gradpipe.graph.replays`), on local threads unless a runner is given.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import TYPE_CHECKING, Any

import numpy as np

from gradpipe.core.display import PATH_LIMIT, printable, printable_names
from gradpipe.core.manifest import manifest_id
from gradpipe.core.snapshot_manifest import SnapshotManifest
from gradpipe.core.state import (
    flat_array_names,
    select_state,
    unflatten_state,
)
from gradpipe.core.tensor_manifest import TensorManifest
from gradpipe.errors import IntegrityError, NotFoundError
from gradpipe.snapshots.chain import (
    find_snapshot,
    read_version,
    snapshot_tensor,
    snapshot_versions,
)
from gradpipe.storage.replays import SnapshotVersion, snapshot_version
from gradpipe.storage.tensors import read_tensors

if TYPE_CHECKING:
    from gradpipe.formats.state_file import StateFileInfo
    from gradpipe.graph.runner import Runner
    from gradpipe.storage.store import Store

__all__ = ["read_arrays", "restore", "restore_file", "restore_manifest", "restore_steps"]


def restore(
    store: Store,
    name: str,
    *,
    step: int | None = None,
    keys: Iterable[str] | None = None,
    runner: Runner | None = None,
) -> Any:
    """The state saved by :func:`snapshot`, exactly (types, dtypes, nesting).

    Parameters
    ----------
    store : Store
    name : str
    step : int, optional
        The snapshot at this step; the newest by default.
    keys : iterable of str, optional
        Only these entries (top-level names, dotted paths or array keys); only
        their chunks are read.
    runner : Runner, optional
        Rebuild the chunks as a Dask graph on this runner (a cluster) instead
        of the local thread pool. Every array then travels back from the
        workers: on local processes (``gp.runner(processes=True)``) a restore
        took 2 s where the thread pool took 0.15-0.3 s (2-core machine, a
        260 MiB AdamW state), so leave ``runner`` out on one machine.
    """
    snapshot_id, manifest = find_snapshot(store, name, step)
    return restore_manifest(store, manifest, keys=keys, runner=runner, snapshot_id=snapshot_id)


def restore_steps(
    store: Store,
    name: str,
    steps: Iterable[int],
    *,
    keys: Iterable[str] | None = None,
    runner: Runner | None = None,
) -> dict[int, Any]:
    """Several snapshots of ``name`` at once, by step: ``{step: state}``.

    One Dask graph reads them all, a task per chunk version named by its
    content, so the keyframes several snapshots share are read and decoded
    once. Without ``runner`` it runs on local threads.
    """
    from gradpipe.graph.chains import read_tensors_graph
    from gradpipe.graph.runner import Runner

    wanted = list(dict.fromkeys(steps))
    found: dict[int, SnapshotManifest] = {}
    ids: dict[int, str] = {}
    for snapshot_id, manifest in snapshot_versions(store, name):
        if manifest.step in wanted and manifest.step not in found:
            found[manifest.step] = manifest
            ids[manifest.step] = snapshot_id
    missing = [s for s in wanted if s not in found]
    if missing:
        raise NotFoundError(
            f"snapshot {printable(name)} has no step {', '.join(map(str, missing))}"
        )
    plans = [(step, *_plan(store, found[step], keys)) for step in wanted]
    if any(found[s].needs_previous for s in wanted):
        versions = [(ids[s], found[s]) for s in wanted]
        arrays = iter(_read_replayed(store, versions, [p[2] for p in plans], runner))
        return {
            step: _unflatten(found[step], tree, {k: next(arrays) for k in keys_})
            for step, tree, keys_, _ in plans
        }
    tensors = [t for _, _, keys_, ts in plans for t in ts]
    shown = printable(name)
    contexts = [
        f"snapshot {shown}, step {step}, {printable(k)}"
        for step, _, keys_, _ in plans
        for k in keys_
    ]
    if runner is None:
        with Runner() as local:
            arrays = iter(read_tensors_graph(store, tensors, runner=local, contexts=contexts))
    else:  # the caller's runner: used, never closed
        arrays = iter(read_tensors_graph(store, tensors, runner=runner, contexts=contexts))
    out = {}
    for step, tree, keys_, _ in plans:
        values = {k: next(arrays) for k in keys_}
        out[step] = _unflatten(found[step], tree, values)
    return out


def _plan(
    store: Store, manifest: SnapshotManifest, keys: Iterable[str] | None
) -> tuple[dict[str, Any], list[str], list[TensorManifest]]:
    """The skeleton to rebuild, the array keys it needs and their tensor manifests."""
    tree = manifest.state
    wanted = list(manifest.tensors)
    if keys is not None:
        tree, wanted = select_state(tree, keys)
    missing = [k for k in wanted if k not in manifest.tensors]
    if missing:
        raise IntegrityError(
            f"snapshot {printable(manifest.name)} at step {manifest.step} lacks arrays "
            f"{printable_names(missing, most=5)}; run `gradpipe verify`"
        )
    return tree, wanted, [snapshot_tensor(store, manifest, k) for k in wanted]


def _unflatten(manifest: SnapshotManifest, tree: dict[str, Any], arrays: dict[str, Any]) -> Any:
    try:
        return unflatten_state(tree, arrays)
    except (KeyError, TypeError, ValueError) as exc:
        raise IntegrityError(
            f"snapshot {printable(manifest.name)} at step {manifest.step} has a damaged state "
            f"skeleton: {printable(exc, limit=PATH_LIMIT)}"
        ) from None


def restore_file(store: Store, manifest: SnapshotManifest, path: str, info: StateFileInfo) -> None:
    """Write one snapshot as a state file of ``info.kind`` (what ``gradpipe restore`` does).

    A flat state written as safetensors is streamed: each tensor is written
    while the next ones decode, so the whole state is never held at once.
    """
    from gradpipe.formats.safetensors import write_safetensors_stream
    from gradpipe.formats.state_file import write_state_file

    names = flat_array_names(manifest.state) if info.kind == "safetensors" else None
    if names is None or set(names) != set(manifest.tensors) or manifest.needs_previous:
        # A replay version is rebuilt whole (its chunks replay through the versions before).
        write_state_file(path, restore_manifest(store, manifest), info)
        return
    tensors = {n: snapshot_tensor(store, manifest, n) for n in names}
    specs = {n: (t.dtype, t.shape) for n, t in tensors.items()}

    def produce(order: list[str]) -> Iterator[np.ndarray]:
        head = f"snapshot {printable(manifest.name)}, step {manifest.step}"
        contexts = [f"{head}, {printable(n)}" for n in order]
        return store.iter_tensors([tensors[n] for n in order], contexts=contexts)

    write_safetensors_stream(path, specs, produce, info.metadata, keep_metadata_order=True)


def restore_manifest(
    store: Store,
    manifest: SnapshotManifest,
    *,
    keys: Iterable[str] | None = None,
    runner: Runner | None = None,
    snapshot_id: str | None = None,
) -> Any:
    """The state of one snapshot manifest (see :func:`restore`).

    A version written with optimizer replay reads, for the parameters asked for, their
    moments too (the prediction needs them), and the versions its replays go back through.
    """
    tree, wanted, tensors = _plan(store, manifest, keys)
    if manifest.needs_previous:
        version = (snapshot_id or manifest_id(manifest), manifest)
        arrays = _read_replayed(store, [version], [wanted], runner)
        return _unflatten(manifest, tree, dict(zip(wanted, arrays, strict=True)))
    head = f"snapshot {printable(manifest.name)}, step {manifest.step}"
    contexts = [f"{head}, {printable(k)}" for k in wanted]
    if runner is None:
        arrays = read_tensors(store, tensors, contexts=contexts)
    else:
        from gradpipe.graph.chains import read_tensors_graph

        arrays = read_tensors_graph(store, tensors, runner=runner, contexts=contexts)
    return _unflatten(manifest, tree, dict(zip(wanted, arrays, strict=True)))


def _read_replayed(
    store: Store,
    versions: list[tuple[str, SnapshotManifest]],
    keys: list[list[str]],
    runner: Runner | None,
) -> list[np.ndarray]:
    """Arrays ``keys[j]`` of each of ``versions``, read through their replays, in order."""
    from gradpipe.graph.replays import read_snapshot_arrays
    from gradpipe.graph.runner import Runner

    chain: dict[str, SnapshotVersion] = {}
    for snapshot_id, manifest in versions:
        _add_ancestors(store, chain, snapshot_id, manifest)
    wanted = [
        (snapshot_id, k) for (snapshot_id, _), ks in zip(versions, keys, strict=True) for k in ks
    ]
    if runner is None:
        with Runner() as local:
            return read_snapshot_arrays(store, chain, wanted, runner=local)
    return read_snapshot_arrays(store, chain, wanted, runner=runner)


def _add_ancestors(
    store: Store, chain: dict[str, SnapshotVersion], snapshot_id: str, manifest: SnapshotManifest
) -> None:
    """Add a version and the ones its replays read through (its replay depth) to ``chain``."""
    version_id, version = snapshot_id, manifest
    for left in range(manifest.replay_depth, -1, -1):
        if version_id not in chain:
            chain[version_id] = snapshot_version(store, version_id, version)
        if left == 0 or version.previous is None:
            return
        version_id = version.previous
        known = chain.get(version_id)
        version = known.manifest if known else read_version(store, version_id, manifest.name)


def read_arrays(
    store: Store, snapshot_id: str, manifest: SnapshotManifest, keys: list[str]
) -> dict[str, np.ndarray]:
    """Arrays ``keys`` of one version, by key (read through its replays if it has any)."""
    if manifest.needs_previous:
        arrays = _read_replayed(store, [(snapshot_id, manifest)], [keys], None)
    else:
        head = f"snapshot {printable(manifest.name)}, step {manifest.step}"
        tensors = [snapshot_tensor(store, manifest, k) for k in keys]
        arrays = read_tensors(store, tensors, contexts=[f"{head}, {printable(k)}" for k in keys])
    return dict(zip(keys, arrays, strict=True))
