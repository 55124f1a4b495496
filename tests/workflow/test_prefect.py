"""``workflows/prefect_nightly.py``: the nightly's stages as Prefect tasks on a Dask cluster.

Runs where ``prefect`` and ``prefect-dask`` are installed (``.ci/run`` installs them in a venv
of their own: prefect and flwr pin incompatible fastapi versions).
"""

from __future__ import annotations

import importlib
import os
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

import gradpipe as gp
from gradpipe.testing.training import TrainingConfig, write_sample_run

pytest.importorskip("prefect")
pytest.importorskip("prefect_dask")
distributed = pytest.importorskip("distributed")
pytestmark = pytest.mark.slow  # a Prefect server and a cluster of processes: ~1 min

REPO = Path(__file__).resolve().parents[2]
FLOWS = REPO / "workflows"
TINY = TrainingConfig(vocab_size=500, embed_dim=8, hidden=16, peers=3, steps=3)


def _flow_module() -> ModuleType:
    """``workflows/prefect_nightly.py``, imported by name as the cluster's workers import it."""
    if str(FLOWS) not in sys.path:
        sys.path.insert(0, str(FLOWS))
    return importlib.import_module("prefect_nightly")


@pytest.fixture(scope="module")
def cluster() -> Iterator[Any]:
    # Deployed workers have the flow's folder on their path. Spawned workers start from
    # this process's sys.path (multiprocessing sends it), and their nannies' from PYTHONPATH.
    _flow_module()
    saved = os.environ.get("PYTHONPATH")
    os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (str(FLOWS), saved) if p)
    try:
        with distributed.LocalCluster(
            n_workers=2,
            threads_per_worker=2,
            processes=True,
            dashboard_address=":0",
            silence_logs=40,
        ) as c:
            yield c
    finally:
        if saved is None:
            os.environ.pop("PYTHONPATH", None)
        else:
            os.environ["PYTHONPATH"] = saved


def test_the_flow_runs_every_stage_on_the_cluster(cluster: Any, tmp_path: Path) -> None:
    from prefect.testing.utilities import prefect_test_harness

    sample = write_sample_run(tmp_path / "sample", TINY)
    path = tmp_path / "nightly.yaml"
    path.write_text(
        textwrap.dedent(
            f"""
            version: 1
            store: {{url: archive, create: true}}
            stages:
              - ingest: {{pattern: "{sample.dump_pattern}", run: exp}}
              - aggregate: {{run: exp, method: fedavg}}
              - gc: {{grace: 24h}}
              - verify: {{}}
            """
        )
    )
    module = _flow_module()
    with prefect_test_harness(server_startup_timeout=300):  # a loaded CI machine is slow
        results = module.on_cluster(cluster.scheduler_address)(
            path=str(path), address=cluster.scheduler_address
        )
    assert [r["kind"] for r in results] == ["ingest", "aggregate", "gc", "verify"]
    assert [r["state"] for r in results] == ["ok"] * 4
    store = gp.open_store(tmp_path / "archive")
    assert len(list(gp.open_run(store, "exp"))) == TINY.steps * TINY.peers
    assert gp.verify(store).ok
