"""The content-addressed store: blocks, manifests and refs over one backend.

:class:`Store` is deliberately thin: the byte layout of blocks lives in
:mod:`~gradpipe.storage.blocks`, tensors in :mod:`~gradpipe.storage.tensors`,
refs in :mod:`~gradpipe.storage.refs`, the store lock in
:mod:`~gradpipe.storage.locks` and the marker in :mod:`~gradpipe.storage.marker`.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator, Sequence
from contextlib import AbstractContextManager
from typing import Any, Final, Literal, TypeVar

import numpy as np
import numpy.typing as npt
from numcodecs.abc import Codec

from gradpipe.codecs import choose_codec
from gradpipe.config import get_seconds, get_setting
from gradpipe.core.buffers import Buffer, joined, nbytes
from gradpipe.core.display import PATH_LIMIT, printable
from gradpipe.core.ids import block_key, hash_bytes, parse_id
from gradpipe.core.manifest import Manifest, decode_manifest, encode_manifest
from gradpipe.core.names import parse_name
from gradpipe.core.tensor_manifest import TensorManifest
from gradpipe.errors import IntegrityError, InvalidInputError, NotFoundError, ReadOnlyError
from gradpipe.meter import READ, WRITE, digest_bytes
from gradpipe.storage import tensors as _tensors
from gradpipe.storage.backend import Backend
from gradpipe.storage.blocks import (
    BlockToWrite,
    Frame,
    WriteStats,
    decode_block,
    encode_block,
    encode_block_parts,
)
from gradpipe.storage.locks import Lease, StoreLock
from gradpipe.storage.marker import read_marker
from gradpipe.storage.refs import Refs
from gradpipe.storage.registry import backend_for_url

__all__ = ["Mode", "Store", "WriteStats", "reopen_store"]

#: ``"r"`` read only; ``"r+"`` read and write an existing store; ``"a"`` read and
#: write, creating the store if absent; ``"w"`` create or empty; ``"w-"`` create only.
Mode = Literal["r", "r+", "a", "w", "w-"]
# Manifests smaller than this are stored uncompressed (readable with `cat`).
_COMPRESS_MANIFEST_BYTES: Final = 4096

M = TypeVar("M", bound=Manifest)


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
        self.lock = StoreLock(self)
        self.write_stats = WriteStats()
        # Whether the next batch of blocks is expected to be mostly new (see write_blocks).
        self._expect_new = True

    def __repr__(self) -> str:
        return f"<gradpipe.Store {self.url!r} mode={self.mode!r}>"

    def _repr_html_(self) -> str:
        """The store and its named things (one listing of the refs; no data read)."""
        from gradpipe.core.html import key_values

        groups: dict[str, list[str]] = {}
        for name in self.refs.names():
            kind, _, rest = name.partition("/")
            groups.setdefault(kind, []).append(rest)
        shown = {
            k: ", ".join(sorted(v)[:12]) + (" …" if len(v) > 12 else "") for k, v in groups.items()
        }
        return key_values(f"gradpipe store {self.url}", {"mode": self.mode, **shown})

    def __reduce__(self) -> tuple[Any, ...]:
        return (reopen_store, (self.url, self.mode, self.storage_options))

    def __dask_tokenize__(self) -> object:
        # Where the data is, not how this handle was opened: a read-only and a
        # writable handle on one store name the same content (xarray puts the
        # store in the keys of the datasets it opens from it).
        return ("gradpipe.Store", self.url, self.storage_options)

    @property
    def writable(self) -> bool:
        """True unless opened with ``mode="r"``."""
        return self.mode != "r"

    def check_writable(self) -> None:
        """Raise :class:`ReadOnlyError` on a read-only store."""
        if not self.writable:
            raise ReadOnlyError(
                f"store {printable(self.url, limit=PATH_LIMIT)} is open read-only; open it with "
                "mode='a'"
            )

    def writing(self, purpose: str) -> AbstractContextManager[Lease | None]:
        """Hold a writer's lease on the store for the ``with`` block.

        Every job that writes blocks and then publishes them with a ref holds
        one from its first existence check to its last ref update, so that
        gc, which takes the store exclusively, cannot delete a block the job
        is about to reference (see ``docs/design/003-gc-safety.md``).
        Re-entrant: nested calls share the outer lease.
        """
        self.check_writable()
        return self.lock.shared(purpose)

    # --- blocks -----------------------------------------------------------------
    def has_blocks(self, ids: Sequence[str]) -> list[bool]:
        """Whether each block exists (one batched round trip where the backend allows)."""
        return [m is not None for m in self.backend.mtimes([block_key(i) for i in ids])]

    def put_raw(self, data: bytes, codecs: Sequence[Codec] = ()) -> str:
        """Store logical bytes as one block; returns its id."""
        self.check_writable()
        block_id = hash_bytes(data)
        self.write_blocks([BlockToWrite(block_id, data, codecs, None)], self.write_stats)
        return block_id

    def write_blocks(self, items: Sequence[BlockToWrite], stats: WriteStats) -> None:
        """Write blocks that may exist already; counts go to ``stats``.

        An existing block older than ``storage.touch-after`` gets a fresh
        time, so that the grace period of gc counts from its last use, not
        its first write. Two orders, by what a backend's requests cost
        (:attr:`Backend.write_first <gradpipe.storage.backend.Backend.write_first>`):

        - *check first* (local disk, and any backend while the last batch
          found most of its blocks stored): one batched existence check, then
          only the missing blocks are encoded and created; existing blocks
          are not re-encoded;
        - *write first* (S3 while blocks come out new): every block is
          encoded and created with ``If-None-Match: *`` straight away, one
          request for a new block instead of two; only the blocks the store
          answers "exists" for are then checked for their age.
        """
        unique: list[tuple[BlockToWrite, str]] = []
        seen: set[str] = set()
        for item in items:
            key = block_key(item.block_id)
            if key in seen:  # the same content twice in one batch
                stats.blocks_reused += 1
                continue
            seen.add(key)
            unique.append((item, key))
        if not unique:
            return
        if self.backend.write_first and self._expect_new:
            existing = self._write_first(unique, stats)
        else:
            existing = self._check_first(unique, stats)
        # The next batch is likely to look like this one (a run of new data, or
        # a re-ingest of stored data): choose its order from what this one found.
        self._expect_new = 2 * existing < len(unique)

    def _check_first(self, unique: Sequence[tuple[BlockToWrite, str]], stats: WriteStats) -> int:
        """Existence check, then creates of the missing blocks; returns how many existed."""
        mtimes = self.backend.mtimes([key for _, key in unique])
        stale = time.time() - get_seconds("storage.touch-after")
        level = int(get_setting("codec-level"))
        todo: list[tuple[str, Sequence[Buffer]]] = []
        existing = 0
        for (item, key), mtime in zip(unique, mtimes, strict=True):
            if mtime is not None:
                existing += 1
                if mtime >= stale or self._touch(key):
                    stats.blocks_reused += 1
                    continue
            todo.append((key, self._frame_parts(item, level)))
        self._create(todo, stats)
        return existing

    def _write_first(self, unique: Sequence[tuple[BlockToWrite, str]], stats: WriteStats) -> int:
        """Conditional creates of every block, then an age check of those that existed."""
        level = int(get_setting("codec-level"))
        todo = [(key, self.encode_block(item, level)) for item, key in unique]
        created = self.backend.write_many_if_absent(todo)
        found = [item for item, new in zip(todo, created, strict=True) if not new]
        for (_, frame), new in zip(todo, created, strict=True):
            if new:
                stats.blocks_written += 1
                stats.stored_bytes += len(frame)
                digest_bytes(WRITE, len(frame))
        if not found:
            return 0
        # A 412 says "exists", not since when: a block older than touch-after
        # must get a fresh time before anything may reference it (gc safety).
        mtimes = self.backend.mtimes([key for key, _ in found])
        stale = time.time() - get_seconds("storage.touch-after")
        again: list[tuple[str, Sequence[Buffer]]] = []
        for (key, frame), mtime in zip(found, mtimes, strict=True):
            if mtime is not None and (mtime >= stale or self._touch(key)):
                stats.blocks_reused += 1
            else:  # removed since the create said it exists
                again.append((key, (frame,)))
        self._create(again, stats)
        return len(found)

    def _create(self, todo: Sequence[tuple[str, Sequence[Buffer]]], stats: WriteStats) -> None:
        created = self.backend.write_parts_if_absent(todo)
        for (_, parts), new in zip(todo, created, strict=True):
            if new:
                size = sum(nbytes(part) for part in parts)
                stats.blocks_written += 1
                stats.stored_bytes += size
                digest_bytes(WRITE, size)
            else:
                stats.blocks_reused += 1

    def _frame_parts(self, item: BlockToWrite, level: int) -> Sequence[Buffer]:
        """The frame of a block to write in parts, which the backend writes without joining
        them where it can (the local disk: ``os.writev``)."""
        return self.encode_frame(item, level).parts

    def encode_frame(self, item: BlockToWrite, level: int | None = None) -> Frame:
        """:meth:`encode_block` as a :class:`~gradpipe.storage.blocks.Frame`: the policy's
        codec gives its parts unjoined."""
        if isinstance(item.frame, Frame):
            return item.frame
        if item.frame is None and item.codecs is None:
            if level is None:
                level = int(get_setting("codec-level"))
            codec = choose_codec(item.data, item.nonzero, level=level)
            return Frame.of(_kept_parts(encode_block_parts(item.data, (codec,)), item.data))
        return Frame.of((self.encode_block(item, level),))

    def encode_block(self, item: BlockToWrite, level: int | None = None) -> bytes | memoryview:
        """The frame of a block to write: the policy's codec, or the caller's checked chain."""
        if isinstance(item.frame, Frame):
            return item.frame.joined()
        if item.frame is not None:
            return item.frame
        if level is None:
            level = int(get_setting("codec-level"))
        if item.codecs is None:
            return encode_block(item.data, (choose_codec(item.data, item.nonzero, level=level),))
        frame = encode_block(item.data, item.codecs)
        # A block's id promises its logical bytes: a caller's codec chain that
        # does not give them back (a lossy one) must not be stored under it.
        # Lossy tensors come here with their frame made and named by the hash
        # of its decoding (storage.tensors), never through this branch.
        try:
            decode_block(frame, item.block_id)
        except IntegrityError:
            names = ", ".join(c.codec_id for c in item.codecs)
            raise InvalidInputError(
                f"codec chain [{names}] does not round-trip this data bit-exactly; "
                "raw blocks are kept lossless: choose lossless codecs, or store a tensor "
                "(put_tensor or ingest), which records a lossy codec and its error"
            ) from None
        return frame

    def _touch(self, key: str) -> bool:
        """Refresh an existing block's time; False if it was removed meanwhile."""
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

    def missing_block(self, block_id: str, context: str = "") -> NotFoundError:
        """The error for a block that is not in the store, naming what needed it."""
        where = f" ({context})" if context else ""
        return NotFoundError(
            f"block {block_id}{where} is missing from store "
            f"{printable(self.url, limit=PATH_LIMIT)}; "
            "run `gradpipe verify` to see what else is affected"
        )

    def _read_frame(self, block_id: str, context: str) -> bytes:
        try:
            frame = self.backend.read(block_key(block_id))
        except NotFoundError:
            raise self.missing_block(block_id, context) from None
        digest_bytes(READ, len(frame))
        return frame

    # --- manifests --------------------------------------------------------------
    def put_manifest(self, manifest: Manifest) -> str:
        """Store a manifest; returns its id."""
        [manifest_id] = self.put_manifests([manifest])
        return manifest_id

    def put_manifests(
        self, manifests: Sequence[Manifest], *, stats: WriteStats | None = None
    ) -> list[str]:
        """Store several manifests in one batched round trip; returns their ids.

        What a manifest links to that exists only in memory (the new shards of
        a run, :meth:`Manifest.unstored_manifests`) is stored with it, in the
        same batch: all of it before any ref can point at it.
        """
        self.check_writable()
        items = []
        ids = []
        for manifest in manifests:
            for part in (*manifest.unstored_manifests(), manifest):
                data = encode_manifest(part)
                codecs = () if len(data) < _COMPRESS_MANIFEST_BYTES else (_manifest_codec(),)
                items.append(BlockToWrite(hash_bytes(data), data, codecs, None))
            ids.append(items[-1].block_id)
        window = _tensors.WRITE_WINDOW
        for lo in range(0, len(items), window):
            self.write_blocks(items[lo : lo + window], stats or self.write_stats)
        return ids

    def get_manifest(self, manifest_id: str, *, context: str = "") -> Manifest:
        """Read and check a manifest of any type."""
        data = self.get_raw(parse_id(manifest_id), context=context)
        return decode_manifest(bytes(data), what=_what(manifest_id, context)).with_source(self)

    def get_manifests(self, manifest_ids: Sequence[str], *, context: str = "") -> list[Manifest]:
        """Read and check several manifests in one batched round trip."""
        frames = self.backend.read_many([block_key(parse_id(i)) for i in manifest_ids])
        out = []
        for manifest_id, frame in zip(manifest_ids, frames, strict=True):
            if isinstance(frame, Exception):
                out.append(self.get_manifest(manifest_id, context=context))  # the precise error
                continue
            data = decode_block(frame, manifest_id, context=context)
            manifest = decode_manifest(bytes(data), what=_what(manifest_id, context))
            out.append(manifest.with_source(self))
        return out

    def get_typed(self, manifest_id: str, cls: type[M], *, context: str = "") -> M:
        """Read a manifest that must be of type ``cls``.

        Raises :class:`IntegrityError` naming ``context`` when the id holds
        another kind of manifest (a ref moved by hand, say).
        """
        return _typed(self.get_manifest(manifest_id, context=context), manifest_id, cls, context)

    def get_typed_many(
        self, manifest_ids: Sequence[str], cls: type[M], *, context: str = ""
    ) -> list[M]:
        """:meth:`get_typed` for several ids, in one batched round trip."""
        manifests = self.get_manifests(manifest_ids, context=context)
        return [_typed(m, i, cls, context) for m, i in zip(manifests, manifest_ids, strict=True)]

    # --- tensors ----------------------------------------------------------------
    def put_tensor(
        self,
        array: npt.ArrayLike,
        *,
        name: str | None = None,
        chunk_bytes: int | None = None,
        codecs: Sequence[Codec] | None = None,
    ) -> str:
        """Store a tensor (bit-exactly, unless given a lossy codec); returns its id.

        Parameters
        ----------
        array : array_like
            Any shape (0-d and empty included) of a gradpipe dtype: bool,
            (u)int8-64, float16, bfloat16, float32, float64.
        name : str, optional
            Keep the tensor under the ref ``tensors/<name>``; a later put with
            the same name moves the ref (its history is kept). **Without a
            name nothing references the tensor**: ``gradpipe gc`` deletes its
            blocks once they are older than the grace period, and
            ``gradpipe verify`` does not check them unless given ``--all``.
        chunk_bytes : int, optional
            Target raw bytes per chunk (default ``gradpipe.chunk-bytes``).
        codecs : sequence of numcodecs codecs, optional
            A fixed codec chain for every chunk; by default each chunk gets
            the lossless codec that suits it (sparse or byte-grouped dense).
            A chain may start with one lossy codec (see
            :mod:`gradpipe.codecs.registry`, e.g. ``[make_codec("bf16")]``):
            then reads give back the decoded values, not ``array``, and the
            tensor's manifest (:meth:`tensor_info`) is marked lossy with the
            codec's bound and the measured error (``.lossy``). Integer and
            bool tensors are stored exactly whatever the chain.

        Examples
        --------
        >>> import numpy as np, tempfile, gradpipe as gp
        >>> store = gp.open_store(tempfile.mkdtemp(), mode="w")
        >>> tid = store.put_tensor(np.arange(6, dtype="float32").reshape(2, 3), name="w")
        >>> store.get_tensor(tid)
        array([[0., 1., 2.],
               [3., 4., 5.]], dtype=float32)
        >>> store.refs.get("tensors/w") == tid
        True
        """
        self.check_writable()
        if name is not None:
            parse_name(name, what="tensor name")
        where = f"tensor {printable(name)}" if name else "tensor"
        with self.writing(f"put tensor {name}" if name else "put tensor"):
            manifest = _tensors.write_tensor(
                self,
                np.asarray(array),
                chunk_bytes=chunk_bytes,
                codecs=codecs,
                stats=self.write_stats,
                where=where,
            )
            tensor_id = self.put_manifest(manifest)
            if name is not None:
                self.refs.set(f"tensors/{name}", tensor_id, message="put_tensor")
        return tensor_id

    def write_tensor(
        self,
        array: np.ndarray,
        *,
        chunk_bytes: int | None = None,
        codecs: Sequence[Codec] | None = None,
    ) -> TensorManifest:
        """Write the chunks of ``array`` and return its (not yet stored) manifest."""
        return _tensors.write_tensor(
            self, array, chunk_bytes=chunk_bytes, codecs=codecs, stats=self.write_stats
        )

    def tensor_info(self, tensor_id: str) -> TensorManifest:
        """The manifest of a stored tensor (dtype, shape, chunks, stats); reads no data.

        For tensors stored with :meth:`put_tensor`. The tensors of an ingested
        dump are kept inside the dump's manifest: read them through the dump
        (``gp.open_run(store, run).dump(step, peer).read(name)`` / ``.info(name)``).
        """
        try:
            return self.get_typed(tensor_id, TensorManifest, context="tensor")
        except NotFoundError:
            raise NotFoundError(
                f"no tensor {tensor_id} stored on its own in "
                f"{printable(self.url, limit=PATH_LIMIT)}. If it is a tensor "
                "of an ingested dump, it is kept inside the dump's manifest: read it with "
                "gp.open_run(store, run).dump(step, peer).read(name); otherwise run "
                "`gradpipe verify`"
            ) from None

    def get_tensor(self, tensor_id: str) -> np.ndarray:
        """Read a stored tensor, checking every block against its id.

        Bit-exact, unless it was stored with a lossy codec: then the values are
        the decoded ones its manifest describes (``tensor_info(id).lossy``).
        """
        manifest = self.tensor_info(tensor_id)
        return self.read_tensor(manifest, context=f"tensor {tensor_id}")

    def read_tensor(self, manifest: TensorManifest, *, context: str = "") -> np.ndarray:
        """Read the tensor a manifest describes."""
        return _tensors.read_tensor(self, manifest, context=context)

    def read_tensors(
        self, manifests: Sequence[TensorManifest], *, contexts: Sequence[str] | None = None
    ) -> list[np.ndarray]:
        """Read several tensors in one parallel pass over all their chunks."""
        return _tensors.read_tensors(self, manifests, contexts=contexts)

    def iter_tensors(
        self, manifests: Sequence[TensorManifest], *, contexts: Sequence[str] | None = None
    ) -> Iterator[np.ndarray]:
        """:meth:`read_tensors`, yielding each tensor in order as soon as it is whole."""
        return _tensors.iter_tensors(self, manifests, contexts=contexts)


def _what(manifest_id: str, context: str) -> str:
    return f"manifest {manifest_id}" + (f" ({context})" if context else "")


def _typed(manifest: Manifest, manifest_id: str, cls: type[M], context: str) -> M:
    if not isinstance(manifest, cls):
        raise IntegrityError(
            f"{_what(manifest_id, context)} is a {manifest.type} manifest where a {cls.type} "
            "was expected; a ref points at the wrong object. Run `gradpipe verify`, then move "
            "the ref back: store.refs.history(ref) lists its earlier targets, newest first, "
            "and store.refs.set(ref, target) restores one"
        )
    return manifest


def _manifest_codec() -> Codec:
    from numcodecs import Zstd

    return Zstd(level=3)


_REOPENED: dict[str, Store] = {}
_REOPENED_MAX = 64
_REOPENED_LOCK = threading.Lock()


def reopen_store(url: str, mode: Mode, storage_options: dict[str, Any] | None) -> Store:
    """Open a store received from another process: it must exist (never created or wiped).

    A Dask worker unpickles the store once per task; opening is cached per
    process so that costs one marker read, not one per task.
    """
    from dask.base import tokenize  # only where stores travel: Dask is running

    key = tokenize(url, mode == "r", storage_options)
    with _REOPENED_LOCK:
        store = _REOPENED.get(key)
        if store is None:
            if len(_REOPENED) >= _REOPENED_MAX:
                _REOPENED.pop(next(iter(_REOPENED)))
            backend = backend_for_url(url, storage_options)
            if read_marker(backend) is None:
                raise NotFoundError(f"no gradpipe store at {url} (it was sent to this process)")
            store = Store(
                backend,
                mode="r" if mode == "r" else "r+",
                url=url,
                storage_options=storage_options,
            )
            _REOPENED[key] = store
        return store


def _kept_parts(parts: Sequence[Buffer], data: Any) -> list[Buffer]:
    """``parts`` as a frame may keep them until it is written: none a view of ``data``, and
    none keeping much more memory alive than the frame is.

    The parts are written after the next chunks are encoded. A raw plane of one-byte
    values is a view of the chunk itself: a caller's array that a training thread moves on
    meanwhile must not reach a block already named by its hash, so such a part is copied.
    A raw plane of wider values is a row of the codec's planes array: where the frame
    keeps more than twice its size alive that way (the other planes compressed well),
    the parts are joined, so that writers counting their window by frame size stay
    within it (snapshots keep frames to compare before they write one).
    """
    source = _owner(data)
    kept: list[Buffer] = []
    size = held = 0
    owners: set[int] = set()
    for given in parts:
        part = given
        if not isinstance(part, bytes):  # bytes (headers, Zstandard's output) own themselves
            owner = _owner(part)
            if owner is source:
                part = bytes(part)
            elif id(owner) not in owners:
                owners.add(id(owner))
                held += _size_of(owner, part)
        if isinstance(part, bytes):
            held += len(part)
        size += nbytes(part)
        kept.append(part)
    return [joined(kept)] if held > 2 * size + 4096 else kept


def _owner(part: Any) -> Any:
    """The object whose memory ``part`` keeps alive: the end of its chain of views (an array,
    bytes, or another exporter such as an ``mmap``)."""
    obj: Any = part
    while True:  # through memoryviews and array views to what owns the memory
        if isinstance(obj, memoryview):
            obj = obj.obj
        elif isinstance(obj, np.ndarray) and obj.base is not None:
            obj = obj.base
        else:
            return obj


def _size_of(owner: Any, part: Buffer) -> int:
    """The bytes ``owner`` holds (``part``'s size where it does not say)."""
    if isinstance(owner, np.ndarray | memoryview | bytes | bytearray):
        return nbytes(owner)
    try:
        return memoryview(owner).nbytes
    except TypeError:
        return nbytes(part)
