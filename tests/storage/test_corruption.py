"""Damaged stores: every read checks, verify finds and names, gc refuses.

The damage is done to the real bytes on disk or in the bucket, the way a bad
disk, a half-finished copy or a careless ``rm`` would.
"""

from __future__ import annotations

import json
import os
import struct
import time
from pathlib import Path

import numpy as np
import pytest

import gradpipe as gp
from gradpipe.cli import main
from gradpipe.core.encoding import to_json_bytes
from gradpipe.core.ids import block_key
from gradpipe.errors import IntegrityError, NotFoundError

REF = "tags/damaged"
# These tests damage and count data blocks: every chunk is a block of its own.
pytestmark = pytest.mark.usefixtures("no_inline")


def overwrite(store: gp.Store, key: str, data: bytes) -> None:
    """Replace the bytes at ``key`` behind the store's back."""
    if store.url.startswith("s3://"):
        store.backend.fs.pipe_file(f"{store.backend.root}/{key}", data)
    else:
        Path(store.backend.root, key).write_bytes(data)


def listing(store: gp.Store) -> dict[str, int]:
    return {info.key: info.size for info in store.backend.list("")}


def payload_start(frame: bytes) -> int:
    _magic, _version, header_len = struct.unpack_from("<4sBI", frame)
    return 9 + header_len


@pytest.fixture
def damaged(store: gp.Store) -> tuple[gp.Store, str, list[str], np.ndarray]:
    """A committed multi-chunk tensor; returns (store, tensor id, block ids, data)."""
    data = np.random.default_rng(3).standard_normal(4096).astype(np.float32)
    tensor_id = store.put_tensor(data, chunk_bytes=4096)
    store.refs.set(REF, tensor_id)
    blocks = [b for b in store.tensor_info(tensor_id).blocks if b is not None]
    assert len(blocks) == 4
    # Something gc would delete, to show that a refusing gc deletes nothing.
    store.put_tensor(np.arange(64, dtype="int64"))
    assert gp.verify(store).ok
    return store, tensor_id, blocks, data


def run_cli(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, dict[str, object]]:
    capsys.readouterr()
    status = main(list(argv))
    return status, json.loads(capsys.readouterr().out)


def assert_reported(
    store: gp.Store, kind: str, bad_id: str, capsys: pytest.CaptureFixture[str]
) -> None:
    report = gp.verify(store)
    assert not report.ok
    assert [(p.kind, p.id) for p in report.problems] == [(kind, bad_id)]
    status, doc = run_cli(capsys, "verify", store.url, "--json")
    assert status == 1
    assert doc["ok"] is False
    assert [(p["kind"], p["id"]) for p in doc["problems"]] == [(kind, bad_id)]  # type: ignore[union-attr]


def assert_gc_refuses(store: gp.Store) -> None:
    before = listing(store)
    with pytest.raises(IntegrityError, match="gc stopped before deleting anything"):
        gp.gc(store, grace=0)
    assert listing(store) == before


@pytest.mark.parametrize("where", ["middle", "last"])
def test_flipped_byte_in_data_block(
    damaged: tuple[gp.Store, str, list[str], np.ndarray],
    where: str,
    capsys: pytest.CaptureFixture[str],
) -> None:
    store, tensor_id, blocks, _ = damaged
    bad = blocks[1]
    frame = bytearray(store.backend.read(block_key(bad)))
    start = payload_start(bytes(frame))
    pos = (start + len(frame)) // 2 if where == "middle" else len(frame) - 1
    frame[pos] ^= 0x10
    overwrite(store, block_key(bad), bytes(frame))

    with pytest.raises(IntegrityError) as info:
        store.get_tensor(tensor_id)
    assert bad in str(info.value)
    assert tensor_id in str(info.value)
    assert_reported(store, "corrupt", bad, capsys)
    # The damaged block is reachable: gc keeps it (it is evidence) and goes on.
    gp.gc(store, grace=0)
    assert block_key(bad) in listing(store)


def test_deleted_block(
    damaged: tuple[gp.Store, str, list[str], np.ndarray], capsys: pytest.CaptureFixture[str]
) -> None:
    store, tensor_id, blocks, _ = damaged
    bad = blocks[2]
    store.backend.delete(block_key(bad))

    with pytest.raises(NotFoundError) as info:
        store.get_tensor(tensor_id)
    assert isinstance(info.value, KeyError)
    assert bad in str(info.value)
    assert tensor_id in str(info.value)
    assert_reported(store, "missing", bad, capsys)


def test_truncated_block(
    damaged: tuple[gp.Store, str, list[str], np.ndarray], capsys: pytest.CaptureFixture[str]
) -> None:
    store, tensor_id, blocks, _ = damaged
    bad = blocks[0]
    frame = store.backend.read(block_key(bad))
    overwrite(store, block_key(bad), frame[: len(frame) // 2])

    with pytest.raises(IntegrityError, match=r"truncated|does not decode|corrupt") as info:
        store.get_tensor(tensor_id)
    assert bad in str(info.value)
    assert_reported(store, "corrupt", bad, capsys)


def test_block_cut_inside_its_frame_prefix(
    damaged: tuple[gp.Store, str, list[str], np.ndarray],
) -> None:
    store, tensor_id, blocks, _ = damaged
    overwrite(store, block_key(blocks[3]), b"GPB")
    with pytest.raises(IntegrityError, match="truncated"):
        store.get_tensor(tensor_id)


def test_corrupt_manifest(
    damaged: tuple[gp.Store, str, list[str], np.ndarray], capsys: pytest.CaptureFixture[str]
) -> None:
    store, tensor_id, _, _ = damaged
    frame = bytearray(store.backend.read(block_key(tensor_id)))
    frame[-2] ^= 0x01  # inside the manifest's JSON
    overwrite(store, block_key(tensor_id), bytes(frame))

    with pytest.raises(IntegrityError) as info:
        store.get_tensor(tensor_id)
    assert tensor_id in str(info.value)
    assert_reported(store, "corrupt", tensor_id, capsys)
    assert_gc_refuses(store)


def test_missing_manifest(
    damaged: tuple[gp.Store, str, list[str], np.ndarray], capsys: pytest.CaptureFixture[str]
) -> None:
    store, tensor_id, _, _ = damaged
    store.backend.delete(block_key(tensor_id))
    with pytest.raises(NotFoundError):
        store.get_tensor(tensor_id)
    assert_reported(store, "missing", tensor_id, capsys)
    assert_gc_refuses(store)


@pytest.mark.parametrize(
    "content",
    [b"", b"\x00garbage\xff", b'{"not": "an entry"}', b'{"type":"ref","format":1}'],
    ids=["empty", "garbage", "json", "incomplete"],
)
def test_corrupt_ref_file(
    damaged: tuple[gp.Store, str, list[str], np.ndarray],
    content: bytes,
    capsys: pytest.CaptureFixture[str],
) -> None:
    store, _, _, _ = damaged
    overwrite(store, f"refs/{REF}", content)

    with pytest.raises(IntegrityError, match=REF):
        store.refs.get(REF)
    with pytest.raises(IntegrityError):
        store.refs.set(REF, None)  # no writer builds on a damaged ref
    assert_reported(store, "corrupt", f"refs/{REF}", capsys)
    # The damaged ref's target can no longer be known: deleting "unreferenced"
    # blocks now could delete what it pointed at.
    assert_gc_refuses(store)


def test_ref_written_by_a_newer_gradpipe(
    damaged: tuple[gp.Store, str, list[str], np.ndarray],
) -> None:
    store, _, _, _ = damaged
    overwrite(store, f"refs/{REF}", to_json_bytes({"type": "ref", "format": 99, "ref": REF}))
    with pytest.raises(gp.UnsupportedFormatError):
        store.refs.get(REF)
    report = gp.verify(store)
    assert [(p.kind, p.id) for p in report.problems] == [("unreadable", f"refs/{REF}")]
    assert_gc_refuses(store)


def test_corrupt_history_entry(
    damaged: tuple[gp.Store, str, list[str], np.ndarray], capsys: pytest.CaptureFixture[str]
) -> None:
    store, tensor_id, _, data = damaged
    store.refs.set(REF, store.put_tensor(data[:10]))
    newest, first = list(store.refs.history(REF))[:2]
    previous = newest.previous
    assert first.target == tensor_id
    assert previous is not None
    overwrite(store, block_key(previous), b"GPBK" + bytes(40))
    assert_reported(store, "corrupt", previous, capsys)
    assert_gc_refuses(store)


def test_unreferenced_corruption_only_seen_with_all(store: gp.Store) -> None:
    orphan = store.put_tensor(np.arange(100, dtype="float64"))
    bad = store.tensor_info(orphan).blocks[0]
    assert bad is not None
    frame = bytearray(store.backend.read(block_key(bad)))
    frame[-1] ^= 0xFF
    overwrite(store, block_key(bad), bytes(frame))
    assert gp.verify(store).ok  # nothing reaches it
    report = gp.verify(store, all_blocks=True)
    assert report.unreferenced == 2
    assert [(p.kind, p.id) for p in report.problems] == [("corrupt", bad)]


def test_gc_keeps_a_damaged_store_intact_when_local_files_are_old(tmp_path: Path) -> None:
    # Local disk lets us age every file: even then gc must delete nothing.
    store = gp.open_store(tmp_path / "s", mode="w")
    tensor_id = store.put_tensor(np.ones(50, "float32"))
    store.refs.set(REF, tensor_id)
    store.put_tensor(np.arange(50, dtype="float32"))  # unreferenced
    old = time.time() - 86400 * 30
    for path in Path(store.backend.root).rglob("*"):
        os.utime(path, (old, old))
    overwrite(store, f"refs/{REF}", b"{}")
    before = listing(store)
    with pytest.raises(IntegrityError):
        gp.gc(store)
    assert listing(store) == before
