"""The chunk grid of a stored tensor.

gradpipe chunks a tensor so that every chunk is one contiguous run of its
C-order elements: the chunk shape is ``(1, …, 1, c, n_{k+1}, …, n_last)``.
Chunks then map to flat byte ranges, which makes encoding zero-copy and lets a
reader fetch one chunk of a dump file with one ranged read, while the grid is
still a regular grid that dask.array and xarray understand.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Sequence

from gradpipe.core.display import printable
from gradpipe.errors import InvalidInputError

__all__ = [
    "MAX_DIMS",
    "choose_chunk_shape",
    "chunk_count",
    "chunk_ranges",
    "dask_chunks",
    "parse_chunk_shape",
    "parse_shape",
]

#: numpy's limit on the number of dimensions.
MAX_DIMS = 64
# numpy refuses arrays whose extent (the product of the dimensions, zeros
# counted as one) times the item size does not fit a signed 64-bit index.
_MAX_EXTENT_BYTES = 2**63 - 1


def parse_shape(shape: object, itemsize: int = 1, *, where: str = "tensor") -> tuple[int, ...]:
    """Validate a tensor shape: numpy must be able to build an array of it.

    Every dimension is an integer >= 0, there are at most 64 of them, and the
    product of the dimensions (zeros counted as one, as numpy does) times the
    item size fits in a signed 64-bit index, so a shape such as
    ``(2**32, 2**32, 0)`` is refused here instead of failing on export.

    >>> parse_shape([3, 0, 2])
    (3, 0, 2)
    """
    if not isinstance(shape, list | tuple) or not all(
        isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in shape
    ):
        raise InvalidInputError(f"{where}: bad shape {printable(shape)}; expected integers >= 0")
    if len(shape) > MAX_DIMS:
        raise InvalidInputError(f"{where}: shape has {len(shape)} dimensions, numpy allows 64")
    extent = itemsize
    for d in shape:
        extent *= max(d, 1)
    if extent > _MAX_EXTENT_BYTES:
        raise InvalidInputError(
            f"{where}: shape {list(shape)} is too large for any array (its extent exceeds "
            "2**63 bytes, even where a zero dimension leaves no elements); fix the writer"
        )
    return tuple(shape)


def choose_chunk_shape(shape: Sequence[int], itemsize: int, target_bytes: int) -> tuple[int, ...]:
    """The contiguous chunk shape closest to ``target_bytes`` per chunk.

    >>> choose_chunk_shape((1000, 64), 4, 4096)
    (16, 64)
    >>> choose_chunk_shape((3, 1_000_000), 4, 4096)
    (1, 1024)
    """
    if target_bytes < 1:
        raise InvalidInputError(f"chunk size must be positive, got {target_bytes} bytes")
    budget = max(1, target_bytes // max(1, itemsize))
    chunk = list(shape)
    inner = 1
    for axis in range(len(shape) - 1, -1, -1):
        n = shape[axis]
        if n == 0 or inner * n <= budget:
            inner *= max(n, 1)
            continue
        chunk[axis] = max(1, budget // inner)
        for lead in range(axis):
            chunk[lead] = 1
        break
    return tuple(chunk)


def parse_chunk_shape(shape: Sequence[int], chunk_shape: Sequence[int]) -> tuple[int, ...]:
    """Check that ``chunk_shape`` is a contiguous chunk shape for ``shape``."""
    chunk = tuple(int(c) for c in chunk_shape)
    if len(chunk) != len(shape) or any(c < 0 for c in chunk):
        raise InvalidInputError(f"chunk shape {chunk} does not fit tensor shape {tuple(shape)}")
    partial = [i for i, (c, n) in enumerate(zip(chunk, shape, strict=True)) if c != n]
    if partial:
        k = partial[-1]
        if any(chunk[i] != 1 for i in partial[:-1]) or not 1 <= chunk[k] <= shape[k]:
            raise InvalidInputError(
                f"chunk shape {chunk} is not contiguous for tensor shape {tuple(shape)}"
            )
    return chunk


def chunk_count(shape: Sequence[int], chunk_shape: Sequence[int]) -> int:
    """Number of chunks in the grid (zero for an empty tensor)."""
    if any(n == 0 for n in shape):
        return 0
    return math.prod(-(-n // c) for n, c in zip(shape, chunk_shape, strict=True))


def chunk_ranges(shape: Sequence[int], chunk_shape: Sequence[int]) -> Iterator[tuple[int, int]]:
    """Flat ``[start, stop)`` element ranges of the chunks, in C order."""
    if chunk_count(shape, chunk_shape) == 0:
        return
    # The last partially-chunked axis k splits each "row" of size n_k * inner.
    partial = [i for i, (c, n) in enumerate(zip(chunk_shape, shape, strict=True)) if c != n]
    k = partial[-1] if partial else 0
    inner = math.prod(shape[k + 1 :])
    row = shape[k] * inner if shape else 1
    step = chunk_shape[k] * inner if shape else 1
    rows = math.prod(shape[:k])
    for r in range(rows):
        base = r * row
        for start in range(0, row, step):
            yield base + start, base + min(start + step, row)


def dask_chunks(shape: Sequence[int], chunk_shape: Sequence[int]) -> tuple[tuple[int, ...], ...]:
    """The grid in ``dask.array`` form (a tuple of block sizes per axis)."""
    out: list[tuple[int, ...]] = []
    for n, c in zip(shape, chunk_shape, strict=True):
        if n == 0:
            out.append((0,))
            continue
        full, rest = divmod(n, c)
        out.append((c,) * full + ((rest,) if rest else ()))
    return tuple(out)
