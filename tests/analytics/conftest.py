"""Fixtures of the analytics tests."""

from __future__ import annotations

from pathlib import Path

import pytest

import gradpipe as gp


@pytest.fixture
def local_store(tmp_path: Path) -> gp.Store:
    """A new store on local disk only: for the math, which the backend does not change.

    Reads, memoisation, commits and their faults run on both backends (``store``).
    """
    return gp.open_store(tmp_path / "store", mode="w")
