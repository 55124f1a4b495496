"""The dashboard's parts without a scheduler: events, the board, the page, the metrics.

Operations report through ``Client.log_event`` (:mod:`gradpipe.graph.telemetry`);
here a recording stand-in takes the client's place, and the board gets the
events directly. ``tests/test_dashboard_cluster.py`` runs it all on real
``dask scheduler`` processes.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import pytest

from gradpipe.dashboard.board import Board, Live
from gradpipe.dashboard.page import render_page
from gradpipe.graph.runner import Runner
from gradpipe.graph.telemetry import MAX_FAILURES, TOPIC, graph_operation, operation, reported

pytest.importorskip("distributed")


class Recorder:
    """Stands in for a ``distributed.Client``: keeps what ``log_event`` was given."""

    def __init__(self) -> None:
        self.events: list[dict[str, Any]] = []

    def log_event(self, topic: str, msg: dict[str, Any]) -> None:
        assert topic == TOPIC
        self.events.append(msg)


class Report:
    """A report of the shape every operation returns."""

    def __init__(self, ok: bool = True, **figures: Any) -> None:
        self._ok, self.figures = ok, figures

    @property
    def ok(self) -> bool:
        return self._ok

    def to_dict(self) -> dict[str, Any]:
        return {"ok": self._ok, **self.figures, "failures": [{"nested": "dropped"}]}

    def summary(self) -> str:
        return "a report"


def _no_live(spans: Sequence[str]) -> Live:
    return Live()


def _ingest_events(board: Board, op: str = "op1", *, t: float = 100.0, **end: Any) -> None:
    board.apply(t, {"event": "start", "operation": op, "kind": "ingest", "run": "exp7",
                    "store": "s3://b/archive"})  # fmt: skip
    board.apply(t + 1, {"event": "graph", "operation": op, "stage": "gradpipe-ingest",
                        "span": f"span-{op}", "tasks": 40})  # fmt: skip
    figures = {"raw_bytes": 4 << 20, "stored_bytes": 1 << 20, "seconds": 2.0, "run_id": "b3:r1"}
    board.apply(
        t + 2,
        {"event": "end", "operation": op, "state": "done", "figures": figures,
         "failures": [], "failed": 0, "commit": "b3:r1", **end},
    )  # fmt: skip


# --- telemetry ----------------------------------------------------------------------
def test_an_operation_on_a_client_logs_start_graphs_and_end() -> None:
    client = Recorder()
    runner = Runner(client)  # type: ignore[arg-type]
    with operation(runner, "ingest", run="exp7", store="/archive") as op:
        with graph_operation(client, "gradpipe-ingest") as same:  # type: ignore[arg-type]
            assert same is op  # a graph inside an operation is one of its stages
            same.graph("gradpipe-ingest", "span-1", 12)
        failures = [f"step {i} peer p: bad" for i in range(MAX_FAILURES + 5)]
        op.finish(Report(ok=False, raw_bytes=10, run_id="b3:x"), failures=failures, commit="b3:x")
    start, graph, end = client.events
    assert start == {"event": "start", "operation": op.id, "kind": "ingest", "run": "exp7",
                     "store": "/archive"}  # fmt: skip
    assert graph["stage"] == "gradpipe-ingest"
    assert (graph["span"], graph["tasks"]) == ("span-1", 12)
    assert end["state"] == "failed"
    assert end["figures"] == {"raw_bytes": 10, "run_id": "b3:x"}  # scalars only, no "ok"
    assert end["failed"] == MAX_FAILURES + 5
    assert len(end["failures"]) == MAX_FAILURES
    assert end["commit"] == "b3:x"


def test_an_operation_that_raises_ends_as_error_and_a_lone_graph_is_its_own() -> None:
    client = Recorder()
    with pytest.raises(ValueError, match="boom"), operation(Runner(client), "aggregate"):  # type: ignore[arg-type]
        raise ValueError("boom")
    assert [e["event"] for e in client.events] == ["start", "end"]
    assert client.events[-1]["state"] == "error"
    assert "ValueError: boom" in client.events[-1]["error"]

    client.events.clear()
    with graph_operation(client, "gradpipe-restore") as op:  # type: ignore[arg-type]
        op.graph("gradpipe-restore", "span-2", 3)
    assert [e["event"] for e in client.events] == ["start", "graph", "end"]
    assert client.events[0]["kind"] == "restore"
    assert client.events[-1]["state"] == "done"


def test_without_a_client_nothing_is_sent() -> None:
    with operation(Runner(), "ingest", run="r") as op:  # local threads
        op.finish(Report(), failures=[], commit=None)
    with operation(None, "aggregate") as op:
        op.finish(Report(), failures=[], commit=None)
    assert op.client is None


def test_reported_reads_store_run_and_runner_of_the_call() -> None:
    client = Recorder()

    class Store:
        url = "memory://x"

    @reported("aggregate", lambda r: ["step 1: no"], lambda r: "b3:c")
    def work(store: Store, *, run: str, runner: Runner | None = None) -> Report:
        return Report(ok=False, computed=1)

    work(Store(), run="r", runner=Runner(client))  # type: ignore[arg-type]
    start, end = client.events
    assert (start["kind"], start["run"], start["store"]) == ("aggregate", "r", "memory://x")
    assert (end["state"], end["failures"], end["commit"]) == ("failed", ["step 1: no"], "b3:c")
    client.events.clear()
    work(Store(), run="r")  # no runner: local threads, nothing sent
    assert client.events == []


# --- the board ----------------------------------------------------------------------
def test_board_document_of_an_ended_ingest() -> None:
    board = Board()
    _ingest_events(board)
    doc = board.document(110.0, _no_live, scheduler="tcp://s:8786")
    [op] = doc["operations"]
    assert (op["kind"], op["run"], op["state"], op["store"]) == (
        "ingest", "exp7", "done", "s3://b/archive"
    )  # fmt: skip
    assert (op["bytes_in"], op["bytes_stored"], op["ratio"]) == (4 << 20, 1 << 20, 4.0)
    assert op["mib_per_second"] == 2.0  # 4 MiB in the report's 2 s
    assert op["stages"] == [{"stage": "gradpipe-ingest", "span": "span-op1", "tasks": 40}]
    assert op["commit"] == "b3:r1"
    assert doc["runs"] == [
        {"run": "exp7", "commits": [{"time": 102.0, "kind": "ingest", "operation": "op1",
                                     "commit": "b3:r1", "store": "s3://b/archive"}]}
    ]  # fmt: skip
    [totals] = doc["totals"]
    assert (totals["kind"], totals["done"], totals["running"], totals["ratio"]) == (
        "ingest", 1, 0, 4.0
    )  # fmt: skip
    assert doc["scheduler"] == "tcp://s:8786"


def test_board_running_operation_shows_live_span_figures() -> None:
    board = Board()
    board.apply(10.0, {"event": "start", "operation": "a", "kind": "aggregate", "run": "r"})
    board.apply(10.5, {"event": "graph", "operation": "a", "stage": "gradpipe-aggregate",
                       "span": "s1", "tasks": 9})  # fmt: skip
    asked: list[list[str]] = []

    def live(spans: Sequence[str]) -> Live:
        asked.append(list(spans))
        return Live(tasks=9, done=3, read=5 << 20, written=1 << 20, raw=2 << 20)

    [op] = board.document(14.0, live)["operations"]
    assert asked == [["s1"]]
    assert op["state"] == "running"
    assert op["tasks"] == {"total": 9, "done": 3, "erred": 0}
    assert (op["bytes_in"], op["bytes_read"], op["bytes_stored"]) == (2 << 20, 5 << 20, 1 << 20)
    assert op["ratio"] == 2.0
    assert op["seconds"] == 4.0
    assert op["mib_per_second"] == 0.5
    assert board.document(14.0, live)["totals"][0]["running"] == 1


def test_board_failures_commits_and_errors() -> None:
    board = Board()
    _ingest_events(board, "ok1", t=1.0)
    board.apply(5.0, {"event": "start", "operation": "bad", "kind": "ingest", "run": "exp7"})
    board.apply(6.0, {"event": "end", "operation": "bad", "state": "failed", "figures": {},
                      "failures": ("step 3 peer <p1>: truncated",), "failed": 4,
                      "commit": None})  # fmt: skip
    board.apply(7.0, {"event": "start", "operation": "err", "kind": "aggregate", "run": "exp7"})
    board.apply(8.0, {"event": "end", "operation": "err", "state": "error",
                      "error": "StorageError: S3 said 503"})  # fmt: skip
    doc = board.document(9.0, _no_live)
    states = {op["id"]: op["state"] for op in doc["operations"]}
    assert states == {"ok1": "done", "bad": "failed", "err": "error"}
    assert [op["id"] for op in doc["operations"]] == ["err", "bad", "ok1"]  # newest first
    assert len(doc["runs"][0]["commits"]) == 1  # a failed or raising operation committed nothing
    totals = {t["kind"]: t for t in doc["totals"]}
    assert (totals["ingest"]["done"], totals["ingest"]["failed"]) == (1, 1)
    assert totals["ingest"]["failures"] == 4
    assert totals["aggregate"]["error"] == 1

    page = render_page(doc, refresh=2)
    assert "step 3 peer &lt;p1&gt;: truncated" in page  # client text is escaped
    assert "<p1>" not in page
    assert "... and 3 more" in page
    assert "StorageError: S3 said 503" in page
    assert '<meta http-equiv="refresh" content="2">' in page
    assert "http-equiv" not in render_page(doc, refresh=0)


def test_board_ignores_malformed_events_and_counts_an_end_once() -> None:
    board = Board()
    for msg in (None, "text", [], {"event": "start"}, {"operation": "x"},
                {"event": 3, "operation": "x"}, {"event": "start", "operation": ""}):  # fmt: skip
        board.apply(1.0, msg)
    assert board.document(2.0, _no_live)["operations"] == []
    # An end whose start fell out of the scheduler's log still shows, once.
    end = {"event": "end", "operation": "y", "kind": "ingest", "state": "done",
           "figures": {"raw_bytes": 8, "stored_bytes": "x", "nested": {"a": 1}}}  # fmt: skip
    board.apply(3.0, end)
    board.apply(4.0, end)
    board.apply(4.0, {"event": "graph", "operation": "y", "stage": 1, "span": "s", "tasks": 1})
    [op] = board.document(5.0, _no_live)["operations"]
    assert (op["kind"], op["state"], op["bytes_in"], op["stages"]) == ("ingest", "done", 8, [])
    assert op["figures"] == {"raw_bytes": 8, "stored_bytes": "x"}
    assert op["bytes_stored"] == 0  # not a number: not taken
    assert board.totals["ingest"].ended["done"] == 1


def test_board_keeps_running_operations_and_totals_when_it_trims() -> None:
    board = Board(keep=3)
    board.apply(0.0, {"event": "start", "operation": "long", "kind": "ingest"})
    for i in range(6):
        _ingest_events(board, f"op{i}", t=float(i + 1))
    kept = [op["id"] for op in board.document(10.0, _no_live)["operations"]]
    assert kept == ["op5", "op4", "long"]
    assert board.totals["ingest"].ended["done"] == 6
    assert board.totals["ingest"].bytes_in == 6 * (4 << 20)


# --- Prometheus ---------------------------------------------------------------------
def test_metrics_of_the_board() -> None:
    prometheus_client = pytest.importorskip("prometheus_client")
    from gradpipe.dashboard.plugin import GradpipeDashboard, _Collector

    plugin = GradpipeDashboard()
    _ingest_events(plugin.board)
    plugin.board.apply(50.0, {"event": "start", "operation": "run2", "kind": "aggregate"})
    collector = _Collector()
    collector.plugin = plugin
    registry = prometheus_client.CollectorRegistry()
    registry.register(collector)  # type: ignore[arg-type]
    from prometheus_client.parser import text_string_to_metric_families

    text = prometheus_client.generate_latest(registry).decode()
    values = {
        (sample.name, tuple(sorted(sample.labels.items()))): sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
    }
    ingest = (("kind", "ingest"),)
    assert values["gradpipe_operations_total", (*ingest, ("state", "done"))] == 1
    assert values["gradpipe_operations_total", (*ingest, ("state", "failed"))] == 0
    assert values["gradpipe_input_bytes_total", ingest] == 4 << 20
    assert values["gradpipe_stored_bytes_total", ingest] == 1 << 20
    assert values["gradpipe_operation_seconds_total", ingest] == 2.0
    assert values["gradpipe_failed_inputs_total", ingest] == 0
    assert values["gradpipe_operations_running", (("kind", "aggregate"),)] == 1
    collector.plugin = None
    assert "gradpipe_" not in prometheus_client.generate_latest(registry).decode()
