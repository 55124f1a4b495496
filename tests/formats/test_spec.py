"""One validation per format, on every path: header parse, whole-file read and ranged read agree."""

from __future__ import annotations

import io
import json
import pickle
import struct
from pathlib import Path

import dask.config
import fsspec
import numpy as np
import pytest

from gradpipe.errors import InvalidInputError
from gradpipe.formats import read_dump_header, read_safetensors
from gradpipe.formats.spec import TensorSpec, check_tensor_values, max_tensor_bytes

LOCAL = fsspec.filesystem("file")


def raw_safetensors(entries: dict[str, object], data: bytes) -> bytes:
    text = json.dumps(entries).encode()
    return struct.pack("<Q", len(text)) + text + data


def write(tmp_path: Path, name: str, data: bytes) -> str:
    path = tmp_path / name
    path.write_bytes(data)
    return str(path)


BOOL_2 = raw_safetensors({"m": {"dtype": "BOOL", "shape": [3], "data_offsets": [0, 3]}}, b"\0\1\2")
HUGE = raw_safetensors(
    {"h": {"dtype": "F32", "shape": [2**32, 2**32, 0], "data_offsets": [0, 0]}}, b""
)


def test_bool_0x02_is_refused_by_the_whole_file_reader(tmp_path: Path) -> None:
    path = write(tmp_path, "b.safetensors", BOOL_2)
    with pytest.raises(InvalidInputError, match=r"tensor 'm'.*other than 0 and 1") as e:
        read_safetensors(path)
    assert path in str(e.value)


def test_bool_0x02_is_refused_on_the_ranged_path(tmp_path: Path) -> None:
    """What ingest's ranged read hands the encoder goes through the same check."""
    path = write(tmp_path, "b.safetensors", BOOL_2)
    header = read_dump_header(LOCAL, path)
    [spec] = header.tensors
    assert spec.offset is not None
    raw = LOCAL.cat_file(path, start=spec.offset, end=spec.offset + spec.nbytes)
    with pytest.raises(InvalidInputError, match=r"tensor 'm'.*other than 0 and 1") as e:
        check_tensor_values(spec, np.frombuffer(raw, np.bool_), path=path)
    assert path in str(e.value)


def test_huge_shape_is_refused_by_every_reader(tmp_path: Path) -> None:
    path = write(tmp_path, "h.safetensors", HUGE)
    for read in (lambda: read_dump_header(LOCAL, path), lambda: read_safetensors(path)):
        with pytest.raises(InvalidInputError, match=r"tensor 'h'.*too large") as e:
            read()
        assert path in str(e.value)


@pytest.mark.parametrize(
    ("name", "match"),
    [("", "empty"), ("a\nb", "control"), ("\ud800", "UTF-8"), ("x" * 1025, "1024")],
    ids=["empty", "newline", "surrogate", "long"],
)
def test_tensor_names_are_validated(tmp_path: Path, name: str, match: str) -> None:
    entries = {name: {"dtype": "U8", "shape": [1], "data_offsets": [0, 1]}}
    text = json.dumps(entries).encode()  # ascii escapes keep the surrogate encodable
    path = write(tmp_path, "n.safetensors", struct.pack("<Q", len(text)) + text + b"\1")
    with pytest.raises(InvalidInputError, match=match) as e:
        read_dump_header(LOCAL, path)
    assert path in str(e.value)


def test_max_tensor_bytes_applies_to_safetensors_and_npy(tmp_path: Path) -> None:
    buf = io.BytesIO()
    np.save(buf, np.zeros(1000, np.float32))
    npy = write(tmp_path, "w.npy", buf.getvalue())
    data = np.zeros(1000, np.float32).tobytes()
    st = write(
        tmp_path,
        "w.safetensors",
        raw_safetensors({"w": {"dtype": "F32", "shape": [1000], "data_offsets": [0, 4000]}}, data),
    )
    for path in (npy, st):
        assert read_dump_header(LOCAL, path).tensors[0].nbytes == 4000
        with (
            dask.config.set({"gradpipe.max-tensor-bytes": 3999}),
            pytest.raises(InvalidInputError, match=r"tensor 'w'.*max-tensor-bytes") as e,
        ):
            read_dump_header(LOCAL, path)
        assert path in str(e.value)


def test_max_tensor_bytes_default_and_parsing() -> None:
    assert max_tensor_bytes() == 64 * 2**30
    with dask.config.set({"gradpipe.max-tensor-bytes": "1 MiB"}):
        assert max_tensor_bytes() == 2**20
    with (
        dask.config.set({"gradpipe.max-tensor-bytes": -1}),
        pytest.raises(InvalidInputError, match="max-tensor-bytes"),
    ):
        max_tensor_bytes()


def test_spec_checks_shape_and_pickles() -> None:
    with pytest.raises(InvalidInputError, match="too large"):
        TensorSpec("h", "float32", (2**32, 2**32, 0), 0)
    spec = TensorSpec("w", "bool", (3,), 8)
    assert pickle.loads(pickle.dumps(spec)) == spec
