"""Where gradpipe's graphs run: a :class:`Runner` over one Dask scheduler.

gradpipe has no scheduler of its own. Graph builders (``build_*_graph``)
return plain task dicts; a runner hands them to Dask: to a client the caller
gave, to the scheduler at an address (``--scheduler``/``DASK_SCHEDULER_ADDRESS``),
to a default client already running in the process (as in Jupyter), to an
in-process ``LocalCluster`` that shows the work on its dashboard, to a pool of
local worker processes (``processes=True``: no GIL shared, for many cores; see
:mod:`gradpipe.graph.process_pool`), or else to the local threaded scheduler
(as fast as the process pool on 2 cores, and without its half-second start;
``benchmarks/bench_scaling.py``).

One runner serves many operations, so a workflow runs all its stages on one
cluster::

    with gp.runner(scheduler="tcp://10.0.0.5:8786") as runner:
        gp.ingest(store, "a/step={step}/peer={peer}.safetensors", run="a", runner=runner)
        gp.ingest(store, "b/step={step}/peer={peer}.safetensors", run="b", runner=runner)

``distributed`` is imported only when a runner needs it, so ``import gradpipe``
stays light.
"""

from __future__ import annotations

import contextlib
import os
import sys
from collections.abc import Hashable, Iterator, Mapping, Sequence
from types import TracebackType
from typing import TYPE_CHECKING, Any, TypedDict, Unpack

from gradpipe.errors import InvalidInputError
from gradpipe.storage._pools import read_threads as cores

if TYPE_CHECKING:
    from distributed import Client, LocalCluster

    from gradpipe.graph.process_pool import LocalProcesses

__all__ = [
    "Runner",
    "RunnerOptions",
    "check_runner_options",
    "job_runner",
    "parse_workers",
    "performance_report",
    "runner",
    "use_runner",
]


class RunnerOptions(TypedDict, total=False):
    """An operation's conveniences for a temporary runner (the arguments of :func:`runner`)."""

    client: Client | None
    scheduler: str | None
    workers: int | None
    dashboard: bool
    progress: bool
    processes: bool


class Runner:
    """Computes task graphs on one Dask scheduler; closes what it opened.

    Build one with :func:`runner` (which finds or starts a scheduler), or
    directly: ``Runner()`` runs on local threads, ``Runner(processes=True)`` on a
    pool of local processes, ``Runner(client)`` on the cluster of a
    ``distributed.Client`` the caller keeps (and closes).

    Use it as a context manager, or call :meth:`close`: a runner closes the
    client and cluster it opened itself, never one it was given. Operations
    given ``runner=`` never close it, so one runner serves many of them.

    Parameters
    ----------
    client : distributed.Client, optional
        The cluster to compute on; None computes on local threads.
    workers : int, optional
        Threads of the local scheduler, or processes with ``processes=True``
        (default: one per core); ignored with a client, whose cluster has its
        own workers.
    progress : bool
        Show a progress bar while computing, and the dashboard link (on stderr)
        before the first graph, when there is one.
    processes : bool
        Without a client, compute on a pool of ``workers`` single-threaded local
        processes (:mod:`gradpipe.graph.process_pool`) instead of threads: no
        GIL shared, for many-core machines; the pool starts with the first graph
        (about half a second) and lives until :meth:`close`.
    """

    def __init__(
        self,
        client: Client | None = None,
        *,
        workers: int | None = None,
        progress: bool = False,
        processes: bool = False,
    ) -> None:
        if processes and client is not None:
            raise InvalidInputError(
                "processes=True runs graphs on local processes; a client runs them on its "
                "cluster: pass one or the other"
            )
        self._client = client
        self.workers = parse_workers(workers)
        self.progress = progress
        self.processes = processes
        self._pool: LocalProcesses | None = None
        self._owned: list[Any] = []  # clients and clusters opened for this runner, in order
        self._cluster: LocalCluster | None = None
        self._closed = False
        self._link_shown = False
        self._warmed: Client | None = None  # the client whose workers have the warm-up plugin

    @property
    def client(self) -> Client | None:
        """The ``distributed.Client`` graphs go to, or None for local threads."""
        return self._client

    @property
    def closed(self) -> bool:
        """True once :meth:`close` ran; a closed runner computes nothing."""
        return self._closed

    @property
    def dashboard_link(self) -> str | None:
        """The Dask dashboard of the cluster, when there is one."""
        if self._cluster is not None:
            # An in-process cluster's link would name its inproc host; it serves on loopback.
            scheduler = self._cluster.scheduler
            assert scheduler is not None  # a running LocalCluster has its scheduler in-process
            port = scheduler.services["dashboard"].port
            return f"http://127.0.0.1:{port}/status"
        link = getattr(self._client, "dashboard_link", None)
        return str(link) if link else None

    def get(
        self, graph: Mapping[Hashable, Any], keys: Sequence[Hashable], *, name: str
    ) -> list[Any]:
        """Compute ``keys`` of ``graph``, in the order of ``keys``.

        ``name`` labels the work on the dashboard: the ``distributed.span``
        it runs in, ``gradpipe-<stage>``, also reported to the scheduler as a
        stage of the current operation (:mod:`gradpipe.graph.telemetry`).
        """
        if self._closed:
            raise InvalidInputError(
                f"{self!r} is closed; open a new one with gradpipe.runner() "
                "(a runner used as a context manager closes when its with-block ends)"
            )
        self._show_dashboard()
        if self._client is None and self.processes:
            if self._pool is None:
                from gradpipe.graph.process_pool import LocalProcesses

                self._pool = LocalProcesses(self.workers or cores())
            with _local_progress(self.progress):
                return self._pool.get(graph, keys, name=name)
        if self._client is None:
            from dask.threaded import get

            with _local_progress(self.progress):
                return list(get(dict(graph), list(keys), num_workers=self.workers))  # type: ignore[arg-type]
        from distributed import span

        from gradpipe.graph.telemetry import graph_operation

        self._warm_up()
        with span(name) as span_id, graph_operation(self._client, name) as operation:
            operation.graph(name, span_id, len(graph))
            futures = self._client.get(dict(graph), list(keys), sync=False)
            if self.progress:
                from distributed import progress

                progress(futures)
            return list(self._client.gather(futures))

    def close(self) -> None:
        """Close the client and cluster this runner opened (none it was given); idempotent."""
        self._closed = True
        pool, self._pool = self._pool, None
        if pool is not None:
            pool.close()
        owned, self._owned = self._owned, []
        for thing in reversed(owned):  # the client before the cluster it talks to
            thing.close()
        self._cluster = None

    def __enter__(self) -> Runner:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    def __repr__(self) -> str:
        if self._client is None:
            kind = "processes" if self.processes else "threads"
            where = f"local {kind} ({self.workers or cores()} workers)"
        else:
            address = getattr(getattr(self._client, "scheduler", None), "address", None)
            where = f"scheduler {address or '?'}"
            if self._cluster is not None:
                where = "an in-process LocalCluster"
        state = ", closed" if self._closed else ""
        return f"<gradpipe Runner on {where}{state}>"

    def _warm_up(self) -> None:
        """Once per runner and client: workers import what the tasks need before the first
        graph runs (:mod:`gradpipe.graph.warmup`), rather than inside its first tasks."""
        if self._warmed is not self._client:
            from gradpipe.graph.warmup_plugin import register

            register(self._client)
            self._warmed = self._client

    def _own(self, client: Client, cluster: LocalCluster | None = None) -> None:
        """Take ``client`` (and ``cluster``) as opened by this runner: :meth:`close` closes them."""
        self._client = client
        self._cluster = cluster
        self._owned = [c for c in (cluster, client) if c is not None]

    @property
    def gradpipe_page_link(self) -> str | None:
        """The gradpipe page of the in-process cluster's dashboard (None for another cluster:
        it has the page only if its scheduler loaded ``gradpipe.dashboard``)."""
        link = self.dashboard_link if self._cluster is not None else None
        return link.removesuffix("/status") + "/gradpipe" if link else None

    def _show_dashboard(self) -> None:
        if self.progress and not self._link_shown and self.dashboard_link:
            page = self.gradpipe_page_link
            extra = f" (gradpipe page: {page})" if page else ""
            print(f"dashboard: {self.dashboard_link}{extra}", file=sys.stderr)
        self._link_shown = True


def parse_workers(workers: int | None) -> int | None:
    """A thread count: a positive int, or None for one per core."""
    if workers is None:
        return None
    if isinstance(workers, bool) or not isinstance(workers, int) or workers < 1:
        raise InvalidInputError(
            f"workers must be a positive number of threads, got {workers!r}; "
            "leave it out for one thread per core"
        )
    return workers


@contextlib.contextmanager
def _local_progress(enabled: bool) -> Iterator[None]:
    if not enabled:
        yield
        return
    from dask.diagnostics.progress import ProgressBar

    with ProgressBar(minimum=1.0, dt=0.5):
        yield


def runner(
    client: Client | None = None,
    *,
    scheduler: str | None = None,
    workers: int | None = None,
    dashboard: bool = False,
    progress: bool = False,
    processes: bool = False,
) -> Runner:
    """A runner for the caller's choice of cluster: the first of these that applies.

    1. ``client``: a ``distributed.Client`` the caller keeps (and closes);
    2. ``scheduler``, else ``DASK_SCHEDULER_ADDRESS`` (unless ``processes``): a
       client to that address, opened here and closed with the runner;
    3. ``dashboard=True``: an in-process ``LocalCluster`` of threads (as fast
       as plain threads on 2 cores, measured), or of ``workers`` single-threaded
       processes with ``processes=True``, so the work can be watched on its
       dashboard at ``runner.dashboard_link``; closed with the runner;
    4. ``processes=True``: a pool of local worker processes
       (:mod:`gradpipe.graph.process_pool`), closed with the runner;
    5. a default ``distributed`` client already running in this process;
    6. local threads.

    Parameters
    ----------
    client : distributed.Client, optional
        An existing client.
    scheduler : str, optional
        The address of a Dask scheduler, e.g. ``"tcp://10.0.0.5:8786"``.
    workers : int, optional
        Threads of the local scheduler or the in-process cluster.
    dashboard : bool
        Without a client or address, start an in-process cluster with a dashboard.
    progress : bool
        Show progress bars, and the dashboard link before the first graph.
    processes : bool
        Compute on ``workers`` single-threaded local processes (default: one per
        core) instead of threads: they share no GIL, so they keep scaling on
        many-core machines where threads stop at a few cores. Starting them
        costs about half a second, once per runner.

    Returns
    -------
    Runner
        Use it as a context manager to close what it opened.

    Examples
    --------
    >>> import gradpipe as gp
    >>> with gp.runner(workers=2) as r:
    ...     r.get({"x": 1, "y": (sum, ["x", "x"])}, ["y"], name="gradpipe-example")
    [2]
    """
    workers = parse_workers(workers)
    if client is not None and scheduler is not None:
        raise InvalidInputError(
            "pass a client or a scheduler address, not both (the client already has a scheduler)"
        )
    if processes and (client is not None or scheduler is not None):
        raise InvalidInputError(
            "processes=True starts local worker processes; a client or a scheduler address "
            "already has its workers: pass one or the other"
        )
    if client is not None:
        return Runner(client, workers=workers, progress=progress)
    address = None if processes else scheduler or os.environ.get("DASK_SCHEDULER_ADDRESS")
    if address:
        from distributed import Client

        made = Runner(workers=workers, progress=progress)
        made._own(Client(address))
        return made
    if dashboard:
        from distributed import Client, LocalCluster

        from gradpipe.graph.process_pool import main_module_hidden

        count = workers or cores()
        with main_module_hidden():  # worker processes must not run the caller's script again
            cluster = LocalCluster(
                n_workers=count if processes else 1,
                threads_per_worker=1 if processes else count,
                processes=processes,
                dashboard_address="127.0.0.1:0",
                scheduler_kwargs=_with_dashboard_preload(),
            )
        made = Runner(workers=workers, progress=progress)
        try:
            made._own(Client(cluster), cluster)
        except BaseException:
            cluster.close()
            raise
        return made
    if processes:
        return Runner(workers=workers, progress=progress, processes=True)
    if "distributed" in sys.modules:  # a default client can only exist if it was imported
        from distributed import default_client

        with contextlib.suppress(ValueError):
            return Runner(default_client(), workers=workers, progress=progress)
    return Runner(workers=workers, progress=progress)


def _with_dashboard_preload() -> dict[str, Any]:
    """Scheduler arguments that add the gradpipe page (/gradpipe) to the configured preloads.

    Given by name (the dashboard module sits above the graph layer). A
    ``preload`` argument replaces ``distributed.scheduler.preload`` from the
    config, so the configured ones are passed along, with their arguments.
    """
    import dask

    preload = dask.config.get("distributed.scheduler.preload", None) or []
    preload = [preload] if isinstance(preload, str) else list(preload)
    argv = list(dask.config.get("distributed.scheduler.preload-argv", None) or [])
    if "gradpipe.dashboard" in preload:
        return {}
    if not argv:
        argv = [[] for _ in preload]
    elif isinstance(argv[0], str):  # one argument list shared by every configured preload
        argv = [list(argv) for _ in preload]
    return {"preload": [*preload, "gradpipe.dashboard"], "preload_argv": [*argv, []]}


def check_runner_options(given: Runner | None, **options: Unpack[RunnerOptions]) -> None:
    """Refuse an operation's runner conveniences passed together with a runner.

    Operations call it first, before any work, so the mistake costs nothing.
    """
    parse_workers(options.get("workers"))
    if given is None:
        return
    clashing = [name for name, value in options.items() if value not in (None, False)]
    if clashing:
        raise InvalidInputError(
            f"pass runner= or {'/'.join(f'{n}=' for n in clashing)}, not both: the runner "
            "already decides where and how graphs run (give them to gradpipe.runner())"
        )


@contextlib.contextmanager
def use_runner(given: Runner | None, **options: Unpack[RunnerOptions]) -> Iterator[Runner]:
    """The runner an operation computes on: ``given`` (left open), or a new one closed after.

    ``options`` are an operation's conveniences for building a temporary runner
    (the arguments of :func:`runner`); passing any of them with a runner is
    refused (:func:`check_runner_options`), since the runner already decides
    where and how graphs run.
    """
    check_runner_options(given, **options)
    if given is not None:
        yield given
        return
    with runner(**options) as temporary:
        yield temporary


@contextlib.contextmanager
def performance_report(active: Runner, path: str | os.PathLike[str]) -> Iterator[None]:
    """Write Dask's performance report of what ``active`` computes in this block to ``path``.

    ``distributed.performance_report``: one HTML file with the task stream,
    the worker profile, bandwidths and the scheduler's figures of the block,
    that outlives the cluster (an in-process cluster's dashboard dies with
    its command). It needs a runner on a ``distributed`` cluster, and bokeh.
    The file is written when the block ends, also when it raises.
    """
    client = active.client
    if client is None:
        raise InvalidInputError(
            "a performance report needs a Dask cluster: use gradpipe.graph.runner.job_runner("
            "report=...), or a runner on one (gradpipe.runner(scheduler=...) or dashboard=True)"
        )
    from distributed import performance_report as dask_report

    with client.as_current(), dask_report(filename=os.fspath(path)):
        yield


@contextlib.contextmanager
def job_runner(
    *, report: str | os.PathLike[str] | None = None, **options: Unpack[RunnerOptions]
) -> Iterator[Runner]:
    """The runner of a batch job (a command, a workflow): :func:`runner`, plus ``--report``.

    With ``report``, the job runs on a ``distributed`` cluster (the one the
    options name, else an in-process one, as ``dashboard=True``) and Dask's
    performance report of everything computed in the block is written to
    ``report`` when it ends (:func:`performance_report`). Closed after.
    """
    if report is None:
        with runner(**options) as active:
            yield active
        return
    options["dashboard"] = True
    with runner(**options) as active, performance_report(active, report):
        yield active
