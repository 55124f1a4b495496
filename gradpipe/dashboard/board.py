"""The gradpipe dashboard's state: operations rebuilt from their scheduler events.

Pure: it takes the events of :mod:`gradpipe.graph.telemetry` (with the time the
scheduler received them) and, when asked for its document, the live figures of
each operation's spans through a callback, so it is tested without a scheduler.
Events come from any client of the scheduler, so each one is checked and a
malformed one is dropped, never trusted.
"""

from __future__ import annotations

from collections import OrderedDict, defaultdict, deque
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Final

__all__ = ["Board", "Live", "OperationRecord", "Totals"]

#: Operations kept (the oldest finished ones go first).
KEEP: Final = 200
#: Commits listed per run.
COMMITS_PER_RUN: Final = 5
_STATES: Final = ("running", "done", "failed", "error")


@dataclass
class Live:
    """What the scheduler's spans say about an operation's graphs so far."""

    tasks: int = 0
    done: int = 0
    erred: int = 0
    read: float = 0.0  # bytes (gradpipe.meter's activities)
    written: float = 0.0
    raw: float = 0.0


@dataclass
class OperationRecord:
    """One operation as its events describe it."""

    id: str
    kind: str
    run: str | None
    store: str | None
    started: float
    ended: float | None = None
    state: str = "running"
    stages: list[tuple[str, str, int]] = field(default_factory=list)  # stage, span id, tasks
    figures: dict[str, Any] = field(default_factory=dict)
    failures: list[str] = field(default_factory=list)
    failed: int = 0
    commit: str | None = None
    error: str | None = None

    @property
    def spans(self) -> list[str]:
        """The ids of the spans its graphs ran in."""
        return [span for _, span, _ in self.stages]

    def bytes_in(self, live: Live) -> float:
        """Bytes it took in: its report's raw (ingest) or computed (aggregate) bytes, or live."""
        for key in ("raw_bytes", "logical_bytes"):
            value = self.figures.get(key)
            if isinstance(value, int | float) and not isinstance(value, bool):
                return float(value)
        return live.raw

    def bytes_stored(self, live: Live) -> float:
        """New bytes it stored: its report's, or live."""
        value = self.figures.get("stored_bytes")
        if isinstance(value, int | float) and not isinstance(value, bool):
            return float(value)
        return live.written

    def seconds(self, now: float) -> float:
        """Wall time: its report's, else from its first to its last event (or now)."""
        value = self.figures.get("seconds")
        if isinstance(value, int | float) and not isinstance(value, bool) and value > 0:
            return float(value)
        return max(0.0, (self.ended if self.ended is not None else now) - self.started)

    def to_dict(self, live: Live, now: float) -> dict[str, Any]:
        """The JSON form: identity, state, figures (normalised across kinds) and the report's."""
        bytes_in, stored, seconds = self.bytes_in(live), self.bytes_stored(live), self.seconds(now)
        return {
            "id": self.id,
            "kind": self.kind,
            "run": self.run,
            "store": self.store,
            "state": self.state,
            "started": self.started,
            "ended": self.ended,
            "seconds": round(seconds, 3),
            "stages": [{"stage": s, "span": i, "tasks": n} for s, i, n in self.stages],
            "tasks": {"total": live.tasks, "done": live.done, "erred": live.erred},
            "bytes_in": int(bytes_in),
            "bytes_read": int(live.read),
            "bytes_stored": int(stored),
            "ratio": round(bytes_in / stored, 3) if stored else None,
            "mib_per_second": round(bytes_in / 2**20 / seconds, 1) if seconds else None,
            "failed": self.failed,
            "failures": list(self.failures),
            "commit": self.commit,
            "error": self.error,
            "figures": dict(self.figures),
        }


@dataclass
class Totals:
    """Cumulative figures of one kind of operation (never decrease: Prometheus counters)."""

    ended: dict[str, int] = field(default_factory=lambda: dict.fromkeys(_STATES[1:], 0))
    bytes_in: float = 0.0
    bytes_stored: float = 0.0
    failures: int = 0
    seconds: float = 0.0


class Board:
    """Operations by id, the latest commits and analyses per run, totals per kind."""

    def __init__(self, keep: int = KEEP, commits_per_run: int = COMMITS_PER_RUN) -> None:
        self.keep = keep
        self.operations: OrderedDict[str, OperationRecord] = OrderedDict()
        self.commits: defaultdict[str, deque[dict[str, Any]]] = defaultdict(
            lambda: deque(maxlen=commits_per_run)
        )
        self.totals: defaultdict[str, Totals] = defaultdict(Totals)
        #: The headline figures of the latest ``analyze`` of each run.
        self.analyses: dict[str, dict[str, Any]] = {}

    def apply(self, when: float, msg: Any) -> None:
        """Take one event received at ``when``; a malformed one is ignored."""
        if not isinstance(msg, Mapping):
            return
        event, op_id = msg.get("event"), msg.get("operation")
        if not isinstance(event, str) or not isinstance(op_id, str) or not op_id:
            return
        record = self.operations.get(op_id)
        if record is None:
            # A start that fell out of the scheduler's event log still leaves its graphs and end.
            record = OperationRecord(
                op_id, _text(msg.get("kind")) or "unknown", None, None, started=when
            )
            self.operations[op_id] = record
            self._trim()
        if event == "start":
            record.kind = _text(msg.get("kind")) or record.kind
            record.run, record.store = _text(msg.get("run")), _text(msg.get("store"))
            record.started = when
        elif event == "graph":
            stage, span, tasks = msg.get("stage"), msg.get("span"), msg.get("tasks")
            if isinstance(stage, str) and isinstance(span, str) and isinstance(tasks, int):
                record.stages.append((stage, span, tasks))
        elif event == "end" and record.ended is None:
            self._end(record, when, msg)

    def _end(self, record: OperationRecord, when: float, msg: Mapping[str, Any]) -> None:
        state = msg.get("state")
        record.state = state if state in _STATES[1:] else "error"
        record.ended = when
        figures = msg.get("figures")
        if isinstance(figures, Mapping):
            record.figures = {
                str(k): v for k, v in figures.items() if isinstance(v, bool | int | float | str)
            }
        failures = msg.get("failures")
        if isinstance(failures, list | tuple):  # msgpack gives lists back as tuples
            record.failures = [str(line) for line in failures]
        failed = msg.get("failed")
        record.failed = failed if isinstance(failed, int) else len(record.failures)
        record.commit = _text(msg.get("commit"))
        record.error = _text(msg.get("error"))
        totals = self.totals[record.kind]
        totals.ended[record.state] += 1
        totals.bytes_in += record.bytes_in(Live())
        totals.bytes_stored += record.bytes_stored(Live())
        totals.failures += record.failed
        totals.seconds += record.seconds(when)
        if record.kind == "analyze" and record.run is not None:
            headlines = {
                key: value
                for key, kinds in _HEADLINES.items()
                if isinstance(value := record.figures.get(key), kinds)
                and not isinstance(value, bool)
            }
            self.analyses[record.run] = {
                **headlines,
                "time": when,
                "operation": record.id,
                "state": record.state,
            }
        if record.run is not None and record.commit is not None:
            self.commits[record.run].appendleft(
                {
                    "time": when,
                    "kind": record.kind,
                    "operation": record.id,
                    "commit": record.commit,
                    "store": record.store,
                }
            )

    def _trim(self) -> None:
        """Forget the oldest finished operations beyond :attr:`keep` (never a running one)."""
        excess = len(self.operations) - self.keep
        if excess <= 0:
            return
        for op_id in [i for i, r in self.operations.items() if r.ended is not None][:excess]:
            del self.operations[op_id]

    def running(self) -> list[OperationRecord]:
        """The operations not ended yet."""
        return [r for r in self.operations.values() if r.ended is None]

    def document(
        self, now: float, live: Callable[[Sequence[str]], Live], **extra: Any
    ) -> dict[str, Any]:
        """Everything the page shows, JSON-able; ``live(span_ids)`` reads the scheduler's spans."""
        operations = [
            r.to_dict(live(r.spans), now) for r in reversed(self.operations.values())
        ]  # newest first
        totals = []
        for kind in sorted(self.totals.keys() | {r.kind for r in self.operations.values()}):
            t = self.totals[kind]
            totals.append(
                {
                    "kind": kind,
                    "running": sum(
                        1 for o in operations if o["kind"] == kind and o["ended"] is None
                    ),
                    **t.ended,
                    "bytes_in": int(t.bytes_in),
                    "bytes_stored": int(t.bytes_stored),
                    "ratio": round(t.bytes_in / t.bytes_stored, 3) if t.bytes_stored else None,
                    "failures": t.failures,
                    "mib_per_second": round(t.bytes_in / 2**20 / t.seconds, 1)
                    if t.seconds
                    else None,
                }
            )
        runs = [
            {"run": run, "commits": list(commits)} for run, commits in sorted(self.commits.items())
        ]
        analyses = [{"run": run, **figures} for run, figures in sorted(self.analyses.items())]
        return {
            "time": now,
            **extra,
            "operations": operations,
            "totals": totals,
            "runs": runs,
            "analyses": analyses,
        }


#: The figures of an ``analyze`` end event the page shows, and their types.
_HEADLINES: Final[dict[str, tuple[type, ...]]] = {
    "spike_count": (int,),
    "first_nonfinite": (str,),
    "outlier_peers": (str,),
    "gns_latest": (int, float),
    "chunks_read": (int,),
}


def _is(value: Any, kinds: tuple[type, ...]) -> bool:
    return isinstance(value, kinds) and not isinstance(value, bool)


def _text(value: Any) -> str | None:
    return value if isinstance(value, str) and value else None
