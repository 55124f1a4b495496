"""Tests of the torch reader's bounds: a tensor's bytes must come from storage in the file."""

from __future__ import annotations

import io
from pathlib import Path

import dask.config
import fsspec
import numpy as np
import pytest

from gradpipe.errors import InvalidInputError
from gradpipe.formats import read_dump_header, read_dump_tensors

torch = pytest.importorskip("torch")
LOCAL = fsspec.filesystem("file")


def save(path: Path, obj: object) -> str:
    buf = io.BytesIO()
    torch.save(obj, buf)
    path.write_bytes(buf.getvalue())
    return str(path)


@pytest.mark.parametrize(
    ("make", "what"),
    [
        (lambda: torch.ones(1).expand(2**29), "stride 0"),
        (lambda: torch.arange(4.0).expand(3, 4), "stride 0"),
        (lambda: torch.arange(10.0).as_strided((5, 4), (1, 1)), "overlap"),
    ],
    ids=["expand-1d", "expand-rows", "overlapping"],
)
def test_views_that_repeat_storage_are_refused(tmp_path: Path, make: object, what: str) -> None:
    path = save(tmp_path / "g.pt", {"w": make(), "ok": torch.ones(3)})  # type: ignore[operator]
    assert Path(path).stat().st_size < 4096
    with pytest.raises(InvalidInputError, match=what) as e:
        read_dump_header(LOCAL, path)
    message = str(e.value)
    assert path in message
    assert "tensor 'w'" in message
    assert ".clone()" in message
    assert ".contiguous()" in message


def test_ordinary_views_still_read(tmp_path: Path) -> None:
    base = torch.arange(24.0).reshape(4, 6)
    views = {"t": base.t(), "step": base[::2, 1::2], "b": torch.ones(1, 5).expand(1, 5)}
    path = save(tmp_path / "v.pt", views)
    got = read_dump_tensors(LOCAL, path, read_dump_header(LOCAL, path))
    for name, t in views.items():
        np.testing.assert_array_equal(got[name], t.numpy(), err_msg=name)


def test_bool_bytes_other_than_0_1_are_refused(tmp_path: Path) -> None:
    raw = torch.tensor([0, 1, 2], dtype=torch.uint8)
    path = save(tmp_path / "m.pt", {"m": raw.view(torch.bool)})
    header = read_dump_header(LOCAL, path)
    with pytest.raises(InvalidInputError, match=r"tensor 'm'.*other than 0 and 1") as e:
        read_dump_tensors(LOCAL, path, header)
    assert path in str(e.value)


def test_max_tensor_bytes_applies_to_torch(tmp_path: Path) -> None:
    path = save(tmp_path / "big.pt", {"w": torch.zeros(1000)})
    with (
        dask.config.set({"gradpipe.max-tensor-bytes": "3 kB"}),
        pytest.raises(InvalidInputError, match=r"tensor 'w'.*4000 bytes.*max-tensor-bytes"),
    ):
        read_dump_header(LOCAL, path)


def test_compressed_records_are_refused_before_torch_inflates_them(tmp_path: Path) -> None:
    """torch.load inflates a deflated record to its declared size: refuse it from the directory."""
    import zipfile

    buf = io.BytesIO()
    torch.save({"w": torch.zeros(1000)}, buf)
    src = zipfile.ZipFile(io.BytesIO(buf.getvalue()))
    out = io.BytesIO()
    with zipfile.ZipFile(out, "w", compression=zipfile.ZIP_DEFLATED) as dst:
        for info in src.infolist():
            dst.writestr(info.filename, src.read(info))
    path = tmp_path / "z.pt"
    path.write_bytes(out.getvalue())
    assert torch.load(path, weights_only=True)["w"].shape == (1000,)  # torch would read it
    with pytest.raises(InvalidInputError, match=r"record '.*' is compressed") as e:
        read_dump_header(LOCAL, str(path))
    assert str(path) in str(e.value)


def test_many_names_for_one_storage_are_bounded_per_file(tmp_path: Path) -> None:
    from gradpipe.formats.torch import SHARED_STORAGE_FACTOR, SHARED_STORAGE_FLOOR

    base = torch.ones(1 << 18)  # 1 MiB of float32
    path = save(tmp_path / "g.pt", {f"w{i}": base for i in range(64)})
    size = Path(path).stat().st_size
    assert size < 2 * base.nbytes
    with pytest.raises(InvalidInputError) as e:
        read_dump_header(LOCAL, path)
    text = str(e.value)
    assert path in text
    assert str(64 * base.nbytes) in text  # the claimed total
    assert str(SHARED_STORAGE_FACTOR * size + SHARED_STORAGE_FLOOR) in text
    assert ".clone()" in text


def test_weight_tying_shares_one_storage_between_two_names(tmp_path: Path) -> None:
    emb = torch.arange(1 << 18, dtype=torch.float32)
    path = save(tmp_path / "g.pt", {"embed.weight": emb, "lm_head.weight": emb})
    header = read_dump_header(LOCAL, path)
    assert sum(t.nbytes for t in header.tensors) == 2 * emb.nbytes
    arrays = read_dump_tensors(LOCAL, path, header)
    assert np.array_equal(arrays["lm_head.weight"], emb.numpy())


def damage_record(data: bytes, suffix: str, at: int, mask: int = 0x01) -> bytes:
    """``data`` (a torch.save file) with byte ``at`` of the record ending in ``suffix`` flipped."""
    import struct
    import zipfile

    raw = bytearray(data)
    [info] = [
        i for i in zipfile.ZipFile(io.BytesIO(data)).infolist() if i.filename.endswith(suffix)
    ]
    name_len, extra_len = struct.unpack_from("<HH", raw, info.header_offset + 26)
    raw[info.header_offset + 30 + name_len + extra_len + at] ^= mask
    return bytes(raw)


def torch_file(obj: object) -> bytes:
    buf = io.BytesIO()
    torch.save(obj, buf)
    return buf.getvalue()


def test_a_damaged_storage_record_is_refused_when_its_tensors_are_read(tmp_path: Path) -> None:
    """torch.load checks no CRC-32: a flipped storage byte used to be read as a value."""
    path = tmp_path / "g.pt"
    path.write_bytes(damage_record(torch_file({"w": torch.arange(1000.0)}), "/data/0", 101))
    header = read_dump_header(LOCAL, str(path))  # mapped, not read: nothing is ingested yet
    with pytest.raises(InvalidInputError, match=r"record 'archive/data/0' is damaged") as e:
        read_dump_tensors(LOCAL, str(path), header)
    assert str(path) in str(e.value)
    assert "copy it again" in str(e.value)


def test_a_damaged_pickle_is_refused_from_the_header(tmp_path: Path) -> None:
    """A flipped byte in a metadata string still unpickles; its CRC-32 gives it away."""
    import zipfile

    data = torch_file({"w": torch.ones(2), "note": "hello"})
    pickle = zipfile.ZipFile(io.BytesIO(data)).read("archive/data.pkl")
    bad = damage_record(data, "data.pkl", pickle.index(b"hello"), ord("h") ^ ord("j"))
    assert b"jello" in bad
    path = tmp_path / "g.pt"
    path.write_bytes(bad)
    with pytest.raises(InvalidInputError, match=r"record 'archive/data.pkl' is damaged"):
        read_dump_header(LOCAL, str(path))


def test_records_without_a_crc_are_read(tmp_path: Path) -> None:
    """torch.save can skip CRC-32s (set_crc32_options(False)): it writes 0, and that reads."""
    torch.serialization.set_crc32_options(False)
    try:
        data = torch_file({"w": torch.arange(5.0)})
    finally:
        torch.serialization.set_crc32_options(True)
    path = tmp_path / "g.pt"
    path.write_bytes(data)
    header = read_dump_header(LOCAL, str(path))
    assert read_dump_tensors(LOCAL, str(path), header)["w"].tolist() == [0, 1, 2, 3, 4]


def test_records_claiming_more_than_the_file_together_are_refused(tmp_path: Path) -> None:
    """A forged directory listing one storage record under many names claims many files' worth."""
    import struct

    data = torch_file({"w": torch.arange(4096.0)})
    eocd = data.rindex(b"PK\x05\x06")
    *_, count, _, cd_size, cd_offset, _ = struct.unpack("<4sHHHHIIH", data[eocd : eocd + 22])
    directory = data[cd_offset : cd_offset + cd_size]
    at = directory.index(b"archive/data/0") - 46  # the central record of data/0
    (name_len, extra_len, comment_len) = struct.unpack_from("<HHH", directory, at + 28)
    record = directory[at : at + 46 + name_len + extra_len + comment_len]
    copies = [record.replace(b"archive/data/0", f"archive/data/{i}".encode()) for i in range(1, 9)]
    central = directory + b"".join(copies)
    total = count + len(copies)
    end = struct.pack("<4sHHHHIIH", b"PK\x05\x06", 0, 0, total, total, len(central), cd_offset, 0)
    path = tmp_path / "g.pt"
    path.write_bytes(data[:cd_offset] + central + end)
    with pytest.raises(InvalidInputError, match=r"records declare \d+ bytes in total") as e:
        read_dump_header(LOCAL, str(path))
    assert str(path) in str(e.value)
