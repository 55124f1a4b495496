"""What each stage of a workflow does: one function per kind, calling gradpipe's operations.

Every function takes the :class:`StageContext` (the store, the runner shared by
all stages) and the stage's checked values, and returns the operation's
:class:`~gradpipe.core.report.Report`. The stages that wrap a single operation
are a line each; ``sample`` and ``snapshot`` have small reports of their own.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Final

from gradpipe.core.display import PATH_LIMIT, printable
from gradpipe.core.html import ReportHtml

if TYPE_CHECKING:
    from gradpipe.core.report import Report
    from gradpipe.graph.runner import Runner
    from gradpipe.storage.store import Store

__all__ = [
    "RUNNERS",
    "AnalyzeStageReport",
    "SampleReport",
    "SnapshotStageReport",
    "StageContext",
    "StatsStageReport",
]


@dataclass(frozen=True)
class StageContext:
    """What every stage shares: the store and the runner its graphs compute on."""

    store: Store
    runner: Runner


@dataclass
class SampleReport(ReportHtml):
    """What the ``sample`` stage did."""

    directory: str
    written: bool
    dumps: int
    states: int

    @property
    def ok(self) -> bool:
        return True

    def to_dict(self) -> dict[str, Any]:
        return {
            "ok": True,
            "directory": self.directory,
            "written": self.written,
            "dumps": self.dumps,
            "states": self.states,
        }

    def summary(self) -> str:
        did = "wrote" if self.written else "found"
        shown = printable(self.directory, limit=PATH_LIMIT)
        return f"{did} {self.dumps} sample dumps and {self.states} states in {shown}"


@dataclass
class SnapshotStageReport(ReportHtml):
    """What the ``snapshot`` stage did: versions taken, steps passed over, files refused."""

    name: str
    taken: list[dict[str, Any]] = field(default_factory=list)
    #: Steps the chain has, or older than its newest (pruned ones included).
    passed: list[int] = field(default_factory=list)
    failures: list[dict[str, Any]] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.failures

    def to_dict(self) -> dict[str, Any]:
        return {
            "ok": self.ok,
            "name": self.name,
            "taken": self.taken,
            "passed": self.passed,
            "failures": self.failures,
        }

    def summary(self) -> str:
        lines = [
            f"snapshot {printable(self.name)}: {len(self.taken)} versions taken, "
            f"{len(self.passed)} steps not newer than the chain's newest, "
            f"{len(self.failures)} failed"
        ]
        lines += [
            f"FAILED {printable(f['path'], limit=PATH_LIMIT)}: {f['reason']}" for f in self.failures
        ]
        return "\n".join(lines)


def _sample(ctx: StageContext, p: dict[str, Any]) -> Report:
    from gradpipe.demo import DEMO_CONFIG
    from gradpipe.testing.training import TrainingConfig, write_sample_run

    root = Path(p["dir"])
    base = DEMO_CONFIG
    config = TrainingConfig(
        vocab_size=base.vocab_size,
        embed_dim=base.embed_dim,
        hidden=base.hidden,
        peers=p.get("peers", base.peers),
        examples_per_peer=base.examples_per_peer,
        steps=p.get("steps", base.steps),
    )
    written = not (root / "dumps").exists()
    if written:  # idempotent: a second run finds the data and writes nothing
        write_sample_run(root, config)
    dumps = sum(1 for _ in (root / "dumps").glob("step=*/peer=*.safetensors"))
    states = sum(1 for _ in (root / "state").glob("step=*.safetensors"))
    return SampleReport(str(root), written, dumps, states)


def _ingest(ctx: StageContext, p: dict[str, Any]) -> Report:
    from gradpipe.ingestion.api import ingest

    pattern = p.pop("pattern")
    return ingest(ctx.store, pattern, runner=ctx.runner, **p)


def _rounds(ctx: StageContext, p: dict[str, Any]) -> Report:
    from gradpipe.aggregation.rounds import rounds

    return rounds(ctx.store, **p)


def _aggregate(ctx: StageContext, p: dict[str, Any]) -> Report:
    from gradpipe.aggregation.api import aggregate

    return aggregate(ctx.store, runner=ctx.runner, **p)


def _snapshot(ctx: StageContext, p: dict[str, Any]) -> Report:
    from gradpipe.core.replay_options import DEFAULT_REPLAY_INTERVAL
    from gradpipe.errors import InvalidInputError, NotFoundError
    from gradpipe.formats.state_file import STATE_FILE_KEY, read_state_file
    from gradpipe.ingestion.discover import parse_pattern
    from gradpipe.snapshots.api import snapshot_versions, write_snapshot

    name, pattern = p["name"], p["pattern"]
    if "://" in pattern:
        raise InvalidInputError(
            f"snapshot stage: state files are read from local disk, not {printable(pattern)}"
        )
    gradient, optimizer = p.get("gradient"), p.get("optimizer")
    if gradient is not None and optimizer is None:
        raise InvalidInputError("snapshot stage: a gradient needs the optimizer")
    interval = p.get("replay_interval", DEFAULT_REPLAY_INTERVAL)
    replay = {"optimizer": optimizer, "replay_interval": interval}
    report = SnapshotStageReport(name)
    try:  # the chain only moves forward: a step it pruned is not taken again
        newest = max(m.step for _, m in snapshot_versions(ctx.store, name))
    except NotFoundError:
        newest = -1
    glob, regex = parse_pattern(pattern)
    files = sorted(
        (int(m.group("step")), str(path))
        for path in Path("/").glob(glob.lstrip("/"))
        if (m := regex.fullmatch(str(path))) is not None
    )
    for step, path in files:
        if step <= newest:
            report.passed.append(step)
            continue
        try:
            state, info = read_state_file(path)
        except (InvalidInputError, OSError) as exc:  # this file: later steps must wait for it
            report.failures.append({"path": path, "step": step, "reason": str(exc)})
            break  # the chain only moves forward: taking step+1 would pass this one over
        meta = {STATE_FILE_KEY: json.dumps(info.to_dict(), separators=(",", ":"))}
        delta = p.get("delta", "int")
        # newer_only: another writer of the chain may have moved it to or past this step
        # meanwhile (then this one writes nothing and passes the step over); storage errors
        # propagate, so the stage is retried (it is idempotent).
        done = write_snapshot(
            ctx.store,
            name,
            state,
            step=step,
            metadata=meta,
            delta=delta,
            newer_only=True,
            gradient=None if gradient is None else gradient.replace("{step}", str(step)),
            **replay,
        )
        if done.written:
            report.taken.append({"step": step, "id": done.id, "path": path})
        else:
            report.passed.append(step)
        newest = step
    return report


@dataclass
class StatsStageReport(ReportHtml):
    """What the ``stats`` stage wrote, and the totals (``gradpipe stats``' figures)."""

    totals: dict[str, Any]
    written: dict[str, str]
    missing_blocks: int

    @property
    def ok(self) -> bool:
        return self.missing_blocks == 0

    def to_dict(self) -> dict[str, Any]:
        return {
            "ok": self.ok,
            "totals": self.totals,
            "written": self.written,
            "missing_blocks": self.missing_blocks,
        }

    def summary(self) -> str:
        t = self.totals
        ratio = t.get("ratio")
        shown = f"{ratio:.2f}" if isinstance(ratio, float) else str(ratio)
        line = (
            f"{t.get('raw_bytes', 0) / 2**20:.1f} MiB raw -> "
            f"{t.get('stored_bytes', 0) / 2**20:.1f} MiB stored (ratio {shown})"
        )
        files = ", ".join(
            # The file written, "a/../b" resolved as the system does (through symlinks).
            f"{k} {printable(str(Path(v).resolve()), limit=PATH_LIMIT)}"
            for k, v in self.written.items()
        )
        missing = (
            f"; {self.missing_blocks} block(s) missing: run verify" if self.missing_blocks else ""
        )
        return line + (f"; wrote {files}" if files else "") + missing


def _stats(ctx: StageContext, p: dict[str, Any]) -> Report:
    from gradpipe.statistics.api import (
        compression_stats,
        records_csv,
        stats_records,
        summarize_stats,
    )

    ds = compression_stats(ctx.store, run=p["run"], aggregate=p.get("aggregate"))
    records = list(stats_records(ds))
    [totals] = list(stats_records(summarize_stats(ds))) or [{}]
    written = {}
    if "csv" in p:
        Path(p["csv"]).write_text(records_csv(records))
        written["csv"] = p["csv"]
    if "json" in p:
        from gradpipe.core.encoding import encode_float

        def safe(r: dict[str, Any]) -> dict[str, Any]:  # JSON has no NaN or infinity
            return {k: encode_float(v) if isinstance(v, float) else v for k, v in r.items()}

        doc = {
            "totals": safe(totals),
            "records": [safe(r) for r in records],
            "attribution": ds.attrs["attribution"],
        }
        Path(p["json"]).write_text(json.dumps(doc))
        written["json"] = p["json"]
    if "plot" in p:
        from gradpipe.statistics.plot import plot_stats

        plot_stats(ds, p["plot"])
        written["plot"] = p["plot"]
    return StatsStageReport(totals, written, int(ds.attrs["missing_blocks"]))


@dataclass
class AnalyzeStageReport(ReportHtml):
    """What the ``analyze`` stage wrote, and the analyses' report."""

    report: Report
    written: dict[str, str]

    @property
    def ok(self) -> bool:
        return self.report.ok

    def to_dict(self) -> dict[str, Any]:
        return {**self.report.to_dict(), "written": self.written}

    def summary(self) -> str:
        files = ", ".join(f"{k} {printable(v, limit=PATH_LIMIT)}" for k, v in self.written.items())
        return self.report.summary() + (f"\nwrote {files}" if files else "")


def _analyze(ctx: StageContext, p: dict[str, Any]) -> Report:
    from gradpipe.analytics.analyze import analyze
    from gradpipe.statistics.api import records_csv

    outputs = {k: p.pop(k) for k in ("csv", "json", "plot") if k in p}
    report = analyze(ctx.store, p.pop("run"), runner=ctx.runner, **p)
    written = {}
    if "csv" in outputs:
        Path(outputs["csv"]).write_text(records_csv(list(report.records())))
        written["csv"] = outputs["csv"]
    if "json" in outputs:
        Path(outputs["json"]).write_text(json.dumps(report.to_dict(), default=str))
        written["json"] = outputs["json"]
    if "plot" in outputs:
        from gradpipe.analytics.plot import plot_report

        plot_report(report, outputs["plot"])
        written["plot"] = outputs["plot"]
    return AnalyzeStageReport(report, written)


def _prune(ctx: StageContext, p: dict[str, Any]) -> Report:
    from gradpipe.snapshots.prune import prune

    return prune(ctx.store, p.pop("snapshot"), **p)


def _gc(ctx: StageContext, p: dict[str, Any]) -> Report:
    from gradpipe.storage.gc import gc

    return gc(ctx.store, **p)


def _verify(ctx: StageContext, p: dict[str, Any]) -> Report:
    from gradpipe.storage.verify import verify

    return verify(ctx.store, **p)


#: The function of each stage kind (its keys are the kinds of ``spec.STAGES``; a test checks).
RUNNERS: Final[dict[str, Callable[[StageContext, dict[str, Any]], Report]]] = {
    "sample": _sample,
    "ingest": _ingest,
    "rounds": _rounds,
    "aggregate": _aggregate,
    "stats": _stats,
    "analyze": _analyze,
    "snapshot": _snapshot,
    "prune": _prune,
    "gc": _gc,
    "verify": _verify,
}
