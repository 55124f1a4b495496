"""Rounds: who is expected at each step of a run, who delivered, and when a step is ready.

The Rust prototype's backward-pass coordinator, for batch work. A run's rounds are kept in
a :class:`RoundsManifest` behind the ref ``rounds/<run>``: the roster (the
expected peers; empty means "the peers seen in any step of the run"), the
quorum policy, peers marked failed, and the claims of aggregations in flight.
Everything else is derived from the run itself, so there is nothing to keep in
step with ingest: a peer is *received* when the run records its dump, and
*aggregated* when an aggregate of that step used that dump.

This module is pure: :func:`evaluate_step` decides one step from plain values.

A step is **ready** when its quorum is met, or when its deadline has passed and
at least one peer delivered. The deadline is measured from the ``start`` time
set with the policy (by default, the moment the policy was set), not from a
step's first dump: dumps carry no arrival time (their ids are content hashes
and must not depend on when a file was read).
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field, replace
from datetime import UTC, datetime, timedelta
from typing import Any, ClassVar, Final

from gradpipe.core.display import printable
from gradpipe.core.ids import parse_id
from gradpipe.core.manifest import Manifest
from gradpipe.core.names import parse_name
from gradpipe.errors import InvalidInputError

__all__ = [
    "FAILURE_SOURCES",
    "PEER_STATUSES",
    "STEP_STATES",
    "Claim",
    "PeerFailure",
    "PeerStatus",
    "Quorum",
    "RoundsManifest",
    "StepRound",
    "claim_steps",
    "evaluate_step",
    "parse_quorum",
    "parse_time",
    "release_claim",
]

#: What a peer can be at one step.
PEER_STATUSES: Final = ("pending", "received", "aggregated", "failed")
#: Where a peer failure comes from: marked by hand, or a dump that failed to ingest.
FAILURE_SOURCES: Final = ("marked", "ingest")
#: What a step can be: aggregated (an aggregate recorded), ready, waiting, failed.
STEP_STATES: Final = ("aggregated", "ready", "waiting", "failed")


def parse_time(value: object, *, what: str = "time") -> datetime:
    """An aware UTC datetime from a datetime or an ISO 8601 string (naive means UTC)."""
    if isinstance(value, datetime):
        out = value
    elif isinstance(value, str):
        try:
            out = datetime.fromisoformat(value)
        except ValueError:
            raise InvalidInputError(
                f"{what} {printable(value)} is not an ISO 8601 time, e.g. 2026-01-31T12:00:00+00:00"
            ) from None
    else:
        raise InvalidInputError(f"{what} {printable(value)} is not a time")
    return out.replace(tzinfo=UTC) if out.tzinfo is None else out.astimezone(UTC)


@dataclass(frozen=True)
class Quorum:
    """How many peers a step needs: ``all``, ``count`` (at least N) or ``fraction`` (a share)."""

    kind: str = "all"
    value: float = 0.0

    def __post_init__(self) -> None:
        if self.kind == "all":
            return
        if self.kind == "count":
            if self.value != int(self.value) or self.value < 1:
                raise InvalidInputError(
                    f"quorum count {printable(self.value)} must be a whole number >= 1"
                )
        elif self.kind == "fraction":
            if not (math.isfinite(self.value) and 0 < self.value <= 1):
                raise InvalidInputError(
                    f"quorum fraction {printable(self.value)} must be in (0, 1]"
                )
        else:
            raise InvalidInputError(
                f"quorum kind {printable(self.kind)} is not all, count or fraction"
            )

    def needed(self, expected: int, failed: int) -> int:
        """Peers that must have delivered (``all``: every expected peer not marked failed)."""
        if self.kind == "all":
            return max(expected - failed, 1)
        if self.kind == "count":
            return int(self.value)
        return max(math.ceil(self.value * expected - 1e-9), 1)

    def describe(self) -> str:
        if self.kind == "all":
            return "all"
        if self.kind == "count":
            return f"at least {int(self.value)}"
        return f"at least {self.value:g} of the roster"

    def to_dict(self) -> dict[str, Any]:
        return {"kind": self.kind, "value": self.value}

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> Quorum:
        return cls(str(data["kind"]), float(data["value"]))


def parse_quorum(text: str) -> Quorum:
    """``all``, ``N`` (at least N peers), ``0.75`` or ``75%`` (that share of the roster)."""
    text = text.strip()
    if text == "all":
        return Quorum()
    try:
        if text.endswith("%"):
            return Quorum("fraction", float(text[:-1]) / 100)
        if text.isdigit():
            return Quorum("count", int(text))
        return Quorum("fraction", float(text))
    except ValueError:
        raise InvalidInputError(
            f"quorum {printable(text)}: expected all, a count (3), a fraction (0.75) or a "
            "percentage (75%)"
        ) from None


@dataclass(frozen=True, slots=True)
class PeerFailure:
    """A peer failed at one step, and why.

    ``source`` is ``"marked"`` (by hand: the peer is left out even if its dump
    arrives) or ``"ingest"`` (its dump could not be ingested: a dump the run
    records for that step and peer, from an earlier or a later ingest, wins).
    """

    step: int
    peer: str
    reason: str
    time: str
    source: str = "marked"

    def __post_init__(self) -> None:
        if self.source not in FAILURE_SOURCES:
            raise InvalidInputError(
                f"peer failure of {printable(self.peer)} at step {self.step}: source "
                f"{printable(self.source)} "
                f"is not one of {', '.join(FAILURE_SOURCES)}"
            )

    def to_dict(self) -> dict[str, Any]:
        out = {"step": self.step, "peer": self.peer, "reason": self.reason, "time": self.time}
        if self.source != "marked":  # older rounds manifests keep their ids
            out["source"] = self.source
        return out

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> PeerFailure:
        return cls(
            int(data["step"]),
            str(data["peer"]),
            str(data["reason"]),
            str(data["time"]),
            str(data.get("source", "marked")),
        )


@dataclass(frozen=True, slots=True)
class Claim:
    """An aggregation of (step, name) in flight: only its holder may commit that aggregate."""

    step: int
    name: str
    claim_id: str
    time: str

    def to_dict(self) -> dict[str, Any]:
        return {"step": self.step, "name": self.name, "claim_id": self.claim_id, "time": self.time}

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> Claim:
        return cls(int(data["step"]), str(data["name"]), str(data["claim_id"]), str(data["time"]))


@dataclass(frozen=True)
class RoundsManifest(Manifest):
    """The rounds of a run: roster, policy, failed peers and claims (behind ``rounds/<run>``)."""

    type: ClassVar[str] = "rounds"

    run: str
    roster: tuple[str, ...] = ()
    quorum: Quorum = field(default_factory=Quorum)
    deadline: float | None = None  # seconds after ``start``
    start: str | None = None
    failures: tuple[PeerFailure, ...] = ()
    claims: tuple[Claim, ...] = ()
    #: The state this one replaced: the rounds' history stays reachable (gc keeps it).
    previous: str | None = None

    def __post_init__(self) -> None:
        parse_name(self.run, what="run name")
        if self.previous is not None:
            parse_id(self.previous)
        for peer in self.roster:
            parse_name(peer, what="peer name")
        if list(self.roster) != sorted(set(self.roster)):
            raise InvalidInputError(
                f"rounds of run {printable(self.run)}: roster out of order or twice"
            )
        if self.deadline is not None and not (math.isfinite(self.deadline) and self.deadline >= 0):
            raise InvalidInputError(f"deadline {printable(self.deadline)} must be >= 0 seconds")
        if self.start is not None:
            parse_time(self.start, what="start")

    def format_needed(self) -> int:
        return 3

    def deadline_at(self) -> datetime | None:
        """When missing peers start counting as failed (None: no deadline)."""
        if self.deadline is None or self.start is None:
            return None
        return parse_time(self.start) + timedelta(seconds=self.deadline)

    def failure(self, step: int, peer: str) -> PeerFailure | None:
        return next((f for f in self.failures if (f.step, f.peer) == (step, peer)), None)

    def claim(self, step: int, name: str) -> Claim | None:
        return next((c for c in self.claims if (c.step, c.name) == (step, name)), None)

    def with_failure(self, failure: PeerFailure) -> RoundsManifest:
        kept = {(f.step, f.peer): f for f in self.failures}
        kept[(failure.step, failure.peer)] = failure
        return replace(self, failures=tuple(kept[k] for k in sorted(kept)))

    def without_failure(self, step: int, peer: str) -> RoundsManifest:
        return replace(
            self, failures=tuple(f for f in self.failures if (f.step, f.peer) != (step, peer))
        )

    def manifest_children(self) -> Iterator[str]:
        # A ref's old targets are not gc roots; the rounds link theirs, like a commit.
        return iter(() if self.previous is None else (self.previous,))

    def to_dict(self) -> dict[str, Any]:
        return {
            "run": self.run,
            "roster": list(self.roster),
            "quorum": self.quorum.to_dict(),
            "deadline": self.deadline,
            "start": self.start,
            "failures": [f.to_dict() for f in self.failures],
            "claims": [c.to_dict() for c in self.claims],
            "previous": self.previous,
        }

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> RoundsManifest:
        deadline = data.get("deadline")
        return cls(
            run=data["run"],
            roster=tuple(str(p) for p in data["roster"]),
            quorum=Quorum.from_dict(data["quorum"]),
            deadline=None if deadline is None else float(deadline),
            start=data.get("start"),
            failures=tuple(PeerFailure.from_dict(f) for f in data.get("failures", ())),
            claims=tuple(Claim.from_dict(c) for c in data.get("claims", ())),
            previous=data.get("previous"),
        )


def claim_steps(
    manifest: RoundsManifest,
    steps: Sequence[int],
    name: str,
    claim_id: str,
    *,
    now: datetime,
    ttl: float,
) -> tuple[RoundsManifest, dict[int, str]]:
    """``manifest`` with (step, name) claimed for ``claim_id``; refused steps with the reason.

    A claim of another aggregation younger than ``ttl`` seconds refuses the
    step; an older one is taken for the claim of a dead aggregation and
    replaced (its holder then finds its claim gone when it commits).
    """
    refused: dict[int, str] = {}
    claims = {(c.step, c.name): c for c in manifest.claims}
    for step in steps:
        held = claims.get((step, name))
        if held is not None and held.claim_id != claim_id:
            age = (now - parse_time(held.time)).total_seconds()
            if age < ttl:
                refused[step] = (
                    f"claimed by another aggregation (claim {held.claim_id[:12]} since "
                    f"{held.time}); it will record this step's {printable(name)}"
                )
                continue
        claims[(step, name)] = Claim(step, name, claim_id, now.isoformat())
    return replace(manifest, claims=tuple(claims[k] for k in sorted(claims))), refused


def release_claim(manifest: RoundsManifest, claim_id: str) -> RoundsManifest:
    """``manifest`` without the claims of ``claim_id``."""
    return replace(manifest, claims=tuple(c for c in manifest.claims if c.claim_id != claim_id))


@dataclass(frozen=True, slots=True)
class PeerStatus:
    """One peer at one step."""

    peer: str
    status: str
    reason: str = ""
    expected: bool = True

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {"peer": self.peer, "status": self.status}
        if self.reason:
            out["reason"] = self.reason
        if not self.expected:
            out["expected"] = False
        return out


@dataclass(frozen=True)
class StepRound:
    """One step: its peers' statuses, whether it is ready, and why (not)."""

    step: int
    state: str
    ready: bool
    reason: str
    peers: tuple[PeerStatus, ...]
    logical_bytes: int = 0
    claimed_by: tuple[str, ...] = ()

    def count(self, status: str) -> int:
        return sum(1 for p in self.peers if p.status == status)

    @property
    def usable(self) -> list[str]:
        """Peers whose dumps an aggregate of this step takes (received or aggregated)."""
        return [p.peer for p in self.peers if p.status in ("received", "aggregated")]

    @property
    def excluded(self) -> list[str]:
        """Peers marked failed: left out of the step's aggregate even if their dump arrived."""
        return [p.peer for p in self.peers if p.status == "failed"]

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "step": self.step,
            "state": self.state,
            "ready": self.ready,
            "reason": self.reason,
            "peers": {p: self.count(p) for p in PEER_STATUSES},
            "statuses": [p.to_dict() for p in self.peers],
            "logical_bytes": self.logical_bytes,
        }
        if self.claimed_by:
            out["claimed_by"] = list(self.claimed_by)
        return out


def evaluate_step(
    step: int,
    *,
    expected: Sequence[str],
    received: Mapping[str, int],
    aggregated: set[str],
    has_aggregate: bool,
    manifest: RoundsManifest,
    now: datetime,
) -> StepRound:
    """Decide one step: each peer's status, the step's state and readiness.

    ``received`` maps each peer whose dump the run records to its logical
    bytes; ``aggregated`` holds the peers an aggregate of the step used.
    """
    deadline = manifest.deadline_at()
    passed = deadline is not None and now >= deadline
    failed: dict[str, PeerFailure] = {}
    for f in manifest.failures:
        if f.step == step and not (f.source == "ingest" and f.peer in received):
            failed[f.peer] = f
    statuses = []
    for peer in sorted(set(expected) | set(received) | set(failed)):
        failure = failed.get(peer)
        on_roster = peer in expected
        if failure is not None:
            statuses.append(PeerStatus(peer, "failed", failure.reason, on_roster))
        elif peer in aggregated:
            statuses.append(PeerStatus(peer, "aggregated", "", on_roster))
        elif peer in received:
            statuses.append(PeerStatus(peer, "received", "", on_roster))
        elif passed:
            why = f"no dump by the deadline {deadline.isoformat() if deadline else ''}"
            statuses.append(PeerStatus(peer, "failed", why, on_roster))
        else:
            statuses.append(PeerStatus(peer, "pending", "", on_roster))
    usable = [p for p in statuses if p.status in ("received", "aggregated")]
    # A mark by hand drops the peer from an "all" quorum; a failed ingest does not
    # (as the Rust prototype's coordinator: the file may be fixed and ingested again).
    marked = sum(1 for p, f in failed.items() if p in expected and f.source == "marked")
    broken = [p for p, f in failed.items() if f.source == "ingest"]
    needed = manifest.quorum.needed(len(expected), marked)
    pending = [p.peer for p in statuses if p.status == "pending"]
    claims = tuple(c.name for c in manifest.claims if c.step == step)
    quorum = manifest.quorum.describe()
    if usable and len(usable) >= needed:
        ready, reason = True, f"quorum {quorum} met: {len(usable)} of {len(expected)} peers"
    elif usable and passed:
        ready, reason = True, f"deadline passed with {len(usable)} of {len(expected)} peers"
    elif not usable and (passed or (expected and marked >= len(expected))):
        ready = False
        reason = "no peer delivered" + (" by the deadline" if passed else "; all marked failed")
    else:
        ready = False
        waiting = ", ".join(pending[:4]) + (", ..." if len(pending) > 4 else "")
        reason = (
            f"not ready: quorum {quorum} needs {needed} peers, {len(usable)} delivered"
            + (f"; waiting for {waiting}" if waiting else "")
            + (f"; failed to ingest: {', '.join(broken)}" if broken else "")
            + (f"; deadline {deadline.isoformat()}" if deadline is not None else "")
        )
    if has_aggregate:
        state = "aggregated"
    elif ready:
        state = "ready"
    elif not usable and reason.startswith("no peer"):
        state = "failed"
    else:
        state = "waiting"
    size = sum(received.get(p.peer, 0) for p in usable)
    return StepRound(step, state, ready, reason, tuple(statuses), size, claims)
