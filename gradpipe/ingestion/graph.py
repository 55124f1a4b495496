"""Builders of the ingest graphs: dump files in, chunks encoded on workers, one commit out.

An ingest computes two graphs, one after the other::

    build_inspect_graph   gradpipe-inspect   headers of a few dumps per task
    build_ingest_graph    gradpipe-read      one ranged read of tens of MiB    ┐ per read unit
                          gradpipe-encode    stats, hash, codec, write blocks  ┘
                          gradpipe-dump      tensor + dump manifests           per dump
                          gradpipe-commit    one compare-and-swap of the run   per ingest
    build_chained_ingest_graph  (``--delta``)
                          gradpipe-chain     a dump's tensors as versions of   per dump, one
                                             the peer's previous step's        chain per peer
                          gradpipe-commit

The builders only build: they return plain task dicts (the tasks are in
:mod:`gradpipe.ingestion.tasks`) and the keys to compute, and a
:class:`~gradpipe.graph.runner.Runner` computes them. Keys are tokenised from
everything that defines the work, so the same dumps give the same keys and a
scheduler that already holds a result does not recompute it.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Hashable, Sequence
from typing import Any

from dask.base import tokenize
from numcodecs.abc import Codec

from gradpipe.formats.dump import DumpHeader
from gradpipe.ingestion.chains import (
    ChainSettings,
    ParentFile,
    ParentRecorded,
    write_dump_version,
)
from gradpipe.ingestion.discover import DumpFile
from gradpipe.ingestion.plan import ChainPlan, ReadUnit, plan_units
from gradpipe.ingestion.tasks import (
    commit_run,
    encode_unit,
    inspect_dumps,
    read_unit,
    write_dump,
)
from gradpipe.storage.store import Store

__all__ = [
    "HEADERS_PER_TASK",
    "build_chained_ingest_graph",
    "build_ingest_graph",
    "build_inspect_graph",
]

#: Dump headers read per inspect task: enough to amortise a task, few enough to spread.
HEADERS_PER_TASK = 16


def build_inspect_graph(
    fs: Any, dumps: Sequence[DumpFile], *, per_task: int = HEADERS_PER_TASK
) -> tuple[dict[Hashable, Any], list[Hashable]]:
    """The graph that reads the headers of ``dumps`` (not computed), and its output keys.

    Each key's result is a list of :class:`~gradpipe.formats.dump.DumpHeader`
    or :class:`~gradpipe.ingestion.discover.Failure`, one per dump of its batch;
    the keys are in the order of ``dumps``, so concatenating the results
    pairs every dump with its header.
    """
    token = tokenize(fs, [(d.path, d.fingerprint) for d in dumps])
    graph: dict[Hashable, Any] = {}
    for i in range(0, len(dumps), per_task):
        graph[(f"gradpipe-inspect-{token}", i)] = (inspect_dumps, fs, list(dumps[i : i + per_task]))
    return graph, list(graph)


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
    """The read/encode/dump/commit graph of ``dumps`` (not computed), and its output key.

    The output key's result is a :class:`~gradpipe.ingestion.tasks.CommitResult`.
    ``lease`` is the key of the writer's lease the commit publishes under
    (:meth:`Store.writing <gradpipe.storage.store.Store.writing>`).
    """
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


def build_chained_ingest_graph(
    store: Store,
    run: str,
    fs: Any,
    dumps: Sequence[tuple[DumpFile, DumpHeader]],
    plans: Sequence[ChainPlan],
    *,
    settings: ChainSettings,
    message: str,
    replace: bool = False,
    lease: str | None = None,
) -> tuple[dict[Hashable, Any], str]:
    """The graph of a ``--delta`` ingest (not computed), and its output key.

    One ``gradpipe-chain`` task per dump, which depends on the task of the
    dump it is written against (``plans``, from
    :func:`~gradpipe.ingestion.plan.plan_chains`): the steps of one peer
    run in order, peers in parallel. The output is the commit's
    :class:`~gradpipe.ingestion.tasks.CommitResult`, as for
    :func:`build_ingest_graph`.
    """
    token = tokenize(
        store.url,
        run,
        [(d.path, d.fingerprint) for d, _ in dumps],
        [(p.previous, p.recorded) for p in plans],
        settings,
    )
    graph: dict[Hashable, Any] = {}
    keys = [(f"gradpipe-chain-{token}", j) for j in range(len(dumps))]
    for j, ((dump, header), plan) in enumerate(zip(dumps, plans, strict=True)):
        parent: ParentFile | ParentRecorded | None = None
        previous = None
        if plan.previous is not None:
            parent = ParentFile(*dumps[plan.previous])
            previous = keys[plan.previous]
        elif plan.recorded is not None:
            parent = ParentRecorded(plan.recorded.dump, plan.recorded.step)
        graph[keys[j]] = (
            write_dump_version,
            store,
            fs,
            dump,
            header,
            run,
            parent,
            previous,
            settings,
        )
    commit_key = f"gradpipe-commit-{token}"
    graph[commit_key] = (
        commit_run,
        store,
        run,
        [d for d, _ in dumps],
        list(keys),
        message,
        replace,
        lease,
    )
    return graph, commit_key


def _unit_header(header: DumpHeader, unit: ReadUnit) -> DumpHeader:
    names = {part.tensor for part in unit.parts}
    tensors = tuple(t for t in header.tensors if t.name in names)
    return dataclasses.replace(header, tensors=tensors, metadata={})
