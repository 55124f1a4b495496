"""Local worker processes: a graph's tasks on a pool of single-threaded processes.

Threads share one GIL. A chunk's work mostly runs without it (numpy, Zstandard, BLAKE3 and
the file writes release it), but the Python around that work holds it for a fifth to a
third of the busy time (``benchmarks/bench_scaling.py``), which caps threads at a few
times one core whatever the core count. Processes share nothing, so they are the way to
use a many-core machine without a cluster.

The graph is culled and fused first (``dask.optimization.fuse``, as
``dask.multiprocessing.get`` does): a read and the encode that consumes it become one
task, so a unit's bytes never cross processes, only its small chunk records do. Each
process is started with the multiprocessing context of Dask's configuration
(``multiprocessing.context``, "spawn" by default: never a fork of a process whose other
threads may hold locks), takes the Dask configuration the pool was made under (gradpipe's
settings included: a spawned process would otherwise see only files and environment
variables), sizes gradpipe's own thread pools to its share of the cores, ignores Ctrl-C
(the parent decides), exits if the parent dies, and warms up (:mod:`gradpipe.graph.warmup`);
the pool is ready once every process has done so. It is made on first use and kept for the
graphs that follow while gradpipe's settings stay the same; a graph computed under other
settings (``dask.config.set({"gradpipe.…": …})``) gets a new pool. One graph runs at a time.

The caller's script is not run again in the processes. A spawned process imports the parent's
``__main__`` module by default, so that functions defined there unpickle; a script without an
``if __name__ == "__main__":`` guard would then run its own top level in every worker (and
fail when that starts processes). gradpipe's tasks live in gradpipe's modules, and Dask
serializes any other task function with cloudpickle (by value for ``__main__``), so the
processes are started with ``__main__``'s file and spec hidden (:func:`main_module_hidden`).

A process that dies (killed, out of memory) breaks the pool: the graph fails with a
:class:`~gradpipe.errors.GradpipeError` saying so. Its commit, the graph's last task, most
likely did not happen; running the operation again is safe either way (every write is
content-addressed, every commit a compare-and-swap). The next graph gets a new pool, also
when the pool broke between graphs.
"""

from __future__ import annotations

import contextlib
import copy
import os
import signal
import sys
import threading
import time
from collections.abc import Hashable, Iterator, Mapping, Sequence
from concurrent.futures import ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from queue import Empty
from typing import Any, Final

from gradpipe.config import all_settings
from gradpipe.errors import GradpipeError
from gradpipe.graph.warmup import warm_up
from gradpipe.storage._pools import limit_threads, read_threads

__all__ = ["START_TIMEOUT", "LocalProcesses", "main_module_hidden"]

#: Seconds a new pool's processes have to start and warm up.
START_TIMEOUT: Final = 120.0


class LocalProcesses:
    """A pool of ``count`` worker processes that computes task graphs; close it after use."""

    def __init__(self, count: int) -> None:
        self.count = count
        self.pids: tuple[int, ...] = ()  # the processes of the current pool, once started
        self._pool: ProcessPoolExecutor | None = None
        self._settings: Any = None  # gradpipe's settings when the processes started
        self._lock = threading.Lock()  # one graph at a time; the pool is made under it

    def get(
        self, graph: Mapping[Hashable, Any], keys: Sequence[Hashable], *, name: str
    ) -> list[Any]:
        """Compute ``keys`` of ``graph`` in the processes (``name``: the stage, for errors)."""
        from dask.multiprocessing import get

        with self._lock:
            try:
                # chunksize 1: tasks go out one at a time, so a few large ones do not queue
                # behind each other on one process while another idles.
                wanted: list[Any] = list(keys)
                return list(get(dict(graph), wanted, pool=self._executor(), chunksize=1))
            except BrokenProcessPool:
                self._close()  # the next graph starts a new pool
                raise GradpipeError(
                    f"a worker process of gradpipe's local process pool died during {name}: "
                    "killed, out of memory, or it could not start (its error, if any, is on "
                    "stderr); the operation most likely committed nothing, and running it "
                    "again is safe (with fewer processes if memory is short)"
                ) from None

    def close(self) -> None:
        """Stop the processes (idempotent); a later :meth:`get` starts new ones."""
        with self._lock:
            self._close()

    def _close(self) -> None:
        pool, self._pool, self.pids = self._pool, None, ()
        if pool is not None:
            pool.shutdown(wait=True, cancel_futures=True)

    def _executor(self) -> ProcessPoolExecutor:
        settings = all_settings()  # defaults merged: not a change of settings
        broken = self._pool is not None and _unusable(self._pool, self.pids)
        if self._pool is not None and (broken or self._settings != settings):
            self._close()  # broken since the last graph, or gradpipe's settings changed
        if self._pool is None:
            self._pool = self._start()
            self._settings = settings
        return self._pool

    def _start(self) -> ProcessPoolExecutor:
        """A new pool whose every process has started and warmed up."""
        import dask.config
        from dask.multiprocessing import get_context

        context = get_context()
        ready = context.Queue()
        threads = max(1, read_threads() // self.count)
        pool = ProcessPoolExecutor(
            self.count,
            mp_context=context,
            initializer=_start_worker,
            initargs=(copy.deepcopy(dask.config.config), threads, ready),
        )
        try:
            # A spawn pool starts a process per task submitted while none is idle: one
            # probe each starts them all now, side by side, rather than some mid-graph.
            with main_module_hidden():
                for _ in range(self.count):
                    pool.submit(os.getpid)
            self.pids = _ready_pids(pool, ready, self.count)
        except BrokenProcessPool:
            pool.shutdown(wait=False, cancel_futures=True)
            raise BrokenProcessPool("the pool's processes did not start") from None
        finally:
            ready.close()
        return pool


def _ready_pids(pool: ProcessPoolExecutor, ready: Any, count: int) -> tuple[int, ...]:
    """The pids the processes put in ``ready`` once warm; raises if the pool breaks first."""
    pids: list[int] = []
    deadline = time.monotonic() + START_TIMEOUT
    while len(pids) < count:
        try:
            pids.append(ready.get(timeout=0.1))
        except Empty:
            if _unusable(pool, ()) or time.monotonic() > deadline:
                raise BrokenProcessPool("the pool's processes did not start") from None
    return tuple(pids)


def _unusable(pool: ProcessPoolExecutor, started: tuple[int, ...]) -> bool:
    """Whether ``pool`` can run no graph: marked broken, or one of the processes ``started``
    has died and the executor's own thread has not marked the pool yet (it does so a
    moment later, and may drop the process from its table first). A process's death is read
    from its sentinel, which does not depend on who reaped it."""
    from multiprocessing.connection import wait

    if getattr(pool, "_broken", False):
        return True
    processes = dict(getattr(pool, "_processes", None) or {})
    if not set(processes).issuperset(started):
        return True
    return bool(wait([process.sentinel for process in processes.values()], timeout=0))


_HIDING = threading.Lock()


@contextlib.contextmanager
def main_module_hidden() -> Iterator[None]:
    """``__main__`` without a file or a spec: processes started now do not import it."""
    main = sys.modules.get("__main__")
    if main is None:
        yield
        return
    with _HIDING:
        saved = {k: v for k, v in vars(main).items() if k in ("__file__", "__spec__")}
        try:
            vars(main).pop("__file__", None)
            if "__spec__" in saved:
                main.__spec__ = None
            yield
        finally:
            vars(main).update(saved)


def _start_worker(config: dict[str, Any], threads: int, ready: Any) -> None:
    """A new worker process: the parent's settings, its share of threads, warmed up, ready."""
    import dask.config

    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the parent's to handle
    _exit_with_parent()
    dask.config.update(dask.config.config, copy.deepcopy(config))
    limit_threads(threads)  # N processes x N threads each would oversubscribe the cores
    warm_up()
    ready.put(os.getpid())


def _exit_with_parent() -> None:
    """End this process when its parent does (killed, out of memory): no orphan writes on."""
    import multiprocessing

    parent = multiprocessing.parent_process()
    if parent is None:
        return

    def watch() -> None:
        from multiprocessing.connection import wait

        wait([parent.sentinel])
        os._exit(1)

    threading.Thread(target=watch, name="gradpipe-parent-watch", daemon=True).start()
