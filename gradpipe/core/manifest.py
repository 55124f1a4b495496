"""Manifests: the structured objects of a store, themselves stored as blocks.

Every manifest is a frozen dataclass with ``to_dict``/``from_dict`` and a
canonical JSON encoding, so it has exactly one id and a whole object graph is
verifiable from its root id. Each carries ``type`` and ``format``; a reader
refuses a format newer than it knows instead of misreading it.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any, ClassVar, Final, Protocol, TypeVar

from gradpipe.core.chunking import chunk_count, chunk_ranges, parse_chunk_shape
from gradpipe.core.dtypes import parse_dtype
from gradpipe.core.encoding import from_json_bytes, to_json_bytes
from gradpipe.core.ids import parse_id
from gradpipe.core.names import parse_ref_name
from gradpipe.core.stats import ChunkStats, merge_stats
from gradpipe.errors import InvalidInputError, UnsupportedFormatError

__all__ = [
    "FORMAT_VERSION",
    "Manifest",
    "RefEntry",
    "TensorManifest",
    "decode_manifest",
    "encode_manifest",
    "register_manifest",
]

#: The manifest format this version of gradpipe writes and the newest it reads.
FORMAT_VERSION: Final = 1


class Manifest(Protocol):
    """What every manifest type provides."""

    type: ClassVar[str]

    def to_dict(self) -> dict[str, Any]: ...

    def manifest_children(self) -> Iterator[str]:
        """Ids of the manifests this one links to (walked by verify and gc)."""
        ...

    def data_children(self) -> Iterator[str]:
        """Ids of the data blocks this one links to."""
        ...


M = TypeVar("M", bound=type)
_TYPES: dict[str, Callable[[dict[str, Any]], Manifest]] = {}


def register_manifest(cls: M) -> M:
    """Class decorator: make a manifest type decodable by :func:`decode_manifest`."""
    _TYPES[cls.type] = cls.from_dict  # type: ignore[attr-defined]
    return cls


def encode_manifest(manifest: Manifest) -> bytes:
    """Canonical bytes of a manifest (what its id is the hash of)."""
    return to_json_bytes({"type": manifest.type, "format": FORMAT_VERSION, **manifest.to_dict()})


def decode_manifest(data: bytes, *, what: str = "manifest") -> Manifest:
    """Parse manifest bytes of any registered type."""
    doc = from_json_bytes(data, what=what)
    if not isinstance(doc, dict) or "type" not in doc or "format" not in doc:
        raise InvalidInputError(f"{what} is not a gradpipe manifest")
    version = doc.pop("format")
    if not isinstance(version, int) or version > FORMAT_VERSION:
        raise UnsupportedFormatError(
            f"{what} has format {version!r}, newer than this gradpipe reads "
            f"({FORMAT_VERSION}); upgrade gradpipe"
        )
    kind = doc.pop("type")
    try:
        parse = _TYPES[kind]
    except KeyError:
        raise UnsupportedFormatError(
            f"{what} has unknown type {kind!r}; it was written by a newer gradpipe"
        ) from None
    try:
        return parse(doc)
    except (KeyError, TypeError, ValueError) as exc:
        raise InvalidInputError(f"{what} of type {kind!r} is malformed: {exc!r}") from None


@register_manifest
@dataclass(frozen=True)
class TensorManifest:
    """A stored tensor: dtype, shape, chunk grid, one block id per chunk, chunk stats.

    ``blocks[i]`` is ``None`` for a chunk whose bytes are all zero: it takes no block.
    """

    type: ClassVar[str] = "tensor"

    dtype: str
    shape: tuple[int, ...]
    chunk_shape: tuple[int, ...]
    blocks: tuple[str | None, ...]
    stats: tuple[ChunkStats, ...]

    def __post_init__(self) -> None:
        parse_dtype(self.dtype)
        if any(n < 0 for n in self.shape):
            raise InvalidInputError(f"negative dimension in shape {self.shape}")
        parse_chunk_shape(self.shape, self.chunk_shape)
        n = chunk_count(self.shape, self.chunk_shape)
        if len(self.blocks) != n or len(self.stats) != n:
            raise InvalidInputError(
                f"tensor of shape {self.shape} in chunks {self.chunk_shape} has {n} chunks, "
                f"manifest lists {len(self.blocks)} blocks and {len(self.stats)} stats"
            )

    @property
    def size(self) -> int:
        """Number of elements."""
        return math.prod(self.shape)

    @property
    def nbytes(self) -> int:
        """Logical (uncompressed) size in bytes."""
        return self.size * parse_dtype(self.dtype).itemsize

    def chunk_ranges(self) -> list[tuple[int, int]]:
        """Flat element range of every chunk."""
        return list(chunk_ranges(self.shape, self.chunk_shape))

    def summary(self) -> ChunkStats:
        """Statistics of the whole tensor, merged from the chunks."""
        return merge_stats(self.stats)

    def manifest_children(self) -> Iterator[str]:
        return iter(())

    def data_children(self) -> Iterator[str]:
        return (b for b in self.blocks if b is not None)

    def to_dict(self) -> dict[str, Any]:
        columns: dict[str, list[Any]] = {"block": list(self.blocks)}
        for record in self.stats:
            for key, value in record.to_dict().items():
                columns.setdefault(key, []).append(value)
        return {
            "dtype": self.dtype,
            "shape": list(self.shape),
            "chunk_shape": list(self.chunk_shape),
            "chunks": columns,
        }

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> TensorManifest:
        shape = tuple(int(n) for n in data["shape"])
        chunk_shape = tuple(int(n) for n in data["chunk_shape"])
        columns = data["chunks"]
        blocks = tuple(None if b is None else parse_id(b) for b in columns["block"])
        counts = [stop - start for start, stop in chunk_ranges(shape, chunk_shape)]
        keys = [k for k in columns if k != "block"]
        stats = tuple(
            ChunkStats.from_dict({k: columns[k][i] for k in keys}, count=count)
            for i, count in enumerate(counts)
        )
        return cls(data["dtype"], shape, chunk_shape, blocks, stats)


@register_manifest
@dataclass(frozen=True)
class RefEntry:
    """One state of a ref: what it points at, and the entry it replaced.

    Entries chain through ``previous`` into the ref's history (its reflog).
    ``write_id`` is unique per attempted update, so a writer whose response was
    lost can tell its own landed write from someone else's.
    """

    type: ClassVar[str] = "ref"

    ref: str
    target: str | None
    previous: str | None
    time: str
    write_id: str
    message: str = ""
    meta: dict[str, str] = field(default_factory=dict)

    def __post_init__(self) -> None:
        parse_ref_name(self.ref)
        if self.target is not None:
            parse_id(self.target)
        if self.previous is not None:
            parse_id(self.previous)

    def manifest_children(self) -> Iterator[str]:
        # The history chain is kept; old targets are not roots (see docs on gc).
        return iter(() if self.previous is None else (self.previous,))

    def data_children(self) -> Iterator[str]:
        return iter(())

    def to_dict(self) -> dict[str, Any]:
        return {
            "ref": self.ref,
            "target": self.target,
            "previous": self.previous,
            "time": self.time,
            "write_id": self.write_id,
            "message": self.message,
            "meta": dict(self.meta),
        }

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> RefEntry:
        return cls(
            ref=data["ref"],
            target=data["target"],
            previous=data["previous"],
            time=data["time"],
            write_id=data["write_id"],
            message=data.get("message", ""),
            meta={str(k): str(v) for k, v in data.get("meta", {}).items()},
        )
