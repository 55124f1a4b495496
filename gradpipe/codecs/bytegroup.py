"""Lossless byte-grouping codec for dense numeric chunks.

The idea is ZipNN's (Hershcovitch et al., 2024): in model weights and
gradients the exponent of a float is highly predictable while the mantissa is
close to random. A general-purpose compressor sees the interleaved bytes and
wins little; grouping the bytes by significance ("byte planes") and
compressing each plane on its own lets an entropy coder spend its bits where
the redundancy is, and lets incompressible planes be stored as they are.

Frame layout (little-endian)::

    magic   4s   b"GPBG"
    version u1   2 (this gradpipe writes 2 and reads 1 and 2)
    width   u1   itemsize in bytes: 1, 2, 4 or 8
    flags   u1   version 2: bit 1 set for float32 and bfloat16 (an 8-bit
                 exponent under the sign); bit 0 set if the sign was moved
                 below the exponent (see ``_planes.move_sign``).
                 version 1: bit 0 set if the whole word was rotated left by
                 one bit, sign to bit 0 (always, for float32 and bfloat16)
    (pad)   u1
    nbytes  u8   decoded size in bytes
    width × (method u1, length u8)   one entry per plane, least significant first
    crc32   u4   zlib.crc32 of everything above
    payload      the planes, in the same order

A plane's method is 0 (stored raw) or 1 (a Zstandard frame). The CRC makes a
damaged header an error rather than a wrong length or a huge allocation; the
payload is covered by the store's block hash.

What version 2 changed, measured on a MiniLM-sized encoder's float32 state
(``benchmarks/bench_codecs.py``): the sign move is chosen per chunk, because
it helps parameters and Adam moments (their exponent byte gets 0.1 bit per
element smaller) but hurts low-rank gradients, whose exponent rows repeat
with their signs (1.87 against 2.21 bits per element); each compressed plane
is coded by whichever of a matching and a literal-only Zstandard setting (see
``_zstd``) does better on a sample; noise planes are detected on a sample and
never given to Zstandard; and decoding writes straight into ``out``.
"""

from __future__ import annotations

import struct
import zlib
from typing import Final, NamedTuple, cast

import numpy as np
from numcodecs.abc import Codec

from gradpipe.codecs._planes import (
    join_planes,
    split_planes,
)
from gradpipe.codecs._zstd import (
    LITERAL,
    MAX_EXPANSION,
    compressor,
    decompress_exact,
    parse_level,
    zstd_content_size,
)
from gradpipe.core.buffers import byte_view, concat
from gradpipe.core.dtypes import dtype_name, is_float, parse_dtype
from gradpipe.errors import IntegrityError, InvalidInputError

__all__ = [
    "DEFAULT_LEVEL",
    "ByteGroupCodec",
    "check_out_size",
    "decompress_exact",
    "parse_level",
    "zstd_content_size",
]

#: Zstandard level of the matching compressor. Level 1 is both the fastest
#: and, on exponent planes, the smallest: higher levels spend effort on
#: matches that make the output larger (float32 gradient exponents: 2.77x at
#: level 1, 2.48x at 3).
DEFAULT_LEVEL: Final = 1

_MAGIC: Final = b"GPBG"
_VERSION: Final = 2
_FLAG_ROTATED_V1: Final = 0x01
_FLAG_SIGN_MOVED: Final = 0x01
_FLAG_EXPONENT_BYTE: Final = 0x02
_HEADER: Final = struct.Struct("<4sBBBxQ")
_PLANE: Final = struct.Struct("<BQ")
_CRC: Final = struct.Struct("<I")
_RAW: Final = 0
_ZSTD: Final = 1
_WORDS: Final[dict[int, np.dtype]] = {
    1: np.dtype("<u1"),
    2: np.dtype("<u2"),
    4: np.dtype("<u4"),
    8: np.dtype("<u8"),
}

# Planes are judged on a sample from their middle: big enough to hold many
# rows of a weight matrix (so row-stride repeats show), small enough to cost
# a few percent of the chunk's encoding. A plane whose sample does not shrink
# by 1% is stored raw (mantissa planes of dense floats are noise; Zstandard
# would store most of them raw anyway, after spending ~40% of encode time).
_SAMPLE_BYTES: Final = 32 * 1024
_SAMPLE_MIN_GAIN: Final = 0.99


class _TopChoice(NamedTuple):
    moved: bool  # the sign moved below the exponent
    high: int | None  # setting of the top plane (None: raw)
    low: int | None  # setting of the plane below it
    size: float  # the two planes' estimated encoded size


def _packed_size(setting: int, sample: np.ndarray) -> int:
    return len(compressor(setting).compress(sample.data))


def _verdict(setting: int, size: int, sample: int, total: int) -> tuple[int | None, float]:
    """A setting and the plane's estimated size, or raw if the sample did not shrink enough."""
    if size >= _SAMPLE_MIN_GAIN * sample:
        return None, float(total)
    return setting, size * total / sample


def _sample(plane: np.ndarray) -> np.ndarray:
    """The part of ``plane`` that settings are judged on: its middle, or all of a small one."""
    if plane.size <= 2 * _SAMPLE_BYTES:
        return plane
    middle = plane.size // 2
    return plane[middle : middle + _SAMPLE_BYTES]


def _sample_words(data: np.ndarray, width: int) -> np.ndarray:
    """The bytes of the elements whose planes :func:`_sample` takes from the planes of ``data``."""
    count = data.size // width
    if count <= 2 * _SAMPLE_BYTES:
        return data[: count * width]
    start = count // 2
    return data[start * width : (start + _SAMPLE_BYTES) * width]


def _rotate_sign_v1(words: np.ndarray, bits: int) -> np.ndarray:
    """Undo version 1's one-bit left rotation of each word."""
    out: np.ndarray = np.right_shift(words, 1)
    out |= np.left_shift(words, bits - 1)
    return out


class ByteGroupCodec(Codec):  # type: ignore[misc]  # numcodecs is untyped
    """Byte planes, each compressed with Zstandard or stored raw.

    Parameters
    ----------
    dtype : str
        gradpipe dtype name of the elements (``"float32"``, ``"bfloat16"``,
        ``"int64"``...). It sets the plane count (the item size) and whether
        the sign bit may be moved out of the exponent's byte.
    level : int
        Zstandard level of the matching compressor, one of the two settings
        tried on each compressible plane.

    Notes
    -----
    The round trip is bit-exact on any input whose size is a multiple of the
    item size: NaN payloads, signed zeros and subnormals are only bytes here.
    Structural damage (bad magic, truncation, lengths that do not add up, an
    undecodable Zstandard frame) raises :class:`gradpipe.errors.IntegrityError`;
    a flipped bit inside a raw plane is not detectable here, which is why the
    store checks every block's hash.

    Examples
    --------
    >>> import numpy as np
    >>> codec = ByteGroupCodec(dtype="float32")
    >>> x = np.array([1.5, -0.0, np.nan], dtype="float32")
    >>> codec.decode(codec.encode(x)).tobytes() == x.tobytes()
    True
    """

    codec_id = "gradpipe_bytegroup"

    def __init__(self, dtype: str, level: int = DEFAULT_LEVEL) -> None:
        self._dtype = parse_dtype(dtype)
        self.dtype = dtype_name(self._dtype)
        self.level = parse_level(level)
        self._width = self._dtype.itemsize
        self._word = _WORDS[self._width]
        # Only float32 and bfloat16 have an 8-bit exponent that the sign move
        # aligns to a byte. For float16 it would split the mantissa's top
        # bits, and float64's 11-bit exponent never fits one byte.
        self._exponent_byte = self.dtype in ("float32", "bfloat16")
        self._float = is_float(self._dtype)

    def encode(self, buf: object) -> bytes | memoryview:
        """Encode a buffer of little-endian elements.

        Parameters
        ----------
        buf : buffer-like
            Contiguous data; its size in bytes must be a multiple of the
            item size of ``dtype``.

        Returns
        -------
        bytes or memoryview
            The encoded frame (a view of a new array when large: joined
            without holding the GIL, see :func:`gradpipe.core.buffers.concat`).
        """
        return concat(self.encode_parts(buf))

    def encode_parts(self, buf: object) -> list[bytes | memoryview]:
        """The frame :meth:`encode` makes, as its parts in order (not joined).

        A caller that frames the frame again (a store's block header) joins everything
        once instead of twice.
        """
        data = byte_view(buf)
        nbytes = data.size
        width = self._width
        if nbytes % width:
            raise InvalidInputError(
                f"{self.codec_id}: {nbytes} bytes is not a whole number of "
                f"{self.dtype} elements ({width} bytes each)"
            )
        count = nbytes // width
        # Settings are chosen on the planes of the sample's elements, split first, so that
        # the whole chunk is split once, with the sign already where the settings want it.
        sample = _sample_words(data, width)
        planes = split_planes(sample, width)
        flags, settings, _ = self._plan(planes, sample)
        if sample.size < nbytes or flags & _FLAG_SIGN_MOVED:  # else the sample is the chunk
            planes = split_planes(data, width, move_sign=bool(flags & _FLAG_SIGN_MOVED))

        table: list[bytes] = []
        payload: list[bytes | memoryview] = []
        for plane, setting in zip(planes, settings, strict=True):
            packed = compressor(setting).compress(plane.data) if setting is not None else b""
            if packed and len(packed) < count:
                table.append(_PLANE.pack(_ZSTD, len(packed)))
                payload.append(packed)
            else:
                table.append(_PLANE.pack(_RAW, count))
                payload.append(plane.data)
        header = b"".join([_HEADER.pack(_MAGIC, _VERSION, width, flags, nbytes), *table])
        return [header, _CRC.pack(zlib.crc32(header)), *payload]

    def _plan(self, planes: np.ndarray, sample: np.ndarray) -> tuple[int, list[int | None], float]:
        """The frame's flags, one setting per plane (a level, LITERAL or None: raw), and the
        planes' estimated encoded size, from ``planes``: ``split_planes(sample, width)``, the
        sign not moved yet (the flags say whether to)."""
        flags = _FLAG_EXPONENT_BYTE if self._exponent_byte else 0
        if self._exponent_byte and planes[0].size:
            top = self._choose_top(planes[-1], planes[-2], sample)
            if top.moved:
                flags |= _FLAG_SIGN_MOVED
            chosen = [self._choose(p) for p in planes[:-2]]
            settings = [setting for setting, _ in chosen] + [top.low, top.high]
            return flags, settings, sum(size for _, size in chosen) + top.size
        chosen = [self._choose(p) for p in planes]
        return flags, [setting for setting, _ in chosen], sum(size for _, size in chosen)

    def estimate(self, buf: object) -> float:
        """About how many bytes :meth:`encode` would make of ``buf``, judged on a sample.

        The planes of :data:`_SAMPLE_BYTES` elements from the middle of ``buf`` are judged
        as :meth:`encode` judges its planes' samples (their settings and sizes), without
        splitting or coding the whole buffer: a few percent of an encoding's work, to
        choose between encodings before making one.
        """
        data = byte_view(buf)
        width = self._width
        count = data.size // width
        if count == 0:
            return float(_HEADER.size + width * _PLANE.size + _CRC.size)
        sample = _sample_words(data, width)
        _, _, size = self._plan(split_planes(sample, width), sample)
        return _HEADER.size + width * _PLANE.size + _CRC.size + size * width * count / sample.size

    def _choose(self, plane: np.ndarray) -> tuple[int | None, float]:
        """The better compressor for ``plane`` (None: raw) and its estimated size."""
        if plane.size == 0:
            return None, 0.0
        sample = _sample(plane)
        literal = _packed_size(LITERAL, sample)
        if literal >= _SAMPLE_MIN_GAIN * sample.size and self._float:
            # Noise to the entropy coder: a mantissa plane. (Integer planes
            # also get the matching setting, for counters whose low byte
            # cycles: no Huffman code shortens that, matches do.)
            return None, float(plane.size)
        matching = _packed_size(self.level, sample)
        size, setting = min((literal, LITERAL), (matching, self.level))
        return _verdict(setting, size, sample.size, plane.size)

    def _choose_top(self, high: np.ndarray, low: np.ndarray, sample: np.ndarray) -> _TopChoice:
        """Where the sign goes and how the top two planes are coded, from samples.

        When matches win on the exponent byte as it is, the chunk is a
        low-rank gradient whose rows repeat with their signs: the sign stays.
        Otherwise the byte is coded by its symbol statistics alone, and moving
        the sign out of it (a 9-bit exponent byte becomes 8 bits) usually
        helps; samples of both layouts decide.
        """
        sample_high = _sample(high)
        literal = _packed_size(LITERAL, sample_high)
        matching = _packed_size(self.level, sample_high)
        size, setting = min((literal, LITERAL), (matching, self.level))
        high_as_is = _verdict(setting, size, sample_high.size, high.size)
        low_as_is = self._choose(low)
        as_is = high_as_is[1] + low_as_is[1]
        if setting != LITERAL:
            return _TopChoice(False, high_as_is[0], low_as_is[0], as_is)
        # The sample's planes are sampled whole (``sample`` is at most twice the sample
        # size), so the moved layout is its split with the sign moved: one pass of the
        # compiled kernel, without the GIL, rather than numpy's passes over the two planes.
        moved_planes = split_planes(sample, self._width, move_sign=True)
        moved_high, moved_low = _sample(moved_planes[-1]), _sample(moved_planes[-2])
        high_moved = _verdict(
            LITERAL, _packed_size(LITERAL, moved_high), moved_high.size, high.size
        )
        low_moved = _verdict(LITERAL, _packed_size(LITERAL, moved_low), moved_low.size, low.size)
        moved = high_moved[1] + low_moved[1]
        if moved < as_is:
            return _TopChoice(True, high_moved[0], low_moved[0], moved)
        return _TopChoice(False, high_as_is[0], low_as_is[0], as_is)

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
        frame = byte_view(buf)
        version, flags, nbytes, entries, offset = self._read_header(frame)
        check_out_size(out, nbytes, self.codec_id)
        width = self._width
        count = nbytes // width
        planes: list[np.ndarray] = []
        for k, (method, length) in enumerate(entries):
            chunk = frame[offset : offset + length]
            offset += length
            if method == _RAW:
                planes.append(chunk)
            else:
                scratch = np.empty(count, dtype=np.uint8)
                planes.append(decompress_exact(chunk, scratch, f"{self.codec_id}: plane {k}"))
        if out is None:
            dest = np.empty(nbytes, dtype=np.uint8)
            result = dest.view(self._dtype)
        else:
            result = cast(np.ndarray, out)  # numcodecs returns the caller's buffer
            dest = byte_view(out)
        join_planes(planes, dest, sign_moved=version == _VERSION and bool(flags & _FLAG_SIGN_MOVED))
        if version == 1 and flags & _FLAG_ROTATED_V1:
            words = dest.view(self._word)
            words[...] = _rotate_sign_v1(words, 8 * width)
        return result

    def _read_header(self, frame: np.ndarray) -> tuple[int, int, int, list[tuple[int, int]], int]:
        """Parse and check the header and plane table; return where data starts."""
        size = frame.size
        width = self._width
        offset = _HEADER.size + width * _PLANE.size + _CRC.size
        if size < offset:
            raise IntegrityError(f"{self.codec_id}: frame of {size} bytes is truncated")
        magic, version, found_width, flags, nbytes = _HEADER.unpack_from(frame.data)
        if magic != _MAGIC:
            raise IntegrityError(f"{self.codec_id}: not a byte-group frame (magic {magic!r})")
        if version not in (1, _VERSION):
            raise IntegrityError(
                f"{self.codec_id}: frame version {version} is not supported "
                f"(this gradpipe reads versions 1 to {_VERSION}); upgrade gradpipe"
            )
        if found_width != width:
            raise IntegrityError(
                f"{self.codec_id}: frame holds {found_width}-byte items but the codec "
                f"is configured for {self.dtype}"
            )
        (crc,) = _CRC.unpack_from(frame.data, offset - _CRC.size)
        if crc != zlib.crc32(frame[: offset - _CRC.size].data):
            raise IntegrityError(f"{self.codec_id}: frame header fails its CRC check")
        # The layout follows from the dtype, so a flag that disagrees with it
        # is a frame from elsewhere, not a choice to honour.
        if version == 1:
            valid = {_FLAG_ROTATED_V1} if self._exponent_byte else {0}
        elif self._exponent_byte:
            valid = {_FLAG_EXPONENT_BYTE, _FLAG_EXPONENT_BYTE | _FLAG_SIGN_MOVED}
        else:
            valid = {0}
        if flags not in valid or nbytes % width:
            raise IntegrityError(f"{self.codec_id}: frame layout does not match dtype {self.dtype}")
        count = nbytes // width
        entries = [
            _PLANE.unpack_from(frame.data, _HEADER.size + k * _PLANE.size) for k in range(width)
        ]
        total = offset
        for k, (method, length) in enumerate(entries):
            if method == _RAW and length != count:
                raise IntegrityError(f"{self.codec_id}: raw plane {k} has the wrong length")
            if method == _ZSTD:
                packed = frame[total : total + length]
                # Checked against the frame's own size first, so a forged
                # count cannot make the decoder allocate more than a
                # Zstandard frame of this length could ever hold.
                if count > MAX_EXPANSION * packed.size or zstd_content_size(packed) != count:
                    raise IntegrityError(f"{self.codec_id}: plane {k} does not hold {count} bytes")
            elif method != _RAW:
                raise IntegrityError(f"{self.codec_id}: plane {k} has unknown method {method}")
            total += length
        if total != size:
            raise IntegrityError(
                f"{self.codec_id}: frame is {size} bytes but its plane table says {total}"
            )
        return version, flags, nbytes, entries, _HEADER.size + width * _PLANE.size + _CRC.size


def check_out_size(out: object, nbytes: int, codec_id: str) -> None:
    """Refuse a destination of the wrong size before decoding anything."""
    if out is not None and (size := byte_view(out).size) != nbytes:
        raise InvalidInputError(
            f"{codec_id}: out holds {size} bytes but the frame decodes to {nbytes}"
        )
