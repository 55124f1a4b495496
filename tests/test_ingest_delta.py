"""``ingest(..., delta=True)``: each peer's tensors as delta chains across steps.

Parameters drift slowly from step to step and their deltas pay; gradients do
not, and the report must say so. Reads and exports do not change.
"""

from __future__ import annotations

import types
from collections.abc import Iterator
from pathlib import Path

import dask.config
import fsspec
import numpy as np
import pytest

import gradpipe as gp
from gradpipe.core.tensor_manifest import TensorManifest
from gradpipe.errors import InvalidInputError
from gradpipe.formats.safetensors import read_safetensors, write_safetensors
from gradpipe.ingestion.api import IngestReport, ingest
from gradpipe.runs import export_dump, open_run
from gradpipe.storage.gc import gc
from gradpipe.storage.verify import verify

PEERS = ("a", "b")
SIZE = 16384  # float32 elements: 64 KiB, eight chunks of 8 KiB
#: Chunks large enough to be delta-eligible (none kept inline).
SMALL = {"gradpipe.chunk-bytes": 8192, "gradpipe.inline-bytes": 0}

Dumps = dict[tuple[int, str], dict[str, np.ndarray]]


@pytest.fixture(autouse=True)
def _small_chunks() -> Iterator[None]:
    with dask.config.set(SMALL):
        yield


def parameters(steps: int, seed: int = 0) -> Dumps:
    """Parameter-like dumps: ``w_s = w_{s-1} + 1e-4 * noise`` per peer, and a small bias."""
    rng = np.random.default_rng(seed)
    out: Dumps = {}
    for peer in PEERS:
        w = rng.standard_normal(SIZE).astype("float32")
        for step in range(steps):
            w = (w + 1e-4 * rng.standard_normal(SIZE)).astype("float32")
            out[step, peer] = {"w": w.reshape(128, 128), "bias": w[:8].copy()}
    return out


def gradients(steps: int, seed: int = 1) -> Dumps:
    """Gradient-like dumps: independent random values at every step."""
    rng = np.random.default_rng(seed)
    return {
        (step, peer): {"g": (1e-3 * rng.standard_normal(SIZE)).astype("float32")}
        for step in range(steps)
        for peer in PEERS
    }


def write_dumps(root: str, dumps: Dumps) -> str:
    """Write ``dumps`` as safetensors under ``root`` (a path or URL); return their pattern."""
    fs, _, [base] = fsspec.get_fs_token_paths(root)
    for (step, peer), tensors in dumps.items():
        path = f"{base}/step={step:03d}/peer={peer}.safetensors"
        fs.makedirs(path.rsplit("/", 1)[0], exist_ok=True)
        with fs.open(path, "wb") as f:
            write_safetensors(f, tensors, {"num_examples": str(step + 1)})
    return f"{root}/step={{step}}/peer={{peer}}.safetensors"


def dump_root(store_url: str, name: str = "d") -> str:
    """Where the dumps go: beside the store (on S3 too, when the store is)."""
    return f"{store_url.rstrip('/')}-{name}"


def check_exports(
    kit: types.ModuleType, store: gp.Store, run: str, want: Dumps, tmp_path: Path
) -> None:
    """Every dump exports bit-exact, with its metadata."""
    assert {(e.step, e.peer) for e in open_run(store, run)} == set(want)
    for (step, peer), tensors in want.items():
        out = tmp_path / f"export-{step}-{peer}.safetensors"
        export_dump(store, run, step, peer, out)
        got, meta = read_safetensors(out)
        kit.assert_all_bit_exact(got, tensors)
        assert meta == {"num_examples": str(step + 1)}


def info(store: gp.Store, run: str, step: int, peer: str, name: str) -> TensorManifest:
    return open_run(store, run).dump(step, peer).info(name)


def tensor_id(store: gp.Store, run: str, step: int, peer: str, name: str) -> str:
    return open_run(store, run).dump(step, peer).manifest.tensor_ids[name]


def test_parameters_chain_store_less_and_export_bit_exact(
    store_url: str, kit: types.ModuleType, tmp_path: Path
) -> None:
    want = parameters(steps=6)
    pattern = write_dumps(dump_root(store_url), want)
    plain = ingest(gp.open_store(f"{store_url}-plain", mode="w"), pattern, run="r")
    store = gp.open_store(store_url, mode="w")
    chained = ingest(store, pattern, run="r", delta=True, keyframe_interval=3)
    assert plain.ok
    assert chained.ok, chained.summary()
    assert chained.ingested == plain.ingested == 12
    assert chained.writes.stored_bytes < plain.writes.stored_bytes
    assert plain.chains is None
    assert plain.to_dict()["chains"] is None

    chains = chained.chains
    assert chains is not None
    # Per peer, six steps with K = 3: steps 1, 2, 4, 5 are deltas, 0 and 3 keyframes.
    assert chains.delta_chunks == 2 * 4 * 8
    # Keyframes of w, and every bias chunk (32 bytes: a delta frame is no smaller).
    assert chains.full_chunks == 2 * 2 * 8 + 12
    assert chains.max_depth == 1  # every delta is against its keyframe
    assert 0 < chains.saved_bytes < chains.full_bytes
    assert chains.tensors == 24
    assert chains.chained_tensors == 20
    doc = chained.to_dict()["chains"]
    assert doc["delta_chunks"] == chains.delta_chunks
    assert doc["saved_bytes"] == chains.saved_bytes
    assert "64 chunks stored as deltas, 44 in full" in chained.summary()
    assert "did not pay" not in chained.summary()

    for peer in PEERS:
        ages = [info(store, "r", step, peer, "w").age for step in range(6)]
        assert ages == [0, 1, 2, 0, 1, 2]  # never more than K - 1
        assert max(info(store, "r", step, peer, "w").depth for step in range(6)) == 1
        for step in range(1, 6):
            chain = info(store, "r", step, peer, "w").chain
            assert chain is not None
            assert chain.parent == tensor_id(store, "r", step - 1, peer, "w")
            assert chain.keyframe_interval == 3
        first = info(store, "r", 0, peer, "w").chain
        assert first is not None
        assert first.parent is None
    check_exports(kit, store, "r", want, tmp_path)
    assert verify(store).ok


def test_gradients_stay_full_and_the_report_says_so(kit: types.ModuleType, tmp_path: Path) -> None:
    want = gradients(steps=4)
    pattern = write_dumps(str(tmp_path / "d"), want)
    store = gp.open_store(str(tmp_path / "store"), mode="w")
    report = ingest(store, pattern, run="r", delta=True)
    assert report.ok
    assert report.chains is not None
    assert report.chains.delta_chunks == 0
    assert report.chains.full_chunks == 4 * 2 * 8
    assert report.chains.saved_bytes == 0
    assert report.chains.chained_tensors == 3 * 2  # every step after the first had a parent
    assert "did not pay" in report.summary()
    assert "0 chunks stored as deltas" in report.summary()
    assert report.to_dict()["chains"]["saved_fraction"] == 0.0
    assert all(info(store, "r", s, p, "g").depth == 0 for s, p in want)
    check_exports(kit, store, "r", want, tmp_path)


def test_xor_kind(kit: types.ModuleType, tmp_path: Path) -> None:
    want = parameters(steps=3, seed=5)
    pattern = write_dumps(str(tmp_path / "d"), want)
    store = gp.open_store(str(tmp_path / "store"), mode="w")
    report = ingest(store, pattern, run="r", delta=True, delta_kind="xor")
    assert report.ok
    assert report.chains is not None
    assert report.chains.delta_chunks > 0
    links = info(store, "r", 2, "a", "w").deltas
    assert links
    assert {link.kind for chain in links.values() for link in chain} == {"xor"}
    check_exports(kit, store, "r", want, tmp_path)


def test_bad_dump_mid_chain_fails_alone(kit: types.ModuleType, tmp_path: Path) -> None:
    """A dump with bad data fails; its peer's next step is stored in full, the other chains on."""
    want = parameters(steps=4)
    for tensors in want.values():
        tensors["mask"] = np.ones(64, dtype=bool)
    pattern = write_dumps(str(tmp_path / "d"), want)
    bad = Path(pattern.format(step="001", peer="a"))
    data = bytearray(bad.read_bytes())
    data[-1] = 2  # the last byte of the file is the bool mask's: not a bool
    bad.write_bytes(bytes(data))
    store = gp.open_store(str(tmp_path / "store"), mode="w")
    report = ingest(store, pattern, run="r", delta=True)
    assert not report.ok
    [failure] = report.failures
    assert (failure.step, failure.peer) == (1, "a")
    assert "mask" in failure.reason
    assert report.ingested == 7
    assert [info(store, "r", s, "a", "w").age for s in (0, 2, 3)] == [0, 0, 1]
    after = info(store, "r", 2, "a", "w").chain
    assert after is not None
    assert after.parent is None
    assert [info(store, "r", s, "b", "w").age for s in range(4)] == [0, 1, 2, 3]
    del want[1, "a"]
    check_exports(kit, store, "r", want, tmp_path)


def test_unreadable_dump_is_skipped_by_the_chain(kit: types.ModuleType, tmp_path: Path) -> None:
    """A dump refused before the write (its header) is left out: the next step chains past it."""
    want = parameters(steps=3)
    pattern = write_dumps(str(tmp_path / "d"), want)
    Path(pattern.format(step="001", peer="a")).write_bytes(b"not a dump")
    store = gp.open_store(str(tmp_path / "store"), mode="w")
    report = ingest(store, pattern, run="r", delta=True)
    assert [(f.step, f.peer) for f in report.failures] == [(1, "a")]
    chain = info(store, "r", 2, "a", "w").chain
    assert chain is not None
    assert chain.parent == tensor_id(store, "r", 0, "a", "w")
    del want[1, "a"]
    check_exports(kit, store, "r", want, tmp_path)


def test_later_ingest_chains_on_recorded_steps(
    store_url: str, kit: types.ModuleType, tmp_path: Path
) -> None:
    """Steps added by a second ingest take their parents from the store."""
    want = parameters(steps=5)
    root = dump_root(store_url)
    store = gp.open_store(store_url, mode="w")
    early = {k: v for k, v in want.items() if k[0] < 3}
    first = ingest(store, write_dumps(root, early), run="r", delta=True)
    assert first.ok
    assert first.ingested == 6
    pattern = write_dumps(root, {k: v for k, v in want.items() if k[0] >= 3})
    second = ingest(store, pattern, run="r", delta=True)
    assert second.ok, second.summary()
    assert (second.ingested, second.skipped) == (4, 6)
    assert second.chains is not None
    assert second.chains.chained_tensors == 2 * 2 * 2  # w and bias of steps 3 and 4, both peers
    assert second.chains.delta_chunks == 2 * 2 * 8
    for peer in PEERS:
        chain = info(store, "r", 3, peer, "w").chain
        assert chain is not None
        assert chain.parent == tensor_id(store, "r", 2, peer, "w")
        assert [info(store, "r", s, peer, "w").age for s in range(5)] == [0, 1, 2, 3, 4]
    check_exports(kit, store, "r", want, tmp_path)
    assert verify(store).ok


def test_a_recorded_parent_with_a_malformed_tensor_means_storing_in_full(
    kit: types.ModuleType, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A parent whose embedded tensor does not decode (its dump read fine: tensors decode
    lazily) lends the successor nothing; the successor is stored in full, not failed."""
    from gradpipe.core.tensor_manifest import TensorRef
    from gradpipe.errors import IntegrityError

    want = parameters(steps=4)
    store_url = str(tmp_path / "store")
    root = dump_root(store_url)
    store = gp.open_store(store_url, mode="w")
    assert ingest(store, write_dumps(root, {k: v for k, v in want.items() if k[0] < 2}), run="r").ok
    damaged = {tensor_id(store, "r", 1, "a", name) for name in ("w", "bias")}
    decode = TensorRef.manifest

    def malformed(ref: TensorRef) -> TensorManifest:
        if ref.tensor_id in damaged:
            raise IntegrityError(f"tensor {ref.tensor_id}, kept in a stored manifest, is malformed")
        return decode(ref)

    monkeypatch.setattr(TensorRef, "manifest", malformed)
    later = {k: v for k, v in want.items() if k[0] >= 2}
    report = ingest(store, write_dumps(root, later), run="r", delta=True)
    assert report.ok, report.summary()
    assert report.ingested == 4
    monkeypatch.undo()
    full = info(store, "r", 2, "a", "w")  # its parent lent nothing: a keyframe
    assert full.chain is not None
    assert full.chain.parent is None
    assert not full.deltas
    chain = info(store, "r", 2, "b", "w").chain
    assert chain is not None
    assert chain.parent == tensor_id(store, "r", 1, "b", "w")
    check_exports(kit, store, "r", want, tmp_path)


def test_rerun_is_a_no_op(tmp_path: Path) -> None:
    pattern = write_dumps(str(tmp_path / "d"), parameters(steps=3))
    store = gp.open_store(str(tmp_path / "store"), mode="w")
    first = ingest(store, pattern, run="r", delta=True)
    history = len(list(store.refs.history("runs/r")))
    again = ingest(store, pattern, run="r", delta=True)
    assert again.ok
    assert (again.ingested, again.skipped) == (0, 6)
    assert again.writes.blocks_written == 0
    assert again.writes.stored_bytes == 0
    assert again.run_id == first.run_id
    assert len(list(store.refs.history("runs/r"))) == history


def test_crashed_ingest_rerun_writes_the_same_objects(tmp_path: Path) -> None:
    """Dumps written but never committed (a crash) are rewritten to the same ids, no block twice."""
    pattern = write_dumps(str(tmp_path / "d"), parameters(steps=3))
    store = gp.open_store(str(tmp_path / "store"), mode="w")
    first = ingest(store, pattern, run="r", delta=True)
    dumps = {(e.step, e.peer): e.dump for e in open_run(store, "r")}
    store.refs.set("runs/r", None)  # as if the commit had never landed
    again = ingest(store, pattern, run="r", delta=True)
    assert again.ok
    assert again.ingested == 6
    assert again.writes.blocks_written == 0
    assert {(e.step, e.peer): e.dump for e in open_run(store, "r")} == dumps
    assert again.run_id == first.run_id


def test_gc_after_replacing_a_parent_keeps_every_chain(
    store_url: str, kit: types.ModuleType, tmp_path: Path
) -> None:
    """Replacing a step others chain on, then gc with no grace: every dump still exports."""
    want = parameters(steps=4)
    root = dump_root(store_url)
    pattern = write_dumps(root, want)
    store = gp.open_store(store_url, mode="w")
    assert ingest(store, pattern, run="r", delta=True).ok
    replaced = parameters(steps=2, seed=9)
    want[1, "a"] = replaced[1, "a"]
    write_dumps(root, {(1, "a"): want[1, "a"]})
    report = ingest(store, pattern, run="r", delta=True, replace=True)
    assert report.ok, report.summary()
    assert report.ingested == 1
    swept = gc(store, grace=0)
    assert swept.ok
    assert swept.deleted > 0  # the replaced dump's manifest at least
    assert verify(store).ok
    # Step 2 of peer a still chains on the blocks of the replaced step 1.
    assert info(store, "r", 2, "a", "w").age == 2
    check_exports(kit, store, "r", want, tmp_path)


def test_options_are_checked_before_any_file_is_read(tmp_path: Path) -> None:
    store = gp.open_store(str(tmp_path / "store"), mode="w")
    pattern = str(tmp_path / "none/step={step}/peer={peer}.safetensors")
    with pytest.raises(InvalidInputError, match="delta kind 'sparse'"):
        ingest(store, pattern, run="r", delta=True, delta_kind="sparse")
    with pytest.raises(InvalidInputError, match="keyframe interval"):
        ingest(store, pattern, run="r", delta=True, keyframe_interval=0)
    import numcodecs

    with pytest.raises(InvalidInputError, match="--codec"):
        ingest(store, pattern, run="r", delta=True, codecs=[numcodecs.Zstd()])


def test_report_round_trips_through_json(tmp_path: Path) -> None:
    import json

    pattern = write_dumps(str(tmp_path / "d"), parameters(steps=2))
    report: IngestReport = ingest(
        gp.open_store(str(tmp_path / "store"), mode="w"), pattern, run="r", delta=True
    )
    doc = json.loads(json.dumps(report.to_dict()))
    assert doc["chains"]["tensors"] == 2 * 2 * 2  # two tensors, two steps, two peers
    assert doc["chains"]["full_bytes"] >= doc["chains"]["stored_bytes"] > 0
