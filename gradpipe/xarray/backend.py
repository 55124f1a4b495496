"""The xarray view of a store: ``xr.open_dataset(STORE, engine="gradpipe", run=RUN)``.

>>> ds = xr.open_dataset("s3://bucket/archive", engine="gradpipe", run="exp7")  # doctest: +SKIP
>>> ds = gp.open_dataset(store, run="exp7", chunks={})                         # doctest: +SKIP
>>> tree = xr.open_datatree("s3://bucket/archive", engine="gradpipe")          # doctest: +SKIP

:class:`GradpipeBackendEntrypoint` is registered under the ``xarray.backends``
entry point as ``gradpipe``. xarray loads it whenever it lists its engines, so
this module imports xarray and nothing else at import time; the store, the
manifests and the readers are imported when something is opened.

What the datasets hold is described in :mod:`gradpipe.xarray.datasets`;
how their arrays read in :mod:`gradpipe.xarray.array`.

Dask keys. With ``chunks=`` xarray names the dask arrays after a token of the
arguments of the open call. :func:`open_dataset` passes ``at=``, the id of the
manifest it opens (the run's, or the newest snapshot's), so its keys are
derived from the content: two opens of one state share them, and a store
that changed in between gives new ones. ``xr.open_dataset(..., at=ID)`` does
the same; without ``at`` the keys follow the URL and the names only.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import TYPE_CHECKING, Any, Final, Literal

from xarray.backends import BackendEntrypoint

if TYPE_CHECKING:
    import xarray as xr
    from xarray.backends.common import T_PathFileOrDataStore

    from gradpipe.storage.store import Store

__all__ = ["GradpipeBackendEntrypoint", "Kind", "open_dataset"]

#: What a dataset is opened from: a run's dumps, one aggregate name of a run, a snapshot
#: chain, or one recorded analysis of a run.
Kind = Literal["run", "aggregate", "snapshot", "analysis"]
_KINDS: Final = ("run", "aggregate", "snapshot", "analysis")


class GradpipeBackendEntrypoint(BackendEntrypoint):
    """xarray's ``engine="gradpipe"``: runs, aggregates and snapshots of a gradpipe store.

    ``filename_or_obj`` is a store URL or path (``s3://bucket/prefix``,
    ``/data/archive``) or an open :class:`~gradpipe.Store`.
    """

    description = "Runs, aggregates and snapshots of a gradpipe store"
    supports_groups = True

    def open_dataset(
        self,
        filename_or_obj: T_PathFileOrDataStore | Store,
        *,
        drop_variables: str | Iterable[str] | None = None,
        run: str | None = None,
        kind: Kind = "run",
        name: str | None = None,
        at: str | None = None,
        storage_options: dict[str, Any] | None = None,
    ) -> xr.Dataset:
        """One run (``run=``), aggregate (``kind="aggregate", run=, name=``) or snapshot chain.

        Parameters
        ----------
        filename_or_obj : str, os.PathLike or Store
            The store.
        drop_variables : str or iterable of str, optional
            Tensors (or coordinates) not to include; a dropped tensor's
            manifests are still read, its chunks never.
        run : str
            The run (``kind="run"`` and ``"aggregate"``).
        kind : {"run", "aggregate", "snapshot", "analysis"}
            What to open.
        name : str
            The aggregate's name (``"fedavg"``), the snapshot chain's, or the
            recorded analysis' (``"norms"``, ``"agreement"``, ``"gns"``,
            ``"histograms"``, ``"projection"``, ``"norms@fedavg"``).
        at : str, optional
            Open the state with this id instead of the current one: the run
            manifest's id (``gp.open_run(store, run).id``) or a snapshot
            version's (``gp.snapshot_log``). Pins the content, and the dask keys.
        storage_options : dict, optional
            fsspec options for a URL (``{"endpoint_url": ...}`` on S3).
        """
        from gradpipe.xarray.datasets import aggregate_dataset, run_dataset, snapshot_dataset

        store = _open_store(filename_or_obj, storage_options)
        drop = _drop_set(drop_variables)
        _check_target(kind, run, name)
        if kind == "snapshot":
            assert name is not None  # _check_target
            return snapshot_dataset(store, name, _snapshot_chain(store, name, at), drop=drop)
        if kind == "analysis":
            from gradpipe.analytics.stored import stored_analysis

            assert run is not None  # _check_target
            assert name is not None
            return stored_analysis(store, run, name)
        assert run is not None  # _check_target
        found = _run(store, run, at)
        if kind == "aggregate":
            assert name is not None
            return aggregate_dataset(store, found, name, drop=drop)
        return run_dataset(store, found, drop=drop)

    def guess_can_open(self, filename_or_obj: T_PathFileOrDataStore) -> bool:
        """A local directory holding a store marker; never a remote URL (no requests here)."""
        if not isinstance(filename_or_obj, str | os.PathLike):
            return False
        path = os.fspath(filename_or_obj)
        if isinstance(path, bytes) or "://" in path:
            return False
        return (Path(path) / "gradpipe.json").is_file()

    def open_groups_as_dict(
        self,
        filename_or_obj: T_PathFileOrDataStore | Store,
        *,
        drop_variables: str | Iterable[str] | None = None,
        storage_options: dict[str, Any] | None = None,
    ) -> dict[str, xr.Dataset]:
        """Every run, aggregate and snapshot chain of the store, by path.

        See :func:`~gradpipe.xarray.backend.tree_groups`.
        """
        store = _open_store(filename_or_obj, storage_options)
        return tree_groups(store, drop=_drop_set(drop_variables))

    def open_datatree(
        self,
        filename_or_obj: T_PathFileOrDataStore | Store,
        *,
        drop_variables: str | Iterable[str] | None = None,
        storage_options: dict[str, Any] | None = None,
    ) -> xr.DataTree:
        """The whole store as a DataTree: ``/runs/<run>``, ``/aggregates/<run>/<name>``, ...."""
        import xarray as xr

        groups = self.open_groups_as_dict(
            filename_or_obj, drop_variables=drop_variables, storage_options=storage_options
        )
        return xr.DataTree.from_dict(groups)


def open_dataset(
    store: Store | str | os.PathLike[str],
    *,
    run: str | None = None,
    kind: Kind = "run",
    name: str | None = None,
    chunks: int | dict[str, int] | Literal["auto"] | None = None,
    drop_variables: str | Iterable[str] | None = None,
    storage_options: dict[str, Any] | None = None,
) -> xr.Dataset:
    """A run, an aggregate or a snapshot chain of a store as an :class:`xarray.Dataset`.

    Parameters
    ----------
    store : Store, str or os.PathLike
        An open store, or its URL or path.
    run : str
        The run (for ``kind="run"`` and ``"aggregate"``).
    kind : {"run", "aggregate", "snapshot"}
        ``"run"``: dims ``(step, peer, <tensor>_dim0, ...)``, one variable per
        tensor name (escaped where it would clash: :mod:`gradpipe.xarray.view_names`;
        ``attrs["tensor"]`` holds it), ``present`` for the (step, peer) pairs with a dump;
        ``"aggregate"``: aggregate ``name`` of the run, dims ``(step, ...)``;
        ``"snapshot"``: the snapshot chain ``name``, dims ``(version, ...)``.
    name : str
        The aggregate's or the snapshot chain's name.
    chunks : None, {} , int, dict or "auto"
        As for :func:`xarray.open_dataset`: None reads lazily into numpy on
        access; ``{}`` gives dask arrays of one block per stored chunk (and
        per step and peer).
    drop_variables : str or iterable of str, optional
        Tensors or coordinates to leave out.
    storage_options : dict, optional
        fsspec options, when ``store`` is a URL.

    Returns
    -------
    xarray.Dataset
        Manifests only are read; the dask keys (with ``chunks``) are derived
        from the id of the state opened, so two opens of one state share them.

    Examples
    --------
    >>> ds = gp.open_dataset(store, run="exp7", chunks={})                 # doctest: +SKIP
    >>> norms = (ds["dense1.weight"] ** 2).sum("dense1.weight_dim1")      # doctest: +SKIP
    """
    import xarray as xr

    opened = _open_store(store, storage_options)
    _check_target(kind, run, name)
    if kind == "snapshot":
        assert name is not None
        from gradpipe.snapshots.api import snapshot_versions

        at = next(snapshot_versions(opened, name))[0]
    else:
        assert run is not None
        at = _run(opened, run, None).id
    return xr.open_dataset(
        opened,  # type: ignore[arg-type]  # the engine takes a Store
        # The class itself, not its entry-point name: works before any install.
        engine=GradpipeBackendEntrypoint,
        chunks=chunks,
        drop_variables=drop_variables,
        run=run,
        kind=kind,
        name=name,
        at=at,
    )


# --- the tree ---------------------------------------------------------------------
def _run_nodes(store: Store, drop: set[str]) -> dict[str, xr.Dataset]:
    """``runs/<run>``: every run's dumps."""
    from gradpipe.runs import list_runs, open_run
    from gradpipe.xarray.datasets import run_dataset

    return {
        f"runs/{r}": run_dataset(store, open_run(store, r), drop=drop) for r in list_runs(store)
    }


def _aggregate_nodes(store: Store, drop: set[str]) -> dict[str, xr.Dataset]:
    """``aggregates/<run>/<name>``: every aggregate name of every run."""
    from gradpipe.runs import list_runs, open_run
    from gradpipe.xarray.datasets import aggregate_dataset

    out = {}
    for run_name in list_runs(store):
        run = open_run(store, run_name)
        for name in sorted({a.name for a in run.aggregates}):
            out[f"aggregates/{run_name}/{name}"] = aggregate_dataset(store, run, name, drop=drop)
    return out


def _snapshot_nodes(store: Store, drop: set[str]) -> dict[str, xr.Dataset]:
    """``snapshots/<name>``: every snapshot chain, oldest version first."""
    from gradpipe.xarray.datasets import snapshot_dataset

    names = [ref.split("/", 1)[1] for ref in store.refs.list("snapshots")]
    return {
        f"snapshots/{n}": snapshot_dataset(store, n, _snapshot_chain(store, n, None), drop=drop)
        for n in names
    }


def _stats_nodes(store: Store, drop: set[str]) -> dict[str, xr.Dataset]:
    """``stats/<run>``: every run's compression statistics (manifests only, no chunk read)."""
    from gradpipe.runs import list_runs
    from gradpipe.statistics.api import compression_stats

    return {f"stats/{r}": compression_stats(store, run=r) for r in list_runs(store)}


def _analytics_nodes(store: Store, drop: set[str]) -> dict[str, xr.Dataset]:
    """``analytics/<run>/<analysis>``: what the store records; never computes (docs/design/017).

    Projections stay out (``kind="analysis", name="projection"`` opens them): k floats per
    layer and dump would make the tree the size of the run's gradients over k/elements.
    """
    from gradpipe.analytics.stored import stored_analyses
    from gradpipe.runs import list_runs

    return {
        f"analytics/{r}/{name}": ds
        for r in list_runs(store)
        for name, ds in stored_analyses(store, r, projections=False).items()
    }


#: The groups of the store's DataTree, one builder per kind of object: a new
#: kind of node is one more function here.
TREE_NODES: Final[tuple[Callable[[Store, set[str]], dict[str, xr.Dataset]], ...]] = (
    _run_nodes,
    _aggregate_nodes,
    _snapshot_nodes,
    _stats_nodes,
    _analytics_nodes,
)


def tree_groups(store: Store, *, drop: Iterable[str] = ()) -> dict[str, xr.Dataset]:
    """The datasets of the store's DataTree by path, root (``/``) first.

    Each node of :data:`TREE_NODES` gives its datasets; a tensor whose name
    has ``/`` in it (``params/w``) is put in a child group (``.../params``,
    variable ``w``), since a DataTree variable name cannot hold one, or, where
    that group would not be a plain name of its own, keeps its place with the
    ``/`` escaped (``step%2Fw``): :mod:`gradpipe.xarray.tree`.
    """
    import xarray as xr

    from gradpipe._version import __version__
    from gradpipe.xarray.tree import nest

    drops = set(drop)
    root = xr.Dataset(attrs={"kind": "store", "store": store.url, "gradpipe_version": __version__})
    groups: dict[str, xr.Dataset] = {"/": root}
    for build in TREE_NODES:
        for path, dataset in build(store, drops).items():
            groups.update(nest(f"/{path}", dataset))
    return groups


# --- helpers ----------------------------------------------------------------------
def _open_store(target: object, storage_options: dict[str, Any] | None) -> Store:
    """The store ``target`` names (or is), opened read-only."""
    from gradpipe.errors import InvalidInputError
    from gradpipe.storage import Store, open_store

    if isinstance(target, Store):
        if storage_options:
            raise InvalidInputError(
                "storage_options apply to a store URL; this store is open already "
                "(pass them to gp.open_store)"
            )
        return target
    if isinstance(target, str | os.PathLike):
        return open_store(os.fspath(target), mode="r", storage_options=storage_options)
    raise InvalidInputError(
        f"engine='gradpipe' opens a store URL, a path or a gradpipe Store, "
        f"not {type(target).__name__}"
    )


def _check_target(kind: str, run: str | None, name: str | None) -> None:
    from gradpipe.core.display import printable
    from gradpipe.errors import InvalidInputError

    if kind not in _KINDS:
        raise InvalidInputError(f"kind must be one of {', '.join(_KINDS)}, not {printable(kind)}")
    if kind == "snapshot":
        if name is None or run is not None:
            raise InvalidInputError(
                "kind='snapshot' opens a snapshot chain: pass name=<snapshot name> and no run"
            )
        return
    if run is None:
        raise InvalidInputError(
            f"kind={printable(kind)} needs run=<run name>; gradpipe ls STORE lists the runs"
        )
    if kind == "aggregate" and name is None:
        raise InvalidInputError(
            "kind='aggregate' needs name=<aggregate name> (fedavg, ...); "
            "gp.open_run(store, run).aggregates lists them"
        )
    if kind == "analysis" and name is None:
        raise InvalidInputError(
            "kind='analysis' needs name=<analysis> (norms, agreement, gns, histograms, "
            "projection); gradpipe analyze records them"
        )


def _run(store: Store, run: str, at: str | None) -> Any:
    """The run as recorded now, or as its manifest ``at`` recorded it."""
    from gradpipe.core.display import printable
    from gradpipe.errors import InvalidInputError
    from gradpipe.runs import Run, open_run
    from gradpipe.storage.catalog import read_run_at

    if at is None:
        return open_run(store, run)
    manifest = read_run_at(store, at, run)
    if manifest.run != run:
        raise InvalidInputError(
            f"at={printable(at)} is a state of run {printable(manifest.run)}, not of "
            f"{printable(run)}"
        )
    return Run(store, at, manifest)


def _snapshot_chain(store: Store, name: str, at: str | None) -> list[tuple[str, Any]]:
    """The versions of snapshot chain ``name`` (from version ``at``), oldest first."""
    from gradpipe.core.display import printable
    from gradpipe.errors import InvalidInputError
    from gradpipe.snapshots.api import snapshot_versions

    chain = list(snapshot_versions(store, name, head=at))
    if chain and chain[0][1].name != name:
        raise InvalidInputError(
            f"at={printable(at)} is a snapshot of {printable(chain[0][1].name)}, not of "
            f"{printable(name)}"
        )
    return chain[::-1]


def _drop_set(drop_variables: str | Iterable[str] | None) -> set[str]:
    if drop_variables is None:
        return set()
    if isinstance(drop_variables, str):
        return {drop_variables}
    return set(drop_variables)
