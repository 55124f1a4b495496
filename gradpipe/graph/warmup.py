"""Worker start-up off the critical path: what gradpipe's tasks import, imported as a worker starts.

A Dask worker imports a task's module when its first task of that kind runs. For gradpipe
that is about 0.12 s of imports per worker process (measured on this project's 2-core
machine: the codecs, numcodecs, dask's config with gradpipe's defaults merged in), paid
inside the first tasks of the first graph while they hold the import lock and the GIL, so
every other thread of the worker waits.

:func:`warm_up` does those imports. It runs as a worker starts: in each process of the
local process pool (:mod:`gradpipe.graph.process_pool`), in
:class:`~gradpipe.graph.warmup_plugin.WarmUp` (a ``distributed`` worker plugin that a
:class:`~gradpipe.graph.runner.Runner` registers once per cluster), and in a worker
started by hand with ``dask worker --preload gradpipe.graph.warmup``. This module imports
neither ``distributed`` nor the modules it warms up until asked.
"""

from __future__ import annotations

import importlib
from typing import Any, Final

__all__ = ["TASK_MODULES", "dask_setup", "warm_up"]

#: The modules whose functions gradpipe's graphs run as tasks, and the codecs they decode with.
TASK_MODULES: Final = (
    "gradpipe.codecs",
    "gradpipe.storage.tensors",
    "gradpipe.storage.chains",
    "gradpipe.ingestion.tasks",
    "gradpipe.aggregation.tasks",
    "gradpipe.aggregation.robust_tasks",
    "gradpipe.aggregation.server_opt_tasks",
    "gradpipe.evaluation.tasks",
    "gradpipe.graph.arrays",
)


def warm_up() -> tuple[str, ...]:
    """Import :data:`TASK_MODULES` and load gradpipe's settings; the modules imported."""
    from gradpipe.config import get_setting

    for name in TASK_MODULES:
        importlib.import_module(name)
    get_setting("inline-bytes")  # imports dask.config and merges gradpipe's defaults
    return TASK_MODULES


def dask_setup(worker: Any) -> None:
    """``dask worker --preload gradpipe.graph.warmup``: warm up before the worker takes tasks."""
    warm_up()
