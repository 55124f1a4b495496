"""Tests of the npz reader's bounds: a tiny archive must not make gradpipe allocate gigabytes."""

from __future__ import annotations

import types
from pathlib import Path

import dask.config
import fsspec
import numpy as np
import pytest

from gradpipe.errors import InvalidInputError
from gradpipe.formats import read_dump_header, read_dump_tensors

LOCAL = fsspec.filesystem("file")
ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("claim", [2 << 30, 8 << 30], ids=["2GiB", "8GiB"])
def test_tiny_npz_claiming_gigabytes_is_refused_cheaply(
    kit: types.ModuleType, tmp_path: Path, claim: int
) -> None:
    path = tmp_path / "step=1" / "peer=a.npz"
    path.parent.mkdir()
    path.write_bytes(kit.bomb_npz(claim))
    assert path.stat().st_size < 300
    result = kit.read_in_capped_child(path)
    outcome = str(result["outcome"])
    assert outcome.startswith("refused: "), outcome
    assert str(path) in outcome
    assert "'w.npy'" in outcome
    assert "1032" in outcome  # names deflate's bound, so the user sees why
    assert int(str(result["grown_kib"])) < 64 * 1024  # the file's claim was never allocated


def test_bomb_is_refused_from_the_header(kit: types.ModuleType, tmp_path: Path) -> None:
    path = tmp_path / "b.npz"
    path.write_bytes(kit.bomb_npz(2 << 30))
    with pytest.raises(InvalidInputError, match=r"declares 2147483648 bytes.*deflate"):
        read_dump_header(LOCAL, str(path))


def test_deflated_member_within_the_ratio_is_read(tmp_path: Path) -> None:
    """Zeros deflate about 1000:1; a genuine all-zero gradient must still be read."""
    arrays = {"z": np.zeros(1 << 20, np.float32), "r": np.arange(10, dtype=np.int64)}
    path = tmp_path / "z.npz"
    np.savez_compressed(path, **arrays)
    header = read_dump_header(LOCAL, str(path))
    got = read_dump_tensors(LOCAL, str(path), header)
    assert all(np.array_equal(got[k], v) for k, v in arrays.items())


def test_other_compression_methods_are_refused(kit: types.ModuleType, tmp_path: Path) -> None:
    import io
    import zipfile

    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w", compression=zipfile.ZIP_BZIP2) as zf:
        zf.writestr("w.npy", kit.npy_head((4,)) + bytes(4))
    path = tmp_path / "bz.npz"
    path.write_bytes(buf.getvalue())
    with pytest.raises(InvalidInputError, match=r"'w.npy'.*compression") as e:
        read_dump_header(LOCAL, str(path))
    assert str(path) in str(e.value)


@pytest.mark.parametrize("compressed", [False, True], ids=["stored", "deflated"])
def test_max_tensor_bytes_applies_to_npz(tmp_path: Path, compressed: bool) -> None:
    path = tmp_path / "m.npz"
    (np.savez_compressed if compressed else np.savez)(path, w=np.zeros(1000, np.float32))
    with (
        dask.config.set({"gradpipe.max-tensor-bytes": 3999}),
        pytest.raises(InvalidInputError, match=r"tensor 'w'.*4000 bytes.*max-tensor-bytes") as e,
    ):
        read_dump_header(LOCAL, str(path))
    assert str(path) in str(e.value)
    with dask.config.set({"gradpipe.max-tensor-bytes": 4000}):
        assert read_dump_header(LOCAL, str(path)).tensors[0].nbytes == 4000


def overlapping_npz(arr: np.ndarray, copies: int) -> bytes:
    """An ``np.savez`` archive whose zip directory lists its one stored member ``copies`` times.

    Every directory entry (``w000.npy``, ``w001.npy``, ...) points at the same local
    header, as a forged archive would, so the file claims ``copies`` times its data.
    """
    import io
    import struct

    buf = io.BytesIO()
    np.savez(buf, w=arr)
    raw = buf.getvalue()
    eocd = raw.rindex(b"PK\x05\x06")
    *_, cd_size, cd_offset, _ = struct.unpack("<4sHHHHIIH", raw[eocd : eocd + 22])
    record = raw[cd_offset : cd_offset + cd_size]
    (name_len,) = struct.unpack("<H", record[28:30])
    names = [f"w{i:03d}.npy".encode() for i in range(copies)]
    central = b"".join(
        record[:28] + struct.pack("<H", len(n)) + record[30:46] + n + record[46 + name_len :]
        for n in names
    )
    end = struct.pack("<4sHHHHIIH", b"PK\x05\x06", 0, 0, copies, copies, len(central), cd_offset, 0)
    return raw[:cd_offset] + central + end


@pytest.mark.parametrize("read", ["header", "whole"])
def test_members_sharing_bytes_are_refused(tmp_path: Path, read: str) -> None:
    path = tmp_path / "g.npz"
    path.write_bytes(overlapping_npz(np.ones(1 << 18, "<f4"), 64))
    from gradpipe.formats.npz import read_npz_arrays

    def whole() -> object:
        with path.open("rb") as f:
            return read_npz_arrays(f, path=str(path), size=path.stat().st_size)

    call = (lambda: read_dump_header(LOCAL, str(path))) if read == "header" else whole
    with pytest.raises(InvalidInputError, match="overlap") as e:
        call()
    assert str(path) in str(e.value)
    assert "'w000.npy'" in str(e.value)


def test_member_claiming_more_than_it_holds_is_read_in_proportion(
    kit: types.ModuleType, tmp_path: Path
) -> None:
    """A 4 MiB file whose deflated member claims ~900 x that: memory follows the real bytes.

    Before, the reader zero-filled the claimed 3.6 GB before reading anything, and
    under the child's 1 GiB cap failed with a bare MemoryError.
    """
    body = np.random.default_rng(0).bytes(4 << 20)  # random: deflate cannot shrink it
    path = tmp_path / "step=1" / "peer=a.npz"
    path.parent.mkdir()
    path.write_bytes(kit.lying_npz(body, 900))
    assert path.stat().st_size < 5 << 20
    result = kit.read_in_capped_child(path)
    outcome = str(result["outcome"])
    assert outcome.startswith("refused: "), outcome
    assert f"'{path}': member 'w.npy'" in outcome
    assert f"holds only {len(body)}" in outcome
    assert int(str(result["grown_kib"])) < 64 * 1024  # a small multiple of the 4 MiB held
