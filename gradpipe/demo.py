"""The README's first command: a sample training run, ingested into a local store.

``gradpipe demo STORE`` trains the small model of :mod:`gradpipe.testing`
(sparse embedding + dense layers, Adam, several peers with unequal example
counts), writes one safetensors dump per (step, peer) next to the store, and
ingests them on a local Dask cluster — the same code path as ``gradpipe ingest``.
"""

from __future__ import annotations

import os
from pathlib import Path

from gradpipe.ingest import IngestReport, ingest
from gradpipe.storage.open import open_store
from gradpipe.testing.training import TrainingConfig, write_sample_run

__all__ = ["DEMO_CONFIG", "run_demo"]

#: The demo's run: ~120 MiB of dumps, a few seconds of training.
DEMO_CONFIG = TrainingConfig(
    vocab_size=20_000,
    embed_dim=64,
    hidden=256,
    peers=4,
    examples_per_peer=(32, 64, 96, 128),
    steps=6,
)


def run_demo(
    store_url: str,
    *,
    workers: int | None = None,
    config: TrainingConfig = DEMO_CONFIG,
    dashboard: bool = True,
) -> IngestReport:
    """Generate the sample run beside ``store_url`` (if not there yet) and ingest it.

    The ingest runs on an in-process Dask ``LocalCluster`` (``dashboard=True``),
    the embedded default of the README's first command.
    """
    dumps_dir = Path(os.path.abspath(store_url.removeprefix("file://"))).with_name(
        Path(store_url).name + "-dumps"
    )
    if not (dumps_dir / "dumps").exists():
        write_sample_run(dumps_dir, config)
    store = open_store(store_url, mode="a")
    pattern = str(dumps_dir / "dumps" / "step={step}" / "peer={peer}.safetensors")
    return ingest(store, pattern, run="demo", workers=workers, dashboard=dashboard)
