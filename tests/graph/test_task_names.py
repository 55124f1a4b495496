"""Every task of every gradpipe graph reads well on the dashboard, and meters its bytes.

A ``SchedulerPlugin`` on a ``LocalCluster`` sees every task the scheduler gets
while gradpipe ingests (plain and ``--delta``), aggregates (plain, clipped and
robust) and restores snapshots; ``dask.utils.key_split`` of each key must be a
``gradpipe-<stage>[-<step>]`` name, the graphs must run in ``gradpipe-<stage>``
spans, and the tasks that read and write must have digested their bytes for
the Fine Performance Metrics page (:mod:`gradpipe.meter`).
"""

from __future__ import annotations

import re
from collections import defaultdict
from collections.abc import Hashable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from dask.utils import key_split

import gradpipe as gp
from gradpipe.meter import RAW, READ, WRITE
from gradpipe.testing import TrainingConfig, write_sample_run

distributed = pytest.importorskip("distributed")

#: The stage (the word after ``gradpipe-``) of every task prefix.
STAGES = {"inspect", "read", "encode", "dump", "chain", "commit", "aggregate", "restore"}
NAME = re.compile(r"gradpipe(-[a-z]+)+")


class KeyNames(distributed.diagnostics.plugin.SchedulerPlugin):
    """Collects ``key_split`` of every task the scheduler is told about."""

    name = "test-key-names"

    def __init__(self) -> None:
        self.names: set[str] = set()

    def transition(self, key: Hashable, start: str, finish: str, *args: Any, **kw: Any) -> None:
        self.names.add(key_split(key))


@pytest.fixture
def cluster() -> Iterator[tuple[Any, Any, KeyNames]]:
    from distributed import Client, LocalCluster

    with (
        LocalCluster(
            n_workers=1, threads_per_worker=2, processes=False, dashboard_address=None
        ) as cluster,
        Client(cluster, set_as_default=False) as client,
    ):
        names = KeyNames()
        cluster.scheduler.add_plugin(names)
        yield cluster, client, names


def _digests(cluster: Any) -> dict[tuple[str, str], float]:
    """Bytes digested on the workers, by (task prefix, activity)."""
    out: dict[tuple[str, str], float] = defaultdict(float)
    for worker in cluster.workers.values():
        for key, value in worker.digests_total.items():
            if isinstance(key, tuple) and key[0] == "execute" and key[-1] == "bytes":
                out[key[2], key[3]] += value
    return out


def test_every_task_and_span_is_named_gradpipe_stage(
    cluster: tuple[Any, Any, KeyNames], tmp_path: Path
) -> None:
    local, client, names = cluster
    sample = write_sample_run(tmp_path / "d", TrainingConfig(peers=3, steps=2))
    store = gp.open_store(tmp_path / "store", mode="w")

    report = gp.ingest(store, sample.dump_pattern, run="r", client=client)
    assert report.ok, report.summary()
    after_ingest = _digests(local)
    gp.ingest(store, sample.dump_pattern, run="chained", client=client, delta=True)
    with gp.runner(client) as runner:
        gp.aggregate(
            store, run="r", method="mean", clip_norm=1.0, clip_aggregate=0.5, runner=runner
        )
        gp.aggregate(store, run="r", method="median", runner=runner)
        gp.aggregate(store, run="r", method="krum", runner=runner)
        state = {"w": np.arange(50_000, dtype=np.float32), "step": 3}
        gp.snapshot(store, "model", state, step=3)
        restored = gp.restore(store, "model", runner=runner)
    assert np.array_equal(restored["w"], state["w"])

    assert names.names, "the plugin saw no task"
    bad = sorted(n for n in names.names if not NAME.fullmatch(n))
    assert bad == [], f"task names that do not read as gradpipe-<stage>: {bad}"
    assert {n.split("-")[1] for n in names.names} == STAGES
    assert {"gradpipe-chain", "gradpipe-restore-chunk", "gradpipe-aggregate-robust"} <= names.names
    spans = {span.name[-1] for span in local.scheduler.extensions["spans"].spans.values()}
    assert {"gradpipe-inspect", "gradpipe-ingest", "gradpipe-aggregate", "gradpipe-restore"} <= (
        spans
    )

    # The first ingest's tasks metered exactly what its report counts.
    assert after_ingest["gradpipe-read", READ] == report.raw_bytes
    assert after_ingest["gradpipe-encode", RAW] == report.raw_bytes
    blocks = after_ingest["gradpipe-encode", WRITE] + after_ingest["gradpipe-dump", WRITE]
    assert blocks == report.writes.stored_bytes  # chunks, then tensor and dump manifests
    assert after_ingest["gradpipe-commit", WRITE] > 0  # and the run manifest
    # Aggregates read stored blocks and write theirs; restores read.
    digests = _digests(local)
    # Peers in one group (at most split_every): one reduce task per chunk reads, reduces and
    # writes; more peers: group read tasks, then write tasks.
    read = digests["gradpipe-aggregate-read", READ] + digests["gradpipe-aggregate-reduce", READ]
    wrote = digests["gradpipe-aggregate-write", WRITE] + digests["gradpipe-aggregate-reduce", WRITE]
    encoded = digests["gradpipe-aggregate-write", RAW] + digests["gradpipe-aggregate-reduce", RAW]
    assert read > 0
    assert wrote > 0
    assert encoded > 0
    assert digests["gradpipe-restore-chunk", READ] > 0
    assert digests["gradpipe-chain", RAW] == report.raw_bytes  # --delta: the same dumps


def test_digests_are_no_ops_without_a_worker() -> None:
    """Outside a task (local threads, plain Python) nothing listens: no error, no state."""
    from distributed.metrics import context_meter

    from gradpipe.meter import digest_bytes

    seen: list[tuple[Any, float, str]] = []
    digest_bytes(READ, 10)  # nobody listening
    with context_meter.add_callback(lambda label, value, unit: seen.append((label, value, unit))):
        digest_bytes(READ, 10)
        digest_bytes(WRITE, 0)  # nothing to say
    assert seen == [(READ, 10, "bytes")]
