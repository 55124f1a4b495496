"""Zstandard helpers shared by the gradpipe codecs.

Frames are written with the ``zstandard`` package, which exposes the
compression parameters, and read with numcodecs' ``zstd.decompress``, which
decodes straight into a destination buffer. Both are the reference library.

Two compressors are used on byte planes:

- *matching*: a plain Zstandard level. On low-rank gradients the exponent
  plane repeats at the row stride, and level 1 codes those repeats (the
  exponent plane of a MiniLM attention-output gradient: 2.59 bits per element
  at level 1 against 3.04 for an order-0 Huffman code).
- *literal*: the fast strategy with 7-byte minimum matches and a 64-entry hash
  table, so it finds almost no matches and codes the plane with Zstandard's
  Huffman literals only. On exponents without structure (parameters, Adam
  moments) level 1's short spurious matches cost more than they save (MiniLM
  parameters: 2.61 bits per element against 3.04 at level 1, within 0.2% of
  the order-0 entropy), and it runs about twice as fast.
"""

from __future__ import annotations

import threading
from typing import Final

import numpy as np
import zstandard
from numcodecs import zstd

from gradpipe.errors import IntegrityError, InvalidInputError

__all__ = [
    "LITERAL",
    "compressor",
    "decompress_exact",
    "parse_level",
    "zstd_content_size",
]

#: Pseudo-level naming the literal-only compressor (outside Zstandard's range).
LITERAL: Final = -(1 << 20)

#: A Zstandard frame of n bytes never decodes to more than this many times n:
#: an RLE block of 128 KiB costs 4 bytes. Used to refuse frames that claim
#: more than they can hold before allocating for them.
MAX_EXPANSION: Final = 1 << 15

_LITERAL_PARAMS: Final = {
    "strategy": zstandard.STRATEGY_FAST,
    "window_log": 17,
    "hash_log": 6,
    "chain_log": 6,
    "search_log": 1,
    "min_match": 7,
}
_local = threading.local()


def parse_level(level: int) -> int:
    """Validate a Zstandard compression level."""
    if isinstance(level, bool) or not isinstance(level, int | np.integer):
        raise InvalidInputError(f"level must be an integer, not {level!r}")
    low, high = zstd.Zstd.min_level(), zstd.Zstd.max_level()
    if not low <= int(level) <= high:
        raise InvalidInputError(f"level {level} is outside Zstandard's range [{low}, {high}]")
    return int(level)


def compressor(level: int) -> zstandard.ZstdCompressor:
    """This thread's compressor for ``level`` (or :data:`LITERAL`).

    ``zstandard.ZstdCompressor`` objects must not be shared between threads
    (Dask encodes chunks on several), and making one costs more than a small
    chunk's compression, so each thread keeps its own.
    """
    cache: dict[int, zstandard.ZstdCompressor] | None = getattr(_local, "cache", None)
    if cache is None:
        cache = _local.cache = {}
    found = cache.get(level)
    if found is None:
        if level == LITERAL:
            params = zstandard.ZstdCompressionParameters(
                write_content_size=True, write_checksum=False, **_LITERAL_PARAMS
            )
            found = zstandard.ZstdCompressor(compression_params=params)
        else:
            found = zstandard.ZstdCompressor(level=level, write_checksum=False)
        cache[level] = found
    return found


def zstd_content_size(frame: np.ndarray) -> int | None:
    """The Frame_Content_Size of a Zstandard frame (RFC 8878, 3.1.1), if present.

    numcodecs' ``decompress`` into a larger destination does not say how much
    it wrote, so the declared size is checked here before trusting a plane.
    """
    if frame.size < 6 or bytes(frame[:4]) != b"\x28\xb5\x2f\xfd":
        return None
    descriptor = int(frame[4])
    fcs_flag, single_segment, did_flag = descriptor >> 6, (descriptor >> 5) & 1, descriptor & 3
    start = 5 + (0 if single_segment else 1) + (0, 1, 2, 4)[did_flag]
    width = (1 if single_segment else 0, 2, 4, 8)[fcs_flag]
    if width == 0 or frame.size < start + width:
        return None
    value = int.from_bytes(bytes(frame[start : start + width]), "little")
    return value + 256 if width == 2 else value


def decompress_exact(packed: np.ndarray, dest: np.ndarray, what: str) -> np.ndarray:
    """Decompress a Zstandard frame that must fill ``dest`` exactly.

    Parameters
    ----------
    packed : numpy.ndarray
        The compressed bytes.
    dest : numpy.ndarray
        Contiguous ``uint8`` destination of the expected size.
    what : str
        What is being decoded, for the error message.

    Returns
    -------
    numpy.ndarray
        ``dest``, filled.
    """
    declared = zstd_content_size(packed)
    if declared != dest.size:
        raise IntegrityError(f"{what} declares {declared} bytes, expected {dest.size}")
    try:
        # Passing the destination bounds the output: a damaged frame cannot
        # make us allocate whatever its header claims.
        zstd.decompress(packed, dest)
    except (RuntimeError, ValueError) as exc:
        raise IntegrityError(f"{what} is not a valid Zstandard frame: {exc}") from exc
    return dest
