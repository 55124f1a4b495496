"""A run in shards reads as a plain dict of its entries, whatever sequence of commits built it."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TypeVar

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule

import gradpipe.core.manifest as manifest_module
from gradpipe.core.ids import hash_bytes
from gradpipe.core.manifest import Manifest, decode_manifest, encode_manifest
from gradpipe.core.run_manifest import (
    AggregateEntry,
    DumpEntry,
    RunManifest,
    merge_run,
    record_aggregates,
)
from gradpipe.core.run_shards import RunShard, ShardLink, TreeShape, link_mismatch
from gradpipe.errors import IntegrityError, InvalidInputError, UnsupportedFormatError

M = TypeVar("M", bound=Manifest)
PEERS = ("a", "b", "c", "d", "e")


class MemorySource:
    """A dict of stored manifests by id: what a store is to a run's shards."""

    def __init__(self) -> None:
        self.blobs: dict[str, bytes] = {}
        self.reads = 0

    def get_typed_many(
        self, manifest_ids: Sequence[str], cls: type[M], *, context: str = ""
    ) -> list[M]:
        self.reads += 1
        out = []
        for i in manifest_ids:
            manifest = decode_manifest(self.blobs[i]).with_source(self)
            assert isinstance(manifest, cls)
            out.append(manifest)
        return out

    def put(self, manifest: Manifest) -> tuple[str, list[str]]:
        """Store a manifest and what it links to unstored: its id, and the ids newly written."""
        new = []
        for part in (*manifest.unstored_manifests(), manifest):
            data = encode_manifest(part)
            part_id = hash_bytes(data)
            if part_id not in self.blobs:
                self.blobs[part_id] = data
                new.append(part_id)
        return new[-1] if new else hash_bytes(encode_manifest(manifest)), new

    def run(self, run_id: str) -> RunManifest:
        [run] = self.get_typed_many([run_id], RunManifest)
        return run


def dump(step: int, peer: str, version: int = 0) -> DumpEntry:
    return DumpEntry(step, peer, hash_bytes(f"{step}/{peer}/{version}".encode()), f"f{version}")


def aggregate(step: int, name: str, version: int = 0) -> AggregateEntry:
    return AggregateEntry(
        step,
        name,
        hash_bytes(f"agg {step}/{name}/{version}".encode()),
        hash_bytes(f"key {step}/{name}".encode()),
    )


def walk(source: MemorySource, run: RunManifest) -> list[tuple[ShardLink, RunShard]]:
    """Every shard under a run, each with the link that names it (checked against it)."""
    out = []
    todo: list[tuple[ShardLink, str, int | None]] = [
        (link, kind, None)
        for link, kind in ((run.dump_shards, "dumps"), (run.aggregate_shards, "aggregates"))
        if link is not None
    ]
    while todo:
        link, kind, level = todo.pop()
        node = decode_manifest(source.blobs[link.id])
        assert isinstance(node, RunShard)
        assert link_mismatch(link, node, kind, level) is None
        out.append((link, node))
        todo.extend((c, kind, node.level - 1) for c in node.children)
    return out


def level(source: MemorySource, link: ShardLink) -> int:
    """The level of the shard ``link`` names (its height above the leaves)."""
    node = decode_manifest(source.blobs[link.id])
    assert isinstance(node, RunShard)
    return node.level


shapes = st.builds(TreeShape, leaf=st.integers(1, 5), branch=st.integers(2, 4))
keys = st.tuples(st.integers(0, 40), st.sampled_from(PEERS))


class ShardedRun(RuleBasedStateMachine):
    """Commits of dumps and aggregates, stored and read back between commits, against dicts."""

    @initialize(shape=shapes)
    def start(self, shape: TreeShape) -> None:
        self.shape = shape
        self.source = MemorySource()
        self.run_id: str | None = None
        self.dumps: dict[tuple[int, str], DumpEntry] = {}
        self.aggregates: dict[tuple[int, str], AggregateEntry] = {}
        self.version = 0

    def _base(self) -> RunManifest:
        return RunManifest("r") if self.run_id is None else self.source.run(self.run_id)

    def _commit(self, run: RunManifest, committed: int) -> None:
        self.run_id, written = self.source.put(run)
        shards = [i for i in written if isinstance(decode_manifest(self.source.blobs[i]), RunShard)]
        tops = [link for link in (run.dump_shards, run.aggregate_shards) if link is not None]
        height = max((level(self.source, t) for t in tops), default=0)
        # Only the paths to the committed keys are remade: at most two shards per
        # committed entry and level (a node and the piece a split adds).
        assert len(shards) <= 2 * committed * (height + 1) * len(tops), (len(shards), committed)

    @rule(batch=st.lists(keys, min_size=1, max_size=12))
    def commit_dumps(self, batch: list[tuple[int, str]]) -> None:
        self.version += 1
        entries = [dump(step, peer, self.version) for step, peer in batch]
        self._commit(merge_run(self._base(), entries, {}, shape=self.shape), len(entries))
        self.dumps.update((e.sort_key, e) for e in entries)

    @rule(batch=st.lists(st.tuples(st.integers(0, 40), st.sampled_from(["avg", "med"]))))
    def record(self, batch: list[tuple[int, str]]) -> None:
        self.version += 1
        entries = [aggregate(step, name, self.version) for step, name in batch]
        run = record_aggregates(self._base(), entries, shape=self.shape)
        self._commit(run, max(len(entries), 1))
        self.aggregates.update((e.sort_key, e) for e in entries)

    @rule(data=st.data())
    def recommit_recorded_dumps(self, data: st.DataObject) -> None:
        """Recording what is recorded writes nothing: the run keeps its id."""
        if not self.dumps:
            return
        picked = data.draw(st.lists(st.sampled_from(sorted(self.dumps)), min_size=1))
        before = self.run_id
        run = merge_run(self._base(), [self.dumps[k] for k in picked], {}, shape=self.shape)
        run_id, written = self.source.put(run)
        assert (run_id, written) == (before, [])

    @invariant()
    def reads_as_the_model(self) -> None:
        if self.run_id is None:
            return
        run = self.source.run(self.run_id)
        expected = [self.dumps[k] for k in sorted(self.dumps)]
        # Point lookups first, on a fresh read: only the paths are loaded.
        for key in [*list(self.dumps)[:3], (41, "a"), (-1, "a")]:
            assert run.entry(*key) == self.dumps.get(key)
        for key in [*list(self.aggregates)[:3], (41, "avg")]:
            assert run.aggregate_entry(*key) == self.aggregates.get(key)
        for step in {0, 40, *(k[0] for k in list(self.dumps)[:3])}:
            assert run.step_dumps(step) == [d for d in expected if d.step == step]
        assert run.dump_count == len(self.dumps)
        assert list(run.dumps) == expected
        assert list(run.aggregates) == [self.aggregates[k] for k in sorted(self.aggregates)]
        assert run.steps == sorted({k[0] for k in self.dumps})
        assert run.peers == sorted({k[1] for k in self.dumps})
        assert run.dump_entries(self.dumps) == self.dumps

    @invariant()
    def shards_have_the_shape(self) -> None:
        if self.run_id is None:
            return
        run = self.source.run(self.run_id)
        assert (run.dump_shards is None) == (len(self.dumps) <= self.shape.leaf)
        assert len(run.inline_dumps) <= self.shape.leaf
        assert len(run.inline_aggregates) <= self.shape.leaf
        for _, node in walk(self.source, run):
            assert len(node.entries) <= self.shape.leaf
            assert len(node.children) <= self.shape.branch


TestShardedRun = ShardedRun.TestCase
TestShardedRun.settings = settings(
    max_examples=60,
    stateful_step_count=25,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)


def test_appending_fills_shards_and_reads_one_batch_per_level() -> None:
    source = MemorySource()
    shape = TreeShape(leaf=4, branch=3)
    run = RunManifest("r")
    for step in range(60):
        run = merge_run(run, [dump(step, p) for p in ("a", "b")], {}, shape=shape)
        run_id, _ = source.put(run)
        run = source.run(run_id)
    leaves = [node for _, node in walk(source, run) if node.level == 0]
    # Steps arrive in order: every leaf but the last is full.
    assert sorted(len(n.entries) for n in leaves)[1:] == [4] * (len(leaves) - 1)
    assert run.dump_shards is not None
    height = level(source, run.dump_shards)
    fresh, source.reads = source.run(run_id), 0
    assert len(fresh.dumps) == 120
    assert source.reads == height + 1  # the top, then one batched read per level
    source.reads = 0
    assert source.run(run_id).entry(31, "b") == dump(31, "b")
    assert source.reads == 1 + height + 1  # the run, then one shard per level


def test_a_small_run_stays_in_its_manifest_in_the_old_format() -> None:
    run = merge_run(RunManifest("r"), [dump(0, "a"), dump(1, "a")], {})
    assert run.dump_shards is None
    doc = encode_manifest(run)
    assert b'"format":1' in doc
    assert b"shards" not in doc
    with_aggregates = record_aggregates(run, [aggregate(0, "avg")])
    assert b'"format":3' in encode_manifest(with_aggregates)


def test_an_old_gradpipe_refuses_a_run_in_shards(monkeypatch: pytest.MonkeyPatch) -> None:
    shape = TreeShape(leaf=2, branch=2)
    run = merge_run(RunManifest("r"), [dump(s, "a") for s in range(5)], {}, shape=shape)
    root = encode_manifest(run)
    [shard] = [encode_manifest(n) for n in run.unstored_manifests()][:1]
    assert b'"format":4' in root
    monkeypatch.setattr(manifest_module, "FORMAT_VERSION", 3)
    for data in (root, shard):
        with pytest.raises(UnsupportedFormatError, match="format 4, newer than this gradpipe"):
            decode_manifest(data)
    # A run that fits its manifest still reads.
    assert decode_manifest(encode_manifest(RunManifest("r", [dump(0, "a")]))) is not None


def test_a_shard_that_does_not_match_its_link_is_refused() -> None:
    source = MemorySource()
    shape = TreeShape(leaf=2, branch=2)
    run = merge_run(RunManifest("r"), [dump(s, "a") for s in range(5)], {}, shape=shape)
    run_id, _ = source.put(run)
    good = source.run(run_id)
    assert good.dump_shards is not None
    lying = RunManifest(
        "r",
        dump_shards=ShardLink(good.dump_shards.id, good.dump_shards.first, 6),
    )
    lying_id, _ = source.put(lying)
    with pytest.raises(IntegrityError, match="does not match its link"):
        _ = source.run(lying_id).dumps


def test_shards_check_what_they_hold() -> None:
    with pytest.raises(InvalidInputError, match="out of order"):
        RunShard("dumps", 0, (dump(2, "a"), dump(1, "a")))
    with pytest.raises(InvalidInputError, match="another kind"):
        RunShard("dumps", 0, (aggregate(1, "avg"),))
    with pytest.raises(InvalidInputError, match="only entries"):
        RunShard("dumps", 0, ())
    with pytest.raises(InvalidInputError, match="unknown kind"):
        RunShard("tensors", 0, (dump(1, "a"),))
    link = ShardLink(dump(0, "a").dump, (0, "a"), 1)
    with pytest.raises(InvalidInputError, match="both in its manifest and in shards"):
        RunManifest("r", [dump(0, "a")], dump_shards=link)


def test_a_run_decoded_without_a_store_says_how_to_read_it() -> None:
    shape = TreeShape(leaf=2, branch=2)
    run = merge_run(RunManifest("r"), [dump(s, "a") for s in range(5)], {}, shape=shape)
    decoded = decode_manifest(encode_manifest(run))
    assert isinstance(decoded, RunManifest)
    assert decoded.dump_count == 5  # from the manifest alone
    with pytest.raises(InvalidInputError, match="without a store"):
        _ = decoded.dumps
