"""The task of a ``--delta`` ingest: a dump written as the next version of its peer's previous one.

One task per dump (``gradpipe-chain``) writes every tensor of the dump with
:func:`~gradpipe.storage.chains.write_version` against the same tensor of the
same peer's previous step (see :func:`~gradpipe.ingestion.plan.plan_chains`):

- when that step is in the batch, its task's result (a small
  :class:`~gradpipe.ingestion.tasks.DumpResult` holding the dump's
  manifest) is this task's argument, and the parent's *values* are read again
  from its file, untrusted: each chunk used as a base is checked against the
  block id it was stored under, so a file changed in between only costs full
  chunks. Arrays never travel between tasks;
- when it is only recorded in the run (a previous ingest), its manifest and
  values are read from the store, which checks every block against its id.

So the tasks of one peer form a chain across steps and peers run in
parallel. A dump that fails becomes a :class:`Failure` as in a plain ingest;
the next step of its peer is then written without a parent, in full.
"""

from __future__ import annotations

import zlib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Final

import numpy as np

from gradpipe.core.chain import ChainTotals
from gradpipe.core.display import printable
from gradpipe.core.dtypes import parse_dtype
from gradpipe.core.run_manifest import DumpManifest
from gradpipe.core.tensor_manifest import TensorManifest
from gradpipe.errors import GradpipeError
from gradpipe.formats.checksum import check_crc32
from gradpipe.formats.dump import DumpHeader, read_byte_range, read_dump_tensors
from gradpipe.formats.spec import TensorSpec, check_tensor_values
from gradpipe.ingestion.discover import DumpFile, Failure
from gradpipe.ingestion.tasks import DumpResult, _isolated, store_dump
from gradpipe.storage.blocks import WriteStats
from gradpipe.storage.chains import ChainParent, write_version
from gradpipe.storage.store import Store
from gradpipe.storage.tensors import read_tensors

__all__ = ["ChainSettings", "ParentFile", "ParentRecorded", "write_dump_version"]

#: A ranged group read whose span is this much larger than its tensors (the
#: parent file lays them out differently) reads tensor by tensor instead.
_SPAN_SLACK: Final = 2


@dataclass(frozen=True, slots=True)
class ChainSettings:
    """How a ``--delta`` ingest writes its versions."""

    kind: str  # delta kind, "int" or "xor"
    keyframe_interval: int
    chunk_bytes: int  # chunk grid of a tensor's first version
    unit_bytes: int  # bytes read per group of tensors


@dataclass(frozen=True, slots=True)
class ParentFile:
    """The parent is the previous dump of this batch: its file, read again for values."""

    dump: DumpFile
    header: DumpHeader


@dataclass(frozen=True, slots=True)
class ParentRecorded:
    """The parent is a dump already recorded in the run (id of its dump manifest)."""

    dump_id: str
    step: int


def write_dump_version(
    store: Store,
    fs: Any,
    dump: DumpFile,
    header: DumpHeader,
    run: str,
    parent: ParentFile | ParentRecorded | None,
    previous: DumpResult | Failure | None,
    settings: ChainSettings,
) -> DumpResult | Failure:
    """Write one dump as the next version of ``parent`` (``previous``: its task's result).

    A parent in the batch that failed leaves this dump without one: it is
    stored in full, and does not fail with it.
    """
    if isinstance(parent, ParentFile) and not isinstance(previous, DumpResult):
        parent = None
    base = previous.manifest if isinstance(previous, DumpResult) else None
    return _write_version(store, fs, dump, header, run, parent, base, settings)


@_isolated
def _write_version(
    store: Store,
    fs: Any,
    dump: DumpFile,
    header: DumpHeader,
    run: str,
    parent: ParentFile | ParentRecorded | None,
    base: DumpManifest | None,
    settings: ChainSettings,
) -> DumpResult:
    if isinstance(parent, ParentRecorded):
        base = _recorded_parent(store, parent, run, dump)
    versions = _Versions(store, fs, parent if base is not None else None, base)
    stats, totals = WriteStats(), ChainTotals()
    manifests: dict[str, TensorManifest] = {}
    for group in _groups(header, settings.unit_bytes):
        arrays = _read_specs(fs, dump.path, header, group, check=True)
        parents = versions.parents(group)
        for spec in group:
            manifest = write_version(
                store,
                arrays.pop(spec.name),
                parents.get(spec.name),
                delta=settings.kind,
                keyframe_interval=settings.keyframe_interval,
                chunk_bytes=settings.chunk_bytes,
                stats=stats,
                where=f"{dump.path}: tensor {printable(spec.name)}",
            )
            totals.add_version(manifest)
            manifests[spec.name] = manifest
    ordered = [(spec.name, manifests[spec.name]) for spec in header.tensors]
    return store_dump(store, dump, header, run, ordered, stats, chain=totals)


def _recorded_parent(
    store: Store, parent: ParentRecorded, run: str, dump: DumpFile
) -> DumpManifest | None:
    """The recorded parent's manifest; None (no parent) if it cannot be read."""
    try:
        manifest = store.get_typed(
            parent.dump_id,
            DumpManifest,
            context=f"run {printable(run)}, step {parent.step}, peer {printable(dump.peer)}",
        )
        for _ in manifest.embedded_manifests():  # its tensors decode lazily: check them here
            pass
        return manifest
    except GradpipeError:
        # A damaged parent (being repaired, say) must not fail its successor,
        # nor lend it blocks that are gone: the successor is stored in full.
        return None


class _Versions:
    """The parents of one dump's tensors, a group of tensors at a time."""

    def __init__(
        self,
        store: Store,
        fs: Any,
        parent: ParentFile | ParentRecorded | None,
        base: DumpManifest | None,
    ) -> None:
        self.store, self.fs, self.parent = store, fs, parent
        self.ids = base.tensor_ids if base is not None else {}
        self.manifests = self._manifests(base) if base is not None else {}

    def _manifests(self, base: DumpManifest) -> dict[str, TensorManifest]:
        # Dumps of format 2 embed their tensors' manifests; older ones do not.
        elsewhere = [tid for _, tid in base.tensors if tid not in base.embedded]
        fetched = self.store.get_typed_many(elsewhere, TensorManifest) if elsewhere else []
        known = {**dict(zip(elsewhere, fetched, strict=True)), **base.embedded}
        return {name: known[tid] for name, tid in base.tensors}

    def parents(self, group: Sequence[TensorSpec]) -> dict[str, ChainParent]:
        """The :class:`ChainParent` of each tensor of ``group`` that has one."""
        usable = [
            s
            for s in group
            if (m := self.manifests.get(s.name)) is not None
            and (m.dtype, m.shape) == (s.dtype, s.shape)
        ]
        if not usable:
            return {}
        values: Mapping[str, np.ndarray] = {}
        if isinstance(self.parent, ParentFile):
            values = self._file_values(self.parent, usable)
            trusted = False
        else:
            try:
                arrays = read_tensors(self.store, [self.manifests[s.name] for s in usable])
            except GradpipeError:
                return {}  # blocks missing or damaged: write these tensors in full
            values = {s.name: a for s, a in zip(usable, arrays, strict=True)}
            trusted = True  # read back from the store, every block checked against its id
        return {
            s.name: ChainParent(
                self.manifests[s.name], self.ids[s.name], values.get(s.name), trusted=trusted
            )
            for s in usable
        }

    def _file_values(
        self, parent: ParentFile, group: Sequence[TensorSpec]
    ) -> dict[str, np.ndarray]:
        """The group's tensors as the parent's file holds them now (unchecked: see module)."""
        specs = {t.name: t for t in parent.header.tensors}
        wanted = [
            specs[s.name]
            for s in group
            if s.name in specs and (specs[s.name].dtype, specs[s.name].shape) == (s.dtype, s.shape)
        ]
        try:
            return _read_specs(self.fs, parent.dump.path, parent.header, wanted, check=False)
        except (GradpipeError, OSError, ValueError):
            # The file changed or went away since its own task: with no base
            # values the tensors keep unchanged chunks and store the rest in full.
            return {}


def _groups(header: DumpHeader, unit_bytes: int) -> list[list[TensorSpec]]:
    """The tensors of a dump in groups read together: about ``unit_bytes`` per ranged read."""
    if not header.ranged:
        return [list(header.tensors)]  # one whole-file read, as a plain ingest does
    groups: list[list[TensorSpec]] = []
    size = 0
    for spec in sorted(header.tensors, key=lambda t: t.offset or 0):
        if groups and size + spec.nbytes <= unit_bytes:
            groups[-1].append(spec)
            size += spec.nbytes
        else:
            groups.append([spec])
            size = spec.nbytes
    return groups


def _read_specs(
    fs: Any, path: str, header: DumpHeader, specs: Sequence[TensorSpec], *, check: bool
) -> dict[str, np.ndarray]:
    """Whole tensors ``specs`` of one file: one ranged read for the lot where that is tight."""
    if not specs:
        return {}
    if not header.ranged:
        return read_dump_tensors(fs, path, header, [s.name for s in specs])
    offsets = {s.name: s.offset or 0 for s in specs}
    start = min(offsets.values())
    stop = max(offsets[s.name] + s.nbytes for s in specs)
    total = sum(s.nbytes for s in specs)
    spans = (
        [(start, stop, list(specs))]
        if stop - start <= _SPAN_SLACK * total + 4096
        else [(offsets[s.name], offsets[s.name] + s.nbytes, [s]) for s in specs]
    )
    out = {}
    for lo, hi, members in spans:
        data = read_byte_range(fs, path, lo, hi)
        for spec in members:
            at = offsets[spec.name] - lo
            raw = data[at : at + spec.nbytes]
            values = raw.view(parse_dtype(spec.dtype))
            if check:  # raw bytes get the checks the whole-file readers apply
                check_tensor_values(spec, values, path=path)
                if spec.crc32 is not None:
                    check_crc32(path, spec.name, zlib.crc32(raw.data), spec.crc32)
            out[spec.name] = values.reshape(spec.shape)
    return out
