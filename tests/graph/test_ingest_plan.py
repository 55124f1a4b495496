"""Read units cover every chunk of every tensor exactly once, in order, within their span."""

from __future__ import annotations

import math

from hypothesis import given, settings
from hypothesis import strategies as st

from gradpipe.core.chunking import chunk_ranges
from gradpipe.core.dtypes import parse_dtype
from gradpipe.formats.dump import DumpHeader, TensorSpec
from gradpipe.ingestion.plan import plan_units, tensor_chunks

tensors = st.lists(
    st.tuples(
        st.sampled_from(["float32", "bfloat16", "int8", "float64"]),
        st.lists(st.integers(0, 40), min_size=0, max_size=3).map(tuple),
    ),
    min_size=1,
    max_size=6,
)


def _header(items: list[tuple[str, tuple[int, ...]]], gap: int) -> DumpHeader:
    specs, offset = [], 100
    for i, (dtype, shape) in enumerate(items):
        specs.append(TensorSpec(f"t{i}", dtype, shape, offset))
        offset += math.prod(shape) * parse_dtype(dtype).itemsize + gap
    return DumpHeader("/dump.safetensors", "safetensors", tuple(specs), {}, offset)


@settings(max_examples=200, deadline=None)
@given(
    items=tensors,
    gap=st.integers(0, 16),
    chunk_bytes=st.integers(1, 512),
    unit_bytes=st.integers(1, 4096),
)
def test_units_cover_each_chunk_once(
    items: list[tuple[str, tuple[int, ...]]], gap: int, chunk_bytes: int, unit_bytes: int
) -> None:
    header = _header(items, gap)
    units = plan_units(header, chunk_bytes=chunk_bytes, unit_bytes=unit_bytes)
    covered: dict[str, list[int]] = {t.name: [] for t in header.tensors}
    for unit in units:
        assert unit.start <= unit.stop
        for part in unit.parts:
            assert unit.start <= part.start <= part.stop <= unit.stop
            covered[part.tensor].extend(range(part.lo, part.hi))
    for spec in header.tensors:
        itemsize = parse_dtype(spec.dtype).itemsize
        grid = list(chunk_ranges(spec.shape, tensor_chunks(spec.shape, spec.dtype, chunk_bytes)))
        assert covered[spec.name] == list(range(len(grid))), spec
        for unit in units:
            for part in unit.parts:
                if part.tensor == spec.name and part.hi > part.lo:
                    assert spec.offset is not None
                    assert part.start == spec.offset + grid[part.lo][0] * itemsize
                    assert part.stop == spec.offset + grid[part.hi - 1][1] * itemsize


def test_a_unit_closes_once_it_reaches_its_size() -> None:
    header = _header([("float32", (1000,))], 0)
    units = plan_units(header, chunk_bytes=400, unit_bytes=1000)
    assert [u.stop - u.start for u in units] == [1200, 1200, 1200, 400]
