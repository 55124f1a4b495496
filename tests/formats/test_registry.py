"""Tests of the dump-reader registry: one explicit, lazy table of formats."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from gradpipe.errors import InvalidInputError
from gradpipe.formats import DUMP_FORMATS
from gradpipe.formats.registry import READERS, DumpReader, get_reader

ROOT = Path(__file__).resolve().parents[2]


def test_every_format_has_one_reader() -> None:
    assert set(DUMP_FORMATS.values()) == set(READERS) == {"safetensors", "npy", "npz", "torch"}
    for fmt in READERS:
        reader = get_reader(fmt)
        assert isinstance(reader, DumpReader)
        assert reader.format == fmt
        assert get_reader(fmt) is reader  # imported once


def test_unknown_format() -> None:
    with pytest.raises(InvalidInputError, match=r"'zarr'.*safetensors, npy, npz, torch"):
        get_reader("zarr")


def test_torch_is_imported_only_for_torch_files(tmp_path: Path) -> None:
    code = f"""
import sys
import numpy as np
import fsspec
from gradpipe.formats import read_dump_header, read_dump_tensors, write_safetensors
fs = fsspec.filesystem("file")
for name in ("a.safetensors", "a.npy", "a.npz"):
    path = {str(tmp_path)!r} + "/" + name
    if name.endswith(".npy"):
        np.save(path, np.ones(2))
    elif name.endswith(".npz"):
        np.savez(path, w=np.ones(2))
    else:
        write_safetensors(path, {{"w": np.ones(2)}})
    read_dump_tensors(fs, path, read_dump_header(fs, path))
print(sorted(m for m in sys.modules if m == "torch" or m.startswith("gradpipe.formats.")))
"""
    out = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        timeout=120,
        env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"},
        check=True,
    ).stdout
    assert "'torch'" not in out
    assert "gradpipe.formats.torch" not in out
    assert "gradpipe.formats.npz" in out
