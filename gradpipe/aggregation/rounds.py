"""``rounds``: the roster, quorum and per-peer status of each step of a run, kept in the store.

The rounds of run ``r`` live behind the ref ``rounds/r`` as a
:class:`~gradpipe.core.rounds.RoundsManifest` (roster, quorum policy,
deadline, peers marked failed, claims of aggregations in flight); every change
is one compare-and-swap of that ref (:meth:`~gradpipe.storage.refs.Refs.update`),
so concurrent schedulers never lose each other's updates. Statuses are derived
from the run (dumps recorded, aggregates recorded and their inputs) by the pure
rules of :mod:`gradpipe.core.rounds`.

:func:`gradpipe.aggregate` uses :func:`step_rounds` to aggregate ready steps
only, and :func:`claim_aggregation` / :func:`release_aggregation` so two
aggregations of one (run, step, name) cannot both record a result.
"""

from __future__ import annotations

import uuid
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field, replace
from datetime import UTC, datetime
from typing import TYPE_CHECKING, Any

from gradpipe.config import get_seconds
from gradpipe.core.aggregate_manifest import AggregateManifest
from gradpipe.core.display import printable
from gradpipe.core.html import ReportHtml
from gradpipe.core.names import parse_name
from gradpipe.core.rounds import (
    PeerFailure,
    Quorum,
    RoundsManifest,
    StepRound,
    claim_steps,
    evaluate_step,
    parse_quorum,
    parse_time,
    release_claim,
)
from gradpipe.core.run_manifest import DumpManifest, RunManifest
from gradpipe.core.tensor_manifest import TensorManifest
from gradpipe.errors import InvalidInputError
from gradpipe.storage.catalog import read_rounds, read_rounds_at, read_run, rounds_ref
from gradpipe.storage.store import Store

if TYPE_CHECKING:
    from gradpipe.core.report import Report
    from gradpipe.ingestion.discover import Failure

__all__ = [
    "RoundsReport",
    "claim_aggregation",
    "record_ingest_failures",
    "release_aggregation",
    "roster_of",
    "rounds",
    "step_rounds",
]


@dataclass
class RoundsReport(ReportHtml):
    """The rounds of a run: roster, policy, every step's state and its peers' statuses."""

    run: str
    rounds_id: str | None
    roster: list[str]
    inferred: bool
    quorum: Quorum
    deadline: float | None
    start: str | None
    steps: list[StepRound] = field(default_factory=list)

    def _count(self, state: str) -> int:
        return sum(1 for s in self.steps if s.state == state)

    @property
    def ok(self) -> bool:
        """True when no step failed (no peer delivered by the deadline, or all marked failed)."""
        return self._count("failed") == 0

    @property
    def participating(self) -> list[str]:
        """Peers that delivered a usable dump at some step."""
        return sorted({p for s in self.steps for p in s.usable})

    def step(self, step: int) -> StepRound:
        found = next((s for s in self.steps if s.step == step), None)
        if found is None:
            raise InvalidInputError(f"run {printable(self.run)} has no step {step} in its rounds")
        return found

    def stats(self) -> dict[str, int]:
        return {
            "total": len(self.steps),
            "completed": self._count("aggregated"),
            "ready": self._count("ready"),
            "pending": self._count("waiting"),
            "failed": self._count("failed"),
            "participating_peers": len(self.participating),
            "logical_bytes": sum(s.logical_bytes for s in self.steps),
        }

    def to_dict(self) -> dict[str, Any]:
        """JSON-able form (what ``gradpipe rounds --json`` prints)."""
        return {
            "ok": self.ok,
            "run": self.run,
            "rounds_id": self.rounds_id,
            "roster": self.roster,
            "roster_inferred": self.inferred,
            "quorum": self.quorum.describe(),
            "deadline_seconds": self.deadline,
            "start": self.start,
            "stats": self.stats(),
            "participating": self.participating,
            "steps": [s.to_dict() for s in self.steps],
        }

    def summary(self) -> str:
        """A table for people: one line per step."""
        from dask.utils import format_bytes

        st = self.stats()
        roster = ", ".join(self.roster) or "none"
        lines = [
            f"run {printable(self.run)}: roster {roster}"
            + (" (inferred)" if self.inferred else ""),
            f"quorum {self.quorum.describe()}"
            + (f", deadline {self.deadline:g} s after {self.start}" if self.deadline else ""),
            f"steps {st['total']}: {st['completed']} completed, {st['ready']} ready, "
            f"{st['pending']} pending, {st['failed']} failed; {st['participating_peers']} peers "
            f"participating; {format_bytes(st['logical_bytes'])} held",
            f"{'step':>6}  {'state':<10} {'recv':>4} {'aggr':>4} {'pend':>4} {'fail':>4}  why",
        ]
        for s in self.steps:
            lines.append(
                f"{s.step:>6}  {s.state:<10} {s.count('received'):>4} {s.count('aggregated'):>4} "
                f"{s.count('pending'):>4} {s.count('failed'):>4}  {s.reason}"
            )
            lines += [
                f"{'':>8}{p.peer} failed: {p.reason}" for p in s.peers if p.status == "failed"
            ]
        return "\n".join(lines)


def _now(now: datetime | None) -> datetime:
    return datetime.now(UTC) if now is None else parse_time(now, what="now")


def _parse_peer_at(text: str) -> tuple[str, int]:
    peer, sep, step = text.rpartition("@")
    if not sep or not step.isdigit():
        raise InvalidInputError(f"{printable(text)}: expected PEER@STEP, e.g. peer3@12")
    return parse_name(peer, what="peer name"), int(step)


def rounds(
    store: Store,
    *,
    run: str,
    expect: Iterable[str] | None = None,
    quorum: str | Quorum | None = None,
    deadline: float | None = None,
    start: str | datetime | None = None,
    fail: Sequence[str] = (),
    reason: str = "",
    unfail: Sequence[str] = (),
    now: datetime | None = None,
) -> RoundsReport:
    """The rounds of ``run``; with settings given, update them first (one compare-and-swap).

    Parameters
    ----------
    store : Store
        The store (writable when a setting is given).
    run : str
        The run.
    expect : iterable of str, optional
        The roster: the peers expected at every step (default: the peers
        seen in any step of the run).
    quorum : str or Quorum, optional
        ``"all"`` (default), ``"N"`` (at least N peers) or ``"0.75"``/``"75%"``.
    deadline : float, optional
        Seconds after ``start`` after which missing peers count as failed and
        a step with at least one peer is ready. ``0`` clears the deadline.
    start : str or datetime, optional
        When the deadline counts from (default: now, when a deadline is set
        and no start was recorded).
    fail : sequence of ``"PEER@STEP"``
        Mark these peers failed at these steps, with ``reason``; a failed
        peer is left out of the step's aggregate.
    unfail : sequence of ``"PEER@STEP"``
        Clear such marks.
    now : datetime, optional
        The clock (for tests and replay).
    """
    clock = _now(now)
    settings = (expect, quorum, deadline, start)
    if any(x is not None for x in settings) or fail or unfail:
        store.check_writable()
        read_run(store, run)  # the run must exist: no rounds for a mistyped name
        marks = [_parse_peer_at(t) for t in fail]
        clears = [_parse_peer_at(t) for t in unfail]
        if marks and not reason.strip():
            raise InvalidInputError("marking a peer failed needs a reason (--reason TEXT)")
        roster = (
            None
            if expect is None
            else tuple(sorted({parse_name(p, what="peer name") for p in expect}))
        )
        chosen = parse_quorum(quorum) if isinstance(quorum, str) else quorum
        began = None if start is None else parse_time(start, what="start").isoformat()

        def change(current: RoundsManifest) -> RoundsManifest:
            new = current
            if roster is not None:
                new = replace(new, roster=roster)
            if chosen is not None:
                new = replace(new, quorum=chosen)
            if deadline is not None:
                new = replace(new, deadline=deadline or None)
            if began is not None:
                new = replace(new, start=began)
            elif new.deadline is not None and new.start is None:
                new = replace(new, start=clock.isoformat())
            for peer, step in marks:
                new = new.with_failure(PeerFailure(step, peer, reason.strip(), clock.isoformat()))
            for peer, step in clears:
                new = new.without_failure(step, peer)
            return new

        _update(store, run, change, message=f"rounds of run {run}: settings")
    return _report(store, run, clock)


def _update(
    store: Store, run: str, change: Callable[[RoundsManifest], RoundsManifest], *, message: str
) -> RoundsManifest:
    """Apply ``change`` to the run's rounds with one compare-and-swap (retried on races)."""
    done: list[RoundsManifest] = []

    def decide(current: str | None) -> str | None:
        base = read_rounds_at(store, current, run) if current else RoundsManifest(run)
        new = replace(change(base), previous=current)
        done[:] = [new]
        return store.put_manifest(new)

    store.refs.update(rounds_ref(run), decide, message=message)
    return done[0]


def _report(store: Store, run: str, clock: datetime) -> RoundsReport:
    rounds_id, manifest = read_rounds(store, run)
    _, recorded = read_run(store, run)
    steps = sorted(set(recorded.steps) | {f.step for f in manifest.failures})
    evaluated = step_rounds(store, recorded, manifest, steps, now=clock, with_bytes=True)
    return RoundsReport(
        run,
        rounds_id,
        roster_of(manifest, recorded),
        not manifest.roster,
        manifest.quorum,
        manifest.deadline,
        manifest.start,
        [evaluated[s] for s in steps],
    )


def roster_of(manifest: RoundsManifest, recorded: RunManifest) -> list[str]:
    """The expected peers: the roster, else every peer seen, including one whose dumps so
    far all failed to ingest (it is expected too, not forgotten)."""
    if manifest.roster:
        return list(manifest.roster)
    failed_ingests = {f.peer for f in manifest.failures if f.source == "ingest"}
    return sorted({*recorded.peers, *failed_ingests})


def step_rounds(
    store: Store,
    recorded: RunManifest,
    manifest: RoundsManifest,
    steps: Sequence[int],
    *,
    now: datetime | None = None,
    with_bytes: bool = False,
) -> dict[int, StepRound]:
    """Each step's round, from the run's dumps and aggregates and the rounds manifest."""
    clock = _now(now)
    expected = roster_of(manifest, recorded)
    wanted = set(steps)
    used: dict[int, set[str]] = {}
    entries = [a for a in recorded.aggregates if a.step in wanted]
    manifests = store.get_typed_many(
        [a.aggregate for a in entries], AggregateManifest, context=f"run {printable(recorded.run)}"
    )
    for entry, agg in zip(entries, manifests, strict=True):
        for inp in agg.inputs:
            dump = recorded.entry(entry.step, inp.peer)
            if dump is not None and dump.dump == inp.dump:
                used.setdefault(entry.step, set()).add(inp.peer)
    sizes = _dump_bytes(store, recorded, wanted) if with_bytes else {}
    out = {}
    for step in steps:
        received = {d.peer: sizes.get((step, d.peer), 0) for d in recorded.step_dumps(step)}
        out[step] = evaluate_step(
            step,
            expected=expected,
            received=received,
            aggregated=used.get(step, set()),
            has_aggregate=any(a.step == step for a in entries),
            manifest=manifest,
            now=clock,
        )
    return out


def _dump_bytes(store: Store, recorded: RunManifest, steps: set[int]) -> dict[tuple[int, str], int]:
    """Logical bytes of each recorded dump of ``steps`` (its tensors' sizes)."""
    entries = [d for d in recorded.dumps if d.step in steps]
    dumps = store.get_typed_many(
        [d.dump for d in entries], DumpManifest, context=f"run {printable(recorded.run)}"
    )
    apart = sorted({t for d in dumps for _, t in d.tensors if t not in d.embedded})
    fetched = dict(
        zip(apart, store.get_typed_many(apart, TensorManifest, context="dump tensors"), strict=True)
    )
    out = {}
    for entry, dump in zip(entries, dumps, strict=True):
        known = {**fetched, **dump.embedded}
        out[(entry.step, entry.peer)] = sum(known[t].nbytes for _, t in dump.tensors)
    return out


def claim_aggregation(
    store: Store,
    run: str,
    name: str,
    steps: Sequence[int],
    *,
    ttl: float | None = None,
    now: datetime | None = None,
) -> tuple[str, dict[int, str]]:
    """Claim (step, name) of ``run`` for a new aggregation: its claim id, and the refused steps.

    A step another live aggregation claimed is refused, with the reason. A
    claim older than ``ttl`` seconds (default: the setting
    ``gradpipe.rounds.claim-ttl``, 1h) is taken for a dead aggregation's.
    """
    ttl = get_seconds("rounds.claim-ttl") if ttl is None else float(ttl)
    if not ttl >= 0:  # 0: every earlier claim is taken for a dead one
        raise InvalidInputError(
            f"claim ttl {printable(ttl)} must be >= 0 seconds (gradpipe.rounds.claim-ttl)"
        )
    claim_id = uuid.uuid4().hex
    clock = _now(now)
    refused: dict[int, str] = {}

    def change(current: RoundsManifest) -> RoundsManifest:
        new, no = claim_steps(current, steps, name, claim_id, now=clock, ttl=ttl)
        refused.clear()
        refused.update(no)
        return new

    _update(store, run, change, message=f"claim {name} of {len(steps)} steps ({claim_id[:12]})")
    return claim_id, refused


def record_ingest_failures(
    store: Store, run: str, failures: Iterable[Failure], *, now: datetime | None = None
) -> int:
    """Mark the peers whose dumps failed to ingest as failed at their steps; how many.

    Each becomes a ``source="ingest"`` failure with the file and the reason, so
    ``gradpipe rounds`` shows why the peer is missing and a quorum or deadline
    can go on without it. A dump the run records for that (step, peer), from
    an earlier or a later ingest, wins over such a mark; a mark set by hand is
    kept. Failures without a usable step and peer (a file the pattern matched
    but whose peer is not a valid name) are not recorded.
    """
    clock = _now(now).isoformat()
    marks = []
    for f in failures:
        try:
            parse_name(f.peer, what="peer name")
        except InvalidInputError:
            continue
        if f.step >= 0:
            reason = f"ingest of {f.path} failed: {f.reason}"
            marks.append(PeerFailure(f.step, f.peer, reason, clock, source="ingest"))
    if not marks:
        return 0

    def news(current: RoundsManifest) -> list[PeerFailure]:
        """The marks that change something: none held yet, or an ingest mark for another reason."""
        out = []
        for mark in marks:
            held = current.failure(mark.step, mark.peer)
            if held is None or (held.source == "ingest" and held.reason != mark.reason):
                out.append(mark)
        return out

    _, now_held = read_rounds(store, run)
    if not news(now_held):  # a dump that stays broken adds no new rounds version every night
        return 0

    def change(current: RoundsManifest) -> RoundsManifest:
        new = current
        for mark in news(current):
            new = new.with_failure(mark)
        return new

    _update(store, run, change, message=f"rounds of run {run}: {len(marks)} failed ingests")
    return len(marks)


def release_aggregation(store: Store, run: str, claim_id: str) -> None:
    """Drop the claims of ``claim_id`` (after its commit, or when it gave up)."""
    _update(
        store,
        run,
        lambda current: release_claim(current, claim_id),
        message=f"release claim {claim_id[:12]}",
    )


if TYPE_CHECKING:
    _IS_A_REPORT: type[Report] = RoundsReport
