"""``ingest``: gradient dumps into a run of the store, as a Dask graph."""

from __future__ import annotations

import dataclasses
import sys
import time
from collections.abc import Hashable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from dask.base import tokenize
from dask.utils import format_bytes
from numcodecs.abc import Codec

from gradpipe.config import get_bytes
from gradpipe.core.names import parse_name
from gradpipe.core.run_manifest import RunManifest, TensorSchema
from gradpipe.errors import NotFoundError
from gradpipe.formats.dump import DumpHeader
from gradpipe.graph.compute import Runner, runner_for
from gradpipe.graph.discover import DumpFile, discover_dumps
from gradpipe.graph.ingest import (
    CommitResult,
    Failure,
    ReadUnit,
    commit_run,
    encode_unit,
    inspect_dumps,
    plan_units,
    read_unit,
    schema_conflict,
    write_dump,
)
from gradpipe.storage.blocks import WriteStats
from gradpipe.storage.catalog import read_run, run_ref
from gradpipe.storage.store import Store

if TYPE_CHECKING:
    from distributed import Client

__all__ = ["IngestReport", "build_ingest_graph", "ingest"]

# Dump headers read per inspect task: enough to amortise a task, few enough to spread.
_HEADERS_PER_TASK = 16


@dataclass
class IngestReport:
    """What an ingest did: counts, bytes, failures, and the run it committed."""

    run: str
    run_id: str | None = None
    ingested: int = 0
    skipped: int = 0
    failures: list[Failure] = field(default_factory=list)
    tensors: int = 0
    raw_bytes: int = 0
    writes: WriteStats = field(default_factory=WriteStats)
    nonfinite: list[str] = field(default_factory=list)
    seconds: float = 0.0
    dashboard: str | None = None

    @property
    def ok(self) -> bool:
        """True when no dump failed."""
        return not self.failures

    @property
    def ratio(self) -> float:
        """Raw bytes ingested per new byte stored (dedup and compression)."""
        return (
            self.raw_bytes / self.writes.stored_bytes if self.writes.stored_bytes else float("inf")
        )

    @property
    def mib_per_second(self) -> float:
        """Raw MiB ingested per second of wall time."""
        return self.raw_bytes / 2**20 / self.seconds if self.seconds else 0.0

    def to_dict(self) -> dict[str, Any]:
        """JSON-able form (what ``gradpipe ingest --json`` prints)."""
        return {
            "ok": self.ok,
            "run": self.run,
            "run_id": self.run_id,
            "ingested": self.ingested,
            "skipped": self.skipped,
            "failed": len(self.failures),
            "failures": [f.to_dict() for f in self.failures],
            "tensors": self.tensors,
            "raw_bytes": self.raw_bytes,
            "stored_bytes": self.writes.stored_bytes,
            "ratio": round(self.ratio, 3) if self.writes.stored_bytes else None,
            "blocks_written": self.writes.blocks_written,
            "blocks_reused": self.writes.blocks_reused,
            "zero_chunks": self.writes.zero_chunks,
            "nonfinite": self.nonfinite,
            "seconds": round(self.seconds, 3),
            "mib_per_second": round(self.mib_per_second, 1),
            "dashboard": self.dashboard,
        }

    def summary(self) -> str:
        """A few lines for people."""
        lines = [
            f"run {self.run!r}: {self.ingested} dumps ingested, {self.skipped} skipped "
            f"(already recorded), {len(self.failures)} failed",
            f"{self.tensors} tensors, {format_bytes(self.raw_bytes)} raw -> "
            f"{format_bytes(self.writes.stored_bytes)} new stored"
            + (f" (ratio {self.ratio:.2f})" if self.writes.stored_bytes else ""),
            f"blocks written {self.writes.blocks_written}, reused {self.writes.blocks_reused}, "
            f"all-zero chunks {self.writes.zero_chunks}; {self.seconds:.1f} s, "
            f"{self.mib_per_second:.0f} MiB/s",
        ]
        lines += [f"warning: {w}" for w in self.nonfinite]
        lines += [f"FAILED step {f.step} peer {f.peer}: {f.reason}" for f in self.failures]
        if self.dashboard:
            lines.append(f"dashboard: {self.dashboard}")
        return "\n".join(lines)


def _select(
    recorded: RunManifest, dumps: list[DumpFile], replace: bool, report: IngestReport
) -> list[DumpFile]:
    """Dumps to ingest: skip those recorded from the same file version."""
    todo = []
    for dump in dumps:
        entry = recorded.entry(dump.step, dump.peer)
        if entry is None:
            todo.append(dump)
        elif entry.fingerprint == dump.fingerprint:
            report.skipped += 1  # also with replace: the same file version is already there
        elif replace:
            todo.append(dump)
        else:
            report.failures.append(
                Failure(
                    dump.path,
                    dump.step,
                    dump.peer,
                    f"run {recorded.run!r} already has step {dump.step}, peer {dump.peer!r} from "
                    "a different version of this file; pass replace=True (--replace) to replace it",
                )
            )
    return todo


def _check_schema(
    recorded: RunManifest,
    dumps: list[DumpFile],
    headers: list[DumpHeader | Failure],
    report: IngestReport,
) -> list[tuple[DumpFile, DumpHeader]]:
    """Pair dumps with headers; refuse dumps whose tensors break the run's schema."""
    schema = dict(recorded.schema)
    good = []
    for dump, header in zip(dumps, headers, strict=True):
        if isinstance(header, Failure):
            report.failures.append(header)
            continue
        theirs = {t.name: TensorSchema(t.dtype, t.shape) for t in header.tensors}
        why = schema_conflict(schema, theirs, f"step {dump.step}, peer {dump.peer!r} ({dump.path})")
        if why is not None:
            report.failures.append(Failure(dump.path, dump.step, dump.peer, why))
            continue
        for name, spec in theirs.items():
            schema.setdefault(name, spec)
        good.append((dump, header))
    return good


def build_ingest_graph(
    store: Store,
    run: str,
    fs: Any,
    dumps: Sequence[tuple[DumpFile, DumpHeader]],
    *,
    chunk_bytes: int,
    unit_bytes: int,
    codecs: Sequence[Codec] | None,
    message: str,
    replace: bool = False,
    lease: str | None = None,
) -> tuple[dict[Hashable, Any], str]:
    """The read/encode/dump/commit graph of ``dumps`` (not computed), and its output key."""
    token = tokenize(
        store.url, run, [(d.path, d.fingerprint) for d, _ in dumps], chunk_bytes, codecs
    )
    graph: dict[Hashable, Any] = {}
    dump_keys = []
    for j, (dump, header) in enumerate(dumps):
        encoded = []
        for k, unit in enumerate(
            plan_units(header, chunk_bytes=chunk_bytes, unit_bytes=unit_bytes)
        ):
            read_key = (f"gradpipe-read-{token}", j, k)
            encode_key = (f"gradpipe-encode-{token}", j, k)
            # A unit's tasks carry only its own tensors' specs: a dump with
            # thousands of tensors must not ship its whole header with every task.
            part = header if unit.whole else _unit_header(header, unit)
            graph[read_key] = (read_unit, fs, dump, part, unit)
            graph[encode_key] = (
                encode_unit,
                store,
                dump,
                part,
                unit,
                read_key,
                chunk_bytes,
                codecs,
            )
            encoded.append(encode_key)
        dump_key = (f"gradpipe-dump-{token}", j)
        graph[dump_key] = (write_dump, store, dump, header, run, encoded, chunk_bytes)
        dump_keys.append(dump_key)
    commit_key = f"gradpipe-commit-{token}"
    graph[commit_key] = (
        commit_run,
        store,
        run,
        [d for d, _ in dumps],
        dump_keys,
        message,
        replace,
        lease,
    )
    return graph, commit_key


def _unit_header(header: DumpHeader, unit: ReadUnit) -> DumpHeader:
    names = {part.tensor for part in unit.parts}
    tensors = tuple(t for t in header.tensors if t.name in names)
    return dataclasses.replace(header, tensors=tensors, metadata={})


def ingest(
    store: Store,
    pattern: str,
    *,
    run: str,
    client: Client | None = None,
    scheduler: str | None = None,
    workers: int | None = None,
    codecs: Sequence[Codec] | None = None,
    chunk_bytes: int | None = None,
    storage_options: dict[str, Any] | None = None,
    replace: bool = False,
    progress: bool = False,
    dashboard: bool = False,
) -> IngestReport:
    """Ingest the dumps matching ``pattern`` into ``run``.

    Parameters
    ----------
    store : Store
        A writable store.
    pattern : str
        Path or fsspec URL with ``{step}`` (an integer) and ``{peer}`` fields,
        e.g. ``"dumps/step={step}/peer={peer}.safetensors"``.
    run : str
        Name of the run to add the dumps to (created if new).
    client, scheduler : optional
        A ``distributed.Client``, or the address of a scheduler; by default a
        client already running in this process, else local threads.
    workers : int, optional
        Threads for the local scheduler.
    codecs : sequence of numcodecs codecs, optional
        A fixed codec chain; by default the lossless policy picks per chunk.
    storage_options : dict, optional
        fsspec options for reading the dump files.
    replace : bool
        Replace dumps already recorded from a different version of the file.
    progress : bool
        Show a progress bar (and the dashboard link, when there is one).
    dashboard : bool
        Without a cluster, run on an in-process ``LocalCluster`` whose
        dashboard shows the work (``report.dashboard`` has the link).

    Returns
    -------
    IngestReport
        Counts, bytes and failures. Bad dumps never stop good ones: they are
        listed in ``report.failures`` and everything else is committed.
    """
    store.check_writable()
    parse_name(run, what="run name")
    started = time.perf_counter()
    report = IngestReport(run)
    fs, found, refused = discover_dumps(pattern, storage_options)
    report.failures.extend(refused)
    _, recorded = read_run(store, run, missing_ok=True)
    todo = _select(recorded, found, replace, report)
    runner = runner_for(
        client=client, scheduler=scheduler, workers=workers, progress=progress, dashboard=dashboard
    )
    report.dashboard = runner.dashboard_link
    if progress and report.dashboard:
        print(f"dashboard: {report.dashboard}", file=sys.stderr)
    try:
        if todo:
            headers = _inspect(runner, fs, todo)
            good = _check_schema(recorded, todo, headers, report)
            if good:
                # The lease covers every dedup decision up to the commit: gc cannot
                # delete a block this ingest found present and will reference.
                with store.writing(f"ingest into run {run}") as lease:
                    graph, key = build_ingest_graph(
                        store,
                        run,
                        fs,
                        good,
                        chunk_bytes=chunk_bytes or get_bytes("chunk-bytes"),
                        unit_bytes=get_bytes("ingest.task-bytes"),
                        codecs=codecs,
                        message=f"ingest {len(good)} dumps from {pattern}",
                        replace=replace,
                        lease=lease.key if lease is not None else None,
                    )
                    [result] = runner.get(graph, [key], name="gradpipe-ingest")
                _add_commit(report, result)
    finally:
        runner.close()
    if report.run_id is None:
        report.run_id = recorded_id(store, run)
    report.failures.sort(key=lambda f: (f.step, f.peer))
    report.seconds = time.perf_counter() - started
    return report


def recorded_id(store: Store, run: str) -> str | None:
    """The manifest id the run ref points at, if the run exists."""
    try:
        return store.refs.get(run_ref(run))
    except NotFoundError:
        return None


def _inspect(runner: Runner, fs: Any, dumps: list[DumpFile]) -> list[DumpHeader | Failure]:
    token = tokenize(fs, [(d.path, d.fingerprint) for d in dumps])
    graph: dict[Hashable, Any] = {}
    for i in range(0, len(dumps), _HEADERS_PER_TASK):
        graph[(f"gradpipe-inspect-{token}", i)] = (
            inspect_dumps,
            fs,
            dumps[i : i + _HEADERS_PER_TASK],
        )
    batches = runner.get(graph, list(graph), name="gradpipe-inspect")
    return [header for batch in batches for header in batch]


def _add_commit(report: IngestReport, result: CommitResult) -> None:
    report.run_id = result.run_id
    report.failures.extend(result.failures)
    for done in result.committed:
        report.ingested += 1
        report.tensors += len(done.schema)
        report.raw_bytes += done.raw_bytes
        report.writes.add(done.stats)
        for name, (nan, inf) in sorted(done.nonfinite.items()):
            report.nonfinite.append(
                f"tensor {name!r} of step {done.entry.step}, peer {done.entry.peer!r} has "
                f"{nan} NaN and {inf} Inf values (stored bit-exact)"
            )
