"""The named objects of a store, read through their refs: one loader per kind.

Every part of gradpipe that needs a run's manifest (ingest, browsing, export,
the CLI) reads it here, so a missing run, a damaged ref or a ref that points at
the wrong kind of object gives the same clear error everywhere.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import TYPE_CHECKING, Final, TypeVar

from gradpipe.core.analytics_index import AnalyticsIndex
from gradpipe.core.display import PATH_LIMIT, printable, printable_names
from gradpipe.core.manifest import Manifest
from gradpipe.core.names import parse_name
from gradpipe.core.rounds import RoundsManifest
from gradpipe.core.run_manifest import RunManifest
from gradpipe.core.tensor_manifest import (
    TensorManifest,
    TensorRef,
    embedded_tensor,
    resolve_tensor,
)
from gradpipe.errors import IntegrityError, NotFoundError

if TYPE_CHECKING:
    from gradpipe.storage.store import Store

__all__ = [
    "MANIFEST_BATCH",
    "analytics_ref",
    "list_runs",
    "named_tensors",
    "read_analytics",
    "read_analytics_at",
    "read_many",
    "read_rounds",
    "read_rounds_at",
    "read_run",
    "rounds_ref",
    "run_ref",
]

#: Manifests fetched per batched round trip (a run of 2,000 dumps: 8 round trips).
MANIFEST_BATCH: Final = 256

M = TypeVar("M", bound=Manifest)


def run_ref(run: str) -> str:
    """The ref that names a run: ``runs/<run>``."""
    return f"runs/{parse_name(run, what='run name')}"


def list_runs(store: Store) -> list[str]:
    """Names of the runs in a store."""
    return [name.split("/", 1)[1] for name in store.refs.list("runs")]


def read_run(store: Store, run: str, *, missing_ok: bool = False) -> tuple[str | None, RunManifest]:
    """The id and manifest a run's ref points at.

    With ``missing_ok``, a run that does not exist yet reads as ``(None, an
    empty run)``; otherwise it raises :class:`NotFoundError` listing the runs
    there are.
    """
    ref = run_ref(run)
    try:
        run_id = store.refs.get(ref)
    except NotFoundError:
        if missing_ok:
            return None, RunManifest(run)
        known = printable_names(list_runs(store)) or "none"
        raise NotFoundError(
            f"no run {printable(run)} in store {printable(store.url, limit=PATH_LIMIT)} (runs: "
            f"{known})"
        ) from None
    return run_id, read_run_at(store, run_id, run)


def read_run_at(store: Store, run_id: str, run: str) -> RunManifest:
    """The run manifest with id ``run_id`` (a state of run ``run``)."""
    return store.get_typed(run_id, RunManifest, context=f"run {printable(run)}")


def rounds_ref(run: str) -> str:
    """The ref that holds a run's rounds (roster, policy, failures, claims): ``rounds/<run>``."""
    return f"rounds/{parse_name(run, what='run name')}"


def read_rounds(store: Store, run: str) -> tuple[str | None, RoundsManifest]:
    """The id and manifest of a run's rounds; ``(None, the defaults)`` if none were set."""
    entry = store.refs.entry(rounds_ref(run))
    if entry is None or entry.target is None:
        return None, RoundsManifest(run)
    return entry.target, read_rounds_at(store, entry.target, run)


def read_rounds_at(store: Store, rounds_id: str, run: str) -> RoundsManifest:
    """The rounds manifest with id ``rounds_id`` (a state of run ``run``'s rounds)."""
    return store.get_typed(rounds_id, RoundsManifest, context=f"rounds of run {printable(run)}")


def analytics_ref(run: str) -> str:
    """The ref that holds the index of a run's analyses: ``analytics/<run>``."""
    return f"analytics/{parse_name(run, what='run name')}"


def read_analytics(store: Store, run: str) -> tuple[str | None, AnalyticsIndex]:
    """The id and index of a run's analyses; ``(None, an empty index)`` if none were recorded."""
    entry = store.refs.entry(analytics_ref(run))
    if entry is None or entry.target is None:
        return None, AnalyticsIndex(run)
    return entry.target, read_analytics_at(store, entry.target, run)


def read_analytics_at(store: Store, index_id: str, run: str) -> AnalyticsIndex:
    """The analytics index with id ``index_id`` (a state of run ``run``'s analyses)."""
    index = store.get_typed(index_id, AnalyticsIndex, context=f"analyses of run {printable(run)}")
    if index.run != run:
        raise IntegrityError(
            f"ref {analytics_ref(run)} points at the analyses of run {printable(index.run)} "
            f"({index_id}); run `gradpipe verify`, then move the ref back"
        )
    return index


def read_many(
    store: Store, ids: Sequence[str], cls: type[M], *, context: str, batch: int = MANIFEST_BATCH
) -> list[M]:
    """Manifests ``ids`` of type ``cls``, in order, ``batch`` per round trip."""
    out: list[M] = []
    for lo in range(0, len(ids), batch):
        out.extend(store.get_typed_many(ids[lo : lo + batch], cls, context=context))
    return out


def named_tensors(
    store: Store,
    tensors: Iterable[tuple[str, str]],
    embedded: Mapping[str, TensorManifest],
    *,
    where: str,
    lazy: bool = False,
) -> dict[str, TensorManifest | TensorRef]:
    """Name → tensor manifest of a dump, aggregate or snapshot (``tensors``: its (name, id)).

    Those not embedded (format 1 stores keep them apart) are fetched in one
    batched read. With ``lazy``, an embedded tensor stays a :class:`TensorRef`
    (undecoded: its grid and :meth:`~TensorRef.chunk_stats` are cheap);
    otherwise every value is a decoded :class:`TensorManifest`.
    """
    pairs = list(tensors)
    found: dict[str, TensorManifest | TensorRef] = {}
    for _, tensor_id in pairs:
        held = embedded_tensor(embedded, tensor_id)
        if held is not None:
            found[tensor_id] = held if lazy else resolve_tensor(held)
    apart = sorted({t for _, t in pairs if t not in found})
    if apart:
        fetched = store.get_typed_many(apart, TensorManifest, context=where)
        found.update(zip(apart, fetched, strict=True))
    return {name: found[tensor_id] for name, tensor_id in pairs}
