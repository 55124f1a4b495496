"""The pure rules of rounds: quorum policies, deadlines, failed peers, claims."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

import pytest

from gradpipe.core.manifest import decode_manifest, encode_manifest
from gradpipe.core.rounds import (
    PeerFailure,
    Quorum,
    RoundsManifest,
    StepRound,
    claim_steps,
    evaluate_step,
    parse_quorum,
    release_claim,
)
from gradpipe.errors import InvalidInputError

T0 = datetime(2026, 1, 1, tzinfo=UTC)
PEERS = ["a", "b", "c", "d"]


def _step(
    manifest: RoundsManifest,
    received: list[str],
    *,
    now: datetime = T0,
    aggregated: tuple[str, ...] | list[str] = (),
) -> StepRound:
    return evaluate_step(
        7,
        expected=manifest.roster,
        received=dict.fromkeys(received, 10),
        aggregated=set(aggregated),
        has_aggregate=bool(aggregated),
        manifest=manifest,
        now=now,
    )


@pytest.mark.parametrize(
    ("text", "quorum"),
    [
        ("all", Quorum()),
        ("3", Quorum("count", 3)),
        ("0.75", Quorum("fraction", 0.75)),
        ("75%", Quorum("fraction", 0.75)),
    ],
)
def test_parse_quorum(text: str, quorum: Quorum) -> None:
    assert parse_quorum(text) == quorum


@pytest.mark.parametrize("text", ["0", "1.5", "most", "-2", "0%", "150%"])
def test_bad_quorums_are_refused(text: str) -> None:
    with pytest.raises(InvalidInputError, match="quorum"):
        parse_quorum(text)


@pytest.mark.parametrize(
    ("quorum", "received", "ready"),
    [
        ("all", ["a", "b", "c"], False),
        ("all", PEERS, True),
        ("3", ["a", "b"], False),
        ("3", ["a", "b", "c"], True),
        ("0.5", ["a"], False),
        ("0.5", ["a", "b"], True),
        ("0.6", ["a", "b"], False),  # ceil(0.6 * 4) = 3
    ],
)
def test_quorum_policies(quorum: str, received: list[str], ready: bool) -> None:
    got = _step(RoundsManifest("r", tuple(PEERS), parse_quorum(quorum)), received)
    assert got.ready is ready, got.reason
    assert got.state == ("ready" if ready else "waiting")
    assert got.count("received") == len(received)
    assert got.count("pending") == 4 - len(received)
    if not ready:
        assert "not ready" in got.reason
        assert "d" in got.reason  # names a peer it waits for


def test_a_failed_peer_no_longer_holds_back_quorum_all() -> None:
    manifest = RoundsManifest("r", tuple(PEERS)).with_failure(PeerFailure(7, "d", "oom", "t"))
    got = _step(manifest, ["a", "b", "c", "d"])  # d's dump arrived, but d is marked failed
    assert got.ready
    assert got.usable == ["a", "b", "c"]
    assert got.excluded == ["d"]
    assert [p.reason for p in got.peers if p.status == "failed"] == ["oom"]
    assert _step(manifest.without_failure(7, "d"), ["a", "b", "c"]).ready is False


def test_a_deadline_turns_missing_peers_into_failures() -> None:
    manifest = RoundsManifest("r", tuple(PEERS), deadline=60, start=T0.isoformat())
    before = _step(manifest, ["a"], now=T0 + timedelta(seconds=59))
    assert not before.ready
    assert before.count("pending") == 3
    after = _step(manifest, ["a"], now=T0 + timedelta(seconds=60))
    assert after.ready
    assert after.count("failed") == 3
    assert "deadline" in after.reason
    nobody = _step(manifest, [], now=T0 + timedelta(seconds=61))
    assert not nobody.ready
    assert nobody.state == "failed"


def test_aggregated_peers_and_state() -> None:
    got = _step(RoundsManifest("r", tuple(PEERS), Quorum("count", 2)), ["a", "b"], aggregated=["a"])
    assert got.state == "aggregated"
    assert [p.status for p in got.peers] == ["aggregated", "received", "pending", "pending"]
    assert got.logical_bytes == 20


def test_an_unexpected_peer_is_listed_and_counted() -> None:
    got = _step(RoundsManifest("r", ("a",)), ["a", "z"])
    assert [(p.peer, p.expected) for p in got.peers] == [("a", True), ("z", False)]
    assert got.ready


def test_claims_exclude_live_claims_and_replace_dead_ones() -> None:
    base = RoundsManifest("r")
    mine, refused = claim_steps(base, [1, 2], "avg", "A", now=T0, ttl=60)
    assert refused == {}
    theirs, refused = claim_steps(mine, [2, 3], "avg", "B", now=T0 + timedelta(seconds=1), ttl=60)
    assert list(refused) == [2]
    assert "claimed by another aggregation" in refused[2]
    assert theirs.claim(2, "avg").claim_id == "A"  # type: ignore[union-attr]
    assert theirs.claim(3, "avg").claim_id == "B"  # type: ignore[union-attr]
    _, refused = claim_steps(mine, [2], "sum", "B", now=T0, ttl=60)
    assert refused == {}  # another name is another aggregate
    late, refused = claim_steps(mine, [2], "avg", "B", now=T0 + timedelta(seconds=61), ttl=60)
    assert refused == {}
    assert late.claim(2, "avg").claim_id == "B"  # type: ignore[union-attr]
    assert [c.claim_id for c in release_claim(theirs, "A").claims] == ["B"]


def test_the_manifest_round_trips() -> None:
    manifest, _ = claim_steps(
        RoundsManifest("r", ("a", "b"), Quorum("fraction", 0.5), 30.0, T0.isoformat()),
        [4],
        "fedavg",
        "c1",
        now=T0,
        ttl=1,
    )
    manifest = manifest.with_failure(PeerFailure(4, "b", "disk full", T0.isoformat()))
    assert decode_manifest(encode_manifest(manifest)) == manifest


def test_bad_manifests_are_refused() -> None:
    with pytest.raises(InvalidInputError):
        RoundsManifest("r", ("b", "a"))
    with pytest.raises(InvalidInputError):
        RoundsManifest("r", deadline=-1)
    with pytest.raises(InvalidInputError):
        RoundsManifest("r", start="yesterday")
