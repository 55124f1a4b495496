"""Thread pools shared by a process: one per purpose, made on first use, remade after a fork.

The codecs' inner loops release the GIL, so decoding (reads) and encoding
(chained writes) run on a pool of as many threads as the process has cores.
Each purpose has its own pool, so a writer that reads its parents while its
chunks are encoded never waits on itself. A forked child never inherits a pool
(its threads do not exist there) or a lock held by a thread of the parent.
"""

from __future__ import annotations

import os
import threading
from concurrent.futures import ThreadPoolExecutor

__all__ = ["limit_threads", "process_pool", "read_threads"]

_POOLS: dict[str, ThreadPoolExecutor] = {}
_LOCK = threading.Lock()
_LIMIT: list[int] = []  # set in a worker process of a pool that shares the cores


def read_threads() -> int:
    """Worker threads: the cores this process may run on (its share, in a pool's worker)."""
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        cores = os.cpu_count() or 1
    return min(cores, *_LIMIT) if _LIMIT else cores


def limit_threads(count: int) -> None:
    """At most ``count`` threads per pool from now on: a process that shares the cores
    with others of a pool (:mod:`gradpipe.graph.process_pool`) takes only its share."""
    _LIMIT[:] = [max(1, count)]


def process_pool(purpose: str) -> ThreadPoolExecutor:
    """The process's pool for ``purpose`` (``"decode"``, ``"encode"``)."""
    with _LOCK:
        pool = _POOLS.get(purpose)
        if pool is None:
            pool = ThreadPoolExecutor(read_threads(), thread_name_prefix=f"gradpipe-{purpose}")
            _POOLS[purpose] = pool
        return pool


def _after_fork_in_child() -> None:
    global _LOCK  # noqa: PLW0603 - a lock held by a parent's thread is never released here
    _LOCK = threading.Lock()
    _POOLS.clear()


os.register_at_fork(after_in_child=_after_fork_in_child)
