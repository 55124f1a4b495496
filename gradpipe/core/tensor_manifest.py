"""The manifest of a stored tensor: dtype, shape, chunk grid, one block per chunk, stats.

Small chunks live inside the manifest (icechunk inlines small chunks the same
way): their encoded block frame is kept in ``inline`` instead of an object of
its own, so a bias vector costs no file. The chunk keeps its block id (the
hash of its logical bytes), and every read checks the frame against it.

A tensor written as a version of another lists, per chunk stored as a delta,
the chain of delta blocks down to a keyframe (format 3, see
:mod:`gradpipe.core.chain`); such a chunk has no block of its own id.

A tensor written with a lossy codec records it in ``lossy`` (format 4, see
:mod:`gradpipe.core.lossy`): the codec, its stated bound and the error
measured at write time. Its chunks' ids are the hashes of the values a read
gives back (the decoded ones), so they are never the ids of the original
values unless the codec kept those exactly; its stats are of the stored values.

A tensor of a snapshot version written with optimizer replay lists, per chunk
stored against a prediction, its :class:`~gradpipe.core.chain.ReplayLink`
(format 5, docs/design/016). Such a tensor is not *self-contained*: only the
snapshot reader can rebuild those chunks, and every other reader refuses it
(:func:`require_self_contained`).
"""

from __future__ import annotations

import base64
import binascii
import math
import threading
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from functools import lru_cache
from typing import Any, ClassVar

from gradpipe.core.chain import ChainInfo, DeltaLink, ReplayLink
from gradpipe.core.chunk_stats import ChunkStats, merge_stats, stats_from_columns
from gradpipe.core.chunking import chunk_count, chunk_ranges, parse_chunk_shape, parse_shape
from gradpipe.core.display import printable, printable_error
from gradpipe.core.dtypes import parse_dtype
from gradpipe.core.ids import parse_id
from gradpipe.core.lossy import LossyInfo
from gradpipe.core.manifest import Manifest
from gradpipe.errors import IntegrityError, InvalidInputError

__all__ = [
    "EmbeddedTensors",
    "LazyTensors",
    "TensorManifest",
    "TensorRef",
    "embedded_tensor",
    "require_self_contained",
    "resolve_tensor",
]


@dataclass(frozen=True)
class TensorManifest(Manifest):
    """A stored tensor: dtype, shape, chunk grid, one block id per chunk, chunk stats.

    ``blocks[i]`` is ``None`` for a chunk whose bytes are all zero: it takes no block.
    ``inline[i]``, where present, is chunk ``i``'s encoded block frame, kept here
    instead of as an object of its own (format 2). ``deltas[i]``, where
    present, is chunk ``i``'s chain of deltas, nearest first (format 3);
    ``chain`` says how this version was chained and what that saved.
    ``lossy`` says which lossy codec stored it and with what error (format 4).
    ``replays[i]``, where present, is chunk ``i``'s residual against an
    optimizer replay (format 5); ``blocks[i]`` stays the chunk's logical id.
    """

    type: ClassVar[str] = "tensor"

    dtype: str
    shape: tuple[int, ...]
    chunk_shape: tuple[int, ...]
    blocks: tuple[str | None, ...]
    stats: tuple[ChunkStats, ...]
    inline: Mapping[int, bytes] = field(default_factory=dict)
    deltas: Mapping[int, tuple[DeltaLink, ...]] = field(default_factory=dict)
    chain: ChainInfo | None = None
    lossy: LossyInfo | None = None
    replays: Mapping[int, ReplayLink] = field(default_factory=dict)

    def __post_init__(self) -> None:
        n = _grid_size(self.dtype, self.shape, self.chunk_shape)
        if len(self.blocks) != n or len(self.stats) != n:
            raise InvalidInputError(
                f"tensor of shape {self.shape} in chunks {self.chunk_shape} has {n} chunks, "
                f"manifest lists {len(self.blocks)} blocks and {len(self.stats)} stats"
            )
        for index, frame in self.inline.items():
            if not 0 <= index < n or self.blocks[index] is None:
                raise InvalidInputError(
                    f"inline frame for chunk {index}, which has no block (of {n} chunks)"
                )
            if not isinstance(frame, bytes):
                raise InvalidInputError(f"inline frame of chunk {index} is not bytes")
        for index, links in self.deltas.items():
            if not 0 <= index < n or self.blocks[index] is None or index in self.inline:
                raise InvalidInputError(
                    f"delta chain for chunk {index}, which has no block or is inline "
                    f"(of {n} chunks)"
                )
            if not links:
                raise InvalidInputError(f"chunk {index} lists an empty delta chain")
        for index in self.replays:
            if (
                not 0 <= index < n
                or self.blocks[index] is None
                or index in self.inline
                or index in self.deltas
            ):
                raise InvalidInputError(
                    f"replay link for chunk {index}, which has no block, is inline or is a "
                    f"delta (of {n} chunks)"
                )
        if self.replays and (self.chain is None or len(self.chain.replay_depths) != n):
            raise InvalidInputError("a tensor with replay links lists no replay depths")
        if self.chain is not None and len(self.chain.stored) != n:
            raise InvalidInputError(
                f"chain info lists {len(self.chain.stored)} chunks, the tensor has {n}"
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

    @property
    def exact(self) -> bool:
        """Whether reads give back the values that were written, bit for bit.

        False for a tensor stored with a lossy codec and for a version with
        lossy (sparse) deltas; :attr:`max_abs_error` then says how far off.
        """
        return self.lossy is None and not (self.chain is not None and self.chain.lossy)

    @property
    def max_abs_error(self) -> float:
        """The largest error a lossy write measured (0.0 when exact)."""
        errors = [0.0]
        if self.lossy is not None:
            errors.append(self.lossy.max_abs_error)
        if self.chain is not None:
            errors.append(self.chain.max_abs_error)
        return max(errors)

    @property
    def depth(self) -> int:
        """The longest delta chain of any chunk (0: every chunk is stored in full)."""
        return max((len(links) for links in self.deltas.values()), default=0)

    @property
    def age(self) -> int:
        """Versions since the oldest keyframe any chunk's delta uses (0: none)."""
        if self.chain is not None and self.chain.ages:
            return max(self.chain.ages)
        return self.depth

    @property
    def self_contained(self) -> bool:
        """Whether every chunk can be read from its own blocks (no optimizer replay)."""
        return not self.replays

    @property
    def replay_depth(self) -> int:
        """The most optimizer replays a read of one chunk makes (0: none)."""
        if self.chain is None or not self.chain.replay_depths:
            return 0
        return max(self.chain.replay_depths)

    def format_needed(self) -> int:
        if self.replays:
            return 5
        if self.lossy is not None:
            return 4
        if self.deltas or self.chain is not None:
            return 3
        return 2 if self.inline else 1

    def data_children(self) -> Iterator[str]:
        for i, block in enumerate(self.blocks):
            links = self.deltas.get(i)
            replayed = self.replays.get(i)
            if links:  # the chunk is its chain: delta blocks and the keyframe, no block of its own
                yield from (link.block for link in links)
                yield links[-1].base
            elif replayed is not None:  # its residual; the prediction is no block
                if replayed.block is not None:
                    yield replayed.block
            elif block is not None and i not in self.inline:
                yield block

    def inline_frames(self) -> Iterator[tuple[str, bytes, str]]:
        return (
            (block, frame, f"chunk {i}")
            for i, frame in sorted(self.inline.items())
            if (block := self.blocks[i]) is not None
        )

    def to_dict(self) -> dict[str, Any]:
        columns: dict[str, list[Any]] = {"block": list(self.blocks)}
        for record in self.stats:
            for key, value in record.to_dict().items():
                columns.setdefault(key, []).append(value)
        out: dict[str, Any] = {
            "dtype": self.dtype,
            "shape": list(self.shape),
            "chunk_shape": list(self.chunk_shape),
            "chunks": columns,
        }
        if self.deltas:
            columns["delta"] = [
                [link.to_list() for link in self.deltas[i]] if i in self.deltas else None
                for i in range(len(self.blocks))
            ]
        if self.replays:
            columns["replay"] = [
                self.replays[i].to_list() if i in self.replays else None
                for i in range(len(self.blocks))
            ]
        if self.chain is not None:
            out["chain"] = self.chain.to_dict()
        if self.lossy is not None:
            out["lossy"] = self.lossy.to_dict()
        if self.inline:
            out["inline"] = {
                str(i): base64.b64encode(frame).decode("ascii")
                for i, frame in sorted(self.inline.items())
            }
        return out

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> TensorManifest:
        shape = tuple(int(n) for n in data["shape"])
        chunk_shape = tuple(int(n) for n in data["chunk_shape"])
        columns = data["chunks"]
        blocks = tuple(None if b is None else parse_id(b) for b in columns["block"])
        counts = _chunk_counts(shape, chunk_shape)
        stats = stats_from_columns(columns, counts)
        inline = {}
        for index, text in data.get("inline", {}).items():
            if not (isinstance(index, str) and index.isdigit() and str(int(index)) == index):
                raise ValueError(f"inline chunk key {printable(index)} is not a chunk number")
            try:
                inline[int(index)] = base64.b64decode(text, validate=True)
            except (binascii.Error, TypeError) as exc:
                raise ValueError(f"inline frame of chunk {index} is not base64: {exc}") from None
        deltas = {
            i: tuple(DeltaLink.from_list(link) for link in links)
            for i, links in enumerate(columns.get("delta") or ())
            if links is not None
        }
        replays = {
            i: ReplayLink.from_list(link)
            for i, link in enumerate(columns.get("replay") or ())
            if link is not None
        }
        chain = ChainInfo.from_dict(data["chain"]) if "chain" in data else None
        lossy = LossyInfo.from_dict(data["lossy"]) if "lossy" in data else None
        return cls(
            data["dtype"], shape, chunk_shape, blocks, stats, inline, deltas, chain, lossy, replays
        )


def require_self_contained(manifest: TensorManifest, where: str) -> None:
    """Refuse a tensor with optimizer-replay chunks: only its snapshot can rebuild them."""
    if manifest.replays:
        first = min(manifest.replays)
        raise InvalidInputError(
            f"{where}: chunk {first} is stored as an optimizer replay of its snapshot's "
            "previous version; read it through the snapshot (gp.restore, gradpipe restore)"
        )


# A run holds thousands of tensors of a few dozen (dtype, shape, chunk shape)
# grids: validating and measuring each grid once makes reading manifests
# (opening a run as a dataset reads every dump's) several times faster.
@lru_cache(maxsize=4096)
def _grid_size(dtype: str, shape: tuple[int, ...], chunk_shape: tuple[int, ...]) -> int:
    """The number of chunks of a valid grid (raises for an invalid one)."""
    parse_shape(shape, parse_dtype(dtype).itemsize, where=f"{dtype} tensor")
    parse_chunk_shape(shape, chunk_shape)
    return chunk_count(shape, chunk_shape)


@lru_cache(maxsize=4096)
def _chunk_counts(shape: tuple[int, ...], chunk_shape: tuple[int, ...]) -> tuple[int, ...]:
    """Elements per chunk, in chunk order."""
    return tuple(stop - start for start, stop in chunk_ranges(shape, chunk_shape))


_DECODING = threading.Lock()


class TensorRef:
    """A tensor manifest kept inside a stored manifest, not decoded yet (docs/design/014).

    Its grid (``dtype``, ``shape``, ``chunk_shape``) is read from the stored
    JSON at once; the rest (chunk ids, statistics, inline frames: nearly all
    of the decoding cost) when :meth:`manifest` is first called. Opening a run
    of many dumps as a dataset needs the grids of every tensor of every dump
    but the chunks of only those it reads.
    """

    __slots__ = ("_decoded", "_raw", "chunk_shape", "dtype", "shape", "tensor_id")

    def __init__(self, tensor_id: str, raw: Mapping[str, Any]) -> None:
        self.tensor_id = tensor_id
        self._raw: Mapping[str, Any] | None = raw
        self._decoded: TensorManifest | None = None
        dtype = raw["dtype"]
        if not isinstance(dtype, str):
            raise TypeError(f"tensor {tensor_id} has a dtype of type {type(dtype).__name__}")
        self.dtype: str = dtype
        self.shape: tuple[int, ...] = _ints(raw["shape"], "shape", tensor_id)
        self.chunk_shape: tuple[int, ...] = _ints(raw["chunk_shape"], "chunk shape", tensor_id)
        _grid_size(dtype, self.shape, self.chunk_shape)  # a valid grid (checked once per grid)

    def manifest(self) -> TensorManifest:
        """The decoded manifest (decoded once; raises IntegrityError if malformed)."""
        decoded = self._decoded
        if decoded is not None:
            return decoded
        # One decoder at a time: the chunks of one tensor are read by concurrent dask
        # tasks, and decoding holds the GIL anyway, so the lock costs no parallelism.
        with _DECODING:
            decoded = self._decoded
            if decoded is None:
                try:
                    decoded = TensorManifest.from_dict(dict(self._raw or {}))
                except (KeyError, TypeError, ValueError, AttributeError) as exc:
                    raise IntegrityError(
                        f"tensor {self.tensor_id}, kept in a stored manifest, is malformed: "
                        f"{printable_error(exc)}"
                    ) from None
                # The stored form goes: a dataset that read a tensor holds it once.
                self._decoded, self._raw = decoded, None
        return decoded

    def chunk_stats(self) -> tuple[ChunkStats, ...]:
        """Each chunk's statistics, decoded from the stats columns alone.

        What ``manifest().stats`` holds, without decoding block ids, deltas or
        inline frames (most of the cost) and without keeping a decoded manifest:
        a pass over the norms of a long run reads nothing else.
        """
        decoded = self._decoded
        if decoded is not None:
            return decoded.stats
        with _DECODING:
            raw = self._raw
        if raw is None:
            return self.manifest().stats
        try:
            return stats_from_columns(raw["chunks"], _chunk_counts(self.shape, self.chunk_shape))
        except (KeyError, TypeError, ValueError, AttributeError) as exc:
            raise IntegrityError(
                f"tensor {self.tensor_id}, kept in a stored manifest, has malformed chunk "
                f"statistics: {printable_error(exc)}"
            ) from None

    def __reduce__(self) -> tuple[Any, ...]:
        with _DECODING:
            raw = self._raw
        if raw is None:
            raw = self.manifest().to_dict()
        return (TensorRef, (self.tensor_id, raw))  # the stored form travels, not the decoding

    def __repr__(self) -> str:
        return f"TensorRef({self.tensor_id!r}, {self.dtype}, shape={self.shape})"


def _ints(value: Any, what: str, tensor_id: str) -> tuple[int, ...]:
    """A stored list of ints as a tuple (not bools, not floats that equal ints)."""
    if type(value) is not list or not all(type(n) is int for n in value):
        raise TypeError(f"tensor {tensor_id} has a malformed {what} {printable(value)}")
    return tuple(value)


class LazyTensors(Mapping[str, TensorManifest]):
    """The tensor manifests embedded in a stored manifest, each decoded on first access.

    What :meth:`from_dict` of a dump, aggregate or snapshot builds: reading a
    manifest costs its JSON and one :class:`TensorRef` per tensor; looking a
    tensor up decodes it (once). Membership, iteration and :meth:`ref` decode
    nothing.
    """

    __slots__ = ("refs",)

    def __init__(self, raw: Mapping[str, Any]) -> None:
        if not isinstance(raw, Mapping):
            raise TypeError("embedded tensors are not an object")
        # The ids need no check here: every container checks that its embedded
        # tensors are among the (checked) ids it lists.
        self.refs: dict[str, TensorRef] = {t: TensorRef(t, m) for t, m in raw.items()}

    def __getitem__(self, tensor_id: str) -> TensorManifest:
        return self.refs[tensor_id].manifest()

    def __contains__(self, tensor_id: object) -> bool:
        return tensor_id in self.refs

    def __iter__(self) -> Iterator[str]:
        return iter(self.refs)

    def __len__(self) -> int:
        return len(self.refs)

    def ref(self, tensor_id: str) -> TensorRef | None:
        """Tensor ``tensor_id``'s grid and a way to decode it, or None if not embedded."""
        return self.refs.get(tensor_id)

    def __repr__(self) -> str:
        return f"LazyTensors({len(self.refs)} tensors)"


def embedded_tensor(
    embedded: Mapping[str, TensorManifest], tensor_id: str
) -> TensorManifest | TensorRef | None:
    """An embedded tensor without decoding it where that can wait (None if not embedded)."""
    if isinstance(embedded, LazyTensors):
        return embedded.ref(tensor_id)
    return embedded.get(tensor_id)


def resolve_tensor(tensor: TensorManifest | TensorRef) -> TensorManifest:
    """The decoded manifest of what :func:`embedded_tensor` gave."""
    return tensor.manifest() if isinstance(tensor, TensorRef) else tensor


class EmbeddedTensors:
    """What a manifest that keeps tensor manifests inside itself (``embedded``) links to.

    A dump or a snapshot embeds its tensors' manifests (format 2): their data
    blocks and inline chunks are the container's, for gc and verify alike.
    Mixed in before :class:`~gradpipe.core.manifest.Manifest`.
    """

    embedded: Mapping[str, TensorManifest]

    def data_children(self) -> Iterator[str]:
        for manifest in self.embedded.values():
            yield from manifest.data_children()

    def embedded_manifests(self) -> Iterator[tuple[str, Manifest]]:
        return iter(self.embedded.items())

    def inline_frames(self) -> Iterator[tuple[str, bytes, str]]:
        for tensor_id, manifest in self.embedded.items():
            for block, frame, where in manifest.inline_frames():
                yield block, frame, f"tensor {tensor_id}, {where}"
