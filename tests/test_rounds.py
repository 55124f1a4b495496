"""``gp.rounds`` and the rounds ``gp.aggregate`` obeys: readiness, failed peers, claims, gc."""

from __future__ import annotations

import threading
from collections.abc import Hashable, Sequence
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pytest

import gradpipe as gp
from gradpipe.aggregation.rounds import claim_aggregation
from gradpipe.core.rounds import RoundsManifest
from gradpipe.storage.catalog import read_rounds
from gradpipe.testing.training import SampleRun, TrainingConfig, write_sample_run

#: 3 peers x 3 steps, tiny.
TINY = TrainingConfig(vocab_size=300, embed_dim=8, hidden=8, peers=3, steps=3)
PAST = datetime(2020, 1, 1, tzinfo=UTC)


@pytest.fixture(scope="module")
def sample(tmp_path_factory: pytest.TempPathFactory) -> SampleRun:
    return write_sample_run(tmp_path_factory.mktemp("sample"), TINY)


def _store(tmp_path: Path, sample: SampleRun, keep: set[tuple[int, str]] | None = None) -> gp.Store:
    """A store holding run ``r``: every dump of ``sample``, or the (step, peer)s in ``keep``."""
    src = tmp_path / "src"
    for step in range(TINY.steps):
        for peer in TINY.peer_names:
            if keep is None or (step, peer) in keep:
                target = src / f"step={step:04d}" / f"peer={peer}.safetensors"
                target.parent.mkdir(parents=True, exist_ok=True)
                target.write_bytes(Path(sample.dump_path(step, peer)).read_bytes())
    store = gp.open_store(tmp_path / "store", mode="w")
    assert gp.ingest(store, str(src / "step={step}/peer={peer}.safetensors"), run="r").ok
    return store


def _statuses(report: gp.AggregateReport) -> dict[int, str]:
    return {s.step: s.status for s in report.steps}


def test_an_inferred_roster_makes_full_steps_ready(sample: SampleRun, tmp_path: Path) -> None:
    # peer2 missed step 1: with the roster inferred (all three peers) step 1 waits.
    keep = {(s, p) for s in range(3) for p in TINY.peer_names} - {(1, "peer2")}
    store = _store(tmp_path, sample, keep)
    report = gp.rounds(store, run="r")
    assert isinstance(report, gp.Report)
    assert report.inferred
    assert report.roster == ["peer0", "peer1", "peer2"]
    assert [s.state for s in report.steps] == ["ready", "waiting", "ready"]
    assert "peer2" in report.step(1).reason
    done = gp.aggregate(store, run="r", method="mean")
    assert _statuses(done) == {0: "computed", 1: "skipped", 2: "computed"}
    assert "not ready" in done.steps[1].reason
    assert "peer2" in done.steps[1].reason
    assert done.ok
    after = gp.rounds(store, run="r")
    stats = after.stats()
    assert (stats["total"], stats["completed"], stats["pending"], stats["failed"]) == (3, 2, 1, 0)
    assert stats["participating_peers"] == 3
    assert stats["logical_bytes"] == sum(s.logical_bytes for s in after.steps) > 0
    assert [p.status for p in after.step(0).peers] == ["aggregated"] * 3
    assert [p.status for p in after.step(1).peers] == ["received", "received", "pending"]


def test_quorum_and_explicit_steps_and_force(sample: SampleRun, tmp_path: Path) -> None:
    store = _store(tmp_path, sample)
    gp.rounds(store, run="r", expect=["peer0", "peer1", "peer2", "peer3"])  # peer3 never comes
    waiting = gp.aggregate(store, run="r", method="mean")
    assert set(_statuses(waiting).values()) == {"skipped"}
    assert all("peer3" in s.reason for s in waiting.steps)
    assert gp.open_run(store, "r").aggregates == []
    explicit = gp.aggregate(store, run="r", method="mean", steps=[1])
    assert _statuses(explicit) == {1: "skipped"}
    forced = gp.aggregate(store, run="r", method="mean", steps=[1], force=True)
    assert _statuses(forced) == {1: "computed"}

    gp.rounds(store, run="r", quorum="75%")  # 3 of 4
    report = gp.aggregate(store, run="r", method="mean")
    assert _statuses(report) == {0: "computed", 1: "memoised", 2: "computed"}
    rounds = gp.rounds(store, run="r")
    assert rounds.quorum.describe() == "at least 0.75 of the roster"
    assert rounds.stats()["completed"] == 3
    assert [p.status for p in rounds.step(0).peers] == ["aggregated"] * 3 + ["pending"]


def test_a_deadline_in_the_past_makes_partial_steps_ready(
    sample: SampleRun, tmp_path: Path
) -> None:
    keep = {(0, "peer0"), (0, "peer1"), (1, "peer0"), (1, "peer1"), (1, "peer2")}
    store = _store(tmp_path, sample, keep)
    gp.rounds(store, run="r", deadline=3600, start=datetime.now(UTC) + timedelta(hours=1))
    assert _statuses(gp.aggregate(store, run="r", method="mean")) == {
        0: "skipped",
        1: "computed",
    }
    gp.rounds(store, run="r", start=PAST)  # the deadline, PAST + 1 h, has passed
    report = gp.rounds(store, run="r")
    step0 = report.step(0)
    assert step0.ready
    assert "deadline" in step0.reason
    assert [(p.peer, p.status) for p in step0.peers][-1] == ("peer2", "failed")
    assert "deadline" in step0.peers[-1].reason
    assert _statuses(gp.aggregate(store, run="r", method="mean")) == {
        0: "computed",
        1: "memoised",
    }
    # the clock is injectable: the same rounds seen before the deadline
    early = gp.rounds(store, run="r", now=PAST + timedelta(minutes=59))
    assert early.step(0).peers[-1].status == "pending"


def test_a_failed_peer_is_left_out(sample: SampleRun, tmp_path: Path) -> None:
    store = _store(tmp_path, sample)
    with pytest.raises(gp.InvalidInputError, match="reason"):
        gp.rounds(store, run="r", fail=["peer2@0"])
    with pytest.raises(gp.InvalidInputError, match="PEER@STEP"):
        gp.rounds(store, run="r", fail=["peer2"], reason="x")
    marked = gp.rounds(store, run="r", fail=["peer2@0"], reason="diverged loss")
    assert marked.step(0).peers[2].reason == "diverged loss"
    report = gp.aggregate(store, run="r", method="mean", steps=[0])
    assert report.computed == 1
    inputs = gp.open_run(store, "r").aggregate("mean", step=0).manifest.inputs
    assert [i.peer for i in inputs] == ["peer0", "peer1"]
    statuses = [p.status for p in gp.rounds(store, run="r").step(0).peers]
    assert statuses == ["aggregated", "aggregated", "failed"]
    cleared = gp.rounds(store, run="r", unfail=["peer2@0"])
    assert cleared.step(0).peers[2].status == "received"


class _Hook(gp.Runner):
    """A runner that calls ``hook`` once the aggregation holds its claim, before computing."""

    def __init__(self, hook: Any) -> None:
        super().__init__()
        self.hook = hook

    def get(self, graph: Any, keys: Sequence[Hashable], **kw: Any) -> list[Any]:
        if kw.get("name") == "gradpipe-aggregate":
            self.hook()
        return super().get(graph, keys, **kw)


def test_two_threads_racing_on_one_step(sample: SampleRun, tmp_path: Path) -> None:
    store = _store(tmp_path, sample)
    other = gp.open_store(store.url, mode="r+")  # another scheduler: its own Store object
    rival: list[gp.AggregateReport] = []

    def race() -> None:  # runs while the first aggregation holds its claim
        thread = threading.Thread(
            target=lambda: rival.append(gp.aggregate(other, run="r", method="sum", name="avg"))
        )
        thread.start()
        thread.join()

    first = gp.aggregate(store, run="r", method="mean", name="avg", runner=_Hook(race))
    [second] = rival
    assert set(_statuses(first).values()) == {"computed"}
    assert set(_statuses(second).values()) == {"skipped"}
    assert all("claimed by another aggregation" in s.reason for s in second.steps)
    run = gp.open_run(store, "r")
    assert [a.aggregate for a in run.aggregates] == [s.aggregate for s in first.steps]
    assert read_rounds(store, "r")[1].claims == ()  # released
    # Asked again later, the same dumps under the same name with another method: refused.
    later = gp.aggregate(other, run="r", method="sum", name="avg", steps=[0])
    assert _statuses(later) == {0: "skipped"}
    assert "already aggregated" in later.steps[0].reason
    replaced = gp.aggregate(other, run="r", method="sum", name="avg", steps=[0], force=True)
    assert _statuses(replaced) == {0: "computed"}


def test_a_claim_taken_over_meanwhile_writes_nothing_visible(
    sample: SampleRun, tmp_path: Path
) -> None:
    store = _store(tmp_path, sample)
    before = store.refs.get("runs/r")

    def steal() -> None:  # as if our claim had expired and another scheduler took the steps
        claim_aggregation(store, "r", "avg", [0, 1, 2], ttl=0.0)

    report = gp.aggregate(store, run="r", method="mean", name="avg", runner=_Hook(steal))
    assert set(_statuses(report).values()) == {"skipped"}
    assert all("claimed by another aggregation" in s.reason for s in report.steps)
    assert report.ok
    assert store.refs.get("runs/r") == before  # nothing recorded
    assert len(read_rounds(store, "r")[1].claims) == 3  # the thief's claims stay


def test_gc_keeps_the_rounds_and_their_history(sample: SampleRun, tmp_path: Path) -> None:
    store = _store(tmp_path, sample)
    gp.rounds(store, run="r", expect=["peer0", "peer1", "peer2"])
    gp.rounds(store, run="r", quorum="2")
    gp.gc(store, grace=0)
    history = list(store.refs.history("rounds/r"))
    assert len(history) == 2
    for entry in history:  # every state, not only the current one
        assert entry.target is not None
        assert isinstance(store.get_typed(entry.target, RoundsManifest), RoundsManifest)
    assert store.get_typed(history[0].target, RoundsManifest).previous == history[1].target  # type: ignore[arg-type]
    assert gp.verify(store).ok
    assert gp.rounds(store, run="r").quorum.describe() == "at least 2"


def test_a_failed_ingest_marks_the_peer_failed_until_its_dump_arrives(
    sample: SampleRun, tmp_path: Path
) -> None:
    src = tmp_path / "src"
    for step in range(TINY.steps):
        for peer in TINY.peer_names:
            target = src / f"step={step:04d}" / f"peer={peer}.safetensors"
            target.parent.mkdir(parents=True, exist_ok=True)
            target.write_bytes(Path(sample.dump_path(step, peer)).read_bytes())
    broken = src / "step=0001" / "peer=peer2.safetensors"
    good = broken.read_bytes()
    broken.write_bytes(good[: len(good) // 2])  # truncated on the way
    pattern = str(src / "step={step}/peer={peer}.safetensors")
    store = gp.open_store(tmp_path / "store", mode="w")
    first = gp.ingest(store, pattern, run="r")
    assert [(f.step, f.peer) for f in first.failures] == [(1, "peer2")]
    report = gp.rounds(store, run="r")
    [status] = [p for p in report.step(1).peers if p.peer == "peer2"]
    assert status.status == "failed"
    assert "ingest of" in status.reason
    assert str(broken) in status.reason
    assert report.step(1).state == "waiting"  # quorum "all": a failed ingest is not a drop
    assert "failed to ingest: peer2" in report.step(1).reason
    gp.rounds(store, run="r", quorum="2")
    assert gp.rounds(store, run="r").step(1).ready
    done = gp.aggregate(store, run="r", method="mean", steps=[1], name="partial")
    assert done.computed == 1
    assert gp.open_run(store, "r").aggregate("partial", step=1).peers == ["peer0", "peer1"]
    # The file is fixed and ingested again: the dump wins over the ingest's mark.
    broken.write_bytes(good)
    assert gp.ingest(store, pattern, run="r").ok
    again = gp.rounds(store, run="r")
    assert [p.status for p in again.step(1).peers] == ["aggregated", "aggregated", "received"]


def test_a_mark_by_hand_outlives_a_failed_ingest(sample: SampleRun, tmp_path: Path) -> None:
    store = _store(tmp_path, sample)
    gp.rounds(store, run="r", fail=["peer1@0"], reason="node lost")
    bad = tmp_path / "bad" / "step=0000" / "peer=peer1.safetensors"
    bad.parent.mkdir(parents=True)
    bad.write_bytes(b"not a safetensors file")
    report = gp.ingest(store, str(tmp_path / "bad/step={step}/peer={peer}.safetensors"), run="r")
    assert [(f.step, f.peer) for f in report.failures] == [(0, "peer1")]
    [status] = [p for p in gp.rounds(store, run="r").step(0).peers if p.peer == "peer1"]
    assert (status.status, status.reason) == ("failed", "node lost")


def test_the_claim_ttl_is_a_setting(sample: SampleRun, tmp_path: Path) -> None:
    import dask.config

    store = _store(tmp_path, sample)
    _, refused = claim_aggregation(store, "r", "avg", [0])
    assert not refused
    _, refused = claim_aggregation(store, "r", "avg", [0])
    assert refused  # the first claim is live for an hour
    with dask.config.set({"gradpipe.rounds.claim-ttl": "1ms"}):
        threading.Event().wait(0.01)
        _, refused = claim_aggregation(store, "r", "avg", [0])
    assert not refused  # taken for a dead aggregation's
    with pytest.raises(gp.InvalidInputError, match="claim-ttl"):
        claim_aggregation(store, "r", "avg", [0], ttl=-1)


def test_a_dump_that_stays_broken_adds_no_rounds_version(sample: SampleRun, tmp_path: Path) -> None:
    store = _store(tmp_path, sample, keep={(0, "peer0"), (0, "peer1")})
    bad = tmp_path / "bad" / "step=0000" / "peer=peer2.safetensors"
    bad.parent.mkdir(parents=True)
    bad.write_bytes(b"truncated")
    pattern = str(tmp_path / "bad/step={step}/peer={peer}.safetensors")
    assert not gp.ingest(store, pattern, run="r").ok
    first = store.refs.get("rounds/r")
    assert not gp.ingest(store, pattern, run="r").ok  # the same failure, the next night
    assert store.refs.get("rounds/r") == first
    # peer2 never delivered a dump, yet the inferred roster knows it: step 0 waits for it.
    report = gp.rounds(store, run="r")
    assert report.roster == ["peer0", "peer1", "peer2"]
    assert not report.step(0).ready
    assert "failed to ingest: peer2" in report.step(0).reason
