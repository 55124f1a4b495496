"""What gradpipe's operations tell a Dask scheduler about themselves: the dashboard's data.

An operation (an ingest, an aggregate, a restore...) that computes on a
``distributed`` cluster logs a few small events to the scheduler under the
topic :data:`TOPIC`, through ``Client.log_event``:

``start``
    ``{"event": "start", "operation": ID, "kind": "ingest", "run": ..., "store": ...}``
``graph``
    one per graph computed: its stage (the ``distributed.span`` it runs in,
    e.g. ``"gradpipe-ingest"``), the span's id and the graph's task count;
    the scheduler's span holds the live figures (tasks done, the byte counts
    of :mod:`gradpipe.meter`)
``end``
    the state (``"done"``, ``"failed"`` when some input failed, ``"error"``
    when the operation raised), the scalar figures of its report
    (``raw_bytes``, ``stored_bytes``, ``seconds``...), its failures (a few
    lines) and the run manifest it committed.

The scheduler keeps the events (``Client.get_events("gradpipe")``), and the
scheduler plugin :mod:`gradpipe.dashboard` turns them into a page, JSON and
Prometheus metrics, also for operations that ended before it was registered.
An operation on local threads has no scheduler to tell: nothing is sent and
nothing imported. A graph computed outside any operation (``runner.get``
called directly) is reported as an operation of its own, named after its stage.
"""

from __future__ import annotations

import contextlib
import functools
import uuid
from collections.abc import Callable, Iterator
from contextvars import ContextVar
from typing import TYPE_CHECKING, Any, Final, ParamSpec, TypeVar

if TYPE_CHECKING:
    from distributed import Client

    from gradpipe.core.report import Report
    from gradpipe.graph.runner import Runner

__all__ = ["MAX_FAILURES", "TOPIC", "Operation", "graph_operation", "operation", "reported"]

#: The scheduler event topic of gradpipe's operations.
TOPIC: Final = "gradpipe"
#: Failure lines an end event carries at most (the report has them all).
MAX_FAILURES: Final = 20

P = ParamSpec("P")
R = TypeVar("R", bound="Report")

_CURRENT: ContextVar[Operation | None] = ContextVar("gradpipe_operation", default=None)


class Operation:
    """One operation's reporting to a scheduler; does nothing without a client.

    Made by :func:`operation`; the operation calls :meth:`finish` with its
    report once it knows it.
    """

    def __init__(
        self,
        client: Client | None,
        kind: str,
        *,
        run: str | None = None,
        store: str | None = None,
    ) -> None:
        self.client = client
        self.kind = kind
        self.run = run
        self.store = store
        self.id = uuid.uuid4().hex
        self.ended = False

    def start(self) -> None:
        """Tell the scheduler the operation started."""
        self._log("start", kind=self.kind, run=self.run, store=self.store)

    def graph(self, stage: str, span_id: str, tasks: int) -> None:
        """Tell the scheduler a graph of ``tasks`` tasks runs in span ``span_id``."""
        self._log("graph", stage=stage, span=span_id, tasks=tasks)

    def finish(self, report: Report, *, failures: list[str], commit: str | None) -> None:
        """Tell the scheduler the operation ended, with its report's figures.

        ``failures`` are one line each (the first :data:`MAX_FAILURES` are
        sent); ``commit`` is the run manifest the operation committed, None
        if it committed nothing (everything skipped, or failed).
        """
        figures = {
            key: value
            for key, value in report.to_dict().items()
            if isinstance(value, bool | int | float | str) and key != "ok"
        }
        self._end(
            "done" if report.ok else "failed",
            figures=figures,
            failures=failures[:MAX_FAILURES],
            failed=len(failures),
            commit=commit,
        )

    def _end(self, state: str, **fields: Any) -> None:
        if not self.ended:
            self.ended = True
            self._log("end", state=state, **fields)

    def _raised(self, exc: BaseException) -> None:
        """End as ``"error"``; a scheduler that cannot hear it must not hide ``exc``."""
        with contextlib.suppress(Exception):
            self._end("error", error=f"{type(exc).__name__}: {exc}"[:500])

    def _log(self, event: str, **fields: Any) -> None:
        if self.client is not None:
            self.client.log_event(TOPIC, {"event": event, "operation": self.id, **fields})


@contextlib.contextmanager
def operation(
    runner: Runner | None, kind: str, *, run: str | None = None, store: str | None = None
) -> Iterator[Operation]:
    """Report the operation of ``kind`` in this block to ``runner``'s scheduler, if it has one.

    The graphs ``runner`` computes in the block are reported as the
    operation's stages. An exception ends it as ``"error"``; a block left
    without :meth:`Operation.finish` ends it as ``"done"``.
    """
    client = runner.client if runner is not None else None
    op = Operation(client, kind, run=run, store=store)
    if client is None:
        yield op
        return
    op.start()
    token = _CURRENT.set(op)
    try:
        yield op
    except BaseException as exc:
        op._raised(exc)
        raise
    finally:
        _CURRENT.reset(token)
    op._end("done")


@contextlib.contextmanager
def graph_operation(client: Client, stage: str) -> Iterator[Operation]:
    """The operation a graph on ``client`` belongs to: the current one, or one of its own."""
    current = _CURRENT.get()
    if current is not None and current.client is client:
        yield current
        return
    op = Operation(client, stage.removeprefix("gradpipe-"))
    op.start()
    try:
        yield op
    except BaseException as exc:
        op._raised(exc)
        raise
    op._end("done")


def reported(
    kind: str, failures: Callable[[R], list[str]], commit: Callable[[R], str | None]
) -> Callable[[Callable[P, R]], Callable[P, R]]:
    """Report each call of an operation ``f(store, *, run, runner, ...) -> Report`` as ``kind``.

    For operations that compute on the ``runner=`` they are given (an
    operation that opens its own runner uses :func:`operation` inside).
    ``failures`` and ``commit`` read :meth:`Operation.finish`'s arguments
    off the report.
    """

    def decorate(func: Callable[P, R]) -> Callable[P, R]:
        @functools.wraps(func)
        def call(*args: P.args, **kwargs: P.kwargs) -> R:
            store = args[0] if args else kwargs.get("store")
            run = kwargs.get("run")
            with operation(
                kwargs.get("runner"),  # type: ignore[arg-type]
                kind,
                run=run if isinstance(run, str) else None,
                store=getattr(store, "url", None),
            ) as reporting:
                report = func(*args, **kwargs)
                reporting.finish(report, failures=failures(report), commit=commit(report))
            return report

        return call

    return decorate
