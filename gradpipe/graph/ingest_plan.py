"""Planning an ingest: each dump cut into read units of tens of MiB, on chunk boundaries.

Pure logic on a dump's header (no I/O): the graph builders in
:mod:`gradpipe.graph.ingest` make one read task and one encode task per unit,
and the tasks in :mod:`gradpipe.graph.ingest_tasks` take a unit as their plan.
"""

from __future__ import annotations

from dataclasses import dataclass

from gradpipe.core.chunking import choose_chunk_shape, chunk_ranges
from gradpipe.core.dtypes import parse_dtype
from gradpipe.formats.dump import DumpHeader

__all__ = ["Part", "ReadUnit", "plan_units", "tensor_chunks"]


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
