"""What :func:`gradpipe.aggregate` reports, per step: the aggregate, and the server step if any."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from dask.utils import format_bytes

from gradpipe.core.display import printable
from gradpipe.core.html import ReportHtml
from gradpipe.storage.blocks import WriteStats

if TYPE_CHECKING:
    from gradpipe.core.report import Report

__all__ = ["AggregateReport", "ServerStepOutcome", "StepOutcome"]


@dataclass(frozen=True)
class ServerStepOutcome:
    """What the server optimizer did with one step's aggregate.

    ``applied`` (a new snapshot), ``memoised`` (the chain applied this
    aggregate already), ``skipped`` (with the reason: no aggregate, an
    earlier step not applied, a step before the chain's newest snapshot) or
    ``failed`` (with the reason; nothing written).
    """

    status: str
    snapshot: str | None = None  # the snapshot's id
    reason: str = ""

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {"status": self.status}
        if self.snapshot is not None:
            out["snapshot"] = self.snapshot
        if self.reason:
            out["reason"] = self.reason
        return out


@dataclass(frozen=True)
class StepOutcome:
    """What happened to one step: computed, memoised, skipped (with the reason) or failed."""

    step: int
    status: str
    aggregate: str | None = None
    reason: str = ""
    server: ServerStepOutcome | None = None  # with a server optimizer

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {"step": self.step, "status": self.status}
        if self.aggregate is not None:
            out["aggregate"] = self.aggregate
        if self.reason:
            out["reason"] = self.reason
        if self.server is not None:
            out["server"] = self.server.to_dict()
        return out


@dataclass
class AggregateReport(ReportHtml):
    """What an aggregate call did, per step, and what it wrote.

    With a server optimizer (``method`` one of ``sgd``, ``fedavgm``,
    ``fedadagrad``, ``fedadam``, ``fedyogi``), ``snapshot`` names the chain
    and ``server_optimizer`` its config, and each step says what the server
    step did.
    """

    run: str
    name: str
    method: str
    run_id: str | None = None
    steps: list[StepOutcome] = field(default_factory=list)
    writes: WriteStats = field(default_factory=WriteStats)
    logical_bytes: int = 0
    seconds: float = 0.0
    snapshot: str | None = None
    server_optimizer: dict[str, Any] | None = None

    def _count(self, status: str) -> int:
        return sum(1 for s in self.steps if s.status == status)

    def _server_count(self, status: str) -> int:
        return sum(1 for s in self.steps if s.server is not None and s.server.status == status)

    @property
    def computed(self) -> int:
        return self._count("computed")

    @property
    def memoised(self) -> int:
        return self._count("memoised")

    @property
    def skipped(self) -> int:
        return self._count("skipped")

    @property
    def failed(self) -> int:
        return self._count("failed")

    @property
    def applied(self) -> int:
        """Server steps that wrote a snapshot."""
        return self._server_count("applied")

    @property
    def ok(self) -> bool:
        """True when no step failed (its aggregate, or its server step)."""
        return self.failed == 0 and self._server_count("failed") == 0

    def aggregate_id(self, step: int) -> str | None:
        """The id of the aggregate of ``step`` (computed or memoised), if any."""
        return next((s.aggregate for s in self.steps if s.step == step), None)

    def snapshot_id(self, step: int) -> str | None:
        """The id of the snapshot the server step of ``step`` wrote or found, if any."""
        found = next((s.server for s in self.steps if s.step == step), None)
        return found.snapshot if found is not None else None

    def to_dict(self) -> dict[str, Any]:
        """JSON-able form (what ``gradpipe aggregate --json`` prints)."""
        out = {
            "ok": self.ok,
            "run": self.run,
            "run_id": self.run_id,
            "name": self.name,
            "method": self.method,
            "computed": self.computed,
            "memoised": self.memoised,
            "skipped": self.skipped,
            "failed": self.failed,
            "steps": [s.to_dict() for s in self.steps],
            "logical_bytes": self.logical_bytes,
            "stored_bytes": self.writes.stored_bytes,
            "blocks_written": self.writes.blocks_written,
            "blocks_reused": self.writes.blocks_reused,
            "seconds": round(self.seconds, 3),
        }
        if self.snapshot is not None:
            out["snapshot"] = self.snapshot
            out["server_optimizer"] = self.server_optimizer
            out["server_steps"] = {
                status: self._server_count(status)
                for status in ("applied", "memoised", "skipped", "failed")
            }
        return out

    def summary(self) -> str:
        """A few lines for people."""
        lines = [
            f"run {printable(self.run)}, aggregate {printable(self.name)} ({self.method}): "
            f"{self.computed} steps "
            f"computed, {self.memoised} memoised, {self.skipped} skipped, "
            f"{self.failed} failed",
        ]
        if self.snapshot is not None:
            lines.append(
                f"snapshot {printable(self.snapshot)}: {self.applied} server steps applied, "
                f"{self._server_count('memoised')} memoised, {self._server_count('skipped')} "
                f"skipped, {self._server_count('failed')} failed"
            )
        lines.append(
            f"{format_bytes(self.logical_bytes)} computed -> "
            f"{format_bytes(self.writes.stored_bytes)} new stored, "
            f"blocks written {self.writes.blocks_written}, reused "
            f"{self.writes.blocks_reused}; {self.seconds:.1f} s"
        )
        lines += [f"FAILED step {s.step}: {s.reason}" for s in self.steps if s.status == "failed"]
        lines += [
            f"skipped step {s.step}: {s.reason}"
            for s in self.steps
            if s.status == "skipped" and s.reason
        ]
        for s in self.steps:
            if s.server is not None and s.server.status in ("failed", "skipped"):
                word = "FAILED" if s.server.status == "failed" else "not applied"
                lines.append(f"{word} server step {s.step}: {s.server.reason}")
        return "\n".join(lines)


if TYPE_CHECKING:
    # mypy checks that the report has the shape every operation's report shares.
    _IS_A_REPORT: type[Report] = AggregateReport
