"""Where gradpipe's graphs run: a distributed cluster if there is one, local threads if not.

gradpipe has no scheduler of its own. Graph builders return plain task
dicts; this module hands them to Dask: to the client the caller gave, to the
scheduler named by ``--scheduler``/``DASK_SCHEDULER_ADDRESS``, to a default
client already running in the process (as in Jupyter), or else to the local
threaded scheduler (measured faster here than a ``LocalCluster`` of
processes, see ``benchmarks/bench_ingest.py``: encoding releases the GIL).
"""

from __future__ import annotations

import contextlib
import os
import sys
from collections.abc import Hashable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

__all__ = ["Runner", "runner_for"]


@dataclass
class Runner:
    """Runs task graphs on one Dask scheduler."""

    client: Any = None  # a distributed.Client, or None for local threads
    workers: int | None = None
    progress: bool = False
    owns_client: bool = False
    cluster: Any = None  # a LocalCluster this runner started, closed with it

    @property
    def dashboard_link(self) -> str | None:
        """The Dask dashboard of the cluster, when there is one."""
        if self.cluster is not None:
            # An in-process cluster's link would name its inproc host; it serves on loopback.
            port = self.cluster.scheduler.services["dashboard"].port
            return f"http://127.0.0.1:{port}/status"
        return getattr(self.client, "dashboard_link", None) if self.client else None

    def get(
        self, graph: Mapping[Hashable, Any], keys: Sequence[Hashable], *, name: str
    ) -> list[Any]:
        """Compute ``keys`` of ``graph``; ``name`` labels the work on the dashboard."""
        if self.client is None:
            from dask.threaded import get

            with _local_progress(self.progress):
                return list(get(dict(graph), list(keys), num_workers=self.workers))  # type: ignore[arg-type]
        from distributed import span

        with span(name):
            futures = self.client.get(dict(graph), list(keys), sync=False)
            if self.progress:
                from distributed import progress

                progress(futures)
            return list(self.client.gather(futures))

    def close(self) -> None:
        """Close a client this runner opened itself."""
        if self.owns_client and self.client is not None:
            self.client.close()
            self.client = None
        if self.cluster is not None:
            self.cluster.close()
            self.cluster = None


@contextlib.contextmanager
def _local_progress(enabled: bool) -> Iterator[None]:
    if not enabled:
        yield
        return
    from dask.diagnostics.progress import ProgressBar

    with ProgressBar(minimum=1.0, dt=0.5):
        yield


def runner_for(
    *,
    client: Any = None,
    scheduler: str | None = None,
    workers: int | None = None,
    progress: bool = False,
    dashboard: bool = False,
) -> Runner:
    """The runner for the caller's choice of client or scheduler address.

    With ``dashboard=True`` and no cluster given, the work runs on an
    in-process ``LocalCluster`` of threads (as fast as plain threads here,
    measured) so that it can be watched on the Dask dashboard.
    """
    if client is not None:
        return Runner(client, workers, progress)
    address = scheduler or os.environ.get("DASK_SCHEDULER_ADDRESS")
    if address:
        from distributed import Client

        return Runner(Client(address), workers, progress, owns_client=True)
    if dashboard:
        from distributed import Client, LocalCluster

        cluster = LocalCluster(
            n_workers=1,
            threads_per_worker=workers or os.cpu_count() or 1,
            processes=False,
            dashboard_address="127.0.0.1:0",
        )
        return Runner(Client(cluster), workers, progress, owns_client=True, cluster=cluster)
    if "distributed" in sys.modules:  # a default client can only exist if it was imported
        from distributed import default_client

        with contextlib.suppress(ValueError):
            return Runner(default_client(), workers, progress)
    return Runner(None, workers, progress)
