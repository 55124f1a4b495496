"""Joining buffers without holding the GIL.

``bytes.join`` copies with the GIL released only when every part is ``bytes``;
a frame's raw planes and payloads are memoryviews and arrays, and joining
those held the GIL for the whole copy (measured with ``py-spy record --gil``
on ingest: the joins of ``ByteGroupCodec.encode`` and ``encode_block`` were a
seventh of the GIL-holding samples). numpy's copies release it.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Final

import numpy as np

__all__ = ["Buffer", "byte_view", "concat", "joined", "nbytes"]

#: What gradpipe's byte paths take: anything with a contiguous buffer of bytes.
Buffer = bytes | bytearray | memoryview | np.ndarray

#: Below this many bytes a plain join is cheaper than an array and its copies.
_SMALL: Final = 64 * 1024


def concat(parts: Sequence[Buffer]) -> bytes | memoryview:
    """The parts, one after another: ``bytes`` when small, else a view of a new array.

    >>> bytes(concat([b"ab", memoryview(b"cd")]))
    b'abcd'
    """
    views = [_flat(part) for part in parts]
    total = sum(view.size for view in views)
    if total <= _SMALL:
        return b"".join(view.data for view in views)
    out = np.empty(total, dtype=np.uint8)
    position = 0
    for view in views:
        out[position : position + view.size] = view
        position += view.size
    return memoryview(out)  # type: ignore[arg-type]  # numpy arrays are buffers


def joined(parts: Sequence[Buffer]) -> bytes | memoryview:
    """:func:`concat` of ``parts``, but one part that is bytes or a memoryview as it is.

    >>> part = b"abc"
    >>> joined([part]) is part, bytes(joined([b"a", b"bc"]))
    (True, b'abc')
    """
    only = parts[0] if len(parts) == 1 else None
    return only if isinstance(only, bytes | memoryview) else concat(parts)


def _flat(part: bytes | bytearray | memoryview | np.ndarray) -> np.ndarray:
    if isinstance(part, np.ndarray):  # any dtype, bfloat16 included (it has no buffer format)
        return part.reshape(-1).view(np.uint8)
    return np.frombuffer(part, dtype=np.uint8)


def nbytes(buf: Buffer) -> int:
    """The size of ``buf`` in bytes (``len`` of a memoryview or an array counts items).

    >>> nbytes(memoryview(b"abcd").cast("I")), nbytes(np.zeros(3, np.float32))
    (4, 12)
    """
    return buf.nbytes if isinstance(buf, np.ndarray | memoryview) else len(buf)


def byte_view(buf: object) -> np.ndarray:
    """A flat uint8 view of a contiguous buffer, without a copy.

    What ``numcodecs.compat.ensure_contiguous_ndarray(buf).reshape(-1).view(np.uint8)``
    gives, with a fast path for numpy arrays, bytes and memoryviews (what gradpipe passes):
    numcodecs checks every buffer against array-like protocols, whose ``isinstance`` held
    the GIL in a tenth of a restore's GIL samples (py-spy; a few calls per chunk).

    >>> byte_view(np.array([1], dtype="<u2")).tolist()
    [1, 0]
    """
    if isinstance(buf, np.ndarray):
        if buf.flags.c_contiguous and not buf.dtype.hasobject:
            return buf.reshape(-1).view(np.uint8)
    elif isinstance(buf, bytes | bytearray) or (isinstance(buf, memoryview) and buf.c_contiguous):
        return np.frombuffer(buf, dtype=np.uint8)
    from numcodecs.compat import ensure_contiguous_ndarray  # anything else, checked

    view: np.ndarray = ensure_contiguous_ndarray(buf).reshape(-1).view(np.uint8)
    return view
