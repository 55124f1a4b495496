"""``ingest(repair=True)``: recorded dumps whose objects went missing are written again."""

from __future__ import annotations

import types
from pathlib import Path

import numpy as np
import pytest

import gradpipe as gp
from gradpipe.core.ids import block_key
from gradpipe.core.tensor_manifest import TensorManifest
from gradpipe.formats.safetensors import read_safetensors
from gradpipe.ingestion.api import ingest
from gradpipe.runs import open_run
from gradpipe.storage.walk import find_missing
from gradpipe.testing.training import SampleRun, TrainingConfig, write_sample_run

CONFIG = TrainingConfig(vocab_size=2000, embed_dim=8, hidden=16, peers=2, steps=2)


@pytest.fixture(scope="module")
def sample(tmp_path_factory: pytest.TempPathFactory) -> SampleRun:
    return write_sample_run(tmp_path_factory.mktemp("sample"), CONFIG)


def _objects(store: gp.Store, run: str, step: int, peer: str) -> tuple[str, list[str]]:
    """A recorded dump's manifest id and the ids of its data blocks stored as objects."""
    recorded = open_run(store, run)
    entry = recorded.manifest.entry(step, peer)
    assert entry is not None
    dump = recorded.dump(step, peer)
    blocks = [b for name in dump.names for b in dump.info(name).data_children()]
    return entry.dump, blocks


def _check_exports(kit: types.ModuleType, store: gp.Store, sample: SampleRun, run: str) -> None:
    recorded = open_run(store, run)
    for step in sample.steps:
        for peer in sample.peers:
            want = read_safetensors(sample.dump_path(step, peer))[0]
            kit.assert_all_bit_exact(recorded.dump(step, peer).read_all(), want)


@pytest.mark.parametrize("lost", ["data block", "dump manifest"])
def test_repair_rewrites_what_went_missing(
    kit: types.ModuleType, sample: SampleRun, store: gp.Store, lost: str
) -> None:
    first = ingest(store, sample.dump_pattern, run="r")
    assert first.ok
    step, peer = sample.steps[-1], sample.peers[0]
    dump_id, blocks = _objects(store, "r", step, peer)
    victim = {"data block": blocks[0], "dump manifest": dump_id}
    store.backend.delete(block_key(victim[lost]))
    assert not gp.verify(store).ok

    plain = ingest(store, sample.dump_pattern, run="r")
    assert plain.skipped == first.ingested  # without repair, recorded dumps are not read
    assert plain.repaired == 0
    assert not gp.verify(store).ok

    fixed = ingest(store, sample.dump_pattern, run="r", repair=True)
    assert fixed.ok
    assert fixed.repaired >= 1  # the damaged dump (and any sharing the lost block)
    assert fixed.skipped == first.ingested - fixed.repaired
    assert fixed.ingested == 0
    assert fixed.writes.blocks_written >= 1
    assert gp.verify(store).ok
    _check_exports(kit, store, sample, "r")
    assert "repaired" in fixed.summary()
    assert fixed.to_dict()["repaired"] == fixed.repaired

    again = ingest(store, sample.dump_pattern, run="r", repair=True)
    assert again.repaired == 0
    assert again.writes.blocks_written == 0
    assert again.skipped == first.ingested


def test_find_missing_names_each_root(tmp_path: Path, no_inline: None) -> None:
    store = gp.open_store(tmp_path / "s", mode="w")
    shared = np.arange(1000, dtype=np.float32)
    a = store.put_tensor(shared, name="a")
    b = store.put_tensor(np.stack([shared, shared]), name="b", chunk_bytes=4000)
    c = store.put_tensor(np.ones(10, dtype=np.int8), name="c")
    block = store.get_typed(a, TensorManifest).blocks[0]
    assert block is not None
    assert block in store.get_typed(b, TensorManifest).blocks  # dedup: b shares a's chunk
    store.backend.delete(block_key(block))
    found = find_missing(store, [(a, "a"), (b, "b"), (c, "c")])
    assert [[p.id for p in problems] for problems in found] == [[block], [block], []]
    assert found[0][0].kind == "missing"
    assert "a" in found[0][0].context
    store.backend.delete(block_key(c))
    assert [p.kind for p in find_missing(store, [(c, "c")])[0]] == ["missing"]


def test_corrupt_block_deleted_by_verify_then_repaired(
    kit: types.ModuleType, sample: SampleRun, store: gp.Store
) -> None:
    assert ingest(store, sample.dump_pattern, run="r").ok
    _, blocks = _objects(store, "r", sample.steps[0], sample.peers[0])
    key = block_key(blocks[0])
    frame = bytearray(store.backend.read(key))
    frame[-1] ^= 0xFF
    store.backend.delete(key)
    store.backend.write_if_absent(key, bytes(frame))
    # Present, so a presence check cannot see it; verify can.
    assert ingest(store, sample.dump_pattern, run="r", repair=True).repaired == 0
    found = gp.verify(store)
    assert [p.kind for p in found.problems] == ["corrupt"]
    assert "--repair" in found.summary()
    cleaned = gp.verify(store, delete_corrupt=True)
    assert cleaned.deleted_corrupt == [blocks[0]]
    assert "--repair" in cleaned.summary()
    assert store.backend.mtimes([key]) == [None]
    fixed = ingest(store, sample.dump_pattern, run="r", repair=True)
    assert fixed.repaired >= 1
    assert gp.verify(store).ok
    _check_exports(kit, store, sample, "r")


def test_verify_reports_a_ref_moved_to_the_wrong_kind_of_object(store: gp.Store) -> None:
    tensor = store.put_tensor(np.arange(5, dtype=np.float32), name="t")
    store.refs.set("runs/r", tensor, expected=None)  # a run ref at a tensor
    report = gp.verify(store)
    assert not report.ok
    [problem] = report.problems
    assert (problem.kind, problem.id) == ("wrong kind", tensor)
    assert "runs/r" in problem.context
    with pytest.raises(gp.IntegrityError, match="gradpipe verify"):
        gp.gc(store, grace=0)
