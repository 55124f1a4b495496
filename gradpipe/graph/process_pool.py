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
variables), and warms up (:mod:`gradpipe.graph.warmup`) before its first task. The pool is
made on first use and kept for the graphs that follow while gradpipe's settings stay the
same; a graph computed under other settings (``dask.config.set({"gradpipe.…": …})``) gets
a new pool.

The caller's script is not run again in the processes. A spawned process imports the parent's
``__main__`` module by default, so that functions defined there unpickle; a script without an
``if __name__ == "__main__":`` guard would then run its own top level in every worker (and
fail when that starts processes). gradpipe's tasks live in gradpipe's modules, and Dask
serializes any other task function with cloudpickle (by value for ``__main__``), so the
processes are started with ``__main__``'s file and spec hidden for the moment of the start.

A process that dies (killed, out of memory) breaks the pool: the graph fails with a
:class:`~gradpipe.errors.GradpipeError` saying so, nothing of it is committed (commits are
the last task of a graph), and the next graph gets a new pool.
"""

from __future__ import annotations

import contextlib
import copy
import os
import sys
import threading
from collections.abc import Hashable, Iterator, Mapping, Sequence
from concurrent.futures import ProcessPoolExecutor, wait
from concurrent.futures.process import BrokenProcessPool
from typing import Any

from gradpipe.config import all_settings
from gradpipe.errors import GradpipeError
from gradpipe.graph.warmup import warm_up

__all__ = ["LocalProcesses"]


class LocalProcesses:
    """A pool of ``count`` worker processes that computes task graphs; close it after use."""

    def __init__(self, count: int) -> None:
        self.count = count
        self._pool: ProcessPoolExecutor | None = None
        self._settings: Any = None  # gradpipe's settings when the processes started

    def get(
        self, graph: Mapping[Hashable, Any], keys: Sequence[Hashable], *, name: str
    ) -> list[Any]:
        """Compute ``keys`` of ``graph`` in the processes (``name``: the stage, for errors)."""
        from dask.multiprocessing import get

        try:
            # chunksize 1: tasks go out one at a time, so a few large ones do not queue
            # behind each other on one process while another idles.
            wanted: list[Any] = list(keys)
            return list(get(dict(graph), wanted, pool=self._executor(), chunksize=1))
        except BrokenProcessPool:
            self.close()  # the next graph starts a new pool
            raise GradpipeError(
                f"a worker process of gradpipe's local process pool died during {name}: killed, "
                "out of memory, or it could not start (its error, if any, is on stderr); "
                "nothing of this operation was committed: run it again, with fewer processes "
                "if memory is short"
            ) from None

    def close(self) -> None:
        """Stop the processes (idempotent); a later :meth:`get` starts new ones."""
        pool, self._pool = self._pool, None
        if pool is not None:
            pool.shutdown(wait=True, cancel_futures=True)

    def _executor(self) -> ProcessPoolExecutor:
        import dask.config
        from dask.multiprocessing import get_context

        settings = all_settings()  # defaults merged: not a change of settings
        if self._pool is not None and self._settings != settings:
            self.close()  # gradpipe's settings changed since the processes started
        if self._pool is None:
            self._settings = settings
            self._pool = ProcessPoolExecutor(
                self.count,
                mp_context=get_context(),
                initializer=_start_worker,
                initargs=(copy.deepcopy(dask.config.config),),
            )
            # Start every process now, side by side: a spawn pool starts them one per task
            # submitted while none is idle, which would leave some to start mid-graph.
            with _main_module_hidden():
                started = [self._pool.submit(os.getpid) for _ in range(self.count)]
            wait(started)
        return self._pool


_HIDING = threading.Lock()


@contextlib.contextmanager
def _main_module_hidden() -> Iterator[None]:
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


def _start_worker(config: dict[str, Any]) -> None:
    """A new worker process: the parent's Dask configuration, then the warm-up."""
    import dask.config

    dask.config.update(dask.config.config, copy.deepcopy(config))
    warm_up()
