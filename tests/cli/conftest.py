"""Fixtures of the CLI tests: a small sample run, and a store holding it."""

from __future__ import annotations

from pathlib import Path

import pytest

import gradpipe as gp
from gradpipe.testing.training import SampleRun, TrainingConfig, write_sample_run

#: A small sample run: 3 steps x 3 peers, a few MiB.
SMALL = TrainingConfig(vocab_size=3000, embed_dim=8, hidden=16, peers=3, steps=3)


@pytest.fixture(scope="module")
def sample(tmp_path_factory: pytest.TempPathFactory) -> SampleRun:
    """Dump files of a small run, written once per test module."""
    return write_sample_run(tmp_path_factory.mktemp("sample"), SMALL)


@pytest.fixture
def ingested(sample: SampleRun, tmp_path: Path) -> str:
    """The URL of a local store holding ``sample`` as run ``train``."""
    url = str(tmp_path / "store")
    assert gp.ingest(gp.open_store(url, mode="w"), sample.dump_pattern, run="train").ok
    return url
