"""``ingest``: gradient dumps into a run of the store.

The user operation: find the dumps, skip those already recorded, check the
headers against the run's schema, then compute the write graph under a
writer's lease and report. The graphs themselves are built in
:mod:`gradpipe.ingestion.graph` and computed by a :class:`~gradpipe.graph.runner.Runner`.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from numcodecs.abc import Codec

from gradpipe.aggregation.rounds import record_ingest_failures
from gradpipe.config import get_bytes
from gradpipe.core.chain import DEFAULT_KEYFRAME_INTERVAL, ChainTotals, parse_keyframe_interval
from gradpipe.core.display import PATH_LIMIT, printable
from gradpipe.core.names import parse_name
from gradpipe.core.run_manifest import RunManifest, TensorSchema
from gradpipe.errors import InvalidInputError, NotFoundError
from gradpipe.formats.dump import DumpHeader
from gradpipe.graph.runner import Runner, RunnerOptions, check_runner_options, use_runner
from gradpipe.graph.telemetry import operation
from gradpipe.ingestion.chains import ChainSettings
from gradpipe.ingestion.discover import DumpFile, Failure, discover_dumps
from gradpipe.ingestion.graph import (
    build_chained_ingest_graph,
    build_ingest_graph,
    build_inspect_graph,
)
from gradpipe.ingestion.plan import plan_chains
from gradpipe.ingestion.report import IngestReport
from gradpipe.ingestion.tasks import CommitResult, schema_conflict
from gradpipe.storage.catalog import read_run, run_ref
from gradpipe.storage.store import Store
from gradpipe.storage.walk import find_missing

if TYPE_CHECKING:
    from distributed import Client


__all__ = ["DELTA_KINDS", "IngestReport", "ingest", "recorded_id"]

#: Delta kinds an ingest may chain with: both lossless (design note 008 measured
#: the integer difference of bit patterns smaller than XOR on parameters).
DELTA_KINDS = ("int", "xor")


def _select(
    recorded: RunManifest, dumps: list[DumpFile], replace: bool, report: IngestReport
) -> tuple[list[DumpFile], list[DumpFile]]:
    """Dumps to ingest, and dumps recorded from the same file version (skipped unless damaged)."""
    todo, same = [], []
    known = recorded.dump_entries((d.step, d.peer) for d in dumps)
    for dump in dumps:
        entry = known.get((dump.step, dump.peer))
        if entry is None:
            todo.append(dump)
        elif entry.fingerprint == dump.fingerprint:
            same.append(dump)  # also with replace: the same file version is already there
        elif replace:
            todo.append(dump)
        else:
            report.failures.append(
                Failure(
                    dump.path,
                    dump.step,
                    dump.peer,
                    f"run {printable(recorded.run)} already has step {dump.step}, peer "
                    f"{printable(dump.peer)} from "
                    "a different version of this file; pass replace=True (--replace) to replace it",
                )
            )
    return todo, same


def _damaged(store: Store, recorded: RunManifest, dumps: list[DumpFile]) -> list[DumpFile]:
    """The recorded dumps some of whose objects are missing or corrupt (manifests) or absent."""
    roots = []
    known = recorded.dump_entries((d.step, d.peer) for d in dumps)
    for dump in dumps:
        entry = known.get((dump.step, dump.peer))
        if entry is None:  # _select only passes recorded dumps
            raise RuntimeError(f"step {dump.step}, peer {printable(dump.peer)} is not recorded")
        where = f"run {printable(recorded.run)}, step {dump.step}, peer {printable(dump.peer)}"
        roots.append((entry.dump, where))
    problems = find_missing(store, roots)
    return [dump for dump, found in zip(dumps, problems, strict=True) if found]


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
        where = (
            f"step {dump.step}, peer {printable(dump.peer)} "
            f"({printable(dump.path, limit=PATH_LIMIT)})"
        )
        why = schema_conflict(schema, theirs, where)
        if why is not None:
            report.failures.append(Failure(dump.path, dump.step, dump.peer, why))
            continue
        for name, spec in theirs.items():
            schema.setdefault(name, spec)
        good.append((dump, header))
    return good


def ingest(
    store: Store,
    pattern: str,
    *,
    run: str,
    runner: Runner | None = None,
    client: Client | None = None,
    scheduler: str | None = None,
    workers: int | None = None,
    processes: bool = False,
    dashboard: bool = False,
    progress: bool = False,
    codecs: Sequence[Codec] | None = None,
    chunk_bytes: int | None = None,
    storage_options: dict[str, Any] | None = None,
    replace: bool = False,
    repair: bool = False,
    delta: bool = False,
    delta_kind: str = "int",
    keyframe_interval: int = DEFAULT_KEYFRAME_INTERVAL,
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
    runner : Runner, optional
        Where the graphs run (see :func:`gradpipe.runner`); it is left open, so
        one runner serves many operations. Without one, a temporary runner is
        built from the next six arguments and closed before returning.
    client, scheduler : optional
        A ``distributed.Client``, or the address of a scheduler; by default a
        client already running in this process, else local threads.
    workers : int, optional
        Threads for the local scheduler (processes with ``processes=True``).
    processes : bool
        Run on a pool of single-threaded local processes instead of threads
        (:func:`gradpipe.runner`): they share no GIL, so they keep scaling on
        machines with many cores; starting them costs about half a second.
    dashboard : bool
        Without a cluster, run on an in-process ``LocalCluster`` whose
        dashboard shows the work (``report.dashboard`` has the link).
    progress : bool
        Show a progress bar (and the dashboard link, when there is one).
    codecs : sequence of numcodecs codecs, optional
        A fixed codec chain; by default the lossless policy picks per chunk.
        It may start with one lossy codec (``gradpipe.codecs.registry.make_codec("bf16")``):
        float tensors are then stored lossily, each marked in its manifest with
        the codec's bound and the error measured (``dump.info(name).lossy``),
        and the run lists the dump as lossy; integer tensors stay exact.
    storage_options : dict, optional
        fsspec options for reading the dump files.
    replace : bool
        Replace dumps already recorded from a different version of the file.
    repair : bool
        Also check the dumps already recorded from the same file version:
        every manifest below them is read and every data block's presence is
        checked (no data is read), and a dump with anything missing is
        ingested again from its file, which rewrites exactly what is missing
        (blocks are named by their content). Without it, recorded dumps are
        skipped unread.
    delta : bool
        Store each peer's tensors as delta chains across steps: tensor ``T``
        of (step, peer) is written against ``T`` of the same peer's previous
        step (in this batch, or already recorded), chunk by chunk as a delta
        or in full, whichever is smaller (:func:`gradpipe.storage.chains.write_version`).
        Reads and exports are unchanged. ``report.chains`` says what it saved:
        on parameters about half, on gradients nothing (docs/design/008).
        Cannot be combined with ``codecs``.
    delta_kind : {"int", "xor"}
        Integer difference or XOR of the bit patterns; both are bit-exact.
    keyframe_interval : int
        A chunk is stored in full at least every this many steps, which bounds
        the chunks a read decodes.

    Returns
    -------
    IngestReport
        Counts, bytes and failures. Bad dumps never stop good ones: they are
        listed in ``report.failures`` and everything else is committed.

    Examples
    --------
    >>> import gradpipe as gp
    >>> with gp.runner(dashboard=True) as runner:  # doctest: +SKIP
    ...     for run in ("a", "b"):
    ...         gp.ingest(store, f"{run}/step={{step}}/peer={{peer}}.npz", run=run, runner=runner)
    """
    store.check_writable()
    parse_name(run, what="run name")
    options: RunnerOptions = {
        "client": client,
        "scheduler": scheduler,
        "workers": workers,
        "processes": processes,
        "dashboard": dashboard,
        "progress": progress,
    }
    check_runner_options(runner, **options)
    settings = _chain_settings(delta, delta_kind, keyframe_interval, codecs, chunk_bytes)
    started = time.perf_counter()
    report = IngestReport(run, chains=ChainTotals() if settings is not None else None)
    fs, found, refused = discover_dumps(pattern, storage_options)
    report.failures.extend(refused)
    _, recorded = read_run(store, run, missing_ok=True)
    todo, same = _select(recorded, found, replace, report)
    broken = _damaged(store, recorded, same) if repair and same else []
    report.skipped += len(same) - len(broken)
    todo += broken
    with (
        use_runner(runner, **options) as active,
        operation(active, "ingest", run=run, store=store.url) as reporting,
    ):
        report.dashboard = active.dashboard_link
        good = _check_schema(recorded, todo, _inspect(active, fs, todo), report) if todo else []
        if good:
            message = f"ingest {len(good)} dumps from {pattern}" + (
                f" ({len(broken)} of them to repair)" if broken else ""
            )
            result = _write(
                store,
                active,
                run,
                fs,
                good,
                message=message,
                chunk_bytes=chunk_bytes,
                codecs=codecs,
                replace=replace,
                chains=settings,
            )
            _add_commit(report, result, {(d.step, d.peer) for d in broken})
        if report.run_id is None:
            report.run_id = recorded_id(store, run)
        report.failures.sort(key=lambda f: (f.step, f.peer))
        if report.failures and report.run_id is not None:
            # The run's rounds say why these peers are missing (gradpipe rounds).
            record_ingest_failures(store, run, report.failures)
        report.seconds = time.perf_counter() - started
        reporting.finish(
            report,
            failures=[
                f"step {f.step} peer {printable(f.peer)}: {f.reason}" for f in report.failures
            ],
            commit=report.run_id if report.ingested or report.repaired else None,
        )
    return report


def _chain_settings(
    delta: bool,
    kind: str,
    keyframe_interval: int,
    codecs: Sequence[Codec] | None,
    chunk_bytes: int | None,
) -> ChainSettings | None:
    """How a ``delta`` ingest chains, validated before any file is read; None without it."""
    from gradpipe.codecs._lossy import check_chain

    check_chain(codecs)  # a misplaced lossy codec fails here, not on every dump
    if not delta:
        return None
    if kind not in DELTA_KINDS:
        raise InvalidInputError(
            f"delta kind {printable(kind)} is not one ingest stores; choose one of "
            f"{', '.join(DELTA_KINDS)}"
        )
    if codecs is not None:
        raise InvalidInputError(
            "a delta ingest chooses the codec of every chunk and delta itself (the lossless "
            "policy); drop the fixed codecs (--codec) or the delta (--delta)"
        )
    return ChainSettings(
        kind,
        parse_keyframe_interval(keyframe_interval),
        chunk_bytes or get_bytes("chunk-bytes"),
        get_bytes("ingest.task-bytes"),
    )


def recorded_id(store: Store, run: str) -> str | None:
    """The manifest id the run ref points at, if the run exists."""
    try:
        return store.refs.get(run_ref(run))
    except NotFoundError:
        return None


def _inspect(runner: Runner, fs: Any, dumps: list[DumpFile]) -> list[DumpHeader | Failure]:
    graph, keys = build_inspect_graph(fs, dumps)
    batches = runner.get(graph, keys, name="gradpipe-inspect")
    return [header for batch in batches for header in batch]


def _write(
    store: Store,
    runner: Runner,
    run: str,
    fs: Any,
    dumps: list[tuple[DumpFile, DumpHeader]],
    *,
    message: str,
    chunk_bytes: int | None,
    codecs: Sequence[Codec] | None,
    replace: bool,
    chains: ChainSettings | None,
) -> CommitResult:
    """Build and compute the write graph: the one place an ingest writes to the store."""
    # The lease covers every dedup decision up to the commit: gc cannot
    # delete a block this ingest found present and will reference.
    with store.writing(f"ingest into run {run}") as lease:
        key_of_lease = lease.key if lease is not None else None
        if chains is None:
            graph, key = build_ingest_graph(
                store,
                run,
                fs,
                dumps,
                chunk_bytes=chunk_bytes or get_bytes("chunk-bytes"),
                unit_bytes=get_bytes("ingest.task-bytes"),
                codecs=codecs,
                message=message,
                replace=replace,
                lease=key_of_lease,
            )
        else:
            # The recorded parents are read here, inside the lease, not from
            # the run read before it: a dump reachable from the run ref now
            # has all its blocks (gc only deletes what no ref reaches), and
            # no gc can sweep until this lease ends (design note 003), by
            # which time the commit has published the new dumps, whose
            # manifests list every block of their chains (delta blocks and
            # keyframes, TensorManifest.data_children). Read before the
            # lease, the parent could have been replaced (--replace) and its
            # blocks swept in between, and the new deltas would name blocks
            # that are gone: write_version reuses a parent's blocks without
            # writing, or checking, them.
            _, recorded = read_run(store, run, missing_ok=True)
            graph, key = build_chained_ingest_graph(
                store,
                run,
                fs,
                dumps,
                plan_chains(recorded, [d for d, _ in dumps]),
                settings=chains,
                message=message,
                replace=replace,
                lease=key_of_lease,
            )
        [result] = runner.get(graph, [key], name="gradpipe-ingest")
    if not isinstance(result, CommitResult):  # our own graph's invariant, not data
        raise TypeError(f"the commit task returned {type(result).__name__}, not CommitResult")
    return result


def _add_commit(report: IngestReport, result: CommitResult, repairs: set[tuple[int, str]]) -> None:
    report.run_id = result.run_id
    report.failures.extend(result.failures)
    for done in result.committed:
        if (done.entry.step, done.entry.peer) in repairs:
            report.repaired += 1
        else:
            report.ingested += 1
        report.tensors += len(done.schema)
        report.raw_bytes += done.raw_bytes
        report.writes.add(done.stats)
        if report.chains is not None and done.chain is not None:
            report.chains.add(done.chain)
        for name, (nan, inf) in sorted(done.nonfinite.items()):
            report.nonfinite.append(
                f"tensor {printable(name)} of step {done.entry.step}, peer "
                f"{printable(done.entry.peer)} has "
                f"{nan} NaN and {inf} Inf values (stored bit-exact)"
            )
