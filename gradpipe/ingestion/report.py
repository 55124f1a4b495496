"""What :func:`gradpipe.ingest` reports: dumps ingested, skipped, failed, and what was written."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from dask.utils import format_bytes

from gradpipe.core.chain import ChainTotals
from gradpipe.core.display import printable
from gradpipe.core.html import ReportHtml
from gradpipe.ingestion.discover import Failure
from gradpipe.storage.blocks import WriteStats

if TYPE_CHECKING:
    from gradpipe.core.report import Report
__all__ = ["IngestReport"]

#: Below this fraction saved, the report says the deltas did not pay.
_DELTAS_PAY = 0.05


@dataclass
class IngestReport(ReportHtml):
    """What an ingest did: counts, bytes, failures, and the run it committed."""

    run: str
    run_id: str | None = None
    ingested: int = 0
    skipped: int = 0
    repaired: int = 0
    failures: list[Failure] = field(default_factory=list)
    tensors: int = 0
    raw_bytes: int = 0
    writes: WriteStats = field(default_factory=WriteStats)
    nonfinite: list[str] = field(default_factory=list)
    seconds: float = 0.0
    dashboard: str | None = None
    chains: ChainTotals | None = None  # a --delta ingest: what chaining did

    @property
    def ok(self) -> bool:
        """True when no dump failed."""
        return not self.failures

    @property
    def ratio(self) -> float:
        """Raw bytes ingested per new byte stored (dedup and compression)."""
        return (
            self.raw_bytes / self.writes.stored_bytes if self.writes.stored_bytes else float("inf")
        )

    @property
    def mib_per_second(self) -> float:
        """Raw MiB ingested per second of wall time."""
        return self.raw_bytes / 2**20 / self.seconds if self.seconds else 0.0

    def to_dict(self) -> dict[str, Any]:
        """JSON-able form (what ``gradpipe ingest --json`` prints)."""
        return {
            "ok": self.ok,
            "run": self.run,
            "run_id": self.run_id,
            "ingested": self.ingested,
            "skipped": self.skipped,
            "repaired": self.repaired,
            "failed": len(self.failures),
            "failures": [f.to_dict() for f in self.failures],
            "tensors": self.tensors,
            "raw_bytes": self.raw_bytes,
            "stored_bytes": self.writes.stored_bytes,
            "ratio": round(self.ratio, 3) if self.writes.stored_bytes else None,
            "blocks_written": self.writes.blocks_written,
            "blocks_reused": self.writes.blocks_reused,
            "zero_chunks": self.writes.zero_chunks,
            "inline_chunks": self.writes.inline_chunks,
            "nonfinite": self.nonfinite,
            "seconds": round(self.seconds, 3),
            "mib_per_second": round(self.mib_per_second, 1),
            "dashboard": self.dashboard,
            "chains": self.chains.to_dict() if self.chains is not None else None,
        }

    def summary(self) -> str:
        """A few lines for people."""
        lines = [
            f"run {printable(self.run)}: {self.ingested} dumps ingested, {self.skipped} skipped "
            f"(already recorded), {len(self.failures)} failed"
            + (f", {self.repaired} repaired" if self.repaired else ""),
            f"{self.tensors} tensors, {format_bytes(self.raw_bytes)} raw -> "
            f"{format_bytes(self.writes.stored_bytes)} new stored"
            + (f" (ratio {self.ratio:.2f})" if self.writes.stored_bytes else ""),
            f"blocks written {self.writes.blocks_written}, reused {self.writes.blocks_reused}, "
            f"all-zero chunks {self.writes.zero_chunks}, small chunks kept in their manifest "
            f"{self.writes.inline_chunks}; {self.seconds:.1f} s, "
            f"{self.mib_per_second:.0f} MiB/s",
        ]
        if self.chains is not None:
            lines.append(_describe_chains(self.chains))
        lines += [f"warning: {w}" for w in self.nonfinite]
        lines += [
            f"FAILED step {f.step} peer {printable(f.peer)}: {f.reason}" for f in self.failures
        ]
        if self.dashboard:
            lines.append(f"dashboard: {self.dashboard}")
        return "\n".join(lines)


def _describe_chains(chains: ChainTotals) -> str:
    """The report's line on a --delta ingest, honest when the deltas did not pay."""
    text = (
        f"delta chains: {chains.delta_chunks} chunks stored as deltas, {chains.full_chunks} in "
        f"full, {chains.unchanged_chunks} unchanged; deltas saved "
        f"{format_bytes(chains.saved_bytes)} of {format_bytes(chains.full_bytes)} "
        f"({chains.saved_fraction:.1%}) against storing them in full; deepest chain "
        f"{chains.max_depth}"
    )
    if chains.full_bytes and chains.saved_fraction < _DELTAS_PAY:
        text += (
            " -- deltas did not pay on these dumps (consecutive gradients are uncorrelated, "
            "see docs/design/008); --delta pays on parameters and optimizer state"
        )
    return text


if TYPE_CHECKING:
    # mypy checks that the report has the shape every operation's report shares.
    _IS_A_REPORT: type[Report] = IngestReport
