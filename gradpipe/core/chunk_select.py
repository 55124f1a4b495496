"""Which stored chunks an outer selection of a tensor touches, and where their parts go.

An outer selection picks, on every axis independently, a list of indices (a
slice is the list ``range(start, stop, step)``); the result has one axis per
axis of the tensor, of the lengths of those lists, as numpy's ``np.ix_`` gives.
:func:`select_chunks` cuts such a selection along the chunk grid: every chunk
that holds at least one selected element becomes one :class:`ChunkPart`
saying which of its elements are selected and where they land in the result.
A chunk nothing selects is not listed, so a reader fetches nothing for it.

Pure: no I/O, no dask, no xarray.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from gradpipe.errors import InvalidInputError

__all__ = ["ChunkPart", "Index", "contiguous_run", "select_chunks", "selected_length"]

#: The positions picked on one axis: a slice (step 1) where they are a plain
#: range, else an array of indices.
Index = slice | np.ndarray


@dataclass(frozen=True)
class ChunkPart:
    """The selected part of one chunk.

    ``chunk`` is the chunk's number in the manifest's C order (its index in
    ``TensorManifest.blocks``); ``local`` picks the selected elements out of
    the chunk (an array of the chunk's shape), ``out`` says where they go in
    the result. ``whole`` is True when every element of the chunk is selected,
    in order: then ``local`` is the whole chunk and ``out`` a box of its shape.
    """

    chunk: int
    chunk_shape: tuple[int, ...]
    local: tuple[Index, ...]
    out: tuple[Index, ...]
    whole: bool


def select_chunks(
    shape: Sequence[int], chunk_shape: Sequence[int], selection: Sequence[Index]
) -> list[ChunkPart]:
    """The chunks ``selection`` (per axis, an array of indices or a step-1 slice, in range)
    touches.

    Parts come in C order of their chunks. An empty selection on any axis
    touches nothing. A slice (what a dask block of a lazily opened dataset
    asks for) is cut along the grid arithmetically, without an array of its
    indices.

    >>> parts = select_chunks((4, 6), (1, 6), [np.array([2, 0]), np.arange(1, 3)])
    >>> [(p.chunk, p.out[0], p.local[1]) for p in parts]
    [(0, slice(1, 2, None), slice(1, 3, None)), (2, slice(0, 1, None), slice(1, 3, None))]
    """
    if len(selection) != len(shape) or len(chunk_shape) != len(shape):
        raise InvalidInputError(
            f"a selection of {len(selection)} axes for a tensor of shape {tuple(shape)} "
            f"in chunks {tuple(chunk_shape)}"
        )
    if any(selected_length(s) == 0 for s in selection) or any(n == 0 for n in shape):
        return []
    grid = [-(-n // c) for n, c in zip(shape, chunk_shape, strict=True)]
    # Per axis: for each chunk coordinate the selection touches, which of the
    # chunk's elements are picked and where they go in the result.
    axes: list[list[tuple[int, Index, Index]]] = []
    for n, c, given in zip(shape, chunk_shape, selection, strict=True):
        if isinstance(given, slice):
            axes.append(_slice_groups(given, n, c))
            continue
        picked = np.asarray(given, dtype=np.intp)
        if picked.min() < 0 or picked.max() >= n:
            raise InvalidInputError(f"selection {picked.tolist()[:8]} out of range for axis {n}")
        coords = picked // c
        groups: list[tuple[int, Index, Index]] = []
        if np.all(coords[1:] >= coords[:-1]):  # sorted: one run per chunk (the common case)
            starts: list[int] = np.flatnonzero(np.diff(coords, prepend=-1)).tolist()
            stops = [*starts[1:], len(picked)]
            for lo, hi in zip(starts, stops, strict=True):
                coord = int(coords[lo])
                groups.append((coord, _compact(picked[lo:hi] - coord * c), slice(lo, hi)))
        else:
            for coord in np.unique(coords).tolist():
                positions = np.flatnonzero(coords == coord)
                groups.append((coord, _compact(picked[positions] - coord * c), _compact(positions)))
        axes.append(groups)
    parts = []
    for combo in _product(axes):
        where = [coord for coord, _, _ in combo]
        number = 0
        for coord, size in zip(where, grid, strict=True):
            number = number * size + coord
        extent = tuple(
            min(c, n - coord * c) for coord, c, n in zip(where, chunk_shape, shape, strict=True)
        )
        local = tuple(sel for _, sel, _ in combo)
        whole = all(
            isinstance(sel, slice) and sel.start == 0 and sel.stop == size
            for sel, size in zip(local, extent, strict=True)
        ) and all(isinstance(pos, slice) for _, _, pos in combo)
        parts.append(ChunkPart(number, extent, local, tuple(p for _, _, p in combo), whole))
    return parts


def contiguous_run(box: Sequence[Index], shape: Sequence[int]) -> tuple[int, int] | None:
    """The flat ``[start, stop)`` of ``box`` in a C-ordered array of ``shape``, if contiguous.

    A box of slices is one contiguous run of a C-ordered array when it is a
    single element on every axis before some axis and whole on every axis
    after it.

    >>> contiguous_run((slice(2, 3), slice(0, 4)), (5, 4))
    (8, 12)
    >>> contiguous_run((slice(0, 2), slice(0, 3)), (5, 4)) is None
    True
    """
    if not all(isinstance(s, slice) for s in box):
        return None
    spans = [(s.start, s.stop) for s in box if isinstance(s, slice)]
    lengths = [hi - lo for lo, hi in spans]
    # The first axis spanning more than one element: every later one must be whole.
    split = next((i for i, k in enumerate(lengths) if k != 1), len(lengths))
    if any(lengths[i] != shape[i] for i in range(split + 1, len(shape))):
        return None
    start = 0
    for (lo, _), n in zip(spans, shape, strict=True):
        start = start * n + lo
    return start, start + math.prod(lengths)


def selected_length(selection: Index) -> int:
    """How many positions one axis of a selection picks."""
    if isinstance(selection, slice):
        return max(0, int(selection.stop) - int(selection.start))
    return len(selection)


def _slice_groups(selection: slice, n: int, c: int) -> list[tuple[int, Index, Index]]:
    """:func:`select_chunks`' groups of one axis for the positions ``start:stop``."""
    lo, hi = selection.start, selection.stop
    if selection.step not in (None, 1) or not 0 <= lo < hi <= n:
        raise InvalidInputError(f"selection {selection} is not a step-1 range in axis {n}")
    groups: list[tuple[int, Index, Index]] = []
    for coord in range(lo // c, (hi - 1) // c + 1):
        first, last = max(lo, coord * c), min(hi, (coord + 1) * c)
        groups.append(
            (coord, slice(first - coord * c, last - coord * c), slice(first - lo, last - lo))
        )
    return groups


def _compact(indices: np.ndarray) -> Index:
    """``indices`` as a slice when they are a run ``k, k+1, ...``, else as they are."""
    if (
        len(indices)
        and indices[-1] - indices[0] == len(indices) - 1
        and (len(indices) < 3 or np.all(np.diff(indices) == 1))
    ):
        return slice(int(indices[0]), int(indices[-1]) + 1)
    return indices


def _product(
    axes: list[list[tuple[int, Index, Index]]],
) -> list[tuple[tuple[int, Index, Index], ...]]:
    """Every combination of one group per axis, in C order (a 0-d tensor: one, empty)."""
    combos: list[tuple[tuple[int, Index, Index], ...]] = [()]
    for groups in axes:
        combos = [(*combo, group) for combo in combos for group in groups]
    return combos
