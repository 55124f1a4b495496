"""CRC-32 of byte ranges read apart: combine them, and check a tensor's bytes against its file.

An ``.npz`` member stored uncompressed is ingested by byte range, chunk by
chunk, possibly by different tasks; its zip directory records one CRC-32 for
the whole member (its ``.npy`` header and its data). Each read computes the
CRC-32 of the bytes it read (``zlib.crc32``, which releases the GIL on large
buffers) and :func:`crc32_combine` joins them in order, as zlib's
``crc32_combine`` does (Python's :mod:`zlib` does not expose it), so the
member's CRC-32 is checked without reading a byte twice.

CRC-32 is linear over GF(2): ``crc(A + B) == shift(crc(A), len(B)) ^ crc(B)``,
where ``shift`` multiplies by ``x**(8 * len(B))`` modulo the CRC polynomial.
That same identity gives the CRC-32 the data alone must have, from the
member's recorded CRC and the CRC-32 of its header (:func:`crc32_remove_prefix`).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Final

from gradpipe.core.display import PATH_LIMIT, printable, printable_text
from gradpipe.errors import InvalidInputError

__all__ = ["check_crc32", "crc32_combine", "crc32_remove_prefix", "damaged", "join_crc32", "reason"]

_POLY: Final = 0xEDB88320  # CRC-32 (zip, zlib), reflected
_TOP: Final = 1 << 31  # the polynomial 1 (x**0), reflected


def _multmodp(a: int, b: int) -> int:
    """``a * b`` modulo the CRC polynomial (zlib's ``multmodp``)."""
    m = _TOP
    p = 0
    while m:
        if a & m:
            p ^= b
            if not a & (m - 1):
                break
        m >>= 1
        b = (b >> 1) ^ _POLY if b & 1 else b >> 1
    return p


def _powers() -> tuple[int, ...]:
    """``x**(2**n)`` modulo the polynomial, for n in 0..31."""
    out = [1 << 30]  # x**1
    for _ in range(31):
        out.append(_multmodp(out[-1], out[-1]))
    return tuple(out)


_X2N: Final = _powers()


def _shift(crc: int, length: int) -> int:
    """``crc * x**(8 * length)`` modulo the polynomial: ``crc`` moved past ``length`` bytes."""
    p = _TOP
    k = 3  # 8 bits a byte: x**(2**3) per byte
    n = length
    while n:
        if n & 1:
            p = _multmodp(_X2N[k & 31], p)
        n >>= 1
        k += 1
    return _multmodp(p, crc)


def crc32_combine(first: int, second: int, length: int) -> int:
    """The CRC-32 of ``A + B`` from ``crc32(A)``, ``crc32(B)`` and ``len(B)``.

    >>> import zlib
    >>> crc32_combine(zlib.crc32(b"grad"), zlib.crc32(b"pipe"), 4) == zlib.crc32(b"gradpipe")
    True
    """
    return _shift(first, length) ^ second


def crc32_remove_prefix(whole: int, prefix: int, length: int) -> int:
    """The CRC-32 of ``B`` from ``crc32(A + B)``, ``crc32(A)`` and ``len(B)``.

    >>> import zlib
    >>> crc32_remove_prefix(zlib.crc32(b"gradpipe"), zlib.crc32(b"grad"), 4) == zlib.crc32(b"pipe")
    True
    """
    return whole ^ _shift(prefix, length)


def join_crc32(pieces: Iterable[tuple[int, int]]) -> tuple[int, int]:
    """``(CRC-32, length)`` of consecutive pieces given as ``(CRC-32, length)`` in order."""
    crc = total = 0
    for piece_crc, length in pieces:
        crc = crc32_combine(crc, piece_crc, length)
        total += length
    return crc, total


def check_crc32(path: str, name: str, got: int, want: int) -> None:
    """Refuse a tensor whose bytes, as read, do not have the CRC-32 its file records.

    Raises
    ------
    InvalidInputError
        Naming the file and the tensor, and saying the file is damaged.
    """
    if got != want:
        raise damaged(
            path,
            f"tensor {printable(name)}",
            f": the CRC-32 of its bytes is {got:08x}, but the file records {want:08x}",
        )


def reason(exc: BaseException) -> str:
    """What a library's exception (zipfile, numpy, json) says, escaped and at most 200 long.

    Their messages quote bytes of the file (a member name, a header), which
    may be anything.
    """
    return printable_text(str(exc), limit=PATH_LIMIT)


def damaged(path: str, what: str, why: str, *, remedy: str = "re-create it") -> InvalidInputError:
    """The refusal of a file whose bytes changed after it was written (a checksum, a zip record).

    Parameters
    ----------
    path : str
        The file, as the user named it (escaped here).
    what : str
        The part that is damaged, its name already :func:`printable`, e.g. ``"tensor 'w'"``.
    why : str
        What was found, appended to "is damaged": ``": the CRC-32 ..."`` or ``" (reason)"``.
    remedy : str
        How to make the file again, before "or copy it again".

    Examples
    --------
    >>> print(damaged("a.npz", "member 'w.npy'", " (bad CRC)"))
    'a.npz': member 'w.npy' is damaged (bad CRC); the file was damaged on disk or in transfer: re-create it or copy it again
    """  # noqa: E501
    return InvalidInputError(
        f"{printable(path, limit=PATH_LIMIT)}: {what} is damaged{why}; the file was damaged on "
        f"disk or in transfer: {remedy} or copy it again"
    )
