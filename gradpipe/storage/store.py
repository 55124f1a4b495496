"""The content-addressed store: blocks, manifests, tensors and refs over fsspec."""

from __future__ import annotations

import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any, Final, Literal, TypeVar

import numpy as np
import numpy.typing as npt
from numcodecs.abc import Codec

import gradpipe.core.runs  # noqa: F401 - registers the run and dump manifests
from gradpipe.codecs import choose_codec
from gradpipe.config import get_bytes, get_seconds, get_setting
from gradpipe.core.chunking import choose_chunk_shape, chunk_ranges
from gradpipe.core.dtypes import canonical_dtype, dtype_name, parse_dtype
from gradpipe.core.encoding import from_json_bytes, to_json_bytes
from gradpipe.core.ids import block_key, hash_bytes, parse_id
from gradpipe.core.manifest import Manifest, TensorManifest, decode_manifest, encode_manifest
from gradpipe.core.stats import ChunkStats, bit_nonzero, chunk_stats
from gradpipe.errors import (
    IntegrityError,
    InvalidInputError,
    NotFoundError,
    ReadOnlyError,
    UnsupportedFormatError,
)
from gradpipe.storage._backend import Backend
from gradpipe.storage.blocks import decode_block, encode_block
from gradpipe.storage.refs import Refs

__all__ = ["MARKER_KEY", "STORE_FORMAT", "Mode", "Store", "WriteStats"]

Mode = Literal["r", "a", "w", "w-"]
#: The key whose presence makes a directory or prefix a gradpipe store.
MARKER_KEY: Final = "gradpipe.json"
#: Store layout version this gradpipe writes and the newest it reads.
STORE_FORMAT: Final = 1
# Manifests smaller than this are stored uncompressed (readable with `cat`).
_COMPRESS_MANIFEST_BYTES: Final = 4096
# Blocks encoded and written per batched round trip (one existence check, then
# concurrent writes on S3): by count for small blocks, by bytes for large ones.
_WRITE_WINDOW: Final = 64
_WRITE_WINDOW_BYTES: Final = 64 * 2**20

M = TypeVar("M")


@dataclass(frozen=True, slots=True)
class _BlockToWrite:
    block_id: str
    data: Any  # logical bytes: bytes or a 1-D array
    codecs: Sequence[Codec] | None  # None: the policy chooses
    nonzero: int | None  # elements with non-zero bits, if known


@dataclass
class WriteStats:
    """What a store's writes did, for reports (mutable, accumulates)."""

    blocks_written: int = 0
    blocks_reused: int = 0
    zero_chunks: int = 0
    logical_bytes: int = 0
    stored_bytes: int = 0

    def add(self, other: WriteStats) -> None:
        """Accumulate ``other`` into this one."""
        for name in self.__dataclass_fields__:
            setattr(self, name, getattr(self, name) + getattr(other, name))


class Store:
    """A gradpipe store; open one with :func:`gradpipe.open_store`.

    It pickles as its URL, mode and storage options: a Dask worker that
    receives it opens its own connection.
    """

    def __init__(
        self,
        backend: Backend,
        *,
        mode: Mode,
        url: str,
        storage_options: dict[str, Any] | None = None,
    ) -> None:
        self.backend = backend
        self.mode = mode
        self.url = url
        self.storage_options = dict(storage_options or {})
        self.refs = Refs(self)
        self.write_stats = WriteStats()

    def __repr__(self) -> str:
        return f"<gradpipe.Store {self.url!r} mode={self.mode!r}>"

    def __reduce__(self) -> tuple[Any, ...]:
        from gradpipe.storage.open import reopen_store

        return (reopen_store, (self.url, self.mode, self.storage_options))

    @property
    def writable(self) -> bool:
        """True unless opened with ``mode="r"``."""
        return self.mode != "r"

    def check_writable(self) -> None:
        """Raise :class:`ReadOnlyError` on a read-only store."""
        if not self.writable:
            raise ReadOnlyError(f"store {self.url} is open read-only; open it with mode='a'")

    # --- blocks -----------------------------------------------------------------
    def has_blocks(self, ids: Sequence[str]) -> list[bool]:
        """Whether each block exists (one batched round trip where the backend allows)."""
        return [m is not None for m in self.backend.mtimes([block_key(i) for i in ids])]

    def put_raw(self, data: bytes, codecs: Sequence[Codec] = ()) -> str:
        """Store logical bytes as one block; returns its id."""
        self.check_writable()
        block_id = hash_bytes(data)
        self._write_blocks([_BlockToWrite(block_id, data, codecs, None)], self.write_stats)
        return block_id

    def _write_blocks(self, items: Sequence[_BlockToWrite], stats: WriteStats) -> None:
        """Write blocks that may exist already.

        Existing blocks are not re-encoded. An existing block older than
        ``storage.touch-after`` gets a fresh time so a concurrent gc, which
        only deletes old unreferenced blocks, cannot take it from under us.
        """
        keys = [block_key(item.block_id) for item in items]
        mtimes = self.backend.mtimes(keys)
        stale = time.time() - get_seconds("storage.touch-after")
        todo: list[tuple[str, bytes]] = []
        level = int(get_setting("codec-level"))
        seen: set[str] = set()
        for item, key, mtime in zip(items, keys, mtimes, strict=True):
            if key in seen:  # the same content twice in one batch
                stats.blocks_reused += 1
                continue
            seen.add(key)
            if mtime is not None and (mtime >= stale or self._touch(key)):
                stats.blocks_reused += 1
                continue
            if item.codecs is None:
                chain = (choose_codec(item.data, item.nonzero, level=level),)
                frame = encode_block(item.data, chain)
            else:
                frame = encode_block(item.data, item.codecs)
                # A block's id promises its logical bytes: a caller's codec chain
                # that does not give them back (a lossy one) must not be stored.
                try:
                    decode_block(frame, item.block_id)
                except IntegrityError:
                    names = ", ".join(c.codec_id for c in item.codecs)
                    raise InvalidInputError(
                        f"codec chain [{names}] does not round-trip this data bit-exactly; "
                        "the store keeps data lossless, choose lossless codecs"
                    ) from None
            todo.append((key, frame))
        created = self.backend.write_many_if_absent(todo)
        for (_, frame), new in zip(todo, created, strict=True):
            if new:
                stats.blocks_written += 1
                stats.stored_bytes += len(frame)
            else:
                stats.blocks_reused += 1

    def _touch(self, key: str) -> bool:
        """Refresh an existing block's time; False if gc removed it meanwhile."""
        try:
            self.backend.touch(key)
        except NotFoundError:
            return False
        return True

    def get_raw(self, block_id: str, *, context: str = "") -> memoryview:
        """The logical bytes of a block, checked against its id."""
        frame = self._read_frame(block_id, context)
        return decode_block(frame, block_id, context=context)

    def read_chunk(self, block_id: str, out: np.ndarray, *, context: str = "") -> None:
        """Decode one block into ``out`` (a contiguous array of its logical size), checked."""
        decode_block(self._read_frame(block_id, context), block_id, out=out, context=context)

    def _read_frame(self, block_id: str, context: str) -> bytes:
        try:
            return self.backend.read(block_key(block_id))
        except NotFoundError:
            where = f" ({context})" if context else ""
            raise NotFoundError(
                f"block {block_id}{where} is missing from store {self.url}; "
                "run `gradpipe verify` to see what else is affected"
            ) from None

    # --- manifests --------------------------------------------------------------
    def put_manifest(self, manifest: Manifest) -> str:
        """Store a manifest; returns its id."""
        [manifest_id] = self.put_manifests([manifest])
        return manifest_id

    def put_manifests(
        self, manifests: Sequence[Manifest], *, stats: WriteStats | None = None
    ) -> list[str]:
        """Store several manifests in one batched round trip; returns their ids."""
        self.check_writable()
        items = []
        for manifest in manifests:
            data = encode_manifest(manifest)
            codecs = () if len(data) < _COMPRESS_MANIFEST_BYTES else (_manifest_codec(),)
            items.append(_BlockToWrite(hash_bytes(data), data, codecs, None))
        for lo in range(0, len(items), _WRITE_WINDOW):
            self._write_blocks(items[lo : lo + _WRITE_WINDOW], stats or self.write_stats)
        return [item.block_id for item in items]

    def get_manifest(self, manifest_id: str, *, context: str = "") -> Manifest:
        """Read and check a manifest of any type."""
        data = self.get_raw(parse_id(manifest_id), context=context)
        what = f"manifest {manifest_id}" + (f" ({context})" if context else "")
        return decode_manifest(bytes(data), what=what)

    def get_manifests(self, manifest_ids: Sequence[str], *, context: str = "") -> list[Manifest]:
        """Read and check several manifests in one batched round trip."""
        frames = self.backend.read_many([block_key(parse_id(i)) for i in manifest_ids])
        out = []
        for manifest_id, frame in zip(manifest_ids, frames, strict=True):
            if isinstance(frame, Exception):
                out.append(self.get_manifest(manifest_id, context=context))  # the precise error
                continue
            what = f"manifest {manifest_id}" + (f" ({context})" if context else "")
            data = decode_block(frame, manifest_id, context=context)
            out.append(decode_manifest(bytes(data), what=what))
        return out

    def _get_typed(self, manifest_id: str, cls: type[M], context: str) -> M:
        manifest = self.get_manifest(manifest_id, context=context)
        if not isinstance(manifest, cls):
            raise InvalidInputError(
                f"{manifest_id} is a {type(manifest).type} manifest, not a {cls.type}"  # type: ignore[attr-defined]
            )
        return manifest

    # --- tensors ----------------------------------------------------------------
    def put_tensor(
        self,
        array: npt.ArrayLike,
        *,
        chunk_bytes: int | None = None,
        codecs: Sequence[Codec] | None = None,
    ) -> str:
        """Store a tensor bit-exactly; returns its id.

        Parameters
        ----------
        array : array_like
            Any shape (0-d and empty included) of a gradpipe dtype: bool,
            (u)int8-64, float16, bfloat16, float32, float64.
        chunk_bytes : int, optional
            Target raw bytes per chunk (default ``gradpipe.chunk-bytes``).
        codecs : sequence of numcodecs codecs, optional
            A fixed codec chain for every chunk; by default each chunk gets
            the lossless codec that suits it (sparse or byte-grouped dense).

        Examples
        --------
        >>> import numpy as np, tempfile, gradpipe as gp
        >>> store = gp.open_store(tempfile.mkdtemp(), mode="w")
        >>> tid = store.put_tensor(np.arange(6, dtype="float32").reshape(2, 3))
        >>> store.get_tensor(tid)
        array([[0., 1., 2.],
               [3., 4., 5.]], dtype=float32)
        """
        self.check_writable()
        manifest = self.write_tensor(np.asarray(array), chunk_bytes=chunk_bytes, codecs=codecs)
        return self.put_manifest(manifest)

    def write_tensor(
        self,
        array: np.ndarray,
        *,
        chunk_bytes: int | None = None,
        codecs: Sequence[Codec] | None = None,
    ) -> TensorManifest:
        """Write the chunks of ``array`` and return its (not yet stored) manifest."""
        dtype = canonical_dtype(array.dtype)
        flat = np.ascontiguousarray(array, dtype=dtype).reshape(-1)
        target = chunk_bytes if chunk_bytes is not None else get_bytes("chunk-bytes")
        chunk_shape = choose_chunk_shape(array.shape, dtype.itemsize, target)
        chunks = (flat[start:stop] for start, stop in chunk_ranges(array.shape, chunk_shape))
        records = self.write_chunks(chunks, codecs=codecs, stats=self.write_stats)
        return TensorManifest(
            dtype_name(dtype),
            array.shape,
            chunk_shape,
            tuple(block for block, _ in records),
            tuple(stat for _, stat in records),
        )

    def write_chunks(
        self,
        chunks: Iterable[np.ndarray],
        *,
        codecs: Sequence[Codec] | None = None,
        stats: WriteStats | None = None,
    ) -> list[tuple[str | None, ChunkStats]]:
        """Write 1-D chunks (canonical little-endian); per chunk, its block id and stats.

        All-zero chunks take no block (id None). ``codecs=None`` lets the
        policy choose a lossless codec per chunk. Counts go to ``stats``.
        """
        self.check_writable()
        stats = stats if stats is not None else WriteStats()
        records: list[tuple[str | None, ChunkStats]] = []
        window: list[_BlockToWrite] = []
        window_bytes = 0
        for chunk in chunks:
            nonzero = bit_nonzero(chunk)
            records.append((None, chunk_stats(chunk, bits_nonzero=nonzero)))
            stats.logical_bytes += chunk.nbytes
            if nonzero == 0:
                stats.zero_chunks += 1  # all-zero bytes: no block at all
                continue
            block_id = hash_bytes(chunk.view(np.uint8))
            records[-1] = (block_id, records[-1][1])
            window.append(_BlockToWrite(block_id, chunk, codecs, nonzero))
            window_bytes += chunk.nbytes
            if len(window) >= _WRITE_WINDOW or window_bytes >= _WRITE_WINDOW_BYTES:
                self._write_blocks(window, stats)
                window, window_bytes = [], 0
        if window:
            self._write_blocks(window, stats)
        return records

    def tensor_info(self, tensor_id: str) -> TensorManifest:
        """The manifest of a stored tensor (dtype, shape, chunks, stats); reads no data."""
        return self._get_typed(tensor_id, TensorManifest, context="tensor")

    def get_tensor(self, tensor_id: str) -> np.ndarray:
        """Read a stored tensor, bit-exact, checking every block against its id."""
        manifest = self.tensor_info(tensor_id)
        return self.read_tensor(manifest, context=f"tensor {tensor_id}")

    def read_tensor(self, manifest: TensorManifest, *, context: str = "") -> np.ndarray:
        """Read the tensor a manifest describes."""
        dtype = parse_dtype(manifest.dtype)
        out = np.zeros(manifest.size, dtype=dtype)
        ranges = manifest.chunk_ranges()
        wanted = [(i, b) for i, b in enumerate(manifest.blocks) if b is not None]
        for lo in range(0, len(wanted), _WRITE_WINDOW):
            batch = wanted[lo : lo + _WRITE_WINDOW]
            frames = self.backend.read_many([block_key(b) for _, b in batch])
            for (i, block_id), frame in zip(batch, frames, strict=True):
                where = f"{context}, chunk {i}" if context else f"chunk {i}"
                if isinstance(frame, NotFoundError):
                    self._read_frame(block_id, where)  # raises the error that names the tensor
                if isinstance(frame, Exception):
                    raise frame
                start, stop = ranges[i]
                decode_block(frame, block_id, out=out[start:stop], context=where)
        return out.reshape(manifest.shape)


def _manifest_codec() -> Codec:
    from numcodecs import Zstd

    return Zstd(level=3)


def read_marker(backend: Backend) -> dict[str, Any] | None:
    """The store marker, None if there is none; checks the layout version."""
    try:
        data = backend.read(MARKER_KEY)
    except NotFoundError:
        return None
    doc = from_json_bytes(data, what=f"{backend.url}/{MARKER_KEY}")
    if not isinstance(doc, dict) or doc.get("gradpipe") != "store":
        raise InvalidInputError(f"{backend.url} has a {MARKER_KEY} that is not gradpipe's")
    version = doc.get("format")
    if not isinstance(version, int) or version > STORE_FORMAT:
        raise UnsupportedFormatError(
            f"store {backend.url} has format {version!r}, newer than this gradpipe reads "
            f"({STORE_FORMAT}); upgrade gradpipe"
        )
    return doc


def marker_bytes() -> bytes:
    """The content of a new store's marker."""
    from gradpipe._version import __version__

    return to_json_bytes(
        {
            "gradpipe": "store",
            "format": STORE_FORMAT,
            "created": datetime.now(UTC).isoformat(timespec="seconds"),
            "created_by": f"gradpipe {__version__}",
        }
    )
