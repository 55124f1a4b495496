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

Errors are those a one-by-one read would raise, in the same order (the
order the chunks are given in): the first
chunk that is missing or does not decode is the one reported, whichever
thread found it first, and no decode still runs when the error is raised.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor, wait
from dataclasses import dataclass
from typing import TYPE_CHECKING, Final

import numpy as np

from gradpipe.core.ids import block_key
from gradpipe.errors import NotFoundError
from gradpipe.storage.blocks import decode_block

if TYPE_CHECKING:
    from gradpipe.storage.store import Store

__all__ = [
    "READ_WINDOW",
    "READ_WINDOW_BYTES",
    "ChunkRead",
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
    """

    block_id: str
    out: np.ndarray  # contiguous slice of the output array, exactly the logical size
    context: str
    frame: bytes | None = None


#: A chunk and its decode, or the error that stopped it before decoding.
_Outcome = tuple[ChunkRead, "Future[None] | BaseException"]


def read_threads() -> int:
    """Decoding threads: the cores this process may run on."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        return os.cpu_count() or 1


_POOLS: dict[int, ThreadPoolExecutor] = {}  # by process id: a forked child makes its own
_POOL_LOCK = threading.Lock()


def _pool() -> ThreadPoolExecutor:
    """The process's decoding pool, made on first use."""
    pid = os.getpid()
    with _POOL_LOCK:
        pool = _POOLS.get(pid)
        if pool is None:
            pool = ThreadPoolExecutor(read_threads(), thread_name_prefix="gradpipe-decode")
            _POOLS.clear()
            _POOLS[pid] = pool
        return pool


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
            wanted = [c for c in window if c.frame is None]
            fetched = store.backend.read_many([block_key(c.block_id) for c in wanted])
            frames = dict(zip(map(id, wanted), fetched, strict=True))
            current = []
            for chunk in window:
                frame = chunk.frame if chunk.frame is not None else frames.pop(id(chunk))
                if isinstance(frame, NotFoundError):
                    current.append((chunk, store.missing_block(chunk.block_id, chunk.context)))
                elif isinstance(frame, BaseException):
                    current.append((chunk, frame))
                else:
                    current.append((chunk, submit(_decode, chunk, frame)))
            del fetched, frames  # the pool holds each frame until it is decoded
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


def _run_here(
    fn: Callable[[ChunkRead, bytes], None], chunk: ChunkRead, frame: bytes
) -> Future[None]:
    """Run ``fn`` now, on this thread, as a finished future (one core, or one chunk)."""
    future: Future[None] = Future()
    try:
        fn(chunk, frame)
    except BaseException as exc:  # reported in chunk order by _finish
        future.set_exception(exc)
    else:
        future.set_result(None)
    return future


def _decode(chunk: ChunkRead, frame: bytes) -> None:
    decode_block(frame, chunk.block_id, out=chunk.out, context=chunk.context)


def _windows(chunks: Sequence[ChunkRead]) -> list[list[ChunkRead]]:
    """Consecutive runs of at most :data:`READ_WINDOW` chunks and :data:`READ_WINDOW_BYTES`."""
    out: list[list[ChunkRead]] = []
    window: list[ChunkRead] = []
    size = 0
    for chunk in chunks:
        if window and (len(window) >= READ_WINDOW or size + chunk.out.nbytes > READ_WINDOW_BYTES):
            out.append(window)
            window, size = [], 0
        window.append(chunk)
        size += chunk.out.nbytes
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
