"""Worker start-up off the critical path: what gradpipe's tasks import, imported as a worker starts.

A Dask worker imports a task's module when its first task of that kind runs. For gradpipe
that is about 0.2 s of imports (numpy's and numcodecs' submodules, the codecs, dask's config
with gradpipe's defaults merged in), paid inside the first tasks of the first graph, while
they hold the import lock and the GIL: every other thread of the worker waits. Measured on
this project's 2-core machine, a 1 GiB ingest on a fresh ``LocalCluster`` of two processes
took 0.4-0.5 s longer the first time than the second.

:class:`WarmUp` is a ``distributed`` worker plugin that does those imports in
:meth:`~WarmUp.setup`, on every worker, including those that join later. A
:class:`~gradpipe.graph.runner.Runner` registers it once per cluster before its first
graph; a worker started by hand can load it first with
``dask worker --preload gradpipe.graph.warmup``.
"""

from __future__ import annotations

import importlib
from typing import Any, Final

from distributed import WorkerPlugin

__all__ = ["PLUGIN_NAME", "TASK_MODULES", "WarmUp", "dask_setup", "register", "warm_up"]

#: The plugin's name on the scheduler: registering it again replaces it, never adds a second.
PLUGIN_NAME: Final = "gradpipe-warmup"

#: The modules whose functions gradpipe's graphs run as tasks, and the codecs they decode with.
TASK_MODULES: Final = (
    "gradpipe.codecs",
    "gradpipe.storage.tensors",
    "gradpipe.storage.chains",
    "gradpipe.graph.ingest_tasks",
    "gradpipe.graph.aggregate_tasks",
    "gradpipe.graph.robust_tasks",
    "gradpipe.graph.server_tasks",
    "gradpipe.graph.evaluate_tasks",
    "gradpipe.graph.arrays",
)


def warm_up() -> tuple[str, ...]:
    """Import :data:`TASK_MODULES` and load gradpipe's settings; the modules imported."""
    from gradpipe.config import get_setting

    for name in TASK_MODULES:
        importlib.import_module(name)
    get_setting("inline-bytes")  # imports dask.config and merges gradpipe's defaults
    return TASK_MODULES


class WarmUp(WorkerPlugin):  # type: ignore[misc]  # distributed is untyped
    """Imports what gradpipe's tasks need when a worker starts (see the module docstring)."""

    name = PLUGIN_NAME
    idempotent = True  # the scheduler keeps one, however often it is registered

    def setup(self, worker: Any) -> None:
        warm_up()


def register(client: Any) -> None:
    """Register :class:`WarmUp` with ``client``'s cluster (present and future workers)."""
    client.register_plugin(WarmUp(), name=PLUGIN_NAME)


def dask_setup(worker: Any) -> None:
    """``dask worker --preload gradpipe.graph.warmup``: warm up before the worker takes tasks."""
    warm_up()
