"""The byte layout of a stored block.

A block is self-describing::

    b"GPBK" | version: u8 | header length: u32 LE | header (canonical JSON) | payload

The header names the codec chain (numcodecs configs, applied in order when
encoding) and the logical size. The block id is the hash of the *logical*
bytes, so it never depends on the codec: re-encoding a block with another
codec keeps its id, and dedup works across codec changes.
"""

from __future__ import annotations

import functools
import struct
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Final

import numcodecs
import numpy as np
from numcodecs.abc import Codec

import gradpipe.codecs  # noqa: F401 - registers the gradpipe_* codecs
from gradpipe.core.buffers import Buffer, byte_view, concat, joined, nbytes
from gradpipe.core.display import printable_error
from gradpipe.core.encoding import from_json_bytes, to_json_bytes
from gradpipe.core.ids import hash_bytes
from gradpipe.errors import GradpipeError, IntegrityError, UnsupportedFormatError

__all__ = [
    "BLOCK_VERSION",
    "BlockToWrite",
    "Frame",
    "WriteStats",
    "decode_block",
    "encode_block",
    "encode_block_parts",
    "encode_lossy_block",
    "frame_codec_ids",
]

_MAGIC: Final = b"GPBK"
#: Version of the block layout this gradpipe writes and the newest it reads.
BLOCK_VERSION: Final = 1
_PREFIX: Final = struct.Struct("<4sBI")


@dataclass(frozen=True, slots=True)
class BlockToWrite:
    """A block a writer wants stored: its id, logical bytes and how to encode them."""

    block_id: str
    data: Any  # logical bytes: bytes or a 1-D array
    codecs: Sequence[Codec] | None  # None: the lossless policy chooses per block
    nonzero: int | None  # elements with non-zero bits, if known (helps the policy)
    frame: bytes | memoryview | Frame | None = None  # the block already encoded, if at hand


@dataclass(frozen=True, slots=True)
class Frame:
    """An encoded block as the parts it is the join of (:func:`encode_block_parts`).

    ``len`` is the frame's size and ``bytes`` its join, so a writer compares and keeps
    frames as it would joined ones, and the store writes the parts without joining them.
    """

    parts: tuple[Buffer, ...]
    size: int

    @classmethod
    def of(cls, parts: Sequence[Buffer]) -> Frame:
        """The frame of ``parts``."""
        return cls(tuple(parts), sum(nbytes(part) for part in parts))

    def __len__(self) -> int:
        return self.size

    def __bytes__(self) -> bytes:
        return bytes(self.joined())

    def joined(self) -> bytes | memoryview:
        """The frame in one buffer (a copy, unless it is one part)."""
        return joined(self.parts)


@dataclass
class WriteStats:
    """What a store's writes did, for reports (mutable, accumulates)."""

    blocks_written: int = 0
    blocks_reused: int = 0
    zero_chunks: int = 0
    inline_chunks: int = 0  # kept inside their manifest (counted in its stored bytes)
    logical_bytes: int = 0
    stored_bytes: int = 0

    def add(self, other: WriteStats) -> None:
        """Accumulate ``other`` into this one."""
        for name in self.__dataclass_fields__:
            setattr(self, name, getattr(self, name) + getattr(other, name))

    def to_dict(self) -> dict[str, int]:
        """JSON-able form."""
        return {name: getattr(self, name) for name in self.__dataclass_fields__}


def encode_block(
    data: bytes | memoryview | np.ndarray, codecs: Sequence[Codec] = ()
) -> bytes | memoryview:
    """Frame ``data`` (the logical bytes) encoded by ``codecs``.

    A large frame is a view of a new array, joined without holding the GIL.
    """
    return concat(encode_block_parts(data, codecs))


def encode_block_parts(
    data: bytes | memoryview | np.ndarray, codecs: Sequence[Codec] = ()
) -> list[bytes | memoryview | np.ndarray]:
    """The frame of :func:`encode_block` in the parts it is the join of, none copied: a
    writer that takes a list of buffers (``os.writev``) writes them without joining them."""
    payload: Any = data
    for codec in codecs[:-1]:
        payload = codec.encode(payload)
    body: list[Any] = [data] if not codecs else []
    if codecs:
        # A codec that gives its frame in parts (the byte-group codec's planes) is joined
        # once, with the block's header, rather than once by itself and once here.
        last = codecs[-1]
        body = last.encode_parts(payload) if _gives_parts(last) else [last.encode(payload)]
    logical = memoryview(data).nbytes if not isinstance(data, np.ndarray) else data.nbytes
    header = to_json_bytes({"codecs": [c.get_config() for c in codecs], "size": logical})
    views = [_bytes_view(part) for part in body]
    return [_PREFIX.pack(_MAGIC, BLOCK_VERSION, len(header)), header, *views]


def _gives_parts(codec: Codec) -> bool:
    """Whether ``codec``'s ``encode`` is the join of its ``encode_parts`` (one class defines
    both; a subclass that overrides ``encode`` alone is asked for its ``encode``)."""
    for klass in type(codec).__mro__:
        if "encode" in vars(klass):
            return "encode_parts" in vars(klass)
    return False


def encode_lossy_block(
    data: np.ndarray, codecs: Sequence[Codec]
) -> tuple[bytes | memoryview, np.ndarray]:
    """Frame ``data`` with a lossy chain; also return the bytes the frame decodes to.

    The block's id must be the hash of those decoded bytes (what every read
    checks), never of ``data``: that is what keeps a lossy block from ever
    standing for the original values (see docs in :mod:`gradpipe.codecs._lossy`).
    """
    frame = encode_block(data, codecs)
    start = _PREFIX.size + _PREFIX.unpack_from(frame)[2]
    payload: Any = memoryview(frame)[start:]
    for codec in reversed(codecs):
        payload = codec.decode(payload)
    return frame, _bytes_array(payload).copy()


def decode_block(
    frame: bytes | memoryview, block_id: str, *, out: np.ndarray | None = None, context: str = ""
) -> memoryview:
    """Decode a block and check it against its id.

    ``out``, if given, is a writable contiguous array of exactly the logical
    size that receives the bytes (decoding straight into a tensor's buffer).
    Raises :class:`IntegrityError` naming the block and ``context`` if the
    frame is damaged or its bytes do not hash to ``block_id``.
    """
    where = f"block {block_id}" + (f" ({context})" if context else "")
    header, start = _header_bytes(frame, where)
    try:
        size, codecs = _decoding(header)
    except UnsupportedFormatError:
        raise
    except (GradpipeError, KeyError, TypeError, ValueError) as exc:
        raise IntegrityError(f"{where} has a damaged header: {printable_error(exc)}") from None
    payload: Any = memoryview(frame)[start:]
    try:
        for i, codec in enumerate(reversed(codecs)):
            last = i == len(codecs) - 1
            payload = codec.decode(payload, out=out if last and out is not None else None)
    except GradpipeError as exc:
        raise IntegrityError(f"{where} does not decode: {exc}") from None
    except Exception as exc:
        raise IntegrityError(f"{where} does not decode: {printable_error(exc)}") from None
    logical = _bytes_view(payload)
    if logical.nbytes != size:
        raise IntegrityError(f"{where} decodes to {logical.nbytes} bytes, header says {size}")
    if out is not None and not codecs:
        _bytes_array(out)[:] = np.frombuffer(logical, np.uint8)
        logical = _bytes_view(out)
    if hash_bytes(logical) != block_id:
        raise IntegrityError(f"{where} is corrupt: its content does not match its id")
    return logical


def frame_codec_ids(frame: bytes | memoryview, *, where: str = "block") -> list[str]:
    """The ids of the codec chain a frame's header names, in encoding order; decodes nothing.

    For looking at how a block is stored (an inline frame, kept in its
    manifest, says so without a read). Raises :class:`IntegrityError` for a
    damaged header.
    """
    header, _ = _header_bytes(frame, where)
    try:
        return list(_codec_ids(header))
    except (GradpipeError, KeyError, TypeError) as exc:
        raise IntegrityError(f"{where} has a damaged header: {printable_error(exc)}") from None


@functools.lru_cache(maxsize=1024)
def _decoding(header: bytes) -> tuple[int, tuple[Any, ...]]:
    """The logical size and the codec chain a frame header names.

    Cached by the header's bytes: the chunks of a tensor share their header
    byte for byte, and a codec is configuration only (numcodecs and zarr share
    one instance across threads the same way), so a read of many chunks builds
    each chain once instead of once per chunk.
    """
    doc = from_json_bytes(header, what="block header")
    return int(doc["size"]), tuple(numcodecs.get_codec(dict(c)) for c in doc["codecs"])


@functools.lru_cache(maxsize=1024)
def _codec_ids(header: bytes) -> tuple[str, ...]:
    # Frames of one dtype, size and codec share their header byte for byte:
    # statistics over thousands of inline chunks parse each kind once.
    doc = from_json_bytes(header, what="block header")
    return tuple(str(config["id"]) for config in doc["codecs"])


def _header_bytes(frame: bytes | memoryview, where: str) -> tuple[bytes, int]:
    """The JSON header of a frame, checked for layout, and where its payload starts."""
    if len(frame) < _PREFIX.size:
        raise IntegrityError(f"{where} is truncated ({len(frame)} bytes)")
    magic, version, header_len = _PREFIX.unpack_from(frame)
    if magic != _MAGIC:
        raise IntegrityError(f"{where} is not a gradpipe block (bad magic)")
    if version > BLOCK_VERSION:
        raise UnsupportedFormatError(
            f"{where} has layout version {version}, newer than this gradpipe reads "
            f"({BLOCK_VERSION}); upgrade gradpipe"
        )
    start = _PREFIX.size + header_len
    if start > len(frame):
        raise IntegrityError(f"{where} is truncated inside its header")
    return bytes(frame[_PREFIX.size : start]), start


def _bytes_array(buf: Any) -> np.ndarray:
    """A flat uint8 view of any contiguous buffer (bfloat16 has no buffer format)."""
    return byte_view(buf)


def _bytes_view(buf: Any) -> memoryview:
    return memoryview(_bytes_array(buf))  # type: ignore[arg-type]
