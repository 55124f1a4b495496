"""Cutting an outer selection along a contiguous chunk grid: the parts rebuild numpy's result."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gradpipe.core.chunk_select import contiguous_run, select_chunks
from gradpipe.core.chunking import choose_chunk_shape, chunk_ranges
from gradpipe.errors import InvalidInputError


def _box(selection: tuple[slice | np.ndarray, ...]) -> tuple[object, ...]:
    if all(isinstance(s, slice) for s in selection):
        return selection
    return np.ix_(*[np.arange(s.start, s.stop) if isinstance(s, slice) else s for s in selection])


def _rebuild(
    array: np.ndarray, chunk_shape: tuple[int, ...], picks: list[np.ndarray]
) -> np.ndarray:
    """The selection assembled from the chunks, as a reader does it."""
    flat = array.reshape(-1)
    ranges = list(chunk_ranges(array.shape, chunk_shape))
    out = np.full([len(p) for p in picks], -1, dtype=array.dtype)
    for part in select_chunks(array.shape, chunk_shape, picks):
        start, stop = ranges[part.chunk]
        chunk = flat[start:stop].reshape(part.chunk_shape)
        if part.whole:
            run = contiguous_run(part.out, out.shape)
            if run is not None:
                out.reshape(-1)[run[0] : run[1]] = chunk.reshape(-1)
                continue
        out[_box(part.out)] = chunk[_box(part.local)]
    return out


@st.composite
def cases(draw: st.DrawFn) -> tuple[np.ndarray, tuple[int, ...], list[np.ndarray]]:
    shape = tuple(draw(st.lists(st.integers(1, 9), min_size=0, max_size=4)))
    target = draw(st.integers(1, 64))
    chunk_shape = choose_chunk_shape(shape, 1, target)
    array = np.arange(int(np.prod(shape)), dtype=np.int64).reshape(shape)
    picks = []
    for n in shape:
        if draw(st.booleans()):
            start, stop = sorted(draw(st.lists(st.integers(0, n), min_size=2, max_size=2)))
            step = draw(st.integers(1, 3))
            picks.append(np.arange(start, stop, step))
        else:
            picks.append(np.array(draw(st.lists(st.integers(0, n - 1), max_size=6)), dtype=int))
    return array, chunk_shape, picks


@settings(max_examples=300, deadline=None)
@given(cases())
def test_parts_rebuild_the_outer_selection(
    case: tuple[np.ndarray, tuple[int, ...], list[np.ndarray]],
) -> None:
    array, chunk_shape, picks = case
    want = array[np.ix_(*picks)] if picks else array
    assert np.array_equal(_rebuild(array, chunk_shape, picks), want)


@settings(max_examples=200, deadline=None)
@given(cases())
def test_only_touched_chunks_are_listed_once(
    case: tuple[np.ndarray, tuple[int, ...], list[np.ndarray]],
) -> None:
    array, chunk_shape, picks = case
    parts = select_chunks(array.shape, chunk_shape, picks)
    numbers = [p.chunk for p in parts]
    assert numbers == sorted(set(numbers))
    ranges = list(chunk_ranges(array.shape, chunk_shape))
    touched = set(array[np.ix_(*picks)].reshape(-1).tolist()) if picks else {0}
    for part in parts:
        start, stop = ranges[part.chunk]
        assert touched & set(range(start, stop))  # each listed chunk holds a selected element
    covered = {i for p in parts for i in range(*ranges[p.chunk])}
    assert touched <= covered


def test_a_row_of_one_chunk() -> None:
    parts = select_chunks((100, 8), (25, 8), [np.arange(30, 35), np.arange(8)])
    assert [p.chunk for p in parts] == [1]
    assert parts[0].local == (slice(5, 10), slice(0, 8))
    assert not parts[0].whole
    whole = select_chunks((100, 8), (25, 8), [np.arange(25, 50), np.arange(8)])
    assert whole[0].whole
    assert contiguous_run(whole[0].out, (25, 8)) == (0, 200)


def test_empty_and_out_of_range_selections() -> None:
    assert select_chunks((4, 4), (1, 4), [np.array([], dtype=int), np.arange(4)]) == []
    with pytest.raises(InvalidInputError, match="out of range"):
        select_chunks((4, 4), (1, 4), [np.array([4]), np.arange(4)])
    with pytest.raises(InvalidInputError, match="selection of 1 axes"):
        select_chunks((4, 4), (1, 4), [np.arange(4)])


@settings(max_examples=300, deadline=None)
@given(cases(), st.data())
def test_a_slice_selects_as_its_index_array_does(
    case: tuple[np.ndarray, tuple[int, ...], list[np.ndarray]], data: st.DataObject
) -> None:
    # What a dask block asks for: step-1 slices, cut along the grid without index arrays.
    array, chunk_shape, _ = case
    slices: list[slice | np.ndarray] = []
    for n in array.shape:
        start = data.draw(st.integers(0, n - 1))
        slices.append(slice(start, data.draw(st.integers(start + 1, n))))
    arrays = [np.arange(s.start, s.stop) for s in slices if isinstance(s, slice)]
    by_slice = select_chunks(array.shape, chunk_shape, slices)
    by_array = select_chunks(array.shape, chunk_shape, arrays)
    assert by_slice == by_array
