from __future__ import annotations

import itertools
import math

import numpy as np
from hypothesis import given
from hypothesis import strategies as st

from gradpipe.core.chunking import choose_chunk_shape, chunk_count, chunk_ranges, dask_chunks

shapes = st.lists(st.integers(0, 7), min_size=0, max_size=4).map(tuple)


@given(shape=shapes, itemsize=st.sampled_from([1, 2, 4, 8]), target=st.integers(1, 600))
def test_chunks_are_contiguous_ranges_covering_the_tensor(shape, itemsize, target) -> None:
    chunk_shape = choose_chunk_shape(shape, itemsize, target)
    ranges = list(chunk_ranges(shape, chunk_shape))
    size = math.prod(shape)
    assert len(ranges) == chunk_count(shape, chunk_shape)
    assert [i for r in ranges for i in range(*r)] == list(range(size))
    # Each flat range is exactly one block of the regular (dask) grid, in C order.
    array = np.arange(size).reshape(shape)
    grid = dask_chunks(shape, chunk_shape)
    if size:
        blocks = []
        for index in itertools.product(*(range(len(c)) for c in grid)):
            where = tuple(
                slice(sum(c[:i]), sum(c[: i + 1])) for c, i in zip(grid, index, strict=True)
            )
            blocks.append(array[where].ravel())
        assert all((b == np.arange(*r)).all() for b, r in zip(blocks, ranges, strict=True))


@given(shape=shapes.filter(lambda s: math.prod(s) > 0), target=st.integers(1, 10_000))
def test_chunks_stay_within_budget_unless_one_element_is_bigger(shape, target) -> None:
    chunk_shape = choose_chunk_shape(shape, 4, target)
    assert math.prod(chunk_shape) * 4 <= max(target, 4)
