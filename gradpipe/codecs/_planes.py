"""Byte planes: splitting little-endian words by byte significance and back.

Pure numpy, chosen by measurement (one core, MiB/s of element bytes, 2.25 MiB
float32 / 1.1 MiB bfloat16 chunks): a shift and a truncating cast per plane
split words at ~4700 MiB/s (a transposed copy: ~3000); one strided copy per
plane joins 4- and 8-byte words at ~3400 MiB/s, and a widening shift and an OR
join 2-byte words at ~8700 MiB/s. numcodecs' Cython ``Shuffle`` is no faster,
nor are shifted ORs of widened planes: joining neighbouring planes into ever
wider words ran 20% faster alone on one core but 10-20% slower inside a
2-thread restore, whose threads share the memory bandwidth its extra passes
and temporaries take.

The sign move for float32 and bfloat16 works on the two top planes only: the
sign bit goes to bit 7 of the second-highest byte and the 8 exponent bits
close up into the highest byte, so one plane holds exactly the exponents. A
9-bit rotation of the top of the word, done on a quarter (float32) or a half
(bfloat16) of the bytes instead of a full-word rotation.

Where gradpipe's C extension was built (:mod:`gradpipe.core.kernels`), a split
with the sign move, and a join with the sign restored, are each one pass
without the GIL (2 MiB float32 chunk, one core: split and sign move 0.16 ms
against 0.71 ms here, join and sign restore 0.29 ms against 1.13 ms). The
numpy functions below are the fallback where it was not built, and the
reference it is tested against.
"""

from __future__ import annotations

import numpy as np

from gradpipe.core.kernels import native

__all__ = ["join_planes", "move_sign", "move_sign_split", "restore_sign", "split_planes"]


def split_planes(data: np.ndarray, width: int, *, move_sign: bool = False) -> np.ndarray:
    """A ``(width, count)`` uint8 array: row k holds byte k of every element.

    ``data`` is a contiguous uint8 array of ``count * width`` bytes. With ``move_sign``
    (2- and 4-byte words), the top two rows are as :func:`move_sign_split` leaves them.
    """
    count = data.size // width
    if width == 1:
        return data.reshape(1, count)
    planes = np.empty((width, count), dtype=np.uint8)
    if native is not None:
        native.split(data, planes, width, move_sign)
        return planes
    # One shift and truncating cast per plane: SIMD, unlike numpy's strided
    # byte copies (4-byte words: 0.47 ms for 2.25 MiB against 0.68 ms for a
    # transposed copy).
    words = data.view(f"<u{width}")
    np.copyto(planes[0], words, casting="unsafe")
    for k in range(1, width):
        np.right_shift(words, 8 * k, out=planes[k], casting="unsafe")
    if move_sign:
        move_sign_split(planes, data)
    return planes


def join_planes(planes: list[np.ndarray], dest: np.ndarray, *, sign_moved: bool = False) -> None:
    """Interleave ``planes`` (least significant first) into ``dest``, a contiguous uint8 array.

    With ``sign_moved``, the top two planes are first turned back with :func:`restore_sign`.
    """
    width = len(planes)
    if native is not None and width > 1:
        native.join(planes, dest, sign_moved)
        return
    if sign_moved:
        planes = [*planes[:-2], *reversed(restore_sign(planes[-1], planes[-2]))]
    if width == 1:
        dest[:] = planes[0]
    elif width == 2:
        words = dest.view("<u2")
        np.left_shift(planes[1], 8, out=words, dtype="<u2")
        np.bitwise_or(words, planes[0], out=words, casting="unsafe")
    else:
        grid = dest.reshape(-1, width)
        for k, plane in enumerate(planes):
            grid[:, k] = plane


_LANE = np.dtype("<u8")
_TOP = 0x8080808080808080
_LOW7 = 0x7F7F7F7F7F7F7F7F
_LOW1 = 0x0101010101010101


def _lanes(plane: np.ndarray) -> np.ndarray:
    """``plane`` as 8-byte words (numpy has no SIMD shifts of single bytes)."""
    return plane[: plane.size - plane.size % 8].view(_LANE)


def move_sign(high: np.ndarray, low: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """From the top two planes, the exponent plane and the sign-and-mantissa plane."""
    exponent = np.empty_like(high)
    rest = np.empty_like(low)
    h, lo, e, r = _lanes(high), _lanes(low), _lanes(exponent), _lanes(rest)
    # Byte-wise (high << 1) | (low >> 7) and (low & 0x7F) | (high & 0x80),
    # eight bytes at a time: the masks stop bits crossing byte boundaries.
    np.left_shift(h, 1, out=e)
    e &= ~_LOW1 & 0xFFFFFFFFFFFFFFFF
    tmp = np.right_shift(lo, 7)
    tmp &= _LOW1
    e |= tmp
    np.bitwise_and(lo, _LOW7, out=r)
    np.bitwise_and(h, _TOP, out=tmp)
    r |= tmp
    tail = slice(h.size * 8, None)
    exponent[tail] = (high[tail] << 1) | (low[tail] >> 7)
    rest[tail] = (low[tail] & 0x7F) | (high[tail] & 0x80)
    return exponent, rest


def move_sign_split(planes: np.ndarray, data: np.ndarray) -> None:
    """:func:`move_sign` on the top two rows of ``split_planes(data, width)``, in place.

    The sign-and-mantissa row is made from the two rows as they are, and the exponent row
    straight from the words (one shift and truncating cast): three passes over a quarter
    of the bytes and one over the words, against seven and three new planes for
    :func:`move_sign`. The rows are the same.
    """
    width = planes.shape[0]
    high, low = planes[-1], planes[-2]
    h, lo = _lanes(high), _lanes(low)
    tail = slice(h.size * 8, None)
    low[tail] = (low[tail] & 0x7F) | (high[tail] & 0x80)
    lo &= _LOW7
    h &= _TOP
    lo |= h
    np.right_shift(data.view(f"<u{width}"), 8 * (width - 1) - 1, out=high, casting="unsafe")


def restore_sign(exponent: np.ndarray, rest: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The inverse of :func:`move_sign`."""
    high = np.empty_like(exponent)
    low = np.empty_like(rest)
    e, r, h, lo = _lanes(exponent), _lanes(rest), _lanes(high), _lanes(low)
    np.right_shift(e, 1, out=h)
    h &= _LOW7
    tmp = np.bitwise_and(r, _TOP)
    h |= tmp
    np.left_shift(e, 7, out=lo)
    lo &= _TOP
    np.bitwise_and(r, _LOW7, out=tmp)
    lo |= tmp
    tail = slice(e.size * 8, None)
    high[tail] = (exponent[tail] >> 1) | (rest[tail] & 0x80)
    low[tail] = (exponent[tail] << 7) | (rest[tail] & 0x7F)
    return high, low
