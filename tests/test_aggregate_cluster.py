"""Every aggregation method gives the same aggregate id on a ``LocalCluster`` of processes.

The tasks of one chunk then run in other processes, in another order, their
partials pickled between them: the results must still be the same bits.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import dask.config
import pytest

import gradpipe as gp
from gradpipe.testing.training import TrainingConfig, write_sample_run

distributed = pytest.importorskip("distributed")

#: 7 peers: Krum tolerates f = 2, Bulyan f = 1; the embedding spans several chunks.
SEVEN = TrainingConfig(vocab_size=2000, embed_dim=16, hidden=16, peers=7, steps=2)

CASES: list[tuple[str, dict[str, Any]]] = [
    ("fedavg", {"clip_norm": 0.05}),
    ("sum", {"clip_aggregate": 1e-3}),
    ("median", {}),
    ("trimmed-mean", {"trim": 0.2}),
    ("krum", {"byzantine": 2}),
    ("multi-krum", {"byzantine": 1, "keep": 3}),
    ("bulyan", {"byzantine": 1}),
    ("dp-fedavg", {"clip_norm": 0.05, "noise_multiplier": 0.5, "seed": 7}),
    ("dp-fedavg", {"clip_norm": 0.05, "seed": 3, "noise_multiplier": 0.5, "adaptive_clip": True}),
]


@pytest.fixture(scope="module")
def store(tmp_path_factory: pytest.TempPathFactory) -> gp.Store:
    sample = write_sample_run(tmp_path_factory.mktemp("sample"), SEVEN)
    store = gp.open_store(tmp_path_factory.mktemp("store") / "s", mode="w")
    with dask.config.set({"gradpipe.chunk-bytes": "32 KiB"}):
        assert gp.ingest(store, sample.dump_pattern, run="r").ok
    return store


@pytest.fixture(scope="module")
def client() -> Iterator[Any]:
    with (
        distributed.LocalCluster(
            n_workers=2,
            threads_per_worker=1,
            processes=True,
            dashboard_address=":0",
            silence_logs=40,
        ) as cluster,
        distributed.Client(cluster, set_as_default=False) as c,
    ):
        yield c


@pytest.mark.parametrize(
    ("method", "kw"), CASES, ids=[f"{m}-{i}" for i, (m, _) in enumerate(CASES)]
)
def test_processes_give_the_ids_of_threads(
    store: gp.Store, client: Any, method: str, kw: dict[str, Any], tmp_path: Path
) -> None:
    name = f"{method}-{abs(hash(tuple(sorted(kw))))}"
    threads = gp.aggregate(store, run="r", method=method, name=name, force=True, **kw)
    assert threads.computed == SEVEN.steps, threads.summary()
    with gp.runner(client) as on_cluster:
        processes = gp.aggregate(
            store,
            run="r",
            method=method,
            name=name,
            force=True,
            runner=on_cluster,
            split_every=2,
            **kw,
        )
    assert processes.computed == SEVEN.steps, processes.summary()
    for step in range(SEVEN.steps):
        assert processes.aggregate_id(step) == threads.aggregate_id(step), (method, step)
    # The work ran in the worker processes.
    assert any("gradpipe-aggregate" in str(k) for k in client.run_on_scheduler(_task_prefixes))


def _task_prefixes(dask_scheduler: Any) -> list[str]:
    return list(dask_scheduler.task_prefixes)
