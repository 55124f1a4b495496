"""The worker warm-up as a ``distributed`` worker plugin (see :mod:`gradpipe.graph.warmup`)."""

from __future__ import annotations

import warnings
from typing import Any, Final

from distributed import WorkerPlugin

from gradpipe.core.display import printable_error
from gradpipe.graph.warmup import warm_up

__all__ = ["PLUGIN_NAME", "WarmUp", "register"]

#: The plugin's name on the scheduler: registering it again keeps one.
PLUGIN_NAME: Final = "gradpipe-warmup"


class WarmUp(WorkerPlugin):
    """Imports what gradpipe's tasks need on every worker, including those that join later."""

    name = PLUGIN_NAME
    idempotent = True  # the scheduler keeps the first, however often it is registered

    def setup(self, worker: Any) -> None:
        warm_up()


def register(client: Any) -> None:
    """Register :class:`WarmUp` with ``client``'s cluster (present and future workers).

    The warm-up only saves time: a worker that cannot import what it imports warns, and the
    graph runs anyway (its tasks then fail with the import's own error, naming the task).
    """
    try:
        client.register_plugin(WarmUp(), name=PLUGIN_NAME)
    except Exception as exc:  # a worker's setup failed
        warnings.warn(
            f"gradpipe's worker warm-up failed on the cluster ({printable_error(exc)}); "
            "continuing without it",
            RuntimeWarning,
            stacklevel=2,
        )
