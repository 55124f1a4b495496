"""Decoding many chunks at once: fetch in windows, decode on a thread pool, into place.

Reading a tensor, or every tensor of a dump, is a list of chunks, each a
block to decode into its slice of a preallocated output array. The work is
split in two, so that neither waits for the other:

- the calling thread fetches blocks in batched :meth:`~Backend.read_many`
  windows (one round trip of concurrent requests on S3, plain reads on disk),
- a thread pool decodes each fetched frame straight into its slice
  (:func:`~gradpipe.storage.blocks.decode_block` with ``out=``) and checks it
  against its id there. The codecs' inner loops release the GIL (numcodecs'
  Zstandard, numpy's plane joins, BLAKE3), so the decodes run on every core.

While the pool decodes window *k*, the caller fetches window *k + 1*; it
waits for window *k* before fetching *k + 2*, so at most two windows of
frames (:data:`READ_WINDOW` blocks or :data:`READ_WINDOW_BYTES` of output,
whichever comes first) are held at any time, whatever the tensor's size.

A chunk stored as a delta chain (:mod:`gradpipe.core.chain`) needs its
keyframe and every delta block: they are fetched in the chunk's window, and its
decode task applies the deltas oldest first, into the same slice, then checks
the result against the chunk's id.

Errors are those a one-by-one read would raise, in the same order (the
order the chunks are given in): the first
chunk that is missing or does not decode is the one reported, whichever
thread found it first, and no decode still runs when the error is raised.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor, wait
from dataclasses import dataclass
from typing import TYPE_CHECKING, Final

import numpy as np

from gradpipe.codecs.delta import DeltaCodec
from gradpipe.core.chain import DeltaLink
from gradpipe.core.dtypes import dtype_name
from gradpipe.core.ids import block_key, hash_bytes
from gradpipe.errors import IntegrityError, NotFoundError
from gradpipe.meter import READ, digest_bytes
from gradpipe.storage._pools import process_pool, read_threads
from gradpipe.storage.blocks import decode_block

if TYPE_CHECKING:
    from gradpipe.storage.store import Store

__all__ = [
    "READ_WINDOW",
    "READ_WINDOW_BYTES",
    "ChunkRead",
    "decode_chain",
    "decode_chunks",
    "decode_windows",
    "read_threads",
]

#: Blocks fetched per batched read (one window).
READ_WINDOW: Final = 64
#: Output bytes one window may fill: with two windows in flight, this bounds
#: the frames held in memory (a frame is at most a few bytes above its output).
READ_WINDOW_BYTES: Final = 32 * 2**20


@dataclass(frozen=True, slots=True)
class ChunkRead:
    """One chunk to decode: its block, its place in the output, and a name for errors.

    ``frame`` is the encoded block when the caller has it already (a chunk
    kept inline in its manifest); None means fetch it from the store.
    ``links`` is the chunk's delta chain, nearest first (empty: a full block).
    """

    block_id: str
    out: np.ndarray  # contiguous slice of the output array, exactly the logical size
    context: str
    frame: bytes | None = None
    links: tuple[DeltaLink, ...] = ()

    @property
    def keys(self) -> list[str]:
        """The blocks to fetch, in decode order: the keyframe, then the deltas oldest first."""
        if self.frame is not None:
            return []
        if not self.links:
            return [self.block_id]
        return [self.links[-1].base, *(link.block for link in reversed(self.links))]


#: A chunk and its decode, or the error that stopped it before decoding.
_Outcome = tuple[ChunkRead, "Future[None] | BaseException"]


def _pool() -> ThreadPoolExecutor:
    """The process's decoding pool."""
    return process_pool("decode")


def decode_chunks(store: Store, chunks: Sequence[ChunkRead]) -> None:
    """Decode every chunk into its ``out``, fetching what is not inline; checks every id.

    Raises the error of the first failing chunk, in the order given:
    :class:`~gradpipe.errors.NotFoundError` for a missing block (naming what
    needed it), :class:`~gradpipe.errors.IntegrityError` for a damaged one,
    or the backend's error.
    """
    for _ in decode_windows(store, chunks):
        pass


def decode_windows(store: Store, chunks: Sequence[ChunkRead]) -> Iterator[int]:
    """:func:`decode_chunks`, yielding how many chunks (a prefix) are decoded so far.

    A consumer can use each chunk's output as soon as it is counted, while
    the next windows are fetched and decoded: ``gradpipe export`` writes
    tensors while later ones decode. Closing the iterator early cancels
    what has not started and waits for what has.
    """
    serial = len(chunks) <= 1 or read_threads() == 1
    submit = _run_here if serial else _pool().submit
    previous: list[_Outcome] = []
    current: list[_Outcome] = []
    done = 0
    try:
        for window in _windows(chunks):
            wanted = [(chunk, key) for chunk in window for key in chunk.keys]
            frames_read = store.backend.read_many([block_key(k) for _, k in wanted])
            digest_bytes(READ, sum(len(f) for f in frames_read if isinstance(f, bytes)))
            fetched = iter(frames_read)
            current = []
            for chunk in window:
                got = [next(fetched) for _ in chunk.keys]
                failed = _failure(store, chunk, got)
                frames = (
                    [chunk.frame]
                    if chunk.frame is not None
                    else [f for f in got if not isinstance(f, BaseException)]
                )
                # A chunk kept inline in its manifest (a frame of at most inline-bytes,
                # one block) decodes here: handing it to a pool thread costs more (a lock,
                # a wake-up, both with the GIL) than decoding it.
                inline = chunk.frame is not None and not chunk.links
                run = _run_here if inline else submit
                current.append((chunk, failed or run(_decode, chunk, frames)))
            del fetched, frames_read, got, frames  # the pool holds each frame until decoded
            if previous:
                _finish(previous)
                done += len(previous)
                yield done
            previous, current = current, []
        _finish(previous)
        done += len(previous)
        previous = []
        yield done
    finally:
        _abandon(previous + current)


def _failure(
    store: Store, chunk: ChunkRead, frames: Sequence[bytes | BaseException]
) -> BaseException | None:
    """The error of the first frame of ``chunk`` that could not be fetched, if any."""
    for key, frame in zip(chunk.keys, frames, strict=True):
        if isinstance(frame, NotFoundError):
            what = chunk.context if key == chunk.block_id else f"{chunk.context}, delta chain"
            return store.missing_block(key, what)
        if isinstance(frame, BaseException):
            return frame
    return None


def _run_here(
    fn: Callable[[ChunkRead, list[bytes]], None], chunk: ChunkRead, frames: list[bytes]
) -> Future[None]:
    """Run ``fn`` now, on this thread, as a finished future (one core, one chunk, inline)."""
    future: Future[None] = Future()
    try:
        fn(chunk, frames)
    except Exception as exc:  # reported in chunk order by _finish (Ctrl-C stops at once)
        future.set_exception(exc)
    else:
        future.set_result(None)
    return future


def _decode(chunk: ChunkRead, frames: list[bytes]) -> None:
    if chunk.links:
        decode_chain(frames, chunk.block_id, chunk.links, out=chunk.out, context=chunk.context)
    else:
        decode_block(frames[0], chunk.block_id, out=chunk.out, context=chunk.context)


def decode_chain(
    frames: Sequence[bytes],
    block_id: str,
    links: Sequence[DeltaLink],
    *,
    out: np.ndarray,
    context: str = "",
) -> None:
    """Rebuild a delta-chained chunk into ``out`` from its frames, checking every id.

    ``frames`` are the keyframe's then each delta's, oldest first (as
    :attr:`ChunkRead.keys` lists them). Each frame is checked against its
    own id as it is decoded; the result is checked against ``block_id``.
    """
    where = context or f"chunk {block_id}"
    decode_block(frames[0], links[-1].base, out=out, context=f"{where}, keyframe")
    dtype = dtype_name(out.dtype)
    for link, frame in zip(reversed(links), frames[1:], strict=True):
        delta = decode_block(frame, link.block, context=f"{where}, delta")
        # The codec computes the target before writing it, so the base may be ``out``.
        DeltaCodec(link.kind, dtype).bind(out).decode(delta, out=out)
    if hash_bytes(out.reshape(-1).view(np.uint8)) != block_id:
        raise IntegrityError(
            f"{where} rebuilt from its keyframe and delta does not match its id {block_id}: "
            "the blocks are intact (each matched its own id), but the delta was written "
            "against other bytes than its keyframe; this version of the chunk is lost"
        )


def _windows(chunks: Sequence[ChunkRead]) -> list[list[ChunkRead]]:
    """Consecutive runs of at most :data:`READ_WINDOW` chunks and :data:`READ_WINDOW_BYTES`."""
    out: list[list[ChunkRead]] = []
    window: list[ChunkRead] = []
    size = 0
    for chunk in chunks:
        # A chained chunk holds its keyframe and deltas: count them all.
        cost = chunk.out.nbytes * (1 + len(chunk.links))
        if window and (len(window) >= READ_WINDOW or size + cost > READ_WINDOW_BYTES):
            out.append(window)
            window, size = [], 0
        window.append(chunk)
        size += cost
    if window:
        out.append(window)
    return out


def _finish(items: list[_Outcome]) -> None:
    """Wait for a window's decodes; raise the first failure in chunk order."""
    for _, outcome in items:
        if isinstance(outcome, BaseException):
            raise outcome
        outcome.result()


def _abandon(items: list[_Outcome]) -> None:
    """Cancel what has not started and wait for what has: nothing writes into ``out`` later."""
    futures = [f for _, f in items if isinstance(f, Future)]
    for future in futures:
        future.cancel()
    wait(futures)
