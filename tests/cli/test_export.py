"""``gradpipe export``: errors, and outputs it must refuse to write."""

from __future__ import annotations

import os
import stat
from pathlib import Path

import pytest

import gradpipe as gp
from gradpipe.cli.testing import CliOutcome, run_cli, run_cli_json
from gradpipe.core.ids import block_key
from gradpipe.testing.training import SampleRun


@pytest.mark.parametrize(
    ("argv", "status", "word"),
    [
        (["--step", "7", "--peer", "peer0"], 1, "no dump for step 7"),
        (["--step", "1", "--peer", "nobody"], 1, "peer 'nobody'"),
        (["--step", "1", "--peer", "../x"], 2, "invalid peer name"),
    ],
)
def test_export_errors(
    argv: list[str],
    status: int,
    word: str,
    sample: SampleRun,
    tmp_path: Path,
) -> None:
    store = str(tmp_path / "store")
    assert run_cli("ingest", store, sample.dump_pattern, "--run", "train").status == 0
    out_file = tmp_path / "out.safetensors"
    got, doc = run_cli_json("export", store, "--run", "train", *argv, "-o", str(out_file))
    assert got == status
    assert doc["ok"] is False
    assert word in doc["error"]
    assert not out_file.exists()


def export(store: str, out: str) -> CliOutcome:
    return run_cli(
        "export", store, "--run", "train", "--step", "1", "--peer", "peer0", "-o", out, "--json"
    )


def test_export_replaces_a_regular_file(ingested: str, tmp_path: Path) -> None:
    out = tmp_path / "out.safetensors"
    out.write_bytes(b"old")
    outcome = export(ingested, str(out))
    assert outcome.status == 0
    assert outcome.doc["tensors"] == 7
    assert out.read_bytes()[:8] != b"old"
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".")] == []  # no temp left


@pytest.mark.parametrize("dangling", [False, True])
def test_export_refuses_a_symlink(ingested: str, tmp_path: Path, dangling: bool) -> None:
    target = tmp_path / "target.safetensors"
    if not dangling:
        target.write_bytes(b"keep me")
    link = tmp_path / "link.safetensors"
    link.symlink_to(target)
    outcome = export(ingested, str(link))
    assert outcome.status == 2
    message = outcome.error_message("export")
    assert "is a symbolic link" in message
    assert "only regular files" in message
    assert link.is_symlink()
    assert link.readlink() == target
    assert target.exists() != dangling
    if not dangling:
        assert target.read_bytes() == b"keep me"


def test_export_refuses_a_fifo_and_a_directory(ingested: str, tmp_path: Path) -> None:
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    outcome = export(ingested, str(fifo))
    assert outcome.status == 2
    assert "is a FIFO" in outcome.error_message("export")
    assert stat.S_ISFIFO(os.lstat(fifo).st_mode)
    outcome = export(ingested, str(tmp_path))
    assert outcome.status == 2
    assert "is a directory" in outcome.error_message("export")


@pytest.mark.skipif(os.geteuid() != 0, reason="making a device node needs root")
def test_export_refuses_a_device_node(ingested: str, tmp_path: Path) -> None:
    """As root, `-o /dev/null` used to replace the system's /dev/null with a file."""
    null = tmp_path / "null"
    os.mknod(null, stat.S_IFCHR | 0o666, os.makedev(1, 3))  # a /dev/null of our own
    outcome = export(ingested, str(null))
    assert outcome.status == 2
    assert "is a character device" in outcome.error_message("export")
    assert stat.S_ISCHR(os.lstat(null).st_mode)
    assert export(ingested, os.devnull).status == 2
    assert stat.S_ISCHR(os.lstat(os.devnull).st_mode)


def test_export_refuses_paths_inside_a_store(ingested: str, tmp_path: Path) -> None:
    """`-o STORE/blocks/ab/cdef...` used to overwrite a manifest."""
    store = gp.open_store(ingested)
    manifest = block_key(store.refs.get("runs/train"))
    victim = Path(ingested) / manifest
    before = victim.read_bytes()
    (tmp_path / "via").symlink_to(ingested)
    other = gp.open_store(tmp_path / "other", mode="w")  # any store, not only the one read
    for out in [
        victim,
        Path(ingested) / "gradpipe.json",
        Path(ingested) / "new.safetensors",
        Path(ingested) / "blocks" / "zz" / "new",
        tmp_path / "via" / manifest,
        Path(other.url) / "refs" / "x.safetensors",
    ]:
        outcome = export(ingested, str(out))
        assert outcome.status == 2, out
        message = outcome.error_message("export")
        assert "inside the gradpipe store at" in message
        assert "Write it outside the store" in message
    assert victim.read_bytes() == before
    assert gp.verify(store).ok
    assert not (Path(ingested) / "new.safetensors").exists()


@pytest.mark.parametrize("out", ["", ".", "..", "dir/"])
def test_export_needs_a_file_name(out: str, ingested: str) -> None:
    outcome = export(ingested, out)
    assert outcome.status == 2
    assert outcome.error_message("export") == f"-o needs a file name, got {out!r}"


def test_export_dump_api_refuses_the_same(ingested: str, tmp_path: Path) -> None:
    store = gp.open_store(ingested)
    (tmp_path / "link").symlink_to(tmp_path / "elsewhere")
    with pytest.raises(gp.InvalidInputError, match="symbolic link"):
        gp.export_dump(store, "train", 1, "peer0", tmp_path / "link")
    with pytest.raises(gp.InvalidInputError, match="inside the gradpipe store"):
        gp.export_dump(store, "train", 1, "peer0", Path(ingested) / "x.safetensors")
    with pytest.raises(gp.InvalidInputError, match="output path needs a file name"):
        gp.export_dump(store, "train", 1, "peer0", "")


def test_export_into_a_missing_directory(ingested: str, tmp_path: Path) -> None:
    outcome = export(ingested, str(tmp_path / "no" / "such" / "out.safetensors"))
    assert outcome.status == 2
    message = outcome.error_message("export")
    assert f"the directory {tmp_path / 'no' / 'such'} does not exist" in message
    assert not (tmp_path / "no").exists()
