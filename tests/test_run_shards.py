"""Runs in shards on a real store: old runs upgrade, gc and verify see every shard, writers race.

Most tests set a tree shape of 4 entries per leaf and 3 links per inner shard,
so that a run of a few dumps is already several levels deep.
"""

from __future__ import annotations

import importlib.util
import shutil
import threading
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import gradpipe as gp
import gradpipe.core.run_shards as run_shards
import gradpipe.ingestion.tasks as ingest_tasks
from gradpipe.cli.testing import run_cli_json
from gradpipe.core.ids import id_from_block_key
from gradpipe.core.manifest import decode_manifest
from gradpipe.core.run_manifest import RunManifest
from gradpipe.core.run_shards import RunShard, ShardLink, TreeShape
from gradpipe.storage.blocks import decode_block
from gradpipe.storage.catalog import read_run, read_run_at
from gradpipe.storage.walk import walk_reachable
from gradpipe.testing.faults import Fault, FaultyBackend, faulty_store
from gradpipe.testing.run_commits import commit_tiny_dumps, write_tiny_dumps

FIXTURES = Path(__file__).parent / "fixtures"


@pytest.fixture
def small_shards(monkeypatch: pytest.MonkeyPatch) -> TreeShape:
    shape = TreeShape(leaf=4, branch=3)
    monkeypatch.setattr(run_shards, "DEFAULT_SHAPE", shape)
    return shape


def _v3_maker() -> Any:
    spec = importlib.util.spec_from_file_location("make_store_v3", FIXTURES / "make_store_v3.py")
    assert spec is not None
    assert spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _shards(store: gp.Store) -> set[str]:
    """Ids of every run shard stored, reachable or not."""
    out = set()
    for info in store.backend.list("blocks"):
        block_id = id_from_block_key(info.key)
        if block_id is None:
            continue
        data = bytes(decode_block(store.backend.read(info.key), block_id))
        if b'"type":"run-shard"' in data:
            out.add(block_id)
    return out


def _stored_format(store: gp.Store, manifest_id: str) -> int:
    doc = bytes(store.get_raw(manifest_id))
    return int(doc.split(b'"format":')[1].split(b",")[0])


def _check_dumps(run: gp.Run, expected: dict[tuple[int, str], dict[str, np.ndarray]]) -> None:
    assert sorted((e.step, e.peer) for e in run) == sorted(expected)
    for (step, peer), tensors in expected.items():
        for name, array in tensors.items():
            back = run.read(name, step=step, peer=peer)
            assert isinstance(back, np.ndarray)
            assert back.tobytes() == array.tobytes(), (step, peer, name)


def test_golden_v3_run_reads_and_moves_into_shards_on_the_next_commit(
    tmp_path: Path, small_shards: TreeShape
) -> None:
    maker = _v3_maker()
    expected = maker.golden_dumps()
    shutil.copytree(FIXTURES / "store-v3", tmp_path / "v3")
    store = gp.open_store(tmp_path / "v3", mode="r+")
    old_id, old = read_run(store, "r")
    assert old_id is not None
    assert _stored_format(store, old_id) == 3  # one manifest: 12 dumps and 4 aggregates
    assert (len(old.inline_dumps), old.dump_shards) == (12, None)

    run = gp.open_run(store, "r")  # bigger than a shard of this shape: read all the same
    assert (run.steps, run.peers, len(run)) == ([0, 1, 2, 3], ["a", "b", "c"], 12)
    _check_dumps(run, expected)
    assert [(a.step, a.name) for a in run.aggregates] == [(s, "fedavg") for s in range(4)]
    assert run.aggregate("fedavg", step=2).stale is None
    assert gp.verify(store, all_blocks=True).ok

    # The next commit (an ingest of step 4) moves the dumps into shards.
    more: dict[tuple[int, str], dict[str, np.ndarray]] = {
        (4, p): {"w": np.full((8, 4), i, np.float32), "b": np.arange(4, dtype=np.float32)}
        for i, p in enumerate("abc")
    }
    pattern = maker.write_dumps(tmp_path / "more", more)
    assert gp.ingest(store, pattern, run="r").ingested == 3
    new_id, new = read_run(store, "r")
    assert new_id is not None
    assert _stored_format(store, new_id) == 4
    assert new.dump_shards is not None
    assert new.inline_dumps == ()
    assert new.aggregates == old.aggregates  # still in the manifest: 4 fit one shard
    _check_dumps(gp.open_run(store, "r"), {**expected, **more})

    # ...and the next aggregate moves the aggregates too.
    assert gp.aggregate(store, run="r", method="fedavg", name="fedavg").computed == 1
    _, last = read_run(store, "r")
    assert last.aggregate_shards is not None
    assert [a.step for a in last.aggregates] == [0, 1, 2, 3, 4]
    assert gp.open_run(store, "r").aggregate("fedavg", step=4).stale is None
    assert gp.verify(store, all_blocks=True).ok


def test_gc_keeps_every_shard_and_drops_replaced_ones_after_the_grace(
    store: gp.Store, small_shards: TreeShape
) -> None:
    for commit in range(6):
        keys = [(commit, p) for p in ("a", "b", "c")] + [(commit + 10, "z")]
        result = commit_tiny_dumps(store, "r", write_tiny_dumps(store, "r", keys))
        assert len(result.committed) == 4
    _, run = read_run(store, "r")
    stored = _shards(store)
    reachable = gp.verify(store)  # walks everything reachable from the refs
    assert reachable.ok, reachable.problems
    walked = set(walk_reachable(store).manifests)
    live = stored & walked
    assert len(live) >= 8  # a tree several levels deep
    assert stored - live  # earlier commits' paths, replaced

    young = gp.gc(store)  # the default grace: replaced shards are young, kept
    assert young.deleted == 0
    assert _shards(store) == stored
    swept = gp.gc(store, grace=0)
    assert swept.deleted >= len(stored - live)
    assert _shards(store) == live  # every reachable shard kept, every replaced one gone
    report = gp.verify(store, all_blocks=True)
    assert report.ok, report.problems
    assert report.unreferenced == 0
    assert list(gp.open_run(store, "r")) == list(run.dumps)
    assert len(run.dumps) == 24


def test_verify_reports_a_shard_its_link_misdescribes(
    tmp_path: Path, small_shards: TreeShape
) -> None:
    store = gp.open_store(tmp_path / "s", mode="w")
    keys = [(s, p) for s in range(4) for p in ("a", "b")]
    commit_tiny_dumps(store, "r", write_tiny_dumps(store, "r", keys))
    _, run = read_run(store, "r")
    top = run.dump_shards
    assert top is not None
    assert gp.verify(store).ok
    wrong = RunManifest("r", schema=run.schema, dump_shards=ShardLink(top.id, top.first, 99))
    store.refs.set("runs/r", store.put_manifest(wrong), message="by hand")
    report = gp.verify(store)
    assert [(p.kind, p.id) for p in report.problems] == [("bad shard", top.id)]
    assert "99 entries" in report.problems[0].detail
    with pytest.raises(gp.IntegrityError, match="does not match its link"):
        list(gp.open_run(store, "r"))


def test_a_commit_that_dies_before_its_swap_leaves_only_unreferenced_shards(
    tmp_path: Path, small_shards: TreeShape
) -> None:
    store = gp.open_store(tmp_path / "s", mode="w")
    commit_tiny_dumps(store, "r", write_tiny_dumps(store, "r", [(s, "a") for s in range(20)]))
    before_id, before = read_run(store, "r")
    shards_before = _shards(store)
    # The ref's swap never lands (every request lost): the commit dies after writing its shards.
    dying, backend = faulty_store(store, Fault("swap", "refs/runs/*", lose="request"))
    results = write_tiny_dumps(dying, "r", [(20, "a"), (21, "a")])
    with pytest.raises(gp.StorageError):
        commit_tiny_dumps(dying, "r", results)
    assert backend.fired("swap")
    orphans = _shards(store) - shards_before
    assert orphans  # the dead commit's path was written first...
    after_id, after = read_run(store, "r")
    assert after_id == before_id  # ...and nothing is visible: the run reads as it was
    assert list(after.dumps) == list(before.dumps)
    assert gp.verify(store).ok
    gp.gc(store, grace=0)
    assert _shards(store) == shards_before  # gc took exactly the dead commit's shards
    assert len(gp.open_run(store, "r")) == 20
    # Re-running the job (its dumps, then its commit) finishes the work.
    results = write_tiny_dumps(store, "r", [(20, "a"), (21, "a")])
    assert len(commit_tiny_dumps(store, "r", results).committed) == 2
    assert len(gp.open_run(store, "r")) == 22
    assert gp.verify(store).ok


class _Counting(FaultyBackend):
    """A backend that remembers the objects it created (key and size), faults none."""

    def __init__(self, inner: Any) -> None:
        super().__init__(inner)
        self.created: list[tuple[str, int]] = []

    def write_if_absent(self, key: str, data: bytes | memoryview) -> bool:
        new = super().write_if_absent(key, data)
        if new:
            self.created.append((key, len(data)))
        return new

    def write_many_if_absent(self, items: Sequence[tuple[str, bytes | memoryview]]) -> list[bool]:
        news = super().write_many_if_absent(items)
        self.created += [(k, len(d)) for (k, d), new in zip(items, news, strict=True) if new]
        return news

    def swap(self, key: str, data: bytes, expected: str | None) -> str:
        token = super().swap(key, data, expected)
        self.created.append((key, len(data)))
        return token


def _counting_store(path: Path) -> tuple[gp.Store, _Counting]:
    plain = gp.open_store(path, mode="w")
    backend = _Counting(plain.backend)
    return gp.Store(backend, mode="a", url=plain.url), backend


def _created_shards(store: gp.Store, created: list[tuple[str, int]]) -> list[RunShard]:
    out = []
    for key, _ in created:
        block_id = id_from_block_key(key)
        if block_id is not None:
            manifest = decode_manifest(bytes(store.get_raw(block_id)))
            if isinstance(manifest, RunShard):
                out.append(manifest)
    return out


def test_two_writers_racing_keep_both_and_the_retry_rebuilds_one_path(
    tmp_path: Path, small_shards: TreeShape, monkeypatch: pytest.MonkeyPatch
) -> None:
    store, backend = _counting_store(tmp_path / "s")
    commit_tiny_dumps(store, "r", write_tiny_dumps(store, "r", [(s, "a") for s in range(40)]))
    mine = write_tiny_dumps(store, "r", [(40, "a"), (41, "a")])
    theirs = write_tiny_dumps(store, "r", [(5, "b"), (42, "a")])

    # Between this commit's read of the run and its swap, another commit lands.
    real = read_run_at
    calls: list[str] = []

    def racing(store_: gp.Store, run_id: str, run: str) -> RunManifest:
        calls.append(run_id)
        if len(calls) == 1:
            monkeypatch.setattr(ingest_tasks, "read_run_at", real)
            assert commit_tiny_dumps(store, "r", theirs).run_id is not None
            monkeypatch.setattr(ingest_tasks, "read_run_at", racing)
        elif len(calls) == 2:
            backend.created.clear()  # what the retry writes
        return real(store_, run_id, run)

    monkeypatch.setattr(ingest_tasks, "read_run_at", racing)
    result = commit_tiny_dumps(store, "r", mine)
    assert len(calls) == 2  # the first attempt lost the swap; the retry read the new run
    assert calls[0] != calls[1]
    assert [r.entry.step for r in result.committed] == [40, 41]
    run = gp.open_run(store, "r")
    assert len(run) == 44
    assert {(e.step, e.peer) for e in run} >= {(40, "a"), (41, "a"), (5, "b"), (42, "a")}
    # The retry remade the right edge of the tree, no more: a leaf or two and
    # one shard per level above (a whole rebuild would write every leaf).
    _, recorded = read_run(store, "r")
    assert recorded.dump_shards is not None
    height = store.get_typed(recorded.dump_shards.id, RunShard).level
    remade = _created_shards(store, backend.created)
    assert 1 <= len(remade) <= 2 * (height + 1)
    assert gp.verify(store, all_blocks=True).ok


def test_two_writers_in_threads_lose_nothing(store_url: str, small_shards: TreeShape) -> None:
    store = gp.open_store(store_url, mode="w")
    batches = {w: [(s, f"p{w}") for s in range(12)] for w in range(2)}
    written = {w: write_tiny_dumps(store, "r", keys) for w, keys in batches.items()}
    barrier = threading.Barrier(2)
    errors: list[BaseException] = []

    def writer(w: int) -> None:
        try:
            mine = gp.open_store(store_url, mode="a")  # a store object per writer
            barrier.wait()
            for lo in range(0, 12, 3):
                commit_tiny_dumps(mine, "r", written[w][lo : lo + 3])
        except BaseException as exc:  # reported below
            errors.append(exc)

    threads = [threading.Thread(target=writer, args=(w,)) for w in written]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    run = gp.open_run(store, "r")
    assert sorted((e.step, e.peer) for e in run) == sorted(k for b in batches.values() for k in b)
    assert gp.verify(store).ok


def _commit_bytes(path: Path, total: int, per_commit: int) -> list[int]:
    """Bytes each commit of ``per_commit`` tiny dumps writes (dumps apart), up to ``total``."""
    store, backend = _counting_store(path)
    out = []
    for lo in range(0, total, per_commit):
        keys = [(s // 4, f"p{s % 4}") for s in range(lo, lo + per_commit)]
        results = write_tiny_dumps(store, "r", keys)
        backend.created.clear()
        commit_tiny_dumps(store, "r", results)
        out.append(sum(size for _, size in backend.created))
    return out


def test_bytes_written_per_commit_stay_flat_as_the_run_grows(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Commits of 100 dumps into a run of 1,000 and of 3,000 dumps write about as much.

    The old layout (one manifest rewritten whole, the same code with an
    unbounded leaf) grows with the run: the anchor of the comparison.
    """
    sharded = _commit_bytes(tmp_path / "sharded", 3000, 100)
    early, late = max(sharded[5:10]), max(sharded[25:30])
    assert late <= 1.3 * early, sharded

    monkeypatch.setattr(run_shards, "DEFAULT_SHAPE", TreeShape(leaf=10**9, branch=2))
    whole = _commit_bytes(tmp_path / "whole", 3000, 100)
    assert whole[-1] >= 2.5 * whole[9]  # 3x the dumps, ~3x the bytes: O(N) per commit
    assert late * 5 <= whole[-1], (late, whole[-1])


def test_ls_describes_a_run_in_shards(tmp_path: Path, small_shards: TreeShape) -> None:
    store = gp.open_store(tmp_path / "s", mode="w")
    keys = [(s, p) for s in range(7) for p in ("a", "b", "c")]
    commit_tiny_dumps(store, "r", write_tiny_dumps(store, "r", keys))
    status, doc = run_cli_json("ls", str(tmp_path / "s"))
    assert status == 0
    [row] = [r for r in doc["refs"] if r["ref"] == "runs/r"]
    assert (row["steps"], row["peers"], row["dumps"]) == (7, 3, 21)
    status, doc = run_cli_json("ls", str(tmp_path / "s"), "r")
    assert status == 0
    assert [(d["step"], d["peer"]) for d in doc["dumps"]] == keys
