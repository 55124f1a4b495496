"""Tests of dump discovery: only regular files become dumps; the rest are failures up front."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import types
from pathlib import Path

import numpy as np
import pytest

from gradpipe.ingestion.discover import discover_dumps

ROOT = Path(__file__).resolve().parents[2]
PATTERN = "step={step}/peer={peer}.safetensors"


def test_non_regular_files_are_refused_before_opening(
    tmp_path: Path, kit: types.ModuleType
) -> None:
    good = tmp_path / "step=1" / "peer=a.safetensors"
    good.parent.mkdir()
    good.write_bytes(kit.safetensors_bytes({"w": np.ones(3, np.float32)}, {}))
    os.mkfifo(tmp_path / "step=1" / "peer=b.safetensors")
    (tmp_path / "step=1" / "peer=c.safetensors").mkdir()
    (tmp_path / "step=1" / "peer=d.safetensors").symlink_to(tmp_path / "nowhere")
    sock = socket.socket(socket.AF_UNIX)
    try:
        sock.bind(str(tmp_path / "step=1" / "peer=e.safetensors"))
        _, dumps, refused = discover_dumps(str(tmp_path / PATTERN))
    finally:
        sock.close()
    assert [d.path for d in dumps] == [str(good)]
    reasons = {f.peer: f.reason for f in refused}
    assert sorted(reasons) == ["b", "c", "d", "e"]
    assert "named pipe" in reasons["b"]
    assert "directory" in reasons["c"]
    assert "No such file" in reasons["d"]
    assert "socket" in reasons["e"]
    for peer, reason in reasons.items():
        assert f"peer={peer}.safetensors" in reason
        assert "not a regular file" in reason or "No such file" in reason


# The ingest runs in a child process with a timeout: a reader that opens the FIFO
# waits for a writer for ever, and must fail this test rather than hang the suite.
CHILD = """
import json, sys
import gradpipe as gp
store = gp.open_store(sys.argv[1], mode="w")
report = gp.ingest(store, sys.argv[2], run="r", workers=2)
print(json.dumps(report.to_dict()))
"""


def test_fifo_beside_a_good_dump_does_not_hang_ingest(
    tmp_path: Path, kit: types.ModuleType
) -> None:
    dumps = tmp_path / "dumps"
    (dumps / "step=1").mkdir(parents=True)
    (dumps / "step=1" / "peer=a.safetensors").write_bytes(
        kit.safetensors_bytes({"w": np.ones(3, np.float32)}, {})
    )
    fifo = dumps / "step=1" / "peer=b.safetensors"
    os.mkfifo(fifo)
    try:
        proc = subprocess.run(
            [sys.executable, "-c", CHILD, str(tmp_path / "store"), str(dumps / PATTERN)],
            capture_output=True,
            text=True,
            timeout=60,
            env={**os.environ, "PYTHONPATH": str(ROOT)},
            check=False,
        )
    except subprocess.TimeoutExpired:  # run() has killed the child
        pytest.fail("ingest hung on a FIFO named like a dump")
    assert proc.returncode == 0, proc.stderr
    report = json.loads(proc.stdout.strip().splitlines()[-1])
    assert report["ingested"] == 1
    assert report["run_id"] is not None
    [failure] = report["failures"]
    assert failure["peer"] == "b"
    assert "named pipe" in failure["reason"]
    assert str(fifo) in failure["reason"]


def test_fsspec_listing_type_is_checked(kit: types.ModuleType) -> None:
    """Off the local disk, the listing's ``type`` decides: a directory is not a dump."""
    import fsspec

    fs = fsspec.filesystem("memory")
    root = f"/discover-{os.getpid()}"
    fs.pipe(f"{root}/step=1/peer=a.safetensors", kit.safetensors_bytes({"w": np.ones(2)}, {}))
    fs.pipe(f"{root}/step=1/peer=b.safetensors/part0", b"x")
    try:
        _, dumps, refused = discover_dumps(f"memory://{root}/{PATTERN}")
    finally:
        fs.rm(root, recursive=True)
    assert [d.peer for d in dumps] == ["a"]
    [failure] = refused
    assert failure.peer == "b"
    assert "directory, not a regular file" in failure.reason
    assert "peer=b.safetensors" in failure.reason
