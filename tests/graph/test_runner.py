"""The runner: one cluster for many operations, closing only what it opened."""

from __future__ import annotations

import json
import urllib.request
from collections import Counter
from pathlib import Path

import pytest
from dask.utils import key_split

import gradpipe as gp
from gradpipe.testing import SampleRun, TrainingConfig, write_sample_run

distributed = pytest.importorskip("distributed")
from gradpipe.dashboard.plugin import JSON_ROUTE  # noqa: E402  (needs distributed)

GRAPH = {"x": 1, "y": 2, "z": (sum, ["x", "y"])}


@pytest.fixture(scope="module")
def samples(tmp_path_factory: pytest.TempPathFactory) -> tuple[SampleRun, SampleRun]:
    root = tmp_path_factory.mktemp("samples")
    config = TrainingConfig(vocab_size=500, embed_dim=4, hidden=8, peers=2, steps=2)
    return write_sample_run(root / "a", config), write_sample_run(root / "b", config)


def test_threads_compute_keys_in_order() -> None:
    with gp.Runner(workers=2) as runner:
        assert runner.client is None
        assert runner.get(GRAPH, ["z", "x", "y"], name="gradpipe-test") == [3, 1, 2]
    assert runner.closed


def test_a_closed_runner_refuses_work() -> None:
    runner = gp.runner(workers=1)
    runner.close()
    runner.close()  # idempotent
    with pytest.raises(gp.InvalidInputError, match="closed"):
        runner.get(GRAPH, ["z"], name="gradpipe-test")


@pytest.mark.parametrize("workers", [0, -3, True, 1.5])
def test_workers_must_be_a_positive_int(workers: object) -> None:
    with pytest.raises(gp.InvalidInputError, match="positive"):
        gp.runner(workers=workers)  # type: ignore[arg-type]


def test_one_runner_runs_two_ingests_on_one_cluster_and_stays_open(
    samples: tuple[SampleRun, SampleRun], tmp_path: Path
) -> None:
    from distributed import Client, LocalCluster, get_task_stream

    a, b = samples
    store = gp.open_store(tmp_path / "store", mode="w")
    with (
        LocalCluster(
            n_workers=1, threads_per_worker=2, processes=False, dashboard_address=":0"
        ) as cluster,
        Client(cluster) as client,
    ):
        with gp.runner(client) as runner, get_task_stream(client) as stream:
            assert runner.client is client
            first = gp.ingest(store, a.dump_pattern, run="a", runner=runner)
            assert client.status == "running"  # the operation left the runner open
            second = gp.ingest(store, b.dump_pattern, run="b", runner=runner)
            assert not runner.closed
        assert first.ok, first.summary()
        assert second.ok, second.summary()
        assert (first.ingested, second.ingested) == (4, 4)
        # Both ingests ran on this cluster: two inspect phases, two commits.
        ran = Counter(key_split(task["key"]) for task in stream.data)
        assert ran["gradpipe-commit"] == 2
        assert ran["gradpipe-dump"] == 8
        # The runner was given the client: closing the runner leaves it open.
        assert runner.closed
        assert client.status == "running"
        assert cluster.status.name == "running"
    assert sorted(gp.list_runs(store)) == ["a", "b"]
    assert gp.verify(store).ok


def test_a_runner_closes_the_cluster_it_started(
    samples: tuple[SampleRun, SampleRun], tmp_path: Path
) -> None:
    a, b = samples
    store = gp.open_store(tmp_path / "store", mode="w")
    with gp.runner(dashboard=True, workers=2) as runner:
        client = runner.client
        assert client is not None
        link = runner.dashboard_link
        assert link is not None
        assert link.startswith("http://127.0.0.1:")
        reports = [
            gp.ingest(store, s.dump_pattern, run=name, runner=runner)
            for name, s in (("a", a), ("b", b))
        ]
        assert [r.dashboard for r in reports] == [link, link]
        assert client.status == "running"
        # the in-process cluster's dashboard has the gradpipe page, showing both ingests
        page = runner.gradpipe_page_link
        assert page == link.removesuffix("/status") + "/gradpipe"
        with urllib.request.urlopen(page, timeout=30) as reply:
            assert "gradpipe" in reply.read().decode()
        with urllib.request.urlopen(page.replace("/gradpipe", JSON_ROUTE), timeout=30) as reply:
            doc = json.load(reply)
        assert sorted(op["run"] for op in doc["operations"] if op["kind"] == "ingest") == ["a", "b"]
    assert all(r.ok for r in reports)
    assert client.status == "closed"
    assert runner.client is not None  # still named, but closed: get() refuses
    with pytest.raises(gp.InvalidInputError, match="closed"):
        runner.get(GRAPH, ["z"], name="gradpipe-test")


def test_a_runner_closes_the_client_it_opened_but_not_the_scheduler() -> None:
    from distributed import LocalCluster

    with LocalCluster(
        n_workers=1, threads_per_worker=1, processes=False, dashboard_address=":0"
    ) as cluster:
        with gp.runner(scheduler=cluster.scheduler_address) as runner:
            client = runner.client
            assert client is not None
            assert runner.get(GRAPH, ["z"], name="gradpipe-test") == [3]
        assert client.status == "closed"
        assert cluster.status.name == "running"


def test_the_scheduler_address_comes_from_the_environment(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from distributed import LocalCluster

    with LocalCluster(
        n_workers=1, threads_per_worker=1, processes=False, dashboard_address=":0"
    ) as cluster:
        monkeypatch.setenv("DASK_SCHEDULER_ADDRESS", cluster.scheduler_address)
        with gp.runner() as runner:
            assert runner.client is not None
            assert runner.client.scheduler.address == cluster.scheduler_address


def test_an_operation_refuses_a_runner_with_runner_options(tmp_path: Path) -> None:
    store = gp.open_store(tmp_path / "store", mode="w")
    with gp.runner(workers=1) as runner:
        with pytest.raises(gp.InvalidInputError, match=r"runner= or workers=/dashboard="):
            gp.ingest(
                store,
                str(tmp_path / "{step}.npz"),
                run="r",
                runner=runner,
                workers=2,
                dashboard=True,
            )
        assert not runner.closed
    assert gp.list_runs(store) == []


def test_a_client_and_an_address_are_refused_together() -> None:
    with pytest.raises(gp.InvalidInputError, match="not both"):
        gp.runner(object(), scheduler="tcp://127.0.0.1:1")  # type: ignore[arg-type]


def test_the_dashboard_cluster_keeps_the_configured_preloads(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import dask

    from gradpipe.graph.runner import _with_dashboard_preload

    (tmp_path / "gp_test_preload.py").write_text(
        "def dask_setup(scheduler, *args):\n    scheduler.gp_test_preload_args = args\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    config = {
        "distributed.scheduler.preload": ["gp_test_preload"],
        "distributed.scheduler.preload-argv": [],
    }
    with dask.config.set(config), gp.runner(dashboard=True, workers=1) as runner:
        assert runner._cluster is not None
        scheduler = runner._cluster.scheduler
        assert scheduler.gp_test_preload_args == ()  # the user's preload ran
        page = runner.gradpipe_page_link
        assert page is not None
        with urllib.request.urlopen(page, timeout=30) as reply:
            assert reply.status == 200  # and so did ours
    with dask.config.set({**config, "distributed.scheduler.preload-argv": ["--x"]}):
        assert _with_dashboard_preload() == {
            "preload": ["gp_test_preload", "gradpipe.dashboard"],
            "preload_argv": [["--x"], []],
        }
    with dask.config.set({"distributed.scheduler.preload": ["gradpipe.dashboard"]}):
        assert _with_dashboard_preload() == {}
