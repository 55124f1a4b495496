"""Lossless codec for chunks that are mostly zero.

Embedding-layer gradients touch only the rows of the tokens in the batch:
often more than 99% of a chunk is zero. This codec stores a bitmap of the
elements whose *bit pattern* is not all zero, compressed with Zstandard, and
only those elements, encoded with :class:`~gradpipe.codecs.bytegroup.ByteGroupCodec`.
``-0.0`` and NaNs are not zero bit patterns, so they are kept like any value.

The Rust prototype this project grew from stored (index, value) pairs, which doubles the
size of a dense update. Here the overhead over dense is bounded by the bitmap,
at most one bit per element (3% for float32) before compression, and it
compresses to almost nothing when the chunk is nearly full or nearly empty.

Frame layout (little-endian)::

    magic    4s   b"GPSP"
    version  u1   1
    width    u1   itemsize in bytes: 1, 2, 4 or 8
    method   u1   bitmap storage: 0 raw, 1 Zstandard, 2 omitted
                  (every element is zero, or none is)
    (pad)    u1
    count    u8   number of elements
    nonzero  u8   number of elements whose bits are not all zero
    length   u8   bytes of bitmap that follow
    crc32    u4   zlib.crc32 of the 32 bytes above
    bitmap        np.packbits(mask, bitorder="little"), as ``method`` says
    values        a gradpipe_bytegroup frame of the nonzero elements, in order
"""

from __future__ import annotations

import struct
import zlib
from typing import Final

import numpy as np
from numcodecs import zstd
from numcodecs.abc import Codec
from numcodecs.compat import ensure_contiguous_ndarray

from gradpipe.codecs.bytegroup import (
    DEFAULT_LEVEL,
    ByteGroupCodec,
    check_out_size,
    decompress_exact,
    parse_level,
    zstd_content_size,
)
from gradpipe.core.dtypes import dtype_name, parse_dtype
from gradpipe.errors import IntegrityError, InvalidInputError

__all__ = ["SparseCodec", "nonzero_mask"]

_MAGIC: Final = b"GPSP"
_VERSION: Final = 1
_HEADER: Final = struct.Struct("<4sBBBxQQQ")
_CRC: Final = struct.Struct("<I")
_START: Final = _HEADER.size + _CRC.size
_RAW: Final = 0
_ZSTD: Final = 1
_OMITTED: Final = 2


def nonzero_mask(words: np.ndarray) -> np.ndarray:
    """Mask of the elements whose bit pattern is not all zero.

    Parameters
    ----------
    words : numpy.ndarray
        Elements of any dtype gradpipe stores; compared by their bits, so
        ``-0.0`` counts as nonzero.

    Returns
    -------
    numpy.ndarray
        Boolean array of the same shape.
    """
    unsigned = np.dtype(f"<u{words.dtype.itemsize}")
    mask: np.ndarray = np.not_equal(words.view(unsigned), 0)
    return mask


class SparseCodec(Codec):  # type: ignore[misc]  # numcodecs is untyped
    """Bitmap of nonzero elements plus their byte-grouped values.

    Parameters
    ----------
    dtype : str
        gradpipe dtype name of the elements (``"float32"``, ``"bfloat16"``...).
    level : int
        Zstandard compression level for the bitmap and the value planes.

    Notes
    -----
    Bit-exact for any input whose size is a multiple of the item size.
    Structural damage raises :class:`gradpipe.errors.IntegrityError`.

    Examples
    --------
    >>> import numpy as np
    >>> codec = SparseCodec(dtype="float32")
    >>> x = np.zeros(1000, dtype="float32")
    >>> x[[3, 500]] = [1.0, -0.0]
    >>> len(codec.encode(x)) < x.nbytes // 20
    True
    >>> codec.decode(codec.encode(x)).tobytes() == x.tobytes()
    True
    """

    codec_id = "gradpipe_sparse"

    def __init__(self, dtype: str, level: int = DEFAULT_LEVEL) -> None:
        self._dtype = parse_dtype(dtype)
        self.dtype = dtype_name(self._dtype)
        self.level = parse_level(level)
        self._width = self._dtype.itemsize
        self._word = np.dtype(f"<u{self._width}")
        self._values = ByteGroupCodec(self.dtype, self.level)

    def encode(self, buf: object) -> bytes:
        """Encode a buffer of little-endian elements.

        Parameters
        ----------
        buf : buffer-like
            Contiguous data; its size in bytes must be a multiple of the
            item size of ``dtype``.

        Returns
        -------
        bytes
            The encoded frame.
        """
        data = ensure_contiguous_ndarray(buf).view(np.uint8)
        if data.size % self._width:
            raise InvalidInputError(
                f"{self.codec_id}: {data.size} bytes is not a whole number of "
                f"{self.dtype} elements ({self._width} bytes each)"
            )
        words = data.view(self._word)
        count = words.size
        mask = nonzero_mask(words)
        nonzero = int(np.count_nonzero(mask))
        bitmap: bytes | memoryview
        if nonzero in (0, count):
            method, bitmap = _OMITTED, b""
            values = words if nonzero else words[:0]
        else:
            method, bitmap = _pack_bitmap(mask, self.level)
            # np.compress is branch-free where words[mask] is not: 0.5 ms
            # against 3.8 ms for 1 Mi float32 at 30% density.
            values = np.compress(mask, words)
        header = _HEADER.pack(_MAGIC, _VERSION, self._width, method, count, nonzero, len(bitmap))
        crc = _CRC.pack(zlib.crc32(header))
        return b"".join([header, crc, bitmap, self._values.encode(values)])

    def decode(self, buf: object, out: object = None) -> np.ndarray:
        """Decode a frame made by :meth:`encode`.

        Parameters
        ----------
        buf : buffer-like
            The encoded frame.
        out : buffer-like, optional
            Destination of the decoded bytes; must be exactly as large.

        Returns
        -------
        numpy.ndarray
            The elements as a 1-D array of ``dtype``, or ``out`` if given.
        """
        frame = ensure_contiguous_ndarray(buf).view(np.uint8)
        count, nonzero, method, bitmap, values_frame = self._split(frame)
        check_out_size(out, count * self._width, self.codec_id)
        values = self._values.decode(values_frame).view(self._word)
        if values.size != nonzero:
            raise IntegrityError(
                f"{self.codec_id}: frame holds {values.size} values but declares {nonzero}"
            )
        if out is None:
            dec = np.empty(count, dtype=self._word)
        else:  # decode in place: no second buffer of ``count`` elements, no copy
            dec = ensure_contiguous_ndarray(out).reshape(-1).view(self._word)
        if method == _OMITTED:
            if nonzero:
                dec[:] = values
            else:
                dec.fill(0)
        else:
            where = _bitmap_indices(bitmap, method, count)
            if where.size != nonzero:
                raise IntegrityError(
                    f"{self.codec_id}: bitmap marks {where.size} elements "
                    f"but the frame declares {nonzero}"
                )
            dec.fill(0)
            # Same reason: index arrays scatter 6x faster than a boolean mask
            # (0.6 ms against 3.9 ms for 1 Mi float32 at 30% density).
            dec[where] = values
        return out if out is not None else dec.view(self._dtype)  # type: ignore[return-value]

    def _split(self, frame: np.ndarray) -> tuple[int, int, int, np.ndarray, np.ndarray]:
        """Check the header; return counts, bitmap method, bitmap and values."""
        size = frame.size
        if size < _START:
            raise IntegrityError(f"{self.codec_id}: frame of {size} bytes is truncated")
        magic, version, width, method, count, nonzero, length = _HEADER.unpack_from(frame.data)
        if magic != _MAGIC:
            raise IntegrityError(f"{self.codec_id}: not a sparse frame (magic {magic!r})")
        if version != _VERSION:
            raise IntegrityError(
                f"{self.codec_id}: frame version {version} is not supported "
                f"(this gradpipe reads version {_VERSION})"
            )
        if width != self._width:
            raise IntegrityError(
                f"{self.codec_id}: frame holds {width}-byte items but the codec "
                f"is configured for {self.dtype}"
            )
        (crc,) = _CRC.unpack_from(frame.data, _HEADER.size)
        if crc != zlib.crc32(frame[: _HEADER.size].data):
            raise IntegrityError(f"{self.codec_id}: frame header fails its CRC check")
        packed_size = -(-count // 8)
        valid = (
            nonzero <= count
            and (method != _OMITTED or (length == 0 and nonzero in (0, count)))
            and (method != _RAW or length == packed_size)
            and method in (_RAW, _ZSTD, _OMITTED)
        )
        if not valid:
            raise IntegrityError(f"{self.codec_id}: corrupt frame header")
        end = _START + length
        if end > size:
            raise IntegrityError(f"{self.codec_id}: frame of {size} bytes is truncated")
        bitmap = frame[_START:end]
        if method == _ZSTD and zstd_content_size(bitmap) != packed_size:
            # Checked before anything of ``count`` elements is allocated.
            raise IntegrityError(f"{self.codec_id}: bitmap does not cover {count} elements")
        return count, nonzero, method, bitmap, frame[end:]


def _pack_bitmap(mask: np.ndarray, level: int) -> tuple[int, bytes | memoryview]:
    """Pack a mask to bits, compressed if that makes it smaller."""
    bits = np.packbits(mask, bitorder="little")
    packed = zstd.compress(bits, level)
    if len(packed) < bits.size:
        return _ZSTD, packed
    return _RAW, bits.data


def _bitmap_indices(bitmap: np.ndarray, method: int, count: int) -> np.ndarray:
    """The indices of the set bits of a packed (maybe compressed) bitmap of ``count`` bits.

    Only the bitmap's non-zero bytes are unpacked: for a sparse chunk (an
    embedding gradient touching a few rows) that is a small fraction of the
    bytes, so this costs a scan of ``count / 8`` bytes rather than building and
    scanning a mask of ``count`` booleans (1 Mi elements at 0.3% density: 0.1 ms
    against 1.1 ms).
    """
    packed_size = -(-count // 8)
    if method == _ZSTD:
        bits = np.empty(packed_size, dtype=np.uint8)
        bitmap = decompress_exact(bitmap, bits, "gradpipe_sparse: bitmap")
    elif count % 8:
        bitmap = bitmap.copy()  # a view of the frame: not ours to write
    if count % 8:  # bits past ``count`` in the last byte are not elements
        bitmap[-1] &= (1 << (count % 8)) - 1
    where = np.flatnonzero(bitmap)
    if where.size > packed_size // 4:  # dense: one pass over the unpacked mask is cheaper
        return np.flatnonzero(np.unpackbits(bitmap, count=count, bitorder="little"))
    lanes = np.unpackbits(bitmap[where], bitorder="little").reshape(-1, 8)
    base = where.astype(np.intp) * 8
    return (base[:, None] + _LANE_OFFSETS)[lanes.view(np.bool_)]


_LANE_OFFSETS = np.arange(8, dtype=np.intp)
