"""``gp.apply_server_update`` out of core: chunk tasks, the chain it writes, failures, clusters.

The data: a small transformer's gradients ingested on a 16 KiB grid; the
snapshots on a 12 KiB grid (so the aggregate is read by overlap), with
``inline-bytes`` lowered so that chunks are delta-encoded as in a real model.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import dask.config
import numpy as np
import pytest

import gradpipe as gp
from gradpipe.aggregation import server_opt_graph as server_graph
from gradpipe.aggregation import server_opt_tasks as server_tasks
from gradpipe.aggregation.server_opt import ServerOptimizerConfig, init_server_state, server_step
from gradpipe.aggregation.tasks import StepResult, commit_aggregates
from gradpipe.core.aggregate_manifest import AggregateInput, AggregateManifest, aggregate_key
from gradpipe.core.run_manifest import AggregateEntry
from gradpipe.formats.safetensors import read_safetensors, write_safetensors
from gradpipe.snapshots.api import find_snapshot
from gradpipe.storage.blocks import WriteStats
from gradpipe.storage.tensors import write_tensor
from gradpipe.testing.training import SampleRun, TrainingConfig, write_sample_run

CONFIG = TrainingConfig(vocab_size=1000, embed_dim=16, hidden=16, peers=2, steps=3)
GRID = {"gradpipe.chunk-bytes": "12 KiB", "gradpipe.inline-bytes": "512 B"}


@pytest.fixture(scope="module")
def sample(tmp_path_factory: pytest.TempPathFactory) -> SampleRun:
    return write_sample_run(tmp_path_factory.mktemp("sample"), CONFIG)


@pytest.fixture(autouse=True)
def _grid() -> Iterator[None]:
    with dask.config.set(GRID):
        yield


def _ingest(store: gp.Store, pattern: str, **kw: Any) -> None:
    with dask.config.set({"gradpipe.chunk-bytes": "16 KiB"}):
        assert gp.ingest(store, pattern, run="r", **kw).ok


def _prepared(url: str | Path, sample: SampleRun) -> gp.Store:
    store = gp.open_store(url, mode="a")
    _ingest(store, sample.dump_pattern)
    assert gp.aggregate(store, run="r", method="fedavg").ok
    return store


def _initial(store: gp.Store) -> dict[str, np.ndarray]:
    grads = _grads(store, 0)
    rng = np.random.default_rng(3)
    return {n: rng.normal(size=g.shape).astype(np.float32) for n, g in grads.items()}


def _grads(store: gp.Store, step: int) -> dict[str, np.ndarray]:
    return gp.open_run(store, "r").aggregate("fedavg", step=step).read_all()


def _apply(store: gp.Store, step: int, name: str = "g", **kw: Any) -> str:
    options: dict[str, Any] = {"optimizer": "fedadam", "lr": 0.01, **kw}
    return gp.apply_server_update(
        store, run="r", step=step, aggregate="fedavg", snapshot=name, **options
    )


def _reference(
    store: gp.Store, params: dict[str, np.ndarray], config: ServerOptimizerConfig, steps: range
) -> tuple[dict[str, np.ndarray], dict[str, dict[str, np.ndarray]]]:
    """``server_step`` on whole arrays, round after round: what the chunks must add up to."""
    x = dict(params)
    state = {n: init_server_state(a, config) for n, a in params.items()}
    for t, step in enumerate(steps, start=1):
        for name, g in _grads(store, step).items():
            x[name], state[name] = server_step(x[name], g, state[name], config, t=t)
    return x, state


def _assert_state(got: dict[str, Any], x: dict[str, np.ndarray], state: dict[str, Any]) -> None:
    for name, want in x.items():
        np.testing.assert_array_equal(got["params"][name], want, err_msg=name)
        for k, values in state[name].items():
            np.testing.assert_array_equal(got["server_optimizer"][k][name], values)


@pytest.mark.parametrize("method", ["fedadam", "fedavgm", "sgd"])
def test_the_chunked_step_is_the_whole_array_step_and_the_snapshot_gp_snapshot_writes(
    sample: SampleRun, tmp_path: Path, method: str
) -> None:
    store = _prepared(tmp_path / "s", sample)
    params = _initial(store)
    gp.snapshot(store, "g", {"params": params}, step=0)
    gp.snapshot(store, "twin", {"params": params}, step=0)
    for step in range(3):
        _apply(store, step, optimizer=method)
        # The twin chain: the same state, written whole by gp.snapshot.
        gp.snapshot(store, "twin", gp.restore(store, "g"), step=step)
        ours, twin = find_snapshot(store, "g")[1], find_snapshot(store, "twin")[1]
        assert ours.state == twin.state
        assert ours.tensors == twin.tensors  # every chunk stored the same way, deltas and all
    config = ServerOptimizerConfig.from_dict({"method": method, "lr": 0.01})
    _assert_state(gp.restore(store, "g"), *_reference(store, params, config, range(3)))
    head = find_snapshot(store, "g")[1]
    embedding = head.embedded[head.tensors["params.embedding.weight"]]
    previous = find_snapshot(store, "g", step=1)[1]
    assert embedding.chain is not None
    assert embedding.chain.parent == previous.tensors["params.embedding.weight"]
    assert len(embedding.blocks) > 2  # chunked: the grid of the first snapshot
    assert embedding.chunk_shape == previous.embedded[embedding.chain.parent].chunk_shape
    assert embedding.deltas  # chunks stored as deltas against their keyframes
    info = gp.snapshot_log(store, "g")[-1]
    assert info.stored_bytes < info.full_bytes


def test_a_step_is_one_task_per_chunk_holding_chunks_not_tensors(
    sample: SampleRun, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    store = _prepared(tmp_path / "s", sample)
    gp.snapshot(store, "g", {"params": _initial(store)}, step=0)
    _apply(store, 0)
    built: list[dict[Any, Any]] = []
    real = server_graph.build_server_graph

    def spy(*args: Any, **kw: Any) -> Any:
        graph, keys = real(*args, **kw)
        built.append(graph)
        return graph, keys

    monkeypatch.setattr(server_graph, "build_server_graph", spy)
    _apply(store, 1)
    [graph] = built
    head = find_snapshot(store, "g", step=0)[1]
    chunks = sum(
        len(head.embedded[t].blocks) for k, t in head.tensors.items() if k[:7] == "params."
    )
    steps = [v for k, v in graph.items() if str(k[0]).startswith("gradpipe-server-step-")]
    assert len(steps) == chunks
    budget = 12 * 1024 // 4  # elements of one 12 KiB chunk of float32
    for task in steps:
        [job] = [a for a in task if isinstance(a, server_tasks.ChunkJob)]
        assert job.stop - job.start <= budget
        assert all(not isinstance(a, np.ndarray) for a in task)  # data stays in the store
        assert job.update is None or all(s.stop - s.start <= 16 * 1024 // 4 for s in job.update)


def test_a_crash_in_a_chunk_task_publishes_nothing_and_a_rerun_finishes(
    sample: SampleRun, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    store = _prepared(tmp_path / "s", sample)
    params = _initial(store)
    gp.snapshot(store, "g", {"params": params}, step=0)
    calls = 0
    real = server_tasks.server_step

    def failing(*args: Any, **kw: Any) -> Any:
        nonlocal calls
        calls += 1
        if calls == 5:
            raise RuntimeError("worker lost")
        return real(*args, **kw)

    monkeypatch.setattr(server_tasks, "server_step", failing)
    before = gp.snapshot_log(store, "g")
    with pytest.raises(RuntimeError, match="worker lost"):
        _apply(store, 0)
    assert calls >= 5  # it failed halfway, after other chunks were written
    assert gp.snapshot_log(store, "g") == before
    monkeypatch.setattr(server_tasks, "server_step", real)
    _apply(store, 0)
    config = ServerOptimizerConfig.from_dict({"method": "fedadam", "lr": 0.01})
    _assert_state(gp.restore(store, "g"), *_reference(store, params, config, range(1)))
    assert gp.verify(store).ok


def test_on_local_disk_and_s3(sample: SampleRun, store_url: str) -> None:
    store = _prepared(store_url, sample)
    params = _initial(store)
    gp.snapshot(store, "g", {"params": params}, step=0)
    ids = [_apply(store, s, optimizer="fedyogi") for s in (0, 1)]
    config = ServerOptimizerConfig.from_dict({"method": "fedyogi", "lr": 0.01})
    _assert_state(gp.restore(store, "g"), *_reference(store, params, config, range(2)))
    assert [i.id for i in gp.snapshot_log(store, "g")[1:]] == ids


def test_on_a_local_cluster_of_processes(sample: SampleRun, tmp_path: Path) -> None:
    distributed = pytest.importorskip("distributed")
    store = _prepared(tmp_path / "s", sample)
    params = _initial(store)
    gp.snapshot(store, "threads", {"params": params}, step=0)
    gp.snapshot(store, "cluster", {"params": params}, step=0)
    for step in (0, 1):
        _apply(store, step, "threads")
    # Workers are other processes, with the default settings: the graph carries the client's.
    with (
        distributed.LocalCluster(
            n_workers=2, threads_per_worker=1, processes=True, dashboard_address=":0",
            silence_logs=40,
        ) as cluster,
        distributed.Client(cluster, set_as_default=False) as client,
        gp.runner(client) as runner,
    ):  # fmt: skip
        for step in (0, 1):
            _apply(store, step, "cluster", runner=runner)
    assert find_snapshot(store, "cluster")[1].tensors == find_snapshot(store, "threads")[1].tensors


def test_a_step_is_applied_once_per_chain_and_in_order(sample: SampleRun, tmp_path: Path) -> None:
    store = _prepared(tmp_path / "s", sample)
    gp.snapshot(store, "g", {"params": _initial(store)}, step=0)
    first = _apply(store, 0)
    assert _apply(store, 0) == first  # memoised: the state does not move twice
    assert len(gp.snapshot_log(store, "g")) == 2
    second = _apply(store, 1)
    assert _apply(store, 0) == first  # still found, behind the head
    with pytest.raises(gp.InvalidInputError, match=r"with .*'lr': 0.01.*applies each step once"):
        _apply(store, 1, lr=0.5)
    assert gp.aggregate(store, run="r", method="mean", steps=[1]).ok
    with pytest.raises(gp.InvalidInputError, match=r"from aggregate 'fedavg'.*not 'mean'"):
        gp.apply_server_update(
            store, run="r", step=1, aggregate="mean", snapshot="g", optimizer="fedadam", lr=0.01
        )
    assert _apply(store, 2) != second
    gp.snapshot(store, "late", {"params": _initial(store)}, step=2)
    with pytest.raises(gp.InvalidInputError, match=r"at step 2, after step 1.*in order"):
        _apply(store, 1, "late")
    assert len(gp.snapshot_log(store, "g")) == 4
    assert len(gp.snapshot_log(store, "late")) == 1


def test_a_stale_aggregate_is_refused(sample: SampleRun, tmp_path: Path) -> None:
    src = tmp_path / "src"
    for step in (0, 1):
        for peer in CONFIG.peer_names:
            target = src / f"step={step:04d}" / f"peer={peer}.safetensors"
            target.parent.mkdir(parents=True, exist_ok=True)
            target.write_bytes(Path(sample.dump_path(step, peer)).read_bytes())
    pattern = str(src / "step={step}/peer={peer}.safetensors")
    store = gp.open_store(tmp_path / "s", mode="a")
    _ingest(store, pattern)
    assert gp.aggregate(store, run="r").ok
    gp.snapshot(store, "g", {"params": _initial(store)}, step=0)
    _apply(store, 0)
    replaced = src / "step=0001" / "peer=peer1.safetensors"
    tensors, meta = read_safetensors(str(replaced))
    write_safetensors(str(replaced), {k: v * 2 for k, v in tensors.items()}, meta)
    _ingest(store, pattern, replace=True)  # a peer re-sent step 1
    before = gp.snapshot_log(store, "g")
    with pytest.raises(gp.InvalidInputError, match=r"stale \(dumps of peer1 replaced\).*--force"):
        _apply(store, 1)
    assert gp.snapshot_log(store, "g") == before
    assert gp.aggregate(store, run="r", steps=[1], force=True).ok
    _apply(store, 1)
    assert len(gp.snapshot_log(store, "g")) == 3


def test_a_non_finite_aggregate_is_refused(sample: SampleRun, tmp_path: Path) -> None:
    store = _prepared(tmp_path / "s", sample)
    params = _initial(store)
    gp.snapshot(store, "g", {"params": params}, step=0)
    # An aggregate another tool recorded, holding an infinity: gradpipe's own refuse NaN input.
    view = gp.open_run(store, "r").aggregate("fedavg", step=0)
    values = view.read_all()
    name = sorted(values)[0]
    values[name].reshape(-1)[7] = np.inf
    tensors = {n: write_tensor(store, a) for n, a in values.items()}
    inputs = tuple(AggregateInput(i.peer, i.dump, i.weight) for i in view.manifest.inputs)
    key = aggregate_key("fedavg", {"source": "elsewhere"}, inputs)
    ids = {n: store.put_manifest(m) for n, m in tensors.items()}
    manifest = AggregateManifest(
        run="r", step=0, name="inf", method="fedavg", params={"source": "elsewhere"},
        inputs=inputs, tensors=tuple(ids.items()), key=key, provenance={},
    )  # fmt: skip
    entry = AggregateEntry(0, "inf", store.put_manifest(manifest), key)
    assert commit_aggregates(store, "r", [StepResult(entry, WriteStats(), 0)], "test").committed
    with pytest.raises(gp.InvalidInputError, match=f"tensor '{name}'.*1 infinite.*finite update"):
        gp.apply_server_update(
            store, run="r", step=0, aggregate="inf", snapshot="g", optimizer="sgd", lr=0.1
        )
    assert len(gp.snapshot_log(store, "g")) == 1


def test_a_step_that_overflows_is_refused(sample: SampleRun, tmp_path: Path) -> None:
    store = _prepared(tmp_path / "s", sample)
    params = {n: np.full_like(a, 3e38) for n, a in _initial(store).items()}
    gp.snapshot(store, "g", {"params": params}, step=0)
    with pytest.raises(gp.InvalidInputError, match=r"non-finite values in params.*nothing was"):
        _apply(store, 0, optimizer="sgd", lr=1e300)
    assert len(gp.snapshot_log(store, "g")) == 1


def test_a_missing_snapshot_is_not_created(sample: SampleRun, tmp_path: Path) -> None:
    store = _prepared(tmp_path / "s", sample)
    with pytest.raises(gp.NotFoundError, match="no snapshot 'nowhere'"):
        _apply(store, 0, "nowhere")
    assert store.refs.list("snapshots") == {}
