"""The tasks of the ingest graph: what runs on workers, one dump or read unit at a time.

The graphs are built by :mod:`gradpipe.ingestion.graph`; the task keys are::

    gradpipe-inspect   headers of a few dumps            (phase 1, computed first)
    gradpipe-read      one ranged read of tens of MiB    ┐ per read unit
    gradpipe-encode    stats, hash, codec, write blocks  ┘
    gradpipe-dump      tensor + dump manifests           per dump
    gradpipe-commit    one compare-and-swap of the run   per ingest

Tasks take paths, store URLs and small plans, never arrays from the client;
the only arrays in flight are a read task's bytes, handed to its encode task.
A task that fails on a bad dump returns a :class:`Failure` instead of raising,
so every good dump of the batch still reaches the commit.
"""

from __future__ import annotations

import functools
import zlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, ParamSpec, TypeVar

import numpy as np
from numcodecs.abc import Codec

from gradpipe.codecs._lossy import LossyCodec, bind_chain
from gradpipe.core.chain import ChainTotals
from gradpipe.core.chunking import chunk_ranges
from gradpipe.core.display import PATH_LIMIT, printable
from gradpipe.core.dtypes import parse_dtype
from gradpipe.core.ids import hash_bytes
from gradpipe.core.manifest import encode_manifest
from gradpipe.core.run_manifest import DumpEntry, DumpManifest, RunManifest, TensorSchema, merge_run
from gradpipe.core.tensor_manifest import TensorManifest
from gradpipe.formats.checksum import check_crc32, join_crc32
from gradpipe.formats.dump import DumpHeader, read_byte_range, read_dump_header, read_dump_tensors
from gradpipe.formats.spec import check_tensor_values
from gradpipe.ingestion.discover import DumpFile, Failure
from gradpipe.ingestion.plan import ReadUnit, tensor_chunks
from gradpipe.storage.blocks import WriteStats
from gradpipe.storage.catalog import read_run_at, run_ref
from gradpipe.storage.store import Store
from gradpipe.storage.tensors import ChunkRecord, build_tensor_manifest, write_chunks

__all__ = [
    "CommitResult",
    "DumpResult",
    "Failure",
    "UnitResult",
    "commit_run",
    "encode_unit",
    "inspect_dumps",
    "read_unit",
    "schema_conflict",
    "store_dump",
    "write_dump",
]

P = ParamSpec("P")
R = TypeVar("R")


def _isolated(func: Callable[P, R]) -> Callable[P, R | Failure]:
    """Run a task for one dump; turn an exception into a :class:`Failure` of that dump.

    The dump is the task's first :class:`DumpFile` argument. Failures from
    upstream tasks pass straight through.
    """

    @functools.wraps(func)
    def task(*args: P.args, **kwargs: P.kwargs) -> R | Failure:
        dump = next(a for a in args if isinstance(a, DumpFile))
        upstream = [a for a in args if isinstance(a, Failure)]
        upstream += [x for a in args if isinstance(a, list) for x in a if isinstance(x, Failure)]
        if upstream:
            return upstream[0]
        try:
            return func(*args, **kwargs)
        except Exception as exc:
            reason = str(exc) if str(exc) else type(exc).__name__
            if dump.path not in reason:
                reason = f"{printable(dump.path, limit=PATH_LIMIT)}: {reason}"
            return Failure(dump.path, dump.step, dump.peer, reason)

    return task


# --- phase 1: headers ---------------------------------------------------------------
def inspect_dumps(fs: Any, dumps: Sequence[DumpFile]) -> list[DumpHeader | Failure]:
    """Read the headers of a few dumps (one task per batch keeps the graph small)."""
    return [_isolated(_read_header)(fs, dump) for dump in dumps]


def _read_header(fs: Any, dump: DumpFile) -> DumpHeader:
    return read_dump_header(fs, dump.path)


# --- phase 2: tasks -----------------------------------------------------------------
@_isolated
def read_unit(fs: Any, dump: DumpFile, header: DumpHeader, unit: ReadUnit) -> Any:
    """The bytes of a unit (one ranged read), or whole tensors for formats without ranges."""
    if unit.whole:
        return read_dump_tensors(fs, dump.path, header)
    return read_byte_range(fs, dump.path, unit.start, unit.stop)


ChunkRecords = dict[str, list[ChunkRecord]]


@dataclass
class UnitResult:
    """Chunk records of one unit: per tensor, the records of chunks ``part.lo…``."""

    records: ChunkRecords = field(default_factory=dict)
    stats: WriteStats = field(default_factory=WriteStats)
    lossy: dict[str, LossyCodec] = field(default_factory=dict)  # tensor → its lossy codec
    # tensor → (first chunk, CRC-32, length) of each part read, for tensors whose
    # file records a CRC-32: write_dump joins them in order and checks the whole.
    crcs: dict[str, list[tuple[int, int, int]]] = field(default_factory=dict)


@_isolated
def encode_unit(
    store: Store,
    dump: DumpFile,
    header: DumpHeader,
    unit: ReadUnit,
    data: Any,
    chunk_bytes: int,
    codecs: Sequence[Codec] | None,
) -> UnitResult:
    """Compute stats, hash, encode and write the chunks of one unit."""
    specs = {t.name: t for t in header.tensors}
    result = UnitResult()
    owners: list[str] = []  # the tensor of each chunk, in order
    chunks: list[np.ndarray] = []
    chains: list[Sequence[Codec] | None] = []  # the codec chain of each chunk
    for part in unit.parts:
        spec = specs[part.tensor]
        dtype = parse_dtype(spec.dtype)
        chain, lossy = bind_chain(codecs, spec.dtype, tuple(spec.shape))
        if lossy is not None:
            result.lossy[part.tensor] = lossy
        grid = tensor_chunks(spec.shape, spec.dtype, chunk_bytes)
        ranges = list(chunk_ranges(spec.shape, grid))
        if unit.whole:
            flat = np.ascontiguousarray(data[part.tensor], dtype=dtype).reshape(-1)
            first = 0
        else:
            base = part.start - unit.start
            raw = data[base : base + (part.stop - part.start)]
            flat = raw.view(dtype)
            # Raw bytes of a ranged read get the checks the whole-file readers apply.
            check_tensor_values(spec, flat, path=dump.path)
            if spec.crc32 is not None:
                piece = (part.lo, zlib.crc32(raw), len(raw))
                result.crcs.setdefault(part.tensor, []).append(piece)
            first = ranges[part.lo][0] if part.hi > part.lo else 0
            ranges = ranges[part.lo : part.hi]
        chunks.extend(flat[a - first : b - first] for a, b in ranges)
        owners.extend([part.tensor] * len(ranges))
        chains.extend([chain] * len(ranges))
        result.records.setdefault(part.tensor, [])
    # One call for the whole unit: many small tensors share batched round trips.
    records = write_chunks(store, chunks, stats=result.stats, where=dump.path, chunk_codecs=chains)
    for tensor, record in zip(owners, records, strict=True):
        result.records[tensor].append(record)
    return result


@dataclass(frozen=True)
class DumpResult:
    """A dump written to the store, not yet part of its run.

    A ``--delta`` ingest's dumps also carry what chaining did (``chain``) and
    their manifest, which the same peer's next step is written against.
    """

    entry: DumpEntry
    schema: dict[str, TensorSchema]
    stats: WriteStats
    raw_bytes: int
    nonfinite: dict[str, tuple[int, int]]  # tensor → (NaN count, Inf count), where any
    chain: ChainTotals | None = None
    manifest: DumpManifest | None = field(default=None, repr=False)


@_isolated
def write_dump(
    store: Store,
    dump: DumpFile,
    header: DumpHeader,
    run: str,
    results: list[UnitResult],
    chunk_bytes: int,
) -> DumpResult:
    """Assemble the tensor manifests and store them inside the dump manifest of one dump."""
    records: ChunkRecords = {}
    lossy: dict[str, LossyCodec] = {}
    stats = WriteStats()
    crcs: dict[str, list[tuple[int, int, int]]] = {}
    for unit_result in results:
        stats.add(unit_result.stats)
        lossy.update(unit_result.lossy)
        for name, recs in unit_result.records.items():
            records.setdefault(name, []).extend(recs)
        for name, pieces in unit_result.crcs.items():
            crcs.setdefault(name, []).extend(pieces)
    # Before the dump is stored (and so before any commit): bytes read by range whose
    # CRC-32 the file records are ingested only if they have it. (A dump read whole
    # was checked by its reader: zipfile compares the CRC-32 of each member read.)
    for spec in header.tensors if header.ranged else ():
        if spec.crc32 is not None:
            got, _ = join_crc32((crc, n) for _, crc, n in sorted(crcs.get(spec.name, [])))
            check_crc32(dump.path, spec.name, got, spec.crc32)
    manifests = [
        (
            spec.name,
            build_tensor_manifest(
                spec.dtype,
                spec.shape,
                tensor_chunks(spec.shape, spec.dtype, chunk_bytes),
                records.get(spec.name, []),
                lossy.get(spec.name),
            ),
        )
        for spec in header.tensors
    ]
    return store_dump(store, dump, header, run, manifests, stats)


def store_dump(
    store: Store,
    dump: DumpFile,
    header: DumpHeader,
    run: str,
    manifests: Sequence[tuple[str, TensorManifest]],
    stats: WriteStats,
    *,
    chain: ChainTotals | None = None,
) -> DumpResult:
    """Store the dump manifest of ``dump`` (its tensors' manifests inside), not yet in the run."""
    nonfinite: dict[str, tuple[int, int]] = {}
    embedded: dict[str, TensorManifest] = {}
    tensors: list[tuple[str, str]] = []
    for name, manifest in manifests:
        summary = manifest.summary()
        if summary.nan or summary.inf:
            nonfinite[name] = (summary.nan, summary.inf)
        # Every tensor's manifest goes inside the dump's: one object for the
        # dump, whatever its number of tensors. Its id is that of its encoding.
        tensor_id = hash_bytes(encode_manifest(manifest))
        embedded[tensor_id] = manifest
        tensors.append((name, tensor_id))
    source = {
        "path": dump.path,
        "format": header.format,
        "size": str(header.size),
        "fingerprint": dump.fingerprint,
    }
    dump_manifest = DumpManifest(
        run, dump.step, dump.peer, tuple(tensors), dict(header.metadata), source, embedded
    )
    [manifest_id] = store.put_manifests([dump_manifest], stats=stats)
    return DumpResult(
        DumpEntry(
            dump.step,
            dump.peer,
            manifest_id,
            dump.fingerprint,
            lossy=not all(m.exact for m in embedded.values()),
        ),
        {t.name: TensorSchema(t.dtype, t.shape) for t in header.tensors},
        stats,
        sum(t.nbytes for t in header.tensors),
        nonfinite,
        chain,
        dump_manifest if chain is not None else None,
    )


@dataclass(frozen=True)
class CommitResult:
    """What the commit published."""

    run_id: str | None
    committed: list[DumpResult]
    failures: list[Failure]


def schema_conflict(
    schema: dict[str, TensorSchema], theirs: dict[str, TensorSchema], where: str
) -> str | None:
    """Why a dump's tensors disagree with the run's schema, or None."""
    for name, spec in theirs.items():
        known = schema.get(name)
        if known is not None and known != spec:
            return (
                f"tensor {printable(name)} of {where} is {spec.describe()}, but the run has it as "
                f"{known.describe()}; fix the dump or ingest it into another run"
            )
    return None


def commit_run(
    store: Store,
    run: str,
    dumps: list[DumpFile],
    results: list[DumpResult | Failure],
    message: str,
    replace: bool,
    lease: str | None = None,
) -> CommitResult:
    """Publish every successful dump into the run with one compare-and-swap.

    The run is re-checked as it is at the swap, not as it was when the ingest
    planned: a concurrent ingest may have recorded the same (step, peer) from
    another file version, or fixed a tensor's schema differently.
    """
    failures = [r for r in results if isinstance(r, Failure)]
    done = [r for r in results if isinstance(r, DumpResult)]
    if not done:
        return CommitResult(None, [], failures)
    outcome: dict[str, Any] = {}

    def decide(current: str | None) -> str | None:
        base = read_run_at(store, current, run) if current else RunManifest(run)
        schema = dict(base.schema)
        accepted, refused = [], []
        paths = {(d.step, d.peer): d.path for d in dumps}
        # One batched read per level of the run's shards, of the paths to these keys only.
        known = base.dump_entries(r.entry.sort_key for r in done)
        for result in done:
            key = (result.entry.step, result.entry.peer)
            why = schema_conflict(schema, result.schema, f"step {key[0]}, peer {printable(key[1])}")
            recorded = known.get(key)
            changed = recorded is not None and recorded.fingerprint != result.entry.fingerprint
            if why is None and changed and not replace:
                why = (
                    f"run {printable(run)} got step {key[0]}, peer {printable(key[1])} "
                    "from another version "
                    "of the file while this ingest ran; re-run with --replace to replace it"
                )
            if why is None:
                accepted.append(result)
                for name, spec in result.schema.items():
                    schema.setdefault(name, spec)
            else:
                refused.append(Failure(paths.get(key, "?"), key[0], key[1], why))
        outcome.update(accepted=accepted, refused=refused)
        if not accepted:
            return current
        merged = store.put_manifest(merge_run(base, [r.entry for r in accepted], schema))
        if merged == current:
            outcome["current"] = current
            # Everything is recorded as we would record it (a racing ingest of the
            # same files committed first): a swap would only add a history entry.
            raise _UnchangedError
        return merged

    # Publish under the client's lease (checked fresh first), not a new one of our own.
    with store.lock.join(lease):
        try:
            target = store.refs.update(run_ref(run), decide, message=message).target
        except _UnchangedError:
            target = outcome["current"]
    return CommitResult(target, outcome["accepted"], failures + outcome["refused"])


class _UnchangedError(Exception):
    """A commit that would not change the run (raised by its ``decide`` to write nothing)."""
