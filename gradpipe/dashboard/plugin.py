"""The gradpipe page of the Dask dashboard: a scheduler plugin.

Load it where the scheduler starts::

    dask scheduler --preload gradpipe.dashboard

or register it on a running scheduler from any client (the same plugin)::

    from gradpipe.dashboard.plugin import GradpipeDashboard
    client.register_plugin(GradpipeDashboard())

It adds, on the scheduler's dashboard server (port 8787 by default):

``/gradpipe``
    a page of gradpipe's operations: ingests, aggregates, restores..., live
    while they run (tasks done, bytes in, read and stored, ratio, MiB/s),
    their failures, totals per kind, and the latest commits per run;
``/json/gradpipe.json``
    the same as JSON, beside distributed's own ``/json/*.json`` routes: per
    operation its ``kind`` (``"ingest"``...), ``run``, ``state`` and figures;
``gradpipe_*`` metrics
    on the scheduler's Prometheus endpoint ``/metrics`` (needs
    ``prometheus_client``, as distributed's own metrics do).

Operations report themselves: one computing on a ``distributed`` client logs
small events under the scheduler's topic ``gradpipe``
(:mod:`gradpipe.graph.telemetry`), and its tasks digest their byte counts into
the span they run in (:mod:`gradpipe.meter`). The plugin replays the events the
scheduler already holds when it starts, so a page registered after the work
still shows it. Nothing here runs, or is imported, when no distributed client
is used. A scheduler started with ``--dashboard-prefix /dask`` serves these
under the prefix too (``/dask/gradpipe``), as it does its own routes.
"""

from __future__ import annotations

import json
import time
from collections.abc import Hashable, Iterator, Mapping, Sequence
from typing import TYPE_CHECKING, Any, ClassVar, Final

from distributed.diagnostics.plugin import SchedulerPlugin
from distributed.http.utils import RequestHandler

from gradpipe.dashboard.board import Board, Live
from gradpipe.dashboard.page import render_page
from gradpipe.graph.telemetry import TOPIC
from gradpipe.meter import RAW, READ, WRITE

if TYPE_CHECKING:
    from distributed import Scheduler

__all__ = [
    "JSON_ROUTE",
    "NAME",
    "PAGE_ROUTE",
    "GradpipeDashboard",
    "dask_setup",
    "route_prefix",
]

#: The plugin's name on the scheduler (registering it twice keeps the first).
NAME: Final = "gradpipe-dashboard"
PAGE_ROUTE: Final = "/gradpipe"
JSON_ROUTE: Final = "/json/gradpipe.json"
#: Seconds between the page's refreshes (``?refresh=N`` overrides, 0 stops).
REFRESH: Final = 2


class GradpipeDashboard(SchedulerPlugin):
    """The scheduler plugin behind ``/gradpipe``, ``/json/gradpipe.json`` and ``gradpipe_*``.

    Parameters
    ----------
    keep : int
        Operations kept for the page (the oldest finished ones are dropped
        first; the totals and Prometheus counters keep counting).
    """

    name = NAME
    idempotent = True  # the preload's instance and a client's are one dashboard

    def __init__(self, keep: int = 200) -> None:
        self.keep = keep
        self.board = Board(keep)
        self.scheduler: Scheduler | None = None

    async def start(self, scheduler: Scheduler) -> None:
        """Replay the events the scheduler holds; mount the routes and the metrics."""
        self.scheduler = scheduler
        self.board = Board(self.keep)
        for when, msg in scheduler.get_events(TOPIC):
            self.board.apply(when, msg)
        _mount_routes(scheduler)
        _Collector.attach(self)

    async def close(self) -> None:
        """Stop feeding ``/metrics`` (the routes answer 404 once the plugin is gone)."""
        _Collector.detach(self)

    def log_event(self, topic: str, msg: Any) -> None:
        """Take a gradpipe event as the scheduler receives it."""
        if topic == TOPIC:
            self.board.apply(time.time(), msg)

    # --- what the page and the metrics read -------------------------------------------
    def live(self, span_ids: Sequence[str]) -> Live:
        """Tasks and bytes of these spans so far, from the scheduler's span extension."""
        out = Live()
        spans = getattr(self.scheduler, "extensions", {}).get("spans")
        if spans is None:
            return out
        for span_id in span_ids:
            span = spans.spans.get(span_id)
            if span is None:
                continue
            states = span.states
            total = sum(states.values())
            out.tasks += total
            out.erred += states.get("erred", 0)
            done = states.get("memory", 0) + states.get("forgotten", 0)
            out.done += total - states.get("erred", 0) if span.done else done
            for key, value in _metrics(span).items():
                activity, unit = key[-2], key[-1]
                if key[0] != "execute" or unit != "bytes":
                    continue
                if activity == READ:
                    out.read += value
                elif activity == WRITE:
                    out.written += value
                elif activity == RAW:
                    out.raw += value
        return out

    def document(self) -> dict[str, Any]:
        """What ``/json/gradpipe.json`` serves."""
        scheduler = self.scheduler
        return self.board.document(
            time.time(),
            self.live,
            scheduler=getattr(scheduler, "address", None),
            tasks=_task_counts(scheduler),
        )


def _metrics(span: Any) -> Mapping[tuple[Hashable, ...], float]:
    """A span's worker metrics (its own and its children's), as the scheduler summed them."""
    metrics: Mapping[tuple[Hashable, ...], float] = span.cumulative_worker_metrics
    return metrics


def _task_counts(scheduler: Scheduler | None) -> dict[str, dict[str, int]]:
    """Per gradpipe task prefix, tasks that reached memory and that erred, ever."""
    if scheduler is None:
        return {}
    return {
        name: {
            "memory": int(prefix.state_counts["memory"]),
            "erred": int(prefix.state_counts["erred"]),
        }
        for name, prefix in scheduler.task_prefixes.items()
        if name.startswith("gradpipe-")
    }


def _plugin(scheduler: Scheduler | None) -> GradpipeDashboard | None:
    plugin = getattr(scheduler, "plugins", {}).get(NAME)
    return plugin if isinstance(plugin, GradpipeDashboard) else None


# --- HTTP -------------------------------------------------------------------------------
class _Handler(RequestHandler):
    """Finds the scheduler's plugin at request time: the routes outlive a re-registration."""

    def _document(self) -> dict[str, Any] | None:
        plugin = _plugin(self.server)
        if plugin is None:
            self.set_status(404)
            self.write("the gradpipe dashboard plugin is not registered on this scheduler")
            return None
        return plugin.document()


class PageHandler(_Handler):
    """``/gradpipe``."""

    def get(self) -> None:
        doc = self._document()
        if doc is None:
            return
        try:
            refresh = max(0, int(self.get_argument("refresh", str(REFRESH))))
        except ValueError:
            refresh = REFRESH
        self.set_header("Content-Type", "text/html; charset=utf-8")
        self.write(render_page(doc, refresh=refresh))


class JSONHandler(_Handler):
    """``/json/gradpipe.json``."""

    def get(self) -> None:
        doc = self._document()
        if doc is None:
            return
        self.set_header("Content-Type", "application/json")
        self.write(json.dumps(doc))


def _mount_routes(scheduler: Scheduler) -> None:
    """Add the routes to the scheduler's dashboard server, once per scheduler.

    Under the prefix distributed's own routes have (``--dashboard-prefix``).
    """
    app = getattr(scheduler, "http_application", None)
    if app is None or getattr(app, "_gradpipe_routes", False):
        return
    prefix = route_prefix(app)
    handlers = [
        (prefix + PAGE_ROUTE, PageHandler, {"dask_server": scheduler}),
        (prefix + JSON_ROUTE, JSONHandler, {"dask_server": scheduler}),
    ]
    app.add_handlers(r".*", handlers)
    app._gradpipe_routes = True


def route_prefix(app: Any) -> str:
    """The path prefix of distributed's routes on ``app`` ("" at the root, else "/prefix").

    The scheduler does not keep the ``http_prefix`` it was started with; its
    ``/health`` route, which every scheduler serves, carries it.
    """
    for rule in getattr(getattr(app, "wildcard_router", None), "rules", ()):
        pattern = getattr(getattr(rule.matcher, "regex", None), "pattern", "")
        if pattern.endswith("/health$"):
            return pattern.removesuffix("/health$").rstrip("/")
    return ""


# --- Prometheus -------------------------------------------------------------------------
class _Collector:
    """The ``gradpipe_*`` metrics, on ``prometheus_client``'s default registry.

    distributed's ``/metrics`` serves that registry. One collector per process
    (a registry refuses two with the same metric names), reading the plugin
    started last: with several schedulers in one process (tests), the newest.
    """

    instance: ClassVar[_Collector | None] = None

    def __init__(self) -> None:
        self.plugin: GradpipeDashboard | None = None

    @classmethod
    def attach(cls, plugin: GradpipeDashboard) -> None:
        try:
            import prometheus_client
        except ImportError:  # distributed serves no /metrics without it either
            return
        if cls.instance is None:
            cls.instance = cls()
            prometheus_client.REGISTRY.register(cls.instance)
        cls.instance.plugin = plugin

    @classmethod
    def detach(cls, plugin: GradpipeDashboard) -> None:
        if cls.instance is not None and cls.instance.plugin is plugin:
            cls.instance.plugin = None

    def collect(self) -> Iterator[Any]:
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

        plugin = self.plugin
        if plugin is None:
            return
        board = plugin.board
        ops = CounterMetricFamily(
            "gradpipe_operations", "gradpipe operations ended", labels=["kind", "state"]
        )
        bytes_in = CounterMetricFamily(
            "gradpipe_input_bytes", "bytes taken in by ended operations", labels=["kind"]
        )
        stored = CounterMetricFamily(
            "gradpipe_stored_bytes", "new bytes stored by ended operations", labels=["kind"]
        )
        failures = CounterMetricFamily(
            "gradpipe_failed_inputs", "inputs (dumps, steps) that failed", labels=["kind"]
        )
        seconds = CounterMetricFamily(
            "gradpipe_operation_seconds", "wall time of ended operations", labels=["kind"]
        )
        for kind, totals in sorted(board.totals.items()):
            for state, count in totals.ended.items():
                ops.add_metric([kind, state], count)
            bytes_in.add_metric([kind], totals.bytes_in)
            stored.add_metric([kind], totals.bytes_stored)
            failures.add_metric([kind], totals.failures)
            seconds.add_metric([kind], totals.seconds)
        running = GaugeMetricFamily(
            "gradpipe_operations_running", "gradpipe operations running", labels=["kind"]
        )
        running_in = GaugeMetricFamily(
            "gradpipe_running_input_bytes",
            "bytes taken in so far by running operations",
            labels=["kind"],
        )
        counts: dict[str, list[float]] = {kind: [0, 0.0] for kind in board.totals}
        for record in board.running():
            entry = counts.setdefault(record.kind, [0, 0.0])
            entry[0] += 1
            entry[1] += record.bytes_in(plugin.live(record.spans))
        for kind, (n, nbytes) in sorted(counts.items()):
            running.add_metric([kind], n)
            running_in.add_metric([kind], nbytes)
        tasks = CounterMetricFamily(
            "gradpipe_tasks", "gradpipe tasks finished, by prefix", labels=["prefix", "state"]
        )
        for prefix, states in sorted(_task_counts(plugin.scheduler).items()):
            for state, n in states.items():
                tasks.add_metric([prefix, state], n)
        yield from (ops, bytes_in, stored, failures, seconds, running, running_in, tasks)


# --- preload ----------------------------------------------------------------------------
def dask_setup(scheduler: Scheduler) -> None:
    """``dask scheduler --preload gradpipe.dashboard``: the scheduler starts the plugin."""
    from distributed import Scheduler

    if not isinstance(scheduler, Scheduler):
        raise TypeError(
            f"gradpipe.dashboard is a scheduler preload, not one for a {type(scheduler).__name__}: "
            "use `dask scheduler --preload gradpipe.dashboard`"
        )
    scheduler.add_plugin(GradpipeDashboard(), idempotent=True)
