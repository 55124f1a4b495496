"""Planning an ingest: each dump cut into read units of tens of MiB, on chunk boundaries.

Pure logic on a dump's header (no I/O): the graph builders in
:mod:`gradpipe.ingestion.graph` make one read task and one encode task per unit,
and the tasks in :mod:`gradpipe.ingestion.tasks` take a unit as their plan.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from itertools import pairwise

from gradpipe.core.chunking import choose_chunk_shape, chunk_ranges
from gradpipe.core.dtypes import parse_dtype
from gradpipe.core.run_manifest import DumpEntry, RunManifest
from gradpipe.formats.dump import DumpHeader
from gradpipe.ingestion.discover import DumpFile

__all__ = ["ChainPlan", "Part", "ReadUnit", "plan_chains", "plan_units", "tensor_chunks"]


@dataclass(frozen=True, slots=True)
class Part:
    """Consecutive chunks ``[lo, hi)`` of one tensor, at bytes ``[start, stop)`` of the file."""

    tensor: str
    lo: int
    hi: int
    start: int
    stop: int


@dataclass(frozen=True, slots=True)
class ReadUnit:
    """What one read task fetches: a byte span over some parts, or (not ranged) whole tensors."""

    start: int
    stop: int
    parts: tuple[Part, ...]
    whole: bool = False


def tensor_chunks(shape: tuple[int, ...], dtype: str, chunk_bytes: int) -> tuple[int, ...]:
    """The chunk shape ingest gives a tensor (the same rule as ``Store.put_tensor``)."""
    return choose_chunk_shape(shape, parse_dtype(dtype).itemsize, chunk_bytes)


def plan_units(header: DumpHeader, *, chunk_bytes: int, unit_bytes: int) -> list[ReadUnit]:
    """Split a dump into read units of about ``unit_bytes`` each, on chunk boundaries."""
    if not header.ranged:
        whole = tuple(Part(t.name, 0, 0, 0, 0) for t in header.tensors)
        return [ReadUnit(0, header.size, whole, whole=True)]
    units: list[ReadUnit] = []
    parts: list[Part] = []

    def close_unit() -> None:
        units.append(ReadUnit(parts[0].start, max(p.stop for p in parts), tuple(parts)))
        parts.clear()

    for spec in sorted(header.tensors, key=lambda t: t.offset or 0):
        # An invariant of the readers, not a check of the file: a ranged header has offsets.
        assert spec.offset is not None
        itemsize = parse_dtype(spec.dtype).itemsize
        grid = chunk_ranges(spec.shape, tensor_chunks(spec.shape, spec.dtype, chunk_bytes))
        bounds = [(spec.offset + a * itemsize, spec.offset + b * itemsize) for a, b in grid]
        lo = 0
        for i, (_, stop) in enumerate(bounds):
            begin = parts[0].start if parts else bounds[lo][0]
            if stop - begin >= unit_bytes:
                parts.append(Part(spec.name, lo, i + 1, bounds[lo][0], stop))
                lo = i + 1
                close_unit()
        if lo < len(bounds) or not bounds:  # the tail (or an empty tensor) joins the next unit
            start = bounds[lo][0] if bounds else spec.offset
            parts.append(
                Part(spec.name, lo, len(bounds), start, bounds[-1][1] if bounds else start)
            )
    if parts:
        close_unit()
    return units


@dataclass(frozen=True, slots=True)
class ChainPlan:
    """What one dump of a ``--delta`` ingest is written against (at most one of the two).

    ``previous`` is the index, in the batch, of the same peer's previous step;
    ``recorded`` the same peer's previous step already in the run, when that
    step is not in the batch. Neither: the peer's first step, stored in full.
    """

    previous: int | None = None
    recorded: DumpEntry | None = None


def plan_chains(recorded: RunManifest, dumps: Sequence[DumpFile]) -> list[ChainPlan]:
    """Per dump of the batch, the version of the same peer its tensors chain on.

    A dump's parent is the same peer's nearest earlier step, in the batch or
    recorded in the run; a step that is both (a repair, a replacement) is the
    batch's, as that is the version about to be recorded.

    >>> from gradpipe.core.run_manifest import DumpEntry, RunManifest
    >>> old = DumpEntry(1, "a", "0" * 64, "f")
    >>> run = RunManifest("r", (old,))
    >>> files = [DumpFile(s, "a", f"{s}", 1, "f") for s in (3, 2)]
    >>> [(p.previous, p.recorded and p.recorded.step) for p in plan_chains(run, files)]
    [(1, None), (None, 1)]
    """
    batch = {(d.step, d.peer): j for j, d in enumerate(dumps)}
    versions: dict[str, list[tuple[int, int | DumpEntry]]] = {}
    for entry in recorded.dumps:
        if (entry.step, entry.peer) not in batch:
            versions.setdefault(entry.peer, []).append((entry.step, entry))
    for (step, peer), j in batch.items():
        versions.setdefault(peer, []).append((step, j))
    plans = [ChainPlan()] * len(dumps)
    for steps in versions.values():
        steps.sort(key=lambda version: version[0])
        for (_, before), (_, this) in pairwise(steps):
            if isinstance(this, int):
                plans[this] = (
                    ChainPlan(previous=before)
                    if isinstance(before, int)
                    else ChainPlan(recorded=before)
                )
    return plans
