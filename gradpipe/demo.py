"""The README's first command: a sample training run, ingested into a local store.

``gradpipe demo STORE`` trains the small model of :mod:`gradpipe.testing`
(sparse embedding + dense layers, Adam, several peers with unequal example
counts), writes one safetensors dump per (step, peer) beside a local store (or
where ``--dumps`` says), and ingests them on a local Dask cluster — the same
code path as ``gradpipe ingest``.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from gradpipe.errors import InvalidInputError
from gradpipe.ingestion.api import IngestReport, ingest
from gradpipe.storage.open import open_store, url_is_local
from gradpipe.storage.registry import backend_for_url
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
    dumps_dir: str | os.PathLike[str] | None = None,
    storage_options: dict[str, Any] | None = None,
) -> IngestReport:
    """Generate the sample run (if not there yet) and ingest it into ``store_url``.

    The store URL is checked, and the store opened (created if new), before
    any dump is written: an unsupported scheme or a foreign location costs
    nothing. The dumps go to ``dumps_dir``, by default ``<store>-dumps``
    beside a local store; a remote store needs an explicit ``dumps_dir`` (a
    URL is never turned into a local path). The ingest runs on an in-process
    Dask ``LocalCluster`` (``dashboard=True``), the embedded default of the
    README's first command.
    """
    url = os.fspath(store_url)
    if dumps_dir is None and not url_is_local(url):
        backend_for_url(url, storage_options)  # an unsupported scheme says so first
        raise InvalidInputError(
            f"the demo writes its sample dumps to local disk and {url} is not a local store; "
            "say where with --dumps DIR (dumps_dir=...)"
        )
    store = open_store(url, mode="a", storage_options=storage_options)
    if dumps_dir is None:
        root = Path(store.url)  # a local store's URL is its absolute path
        dumps_dir = root.with_name(root.name + "-dumps")
    dumps = Path(dumps_dir)
    if not (dumps / "dumps").exists():
        write_sample_run(dumps, config)
    pattern = str(dumps / "dumps" / "step={step}" / "peer={peer}.safetensors")
    return ingest(store, pattern, run="demo", workers=workers, dashboard=dashboard)
