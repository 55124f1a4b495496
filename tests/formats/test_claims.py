"""Every format: a small file whose header claims gigabytes is refused in proportion to its size.

Each file is read whole in a child process whose address space is capped 1 GiB above
what its imports take, so a reader that allocated what the header claims fails there
(with ``MemoryError``) instead of on the machine the tests share.
"""

from __future__ import annotations

import io
import json
import struct
import types
import zipfile
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest

CLAIM = 3 << 30  # bytes each forged header claims: three times the child's memory cap


def npy(kit: types.ModuleType) -> bytes:
    return kit.npy_head((CLAIM,)) + bytes(64)


def npz_stored(kit: types.ModuleType) -> bytes:
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w", zipfile.ZIP_STORED) as zf:
        zf.writestr("w.npy", kit.npy_head((CLAIM,)) + bytes(64))
    return buf.getvalue()


def npz_deflated(kit: types.ModuleType) -> bytes:
    body = np.random.default_rng(1).bytes(3 << 20)  # ~3 MiB held, ~3 GB claimed
    data: bytes = kit.lying_npz(body, 1000)
    return data


def safetensors(kit: types.ModuleType) -> bytes:
    text = json.dumps({"w": {"dtype": "U8", "shape": [CLAIM], "data_offsets": [0, CLAIM]}})
    return struct.pack("<Q", len(text)) + text.encode() + bytes(64)


def torch_record(kit: types.ModuleType) -> bytes:
    """A torch.save file whose zip directory says its storage record holds ``CLAIM`` bytes."""
    pytest.importorskip("torch")
    import torch

    raw = bytearray(kit.torch_bytes({"w": torch.ones(16)}))
    at = next(
        i
        for i in range(len(raw) - 46)
        if raw[i : i + 4] == b"PK\x01\x02" and raw[i + 46 : i + 60] == b"archive/data/0"
    )
    struct.pack_into("<II", raw, at + 20, CLAIM, CLAIM)  # compressed and uncompressed sizes
    return bytes(raw)


FILES: dict[str, tuple[str, Callable[[types.ModuleType], bytes], str]] = {
    "npy": ("npy", npy, "truncated or padded"),
    "npz-stored": ("npz", npz_stored, "'w.npy'"),
    "npz-deflated": ("npz", npz_deflated, f"holds only {3 << 20}"),
    "safetensors": ("safetensors", safetensors, "tensor data ends at byte"),
    "torch": ("pt", torch_record, "declare"),
}


@pytest.mark.parametrize("case", sorted(FILES))
def test_a_small_file_claiming_gigabytes_is_refused_cheaply(
    kit: types.ModuleType, tmp_path: Path, case: str
) -> None:
    ext, make, reason = FILES[case]
    path = tmp_path / f"w.{ext}"
    path.write_bytes(make(kit))
    assert path.stat().st_size < 4 << 20
    result = kit.read_in_capped_child(path)
    outcome = str(result["outcome"])
    assert outcome.startswith(f"refused: '{path}'"), outcome  # the path, escaped
    assert reason in outcome
    assert int(str(result["grown_kib"])) < 64 * 1024  # a small multiple of what the file holds
