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
