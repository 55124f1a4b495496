"""Snapshots: exact restore of nested training state, chains, prune + gc, writers racing."""

from __future__ import annotations

import math
import tempfile
import threading
from collections import OrderedDict
from pathlib import Path
from typing import Any

import dask.config
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import gradpipe as gp
from gradpipe.core.dtypes import DTYPE_NAMES
from gradpipe.core.ids import block_key
from gradpipe.errors import InvalidInputError, NotFoundError
from gradpipe.snapshots.api import find_snapshot
from gradpipe.testing.store_suite import special_values

SMALL = {"gradpipe.chunk-bytes": 4096, "gradpipe.inline-bytes": 0}


def same(a: Any, b: Any) -> bool:
    """Equal in type, dtype, nesting, key types and bits."""
    if isinstance(a, np.ndarray):
        return (
            isinstance(b, np.ndarray)
            and a.dtype == b.dtype
            and a.shape == b.shape
            and np.ascontiguousarray(a).tobytes() == np.ascontiguousarray(b).tobytes()
        )
    if isinstance(a, np.generic):
        return type(a) is type(b) and a.tobytes() == b.tobytes()
    if isinstance(a, dict):
        return (
            type(a) is type(b)
            and [(type(k), k) for k in a] == [(type(k), k) for k in b]
            and all(same(a[k], b[k]) for k in a)
        )
    if isinstance(a, list | tuple):
        return type(a) is type(b) and len(a) == len(b) and all(map(same, a, b))
    if isinstance(a, float):
        return type(b) is float and ((math.isnan(a) and math.isnan(b)) or a.hex() == b.hex())
    return type(a) is type(b) and a == b


def training_state(step: int, params: dict[str, np.ndarray]) -> dict[str, Any]:
    """Shaped like a PyTorch model + Adam state dict, with RNG, loader and config entries."""
    return {
        "model": OrderedDict(params),
        "optimizer": {
            "state": {
                i: {
                    "step": np.float32(step),
                    "exp_avg": p * np.float32(0.1),
                    "exp_avg_sq": p * p,
                }
                for i, p in enumerate(params.values())
            },
            "param_groups": [
                {"lr": 1e-3, "betas": (0.9, 0.999), "eps": 1e-8, "params": list(range(len(params)))}
            ],
        },
        "rng": {"numpy": np.random.default_rng(step).bit_generator.state, "torch": b"\x01" * 5056},
        "loader": {"epoch": step // 3, "position": step * 32},
        "config": {"model": "mini", "layers": 2, "dropout": 0.0, "tags": ["a", None, True]},
        "blobs": [b"opaque" * step, bytearray(b"\x00\xff")],
    }


def drifting(steps: int, seed: int = 0) -> list[dict[str, Any]]:
    rng = np.random.default_rng(seed)
    params = {
        "embed.weight": rng.standard_normal((64, 128)).astype("float32"),
        "fc.weight": rng.standard_normal((128, 32)).astype("float32"),
        "fc.bias": np.zeros(32, "float32"),
    }
    out = []
    for step in range(steps):
        out.append(training_state(step, {k: v.copy() for k, v in params.items()}))
        for name, value in params.items():
            params[name] = value + (rng.standard_normal(value.shape) * 1e-4).astype("float32")
    return out


@pytest.fixture
def small() -> Any:
    with dask.config.set(SMALL):
        yield


def test_every_dtype_and_nesting_comes_back_exactly(store: gp.Store) -> None:
    state = {
        "arrays": {name: special_values(name, 300, seed=i) for i, name in enumerate(DTYPE_NAMES)},
        "scalars": [np.float32(-0.0), np.int64(-5), np.bool_(True), 0.1, float("nan"), -0.0],
        "zero-d": np.array(3.5, dtype="float64"),
        "empty": np.zeros((0, 4), "float32"),
        3: "int key",
        "nested": (1, (2, [3, {"deep": b"bytes"}])),
        "none": None,
        "big": 2**80,
    }
    gp.snapshot(store, "all", state, step=0)
    assert same(gp.restore(store, "all"), state)


def test_chain_of_training_states(tmp_path: Path, small: None) -> None:
    store = gp.open_store(tmp_path / "store", mode="w")
    states = drifting(6)
    ids = [
        gp.snapshot(store, "run", s, step=10 * i, loss=1.0 / (i + 1), metadata={"i": str(i)})
        for i, s in enumerate(states)
    ]
    log = gp.snapshot_log(store, "run")
    assert [v.step for v in log] == [0, 10, 20, 30, 40, 50]
    assert [v.id for v in log] == ids
    assert all(isinstance(v, gp.SnapshotInfo) for v in log)
    assert log[0].depth == 0
    assert log[-1].depth >= 1
    assert all(v.ratio < 0.9 for v in log[1:])  # parameters and moments drift slowly
    assert log[3].loss == 0.25
    assert log[3].metadata == {"i": "3"}
    for i, state in enumerate(states):
        assert same(gp.restore(store, "run", step=10 * i), state)
    assert same(gp.restore(store, "run"), states[-1])
    # A new process has no memory of the last snapshot: it reads it back, same result.
    other = gp.open_store(tmp_path / "store", mode="a")
    gp.snapshot(other, "run", states[0], step=60)
    assert same(gp.restore(other, "run", step=60), states[0])
    assert gp.verify(store).ok


def test_restore_selected_keys_reads_only_their_chunks(tmp_path: Path, small: None) -> None:
    store = gp.open_store(tmp_path / "store", mode="w")
    state = drifting(1)[0]
    gp.snapshot(store, "run", state, step=0)
    got = gp.restore(store, "run", keys=["model", "loader"])
    assert list(got) == ["model", "loader"]
    assert same(got["model"], state["model"])
    # Damage every block of the optimizer's arrays: a keys= read never touches them.
    _, manifest = find_snapshot(store, "run")
    for key, tensor_id in manifest.tensors.items():
        if key.startswith("optimizer."):
            for block in manifest.embedded[tensor_id].data_children():
                store.backend.delete(block_key(block))
    assert same(
        gp.restore(store, "run", keys=["model.fc.weight"])["model"]["fc.weight"],
        state["model"]["fc.weight"],
    )
    with pytest.raises(NotFoundError):
        gp.restore(store, "run", keys=["optimizer"])
    with pytest.raises(NotFoundError, match="top-level entries"):
        gp.restore(store, "run", keys=["nonsense"])


def test_missing_names_and_steps_are_clear(store: gp.Store) -> None:
    with pytest.raises(NotFoundError, match="no snapshot 'nope'"):
        gp.restore(store, "nope")
    gp.snapshot(store, "a", {"x": np.arange(3)}, step=5)
    with pytest.raises(NotFoundError, match="has no step 6"):
        gp.restore(store, "a", step=6)
    with pytest.raises(InvalidInputError, match="step"):
        gp.snapshot(store, "a", {"x": 1}, step=-1)
    with pytest.raises(InvalidInputError, match=r"state\['bad'\]"):
        gp.snapshot(store, "a", {"bad": {1, 2}}, step=6)
    assert [v.step for v in gp.snapshot_log(store, "a")] == [5]  # the refused ones left nothing


def test_prune_then_gc_keeps_every_kept_version_exact(store: gp.Store) -> None:
    with dask.config.set(SMALL):
        states = drifting(10, seed=1)
        for i, state in enumerate(states):
            gp.snapshot(store, "run", state, step=i, keyframe_interval=4)
        dry = gp.prune(store, "run", keep_last=3, keep_every=4, dry_run=True)
        assert isinstance(dry, gp.PruneReport)
        assert isinstance(dry, gp.Report)
        assert dry.dropped_steps == [1, 2, 3, 5, 6]
        assert [v.step for v in gp.snapshot_log(store, "run")] == list(range(10))  # unchanged
        report = gp.prune(store, "run", keep_last=3, keep_every=4)
        assert report.kept_steps == [0, 4, 7, 8, 9]
        assert report.freed_bytes == dry.freed_bytes > 0
        gc = gp.gc(store, grace=0)
        assert gc.deleted_bytes >= report.freed_bytes
        log = gp.snapshot_log(store, "run")
        assert [v.step for v in log] == [0, 4, 7, 8, 9]
        assert all(v.depth <= 1 for v in log)
        assert all(v.age <= 3 for v in log)  # K = 4
        assert max(v.age for v in log) >= 1
        for step in (0, 4, 7, 8, 9):
            assert same(gp.restore(store, "run", step=step), states[step])
        assert gp.verify(store).ok
        # Pruning again keeps what is there; a later snapshot chains on the new head.
        assert not gp.prune(store, "run", keep_last=3, keep_every=4).dropped_steps
        gp.snapshot(store, "run", states[0], step=10)
        assert same(gp.restore(store, "run", step=10), states[0])


def test_two_writers_of_one_name_both_land(
    tmp_path: Path, small: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Each snapshot is one compare-and-swap; the loser rebuilds against the winner."""
    import sys

    module = sys.modules["gradpipe.snapshots.save"]
    url = f"file://{tmp_path}/store"
    gp.open_store(url, mode="w")
    states = drifting(8, seed=2)
    errors: list[BaseException] = []
    # Both writers build their first snapshot against the same (empty) head before
    # either publishes, so one of them must lose the race and rebuild.
    barrier = threading.Barrier(2, timeout=30)
    builds: list[int] = []
    real = module._write

    def raced(*args: Any, **kwargs: Any) -> Any:
        out = real(*args, **kwargs)
        builds.append(1)
        if len(builds) <= 2:
            barrier.wait()
        return out

    monkeypatch.setattr(module, "_write", raced)

    def writer(offset: int) -> None:
        store = gp.open_store(url, mode="a")
        try:
            for i in range(offset, 8, 2):
                gp.snapshot(store, "run", states[i], step=i)
        except BaseException as exc:  # reported below
            errors.append(exc)

    threads = [threading.Thread(target=writer, args=(k,)) for k in (0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    assert len(builds) > 8  # at least one snapshot was built twice
    store = gp.open_store(url, mode="r")
    log = gp.snapshot_log(store, "run")
    assert sorted(v.step for v in log) == list(range(8))
    for i in range(8):
        assert same(gp.restore(store, "run", step=i), states[i])
    assert gp.verify(store).ok


def test_restore_on_a_local_cluster_shares_chain_work(tmp_path: Path, small: None) -> None:
    from distributed import Client, LocalCluster

    store = gp.open_store(tmp_path / "store", mode="w")
    states = drifting(4, seed=3)
    for i, state in enumerate(states):
        gp.snapshot(store, "run", state, step=i)
    with (
        LocalCluster(n_workers=2, threads_per_worker=1, processes=False) as cluster,
        Client(cluster) as client,
        gp.runner(client) as runner,
    ):
        for i, state in enumerate(states):
            assert same(gp.restore(store, "run", step=i, runner=runner), state)

    from gradpipe.graph.chains import build_read_graph

    manifests = []
    for step in (2, 3):
        _, snap = find_snapshot(store, "run", step)
        manifests += list(snap.embedded.values())
    graph, _ = build_read_graph(store, manifests)
    chunk_tasks = [k for k in graph if k[0] == "gradpipe-restore-chunk"]
    # Two versions of one chain: the shared keyframes and deltas appear once.
    listed = sum(
        len(m.deltas.get(i, ())) + 1 for m in manifests for i, b in enumerate(m.blocks) if b
    )
    assert len(chunk_tasks) < listed


def test_concurrent_restores_on_one_cluster_get_their_own_data(tmp_path: Path, small: None) -> None:
    """Task keys are named by content: two restores in flight never share a result."""
    from distributed import Client, LocalCluster

    store = gp.open_store(tmp_path / "store", mode="w")
    states = drifting(2, seed=4)
    for i, state in enumerate(states):
        gp.snapshot(store, "run", state, step=i)
    results: dict[int, list[bool]] = {0: [], 1: []}
    with (
        LocalCluster(n_workers=1, threads_per_worker=2, processes=False) as cluster,
        Client(cluster) as client,
        gp.runner(client) as runner,
    ):

        def reader(step: int) -> None:
            for _ in range(5):
                got = gp.restore(store, "run", step=step, runner=runner)
                results[step].append(same(got, states[step]))

        threads = [threading.Thread(target=reader, args=(s,)) for s in (0, 1)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        both = gp.restore_steps(store, "run", [1, 0], runner=runner)
    assert results == {0: [True] * 5, 1: [True] * 5}
    assert list(both) == [1, 0]
    assert same(both[0], states[0])
    assert same(both[1], states[1])
    assert same(gp.restore_steps(store, "run", [0], keys=["model"])[0]["model"], states[0]["model"])
    with pytest.raises(NotFoundError, match="has no step 7"):
        gp.restore_steps(store, "run", [0, 7])


@pytest.mark.parametrize("cache", ["warm", "cold"])
def test_a_snapshot_over_lost_parent_blocks_stores_them_again(
    tmp_path: Path, small: None, cache: str
) -> None:
    """Blocks of the previous snapshot lost (or deleted as corrupt): the next one is whole."""
    import sys

    store = gp.open_store(tmp_path / "store", mode="w")
    states = drifting(3, seed=5)
    gp.snapshot(store, "run", states[0], step=0)
    if cache == "cold":
        sys.modules["gradpipe.snapshots.save"]._KEYFRAMES.clear()
    _, first = find_snapshot(store, "run")
    for block in first.data_children():
        store.backend.delete(block_key(block))
    gp.snapshot(store, "run", states[1], step=1)  # changed arrays and unchanged ones alike
    gp.snapshot(store, "run", states[2], step=2)
    for step in (1, 2):
        assert same(gp.restore(store, "run", step=step), states[step])
    with pytest.raises(NotFoundError):
        gp.restore(store, "run", step=0)  # that one is gone, and verify says so
    assert {p.kind for p in gp.verify(store).problems} == {"missing"}


def test_keyframes_changed_after_hashing_are_not_remembered(
    tmp_path: Path, small: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A training thread changing the arrays while a snapshot is written cannot poison the next."""
    import sys

    module = sys.modules["gradpipe.snapshots.save"]
    real = module.write_version

    def then_changed(store: gp.Store, array: np.ndarray, *args: Any, **kwargs: Any) -> Any:
        manifest = real(store, array, *args, **kwargs)
        array += 1  # after it was hashed and written: the copy kept for later differs
        return manifest

    store = gp.open_store(tmp_path / "store", mode="w")
    states = drifting(2, seed=6)
    monkeypatch.setattr(module, "write_version", then_changed)
    gp.snapshot(store, "run", {"w": states[0]["model"]["embed.weight"].copy()}, step=0)
    monkeypatch.setattr(module, "write_version", real)
    gp.snapshot(store, "run", {"w": states[1]["model"]["embed.weight"]}, step=1)
    got = gp.restore(store, "run", step=1)["w"]
    assert got.tobytes() == states[1]["model"]["embed.weight"].tobytes()


def test_arrays_changed_while_they_are_encoded_give_a_consistent_version(
    tmp_path: Path, small: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A training thread moving the arrays between a chunk's hash and its encoding: the
    version is of the private copy each chunk was hashed and encoded from."""
    from gradpipe.storage.store import Store

    store = gp.open_store(tmp_path / "store", mode="w")
    states = drifting(2, seed=8)
    weight = states[0]["model"]["embed.weight"].copy()
    before = weight.copy()
    real = Store.encode_frame

    def moving(self: Store, item: Any, level: int | None = None) -> Any:
        weight.reshape(-1)[::7] += 1  # after the hash, before the encoding
        return real(self, item, level)

    monkeypatch.setattr(Store, "encode_frame", moving)
    gp.snapshot(store, "run", {"w": weight}, step=0)
    monkeypatch.setattr(Store, "encode_frame", real)
    # Every block's bytes match its id: each chunk was encoded from what was hashed (the
    # caller's array moved on between the two, which made a mismatched block before).
    assert gp.verify(store).ok
    got = gp.restore(store, "run", step=0)["w"]
    assert got.tobytes() != weight.tobytes()  # the arrays moved on
    assert got.shape == before.shape
    gp.snapshot(store, "run", {"w": states[1]["model"]["embed.weight"]}, step=1)
    assert gp.restore(store, "run", step=1)["w"].tobytes() == (
        states[1]["model"]["embed.weight"].tobytes()
    )
    assert gp.verify(store).ok


def test_keyframes_kept_as_views_count_the_memory_they_keep_alive() -> None:
    """A view keeps its whole array: one mostly unused is copied out, one mostly used stays."""
    import sys

    from gradpipe.snapshots.cache import owned_bytes

    compact = sys.modules["gradpipe.snapshots.save"]._compact
    big = np.arange(1000, dtype=np.float32)
    sparse = compact({"a": big[:10], "b": big[10:20]})
    assert all(v.base is None for v in sparse.values())
    assert owned_bytes(sparse.values()) == 80
    dense = compact({"a": big[:600], "b": big[600:]})
    assert all(v.base is big for v in dense.values())
    assert owned_bytes([*dense.values(), big[:5]]) == big.nbytes  # the owner counted once


def test_private_copies_only_within_the_room_the_caches_leave(
    tmp_path: Path, small: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Copies are made while the previous keyframes are held: past the room left, a snapshot
    writes from the caller's arrays and checks what it keeps, and the cache stays in budget."""
    import sys

    from gradpipe.core.state import flatten_state

    module = sys.modules["gradpipe.snapshots.save"]
    for cache in sys.modules["gradpipe.snapshots.cache"]._CACHES:  # earlier tests' keyframes
        cache.clear()
    states = drifting(3, seed=9)
    state_bytes = sum(a.nbytes for a in flatten_state(states[0]).arrays.values())
    budget = int(1.5 * state_bytes)
    seen: list[bool] = []
    real = module.write_version

    def spying(*args: Any, copy_to: Any = None, **kwargs: Any) -> Any:
        seen.append(copy_to is not None)
        return real(*args, copy_to=copy_to, **kwargs)

    monkeypatch.setattr(module, "write_version", spying)
    store = gp.open_store(tmp_path / "store", mode="w")
    with dask.config.set({"gradpipe.snapshot-cache-bytes": budget}):
        made = []
        for step, state in enumerate(states):
            seen.clear()
            gp.snapshot(store, "run", state, step=step)
            made.append(all(seen))
            assert module._KEYFRAMES.held_bytes() <= budget
    assert made[0]
    assert not made[1]  # the first keyframes leave a third of a state's room
    for step, state in enumerate(states):
        assert same(gp.restore(store, "run", step=step), state)
    assert gp.verify(store).ok


def test_keyframes_past_the_budget_are_not_all_copied(
    tmp_path: Path, small: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Without private copies (no room), the keyframes are copied and checked only up to the
    budget: a state far larger than it is never copied whole to be thrown away."""
    import sys

    module = sys.modules["gradpipe.snapshots.save"]
    for cache in sys.modules["gradpipe.snapshots.cache"]._CACHES:
        cache.clear()
    checked: list[int] = []
    real = module.hash_bytes

    def counting(data: Any) -> str:
        checked.append(1)
        return real(data)

    monkeypatch.setattr(module, "hash_bytes", counting)
    store = gp.open_store(tmp_path / "store", mode="w")
    state = drifting(1, seed=10)[0]  # a dozen and more chunks of 4 KiB
    with dask.config.set({"gradpipe.snapshot-cache-bytes": 8192}):
        gp.snapshot(store, "run", state, step=0)
    assert 0 < len(checked) <= 3
    assert module._KEYFRAMES.held_bytes() == 0
    assert same(gp.restore(store, "run", step=0), state)


def test_sparse_snapshots_keep_other_dtypes_exact(tmp_path: Path, small: None) -> None:
    store = gp.open_store(tmp_path / "store", mode="w")
    rng = np.random.default_rng(7)
    w = rng.standard_normal(4096).astype("float32")
    blob = rng.integers(0, 255, 100_000, dtype=np.uint8).tobytes()  # > 64 KiB: an array
    counts = np.arange(4096, dtype="int32")
    gp.snapshot(store, "s", {"w": w, "blob": blob, "n": counts}, step=0, delta="sparse")
    w2 = w.copy()
    w2[::64] += 0.5
    w2[1::64] += np.float32(1e-7)
    gp.snapshot(
        store, "s", {"w": w2, "blob": blob, "n": counts + 1}, step=1, delta="sparse", threshold=1e-3
    )
    got = gp.restore(store, "s", step=1)
    assert got["blob"] == blob
    assert got["n"].tobytes() == (counts + 1).tobytes()
    assert np.max(np.abs(got["w"] - w2)) <= 1e-3
    [_, newest] = gp.snapshot_log(store, "s")
    assert newest.lossy
    assert 0 < newest.max_abs_error <= 1e-3
    assert gp.verify(store).ok


def test_prune_counts_only_what_no_other_ref_uses(tmp_path: Path, small: None) -> None:
    store = gp.open_store(tmp_path / "store", mode="w")
    states = drifting(3, seed=8)
    for i, state in enumerate(states):
        gp.snapshot(store, "a", state, step=i)
        gp.snapshot(store, "b", state, step=i)  # the same blocks, under another name
    report = gp.prune(store, "a", keep_last=1)
    assert report.dropped_steps == [0, 1]
    assert report.freed_blocks == 0
    assert report.freed_bytes == 0


def test_newer_only_writes_each_step_once_even_when_racing(tmp_path: Path) -> None:
    from gradpipe.testing.faults import Fault, faulty_store

    inner = gp.open_store(str(tmp_path / "store"), mode="w")
    state = {"w": np.arange(10.0)}
    first = gp.snapshot(inner, "m", state, step=1, newer_only=True)
    assert gp.snapshot(inner, "m", {"w": np.zeros(10)}, step=1, newer_only=True) == first
    assert gp.snapshot(inner, "m", state, step=0, newer_only=True) == first  # older: nothing
    theirs: list[str] = []

    def the_other_writer() -> None:  # lands step 2 while ours is about to swap
        theirs.append(gp.snapshot(inner, "m", {"w": np.ones(10)}, step=2, newer_only=True))

    store, backend = faulty_store(
        inner, Fault("swap", "refs/snapshots/m", calls={1}, lose=None, action=the_other_writer)
    )
    ours = gp.snapshot(store, "m", {"w": np.full(10, 2.0)}, step=2, newer_only=True)
    assert len(backend.fired("swap")) == 1
    assert ours == theirs[0]  # ours lost the race and found step 2 there
    assert [v.step for v in gp.snapshot_log(inner, "m")] == [1, 2]
    assert same(gp.restore(inner, "m"), {"w": np.ones(10)})
    # Without newer_only the same step is a new version.
    gp.snapshot(inner, "m", state, step=2)
    assert [v.step for v in gp.snapshot_log(inner, "m")] == [1, 2, 2]


# --- a step recorded once: re-running a snapshot that landed writes nothing ------------
def _objects(root: Path) -> dict[str, bytes]:
    """Every object of a local store but its lock files (leases come and go)."""
    return {
        str(p.relative_to(root)): p.read_bytes()
        for p in sorted(root.rglob("*"))
        if p.is_file() and "locks" not in p.relative_to(root).parts
    }


@pytest.mark.parametrize(
    ("delta", "threshold"), [("int", 0.0), ("xor", 0.0), ("sparse", 1e-3)], ids=str
)
def test_a_snapshot_run_again_records_its_step_once(
    tmp_path: Path, small: None, delta: str, threshold: float
) -> None:
    """A job killed after its commit landed, run again: nothing is written, the id comes back."""
    from gradpipe.snapshots.api import write_snapshot

    store = gp.open_store(tmp_path / "store", mode="w")
    states = drifting(3, seed=9)
    options: dict[str, Any] = {"delta": delta, "threshold": threshold}
    ids = [
        gp.snapshot(store, "run", s, step=i, loss=0.5 / (i + 1), metadata={"host": "n1"}, **options)
        for i, s in enumerate(states)
    ]
    if delta == "sparse":
        assert gp.snapshot_log(store, "run")[1].lossy  # stored values differ from the given ones
    before = _objects(tmp_path / "store")
    # The newest step again, then older ones (re-running a job after later steps landed).
    for i in (2, 1, 0):
        again = write_snapshot(
            store, "run", states[i], step=i, loss=0.5 / (i + 1), metadata={"host": "n1"}, **options
        )
        assert again.id == ids[i]
        assert not again.written
        assert (
            gp.snapshot(
                store,
                "run",
                states[i],
                step=i,
                loss=0.5 / (i + 1),
                metadata={"host": "n1"},
                **options,
            )
            == ids[i]
        )
    assert [v.id for v in gp.snapshot_log(store, "run")] == ids
    assert _objects(tmp_path / "store") == before  # not a block, manifest or ref entry
    nxt = write_snapshot(store, "run", states[0], step=3, **options)  # a new step is written
    assert nxt.written
    assert [v.step for v in gp.snapshot_log(store, "run")] == [0, 1, 2, 3]
    if delta != "sparse":
        assert same(gp.restore(store, "run", step=2), states[2])
    assert gp.verify(store).ok


def test_the_same_step_with_other_content_is_a_new_version(tmp_path: Path, small: None) -> None:
    """A step taken again with another state, loss or metadata is recorded again (as before)."""
    store = gp.open_store(tmp_path / "store", mode="w")
    states = drifting(2, seed=10)
    first = gp.snapshot(store, "run", states[0], step=5, loss=1.0, metadata={"try": "1"})
    changed = [
        (states[1], 1.0, {"try": "1"}),  # other arrays
        (states[1], 0.5, {"try": "1"}),  # another loss
        (states[1], 0.5, {"try": "2"}),  # other metadata
        ({**states[1], "loader": {"epoch": 9, "position": 0}}, 0.5, {"try": "2"}),  # skeleton
    ]
    ids = [first]
    for state, loss, meta in changed:
        ids.append(gp.snapshot(store, "run", state, step=5, loss=loss, metadata=meta))
    assert len(set(ids)) == len(ids)
    assert [v.id for v in gp.snapshot_log(store, "run")] == ids
    assert same(gp.restore(store, "run", step=5), changed[-1][0])  # the newest of the step
    # The first state again: the step's newest version holds another, so it is recorded.
    again = gp.snapshot(store, "run", states[0], step=5, loss=1.0, metadata={"try": "1"})
    assert again not in ids
    assert same(gp.restore(store, "run", step=5), states[0])
    # A run resumed from an earlier step retakes its steps: each is a new version, even with
    # the state the chain holds at that step further back (the versions since the chain went
    # back below the step are the ones compared).
    gp.snapshot(store, "run", states[1], step=6)
    gp.snapshot(store, "run", states[0], step=4)
    gp.snapshot(store, "run", states[1], step=6)
    assert [v.step for v in gp.snapshot_log(store, "run")] == [5, 5, 5, 5, 5, 5, 6, 4, 6]
    assert gp.verify(store).ok


def test_identical_writers_racing_record_the_step_once(tmp_path: Path, small: None) -> None:
    """The check is made against the head each compare-and-swap is made from."""
    from gradpipe.snapshots.api import write_snapshot
    from gradpipe.testing.faults import Fault, faulty_store

    inner = gp.open_store(str(tmp_path / "store"), mode="w")
    states = drifting(2, seed=11)
    gp.snapshot(inner, "m", states[0], step=0)
    theirs: list[str] = []

    def the_other_writer() -> None:  # the same state and step lands while ours is about to swap
        theirs.append(gp.snapshot(inner, "m", states[1], step=1, loss=0.25))

    store, backend = faulty_store(
        inner, Fault("swap", "refs/snapshots/m", calls={1}, lose=None, action=the_other_writer)
    )
    ours = write_snapshot(store, "m", states[1], step=1, loss=0.25)
    assert len(backend.fired("swap")) == 1
    assert (ours.id, ours.written) == (theirs[0], False)  # lost the race, found the step there
    assert [v.step for v in gp.snapshot_log(inner, "m")] == [0, 1]
    assert same(gp.restore(inner, "m"), states[1])


def test_identical_writers_in_threads_record_the_step_once(
    tmp_path: Path, small: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    import sys

    module = sys.modules["gradpipe.snapshots.save"]
    url = f"file://{tmp_path}/store"
    gp.open_store(url, mode="w")
    states = drifting(4, seed=12)
    # Both writers build each snapshot against the same head before either publishes.
    barrier = threading.Barrier(2, timeout=30)
    real = module._write

    def raced(*args: Any, **kwargs: Any) -> Any:
        out = real(*args, **kwargs)
        barrier.wait()
        return out

    monkeypatch.setattr(module, "_write", raced)
    got: dict[int, list[str]] = {0: [], 1: []}
    errors: list[BaseException] = []

    def writer(k: int) -> None:
        store = gp.open_store(url, mode="a")
        try:
            for i, state in enumerate(states):
                got[k].append(gp.snapshot(store, "run", state, step=i))
        except BaseException as exc:  # reported below
            errors.append(exc)
            barrier.abort()

    threads = [threading.Thread(target=writer, args=(k,)) for k in (0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    log = gp.snapshot_log(gp.open_store(url, mode="r"), "run")
    assert [v.step for v in log] == [0, 1, 2, 3]
    assert got[0] == got[1] == [v.id for v in log]  # each writer got the one version


@pytest.mark.parametrize("lossy", [False, True], ids=["exact", "lossy"])
def test_versions_from_before_content_ids_are_compared_by_their_chunks(
    tmp_path: Path, small: None, lossy: bool
) -> None:
    """A version without a content id: exact ones are told by their chunk ids; lossy ones not."""
    from dataclasses import replace

    from gradpipe.core.snapshot_manifest import SnapshotManifest
    from gradpipe.snapshots.api import snapshot_ref, write_snapshot

    store = gp.open_store(tmp_path / "store", mode="w")
    states = drifting(2, seed=13)
    options: dict[str, Any] = {"delta": "sparse", "threshold": 1e-3} if lossy else {}
    gp.snapshot(store, "run", states[0], step=0, **options)
    new_id = gp.snapshot(store, "run", states[1], step=1, loss=0.5, **options)
    manifest = store.get_typed(new_id, SnapshotManifest)
    assert manifest.content is not None
    assert manifest.lossy is lossy
    old = replace(manifest, content=None)  # as gradpipe wrote it before content ids
    assert "content" not in old.to_dict()
    old_id = store.put_manifest(old)
    store.refs.set(snapshot_ref("run"), old_id, expected=new_id)
    again = write_snapshot(store, "run", states[1], step=1, loss=0.5, **options)
    assert (again.id == old_id, again.written) == (not lossy, lossy)
    assert not write_snapshot(store, "run", states[1], step=1, loss=0.5, **options).written
    steps = [v.step for v in gp.snapshot_log(store, "run")]
    assert steps == ([0, 1, 1] if lossy else [0, 1])


@settings(max_examples=30, deadline=None)
@given(
    dtype=st.sampled_from(DTYPE_NAMES),
    size=st.integers(0, 3000),
    seed=st.integers(0, 2**16),
    zeros=st.sampled_from([None, slice(None), slice(0, 1500)]),
    layout=st.sampled_from(["contiguous", "strided", "swapped", "2d"]),
    changed=st.booleans(),
)
def test_any_array_saved_again_at_its_step_is_found(
    dtype: str, size: int, seed: int, zeros: slice | None, layout: str, changed: bool
) -> None:
    """The content id a version records is the one the same values give again: every dtype,
    all-zero chunks, views and byte orders, as a first version or as deltas against one."""
    from gradpipe.snapshots.api import write_snapshot

    values = special_values(dtype, size, seed=seed)
    if zeros is not None:
        values[zeros] = 0
    if layout == "strided":
        values = np.repeat(values, 2)[::2]  # same values, not contiguous
    elif layout == "swapped" and values.dtype.itemsize > 1 and values.dtype.kind != "V":
        values = values.astype(values.dtype.newbyteorder())  # same values, other byte order
    elif layout == "2d" and size % 3 == 0:
        values = values.reshape(3, -1)
    earlier = special_values(dtype, size, seed=seed + 1).reshape(values.shape)
    with tempfile.TemporaryDirectory() as root, dask.config.set(SMALL):
        store = gp.open_store(root, mode="w")
        if changed:  # written as a delta against an earlier version where it pays
            gp.snapshot(store, "p", {"a": earlier, "n": 1}, step=0)
        first = write_snapshot(store, "p", {"a": values, "n": 1}, step=1)
        again = write_snapshot(store, "p", {"a": values.copy(), "n": 1}, step=1)
        assert first.written
        assert (again.id, again.written) == (first.id, False)
        other = values.copy()
        if other.size:
            other.reshape(-1).view(np.uint8)[-1] ^= 1  # one bit of the last element
            assert write_snapshot(store, "p", {"a": other, "n": 1}, step=1).written


def test_logical_bytes_count_every_array_even_identical_ones(store: gp.Store) -> None:
    # Two identical arrays share one embedded manifest; the state still holds both.
    weights = np.arange(96 * 1024, dtype="float32").reshape(96, 1024)
    state = {"params": {"w": weights}, "ema": {"w": weights.copy()}}
    gp.snapshot(store, "twins", state, step=0)
    [info] = gp.snapshot_log(store, "twins")
    assert info.logical_bytes == 2 * weights.nbytes
