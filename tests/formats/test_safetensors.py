"""Tests of gradpipe's own safetensors reader and writer."""

from __future__ import annotations

import io
import json
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp
from safetensors import safe_open
from safetensors.numpy import load_file, save, save_file

from gradpipe.core.dtypes import DTYPE_NAMES, parse_dtype
from gradpipe.errors import InvalidInputError, UnsupportedFormatError
from gradpipe.formats import safetensors as st_mod
from gradpipe.formats.safetensors import (
    read_header,
    read_safetensors,
    read_tensor,
    read_tensor_range,
    write_safetensors,
)

FLOATS = ["float16", "bfloat16", "float32", "float64"]
SHAPES = [(), (0,), (2, 0, 3), (5,), (3, 4)]


def bits(a: np.ndarray) -> tuple[str, tuple[int, ...], bytes]:
    """Everything that makes two arrays bit-identical."""
    return str(a.dtype), a.shape, np.ascontiguousarray(a).reshape(-1).view(np.uint8).tobytes()


def sample(dtype: str, shape: tuple[int, ...], seed: int = 0) -> np.ndarray:
    """Arbitrary bit patterns (all of them valid for the dtype) of the given shape."""
    dt = parse_dtype(dtype)
    rng = np.random.default_rng(seed)
    if dtype == "bool":
        return rng.integers(0, 2, shape).astype(bool)
    raw = rng.integers(0, 256, int(np.prod(shape)) * dt.itemsize, dtype=np.uint8)
    return raw.view(dt).reshape(shape)


def special_floats(dtype: str) -> np.ndarray:
    """-0.0, infinities, subnormals and NaNs with payloads, as raw bit patterns."""
    dt = parse_dtype(dtype)
    patterns = {
        2: [0x8000, 0x7C00, 0xFC00, 0x0001, 0x7E01, 0xFD55, 0x7FFF],
        4: [0x80000000, 0x7F800000, 0x00000001, 0x7FC00001, 0xFFA5A5A5, 0x7F800001],
        8: [1 << 63, 0x7FF0000000000000, 1, 0x7FF8DEADBEEF0001, 0xFFF0000000000001],
    }[dt.itemsize]
    if dtype == "bfloat16":
        patterns = [0x8000, 0x7F80, 0xFF80, 0x0001, 0x7FC1, 0xFFA5, 0x7F81]
    return np.array(patterns, dtype=f"<u{dt.itemsize}").view(dt)


def roundtrip(tensors: dict[str, np.ndarray], metadata: dict[str, str] | None = None):
    buf = io.BytesIO()
    write_safetensors(buf, tensors, metadata)
    buf.seek(0)
    return read_safetensors(buf)


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("dtype", DTYPE_NAMES)
def test_round_trip_every_dtype_is_bit_exact(dtype: str, shape: tuple[int, ...]) -> None:
    a = sample(dtype, shape)
    out, meta = roundtrip({"t": a})
    assert list(out) == ["t"]
    assert bits(out["t"]) == bits(a)
    assert meta == {}
    assert out["t"].flags.writeable


@pytest.mark.parametrize("dtype", FLOATS)
def test_nan_payloads_and_negative_zero_survive(dtype: str) -> None:
    a = special_floats(dtype)
    out, _ = roundtrip({"special": a})
    assert bits(out["special"]) == bits(a)


def test_big_endian_and_strided_inputs_are_stored_little_endian_and_contiguous() -> None:
    be = special_floats("float32").astype(">f4")  # a byteswapping copy preserves the bits
    strided = np.arange(12.0).reshape(3, 4).T
    out, _ = roundtrip({"be": be, "strided": strided})
    assert out["be"].dtype == np.dtype("<f4")
    assert bits(out["be"]) == bits(special_floats("float32"))
    np.testing.assert_array_equal(out["strided"], strided)


def test_header_entries_use_absolute_offsets_and_ranges_read_slices(tmp_path: Path) -> None:
    a, b = np.arange(10, dtype="<i4"), np.arange(6, dtype="<f8").reshape(2, 3)
    path = tmp_path / "x.safetensors"
    write_safetensors(path, {"a": a, "b": b}, {"k": "v"})
    with path.open("rb") as f:
        header = read_header(f, path=str(path))
        assert header.metadata == {"k": "v"}
        # the reference order: 8-byte dtypes first, so "b" starts the data section
        assert header.tensors["b"].start == header.data_start
        assert header.tensors["a"].start == header.tensors["b"].stop
        assert header.tensors["a"].stop == path.stat().st_size
        assert (header.tensors["a"].dtype, header.tensors["a"].shape) == ("int32", (10,))
        np.testing.assert_array_equal(read_tensor(f, header.tensors["a"]), a)
        assert read_tensor_range(f, header.tensors["a"], 8, 20) == a[2:5].tobytes()
        with pytest.raises(InvalidInputError, match="outside tensor 'a'"):
            read_tensor_range(f, header.tensors["a"], 36, 44)


@pytest.mark.parametrize("dtype", DTYPE_NAMES)
def test_bytes_identical_to_reference_writer(dtype: str) -> None:
    tensors = {"w": sample(dtype, (3, 5)), "b": sample(dtype, (5,)), "s": sample(dtype, ())}
    tensors["i"] = sample("int64", (4,))
    tensors["z"] = sample("uint8", (0,))
    for metadata in (None, {"num_examples": "32"}):
        buf = io.BytesIO()
        write_safetensors(buf, tensors, metadata)
        assert buf.getvalue() == save(tensors, metadata=metadata)


def test_all_dtypes_in_one_file_laid_out_like_the_reference() -> None:
    # Names sort against the dtype order, so only the dtype rank can explain the layout.
    tensors = {f"{99 - i:02d}": sample(d, (3,), seed=i) for i, d in enumerate(DTYPE_NAMES)}
    tensors.update({f"x{i}": sample(d, (2,), seed=i) for i, d in enumerate(DTYPE_NAMES)})
    buf = io.BytesIO()
    write_safetensors(buf, tensors)
    assert buf.getvalue() == save(tensors)


@pytest.mark.parametrize("dtype", [d for d in DTYPE_NAMES if d != "bfloat16"])
def test_reference_reads_ours_and_we_read_theirs(tmp_path: Path, dtype: str) -> None:
    tensors = {f"t{i}": sample(dtype, s, seed=i) for i, s in enumerate(SHAPES)}
    ours, theirs = tmp_path / "ours.safetensors", tmp_path / "theirs.safetensors"
    write_safetensors(ours, tensors, {"a": "1", "é": "ü"})
    save_file(tensors, str(theirs), metadata={"a": "1", "é": "ü"})
    by_reference = load_file(str(ours))
    by_us, meta = read_safetensors(theirs)
    with safe_open(str(ours), framework="np") as f:
        assert f.metadata() == {"a": "1", "é": "ü"}
    assert meta == {"a": "1", "é": "ü"}
    for name, a in tensors.items():
        assert bits(by_reference[name]) == bits(a)
        assert bits(by_us[name]) == bits(a)


def test_bfloat16_with_reference_torch(tmp_path: Path) -> None:
    torch = pytest.importorskip("torch")
    from safetensors.torch import load_file as torch_load
    from safetensors.torch import save_file as torch_save

    a = np.concatenate([special_floats("bfloat16"), sample("bfloat16", (9,))])
    ours, theirs = tmp_path / "ours.safetensors", tmp_path / "theirs.safetensors"
    write_safetensors(ours, {"g": a, "s": a[:1].reshape(())})
    t = torch_load(str(ours))["g"]
    assert t.dtype == torch.bfloat16
    assert t.view(torch.int16).numpy().tobytes() == a.tobytes()
    assert torch_load(str(ours))["s"].shape == ()
    torch_save({"g": torch.from_numpy(a.view(np.int16).copy()).view(torch.bfloat16)}, str(theirs))
    assert bits(read_safetensors(theirs)[0]["g"]) == bits(a)


def test_metadata_round_trip_sorted_and_validated() -> None:
    meta = {"z": "last", "num_examples": "128", "json": json.dumps({"a": [1, 2]}), "e": ""}
    buf = io.BytesIO()
    write_safetensors(buf, {"x": np.zeros(2, "<f4")}, meta)
    assert read_safetensors(io.BytesIO(buf.getvalue()))[1] == meta
    raw = buf.getvalue()
    header = json.loads(raw[8 : 8 + int.from_bytes(raw[:8], "little")])
    assert list(header["__metadata__"]) == sorted(meta)
    with pytest.raises(InvalidInputError, match="str to str"):
        write_safetensors(io.BytesIO(), {}, {"n": 3})  # type: ignore[dict-item]


@pytest.mark.parametrize(
    ("tensors", "match"),
    [
        ({"__metadata__": np.zeros(1)}, "not allowed"),
        ({"c": np.zeros(2, np.complex64)}, "tensor 'c'.*unsupported dtype"),
        ({"o": np.array(["x"], dtype=object)}, "tensor 'o'"),
        ({"a\nb": np.zeros(1)}, "control characters"),
        ({"": np.zeros(1)}, "empty"),
    ],
)
def test_write_rejects_what_safetensors_cannot_hold(tensors: dict, match: str) -> None:
    with pytest.raises(InvalidInputError, match=match):
        write_safetensors(io.BytesIO(), tensors)


def test_path_writes_are_atomic(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = tmp_path / "d.safetensors"
    write_safetensors(path, {"a": np.ones(4, "<f4")})
    before = path.read_bytes()

    def half_write(f, prepared, meta):  # type: ignore[no-untyped-def]
        f.write(b"partial")
        raise OSError("disk full")

    monkeypatch.setattr(st_mod, "_write", half_write)
    with pytest.raises(OSError, match="disk full"):
        write_safetensors(path, {"a": np.zeros(4, "<f4")})
    assert path.read_bytes() == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["d.safetensors"]


def test_fsspec_urls() -> None:
    tensors = {"a": sample("bfloat16", (4, 4)), "b": sample("bool", (3,))}
    write_safetensors("memory://gp-test/x.safetensors", tensors, {"m": "1"})
    out, meta = read_safetensors("memory://gp-test/x.safetensors")
    assert meta == {"m": "1"}
    assert {k: bits(v) for k, v in out.items()} == {k: bits(v) for k, v in tensors.items()}


dtype_names = st.sampled_from(DTYPE_NAMES)


@st.composite
def tensor_dicts(draw: st.DrawFn) -> dict[str, np.ndarray]:
    # Any text a tensor name may be (no control characters, see gradpipe.formats.spec).
    text = st.text(st.characters(blacklist_categories=("Cc", "Cs")), min_size=1, max_size=8)
    names = draw(st.lists(text, max_size=5, unique=True))
    out = {}
    for name in names:
        if name == "__metadata__":
            continue
        dtype = parse_dtype(draw(dtype_names))
        shape = draw(hnp.array_shapes(min_dims=0, max_dims=3, min_side=0, max_side=4))
        raw_dtype = np.bool_ if dtype.kind == "b" else np.dtype(f"<u{dtype.itemsize}")
        raw = draw(hnp.arrays(raw_dtype, shape))
        out[name] = raw if dtype.kind == "b" else raw.view(dtype)
    return out


@settings(max_examples=60, deadline=None)
@given(tensors=tensor_dicts(), metadata=st.dictionaries(st.text(), st.text(), max_size=3))
def test_hypothesis_round_trip(tensors: dict[str, np.ndarray], metadata: dict[str, str]) -> None:
    out, meta = roundtrip(tensors, metadata)
    assert meta == metadata
    assert {k: bits(v) for k, v in out.items()} == {k: bits(v) for k, v in tensors.items()}
    if not metadata:
        buf = io.BytesIO()
        write_safetensors(buf, tensors)
        assert buf.getvalue() == save(tensors)


# ---- malformed files -------------------------------------------------------


def raw_file(header: object, data: bytes = b"", *, length: int | None = None) -> bytes:
    body = header if isinstance(header, bytes) else json.dumps(header).encode()
    return (len(body) if length is None else length).to_bytes(8, "little") + body + data


GOOD = {"a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}}
TWO = {
    "a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]},
    "b": {"dtype": "I8", "shape": [4], "data_offsets": [8, 12]},
}


def entry(**kw: object) -> dict[str, object]:
    return {"a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8], **kw}}


MALFORMED = {
    "empty": (b"", "shorter than the 8-byte"),
    "short length field": (b"\x10\x00\x00", "shorter than the 8-byte"),
    "header longer than file": (raw_file(GOOD, b"\0" * 8, length=10_000), "does not fit"),
    "header length absurd": (raw_file(GOOD, b"\0" * 8, length=2**63), "does not fit"),
    "truncated data": (raw_file(GOOD, b"\0" * 5), "ends at byte"),
    "trailing bytes": (raw_file(GOOD, b"\0" * 9), "ends at byte"),
    "bad json": (raw_file(b'{"a": {', b""), "not valid JSON"),
    "not utf-8": (raw_file(b'{"\xff": 1}'), "not valid JSON"),
    "json array": (raw_file([1, 2]), "not a JSON object"),
    "duplicate key": (raw_file(b'{"a":{},"a":{}}'), "duplicate key 'a'"),
    "missing key": (raw_file({"a": {"dtype": "F32", "shape": [2]}}, b"\0" * 8), "tensor 'a'"),
    "shape not ints": (raw_file(entry(shape=[2.0]), b"\0" * 8), "tensor 'a' has shape"),
    "shape bool": (raw_file(entry(shape=[True, 2]), b"\0" * 8), "tensor 'a' has shape"),
    "negative offset": (raw_file(entry(data_offsets=[-8, 0]), b"\0" * 8), "data_offsets"),
    "size mismatch": (raw_file(entry(shape=[3]), b"\0" * 8), "needs 12 bytes"),
    "reversed offsets": (raw_file(entry(shape=[0], data_offsets=[8, 0]), b"\0" * 8), "needs 0"),
    "overlap": (
        raw_file({**TWO, "b": {**TWO["b"], "data_offsets": [4, 8]}}, b"\0" * 8),
        "tensor 'b' at offset .* overlaps",
    ),
    "gap": (raw_file({**TWO, "b": {**TWO["b"], "data_offsets": [9, 13]}}, b"\0" * 13), "gap"),
    "metadata value": (raw_file({**GOOD, "__metadata__": {"n": 3}}, b"\0" * 8), "__metadata__"),
    "metadata list": (raw_file({**GOOD, "__metadata__": ["x"]}, b"\0" * 8), "__metadata__"),
}


@pytest.mark.parametrize("case", sorted(MALFORMED))
def test_malformed_files_raise_invalid_input_naming_the_path(tmp_path: Path, case: str) -> None:
    data, match = MALFORMED[case]
    path = tmp_path / "bad.safetensors"
    path.write_bytes(data)
    with pytest.raises(InvalidInputError, match=match) as info:
        read_safetensors(path)
    assert str(path) in str(info.value)


def test_unknown_dtype_is_unsupported_format(tmp_path: Path) -> None:
    path = tmp_path / "f8.safetensors"
    path.write_bytes(raw_file(entry(dtype="F8_E4M3"), b"\0" * 8))
    with pytest.raises(UnsupportedFormatError, match="tensor 'a' has dtype 'F8_E4M3'") as info:
        read_safetensors(path)
    assert str(path) in str(info.value)


def test_bool_bytes_other_than_0_1_are_rejected() -> None:
    data = raw_file({"m": {"dtype": "BOOL", "shape": [3], "data_offsets": [0, 3]}}, b"\0\1\2")
    with pytest.raises(InvalidInputError, match=r"tensor 'm'.*bool.*other than 0 and 1"):
        read_safetensors(io.BytesIO(data))


def test_file_shrinking_after_header_read_is_detected() -> None:
    good = io.BytesIO()
    write_safetensors(good, {"a": np.arange(4, dtype="<f4")})
    f = io.BytesIO(good.getvalue())
    header = read_header(f, path="x")
    f.truncate(len(good.getvalue()) - 2)
    with pytest.raises(InvalidInputError, match="file ends inside 'a'"):
        read_tensor(f, header.tensors["a"], path="x")


def test_bfloat16_dtype_is_ml_dtypes() -> None:
    out, _ = roundtrip({"b": np.ones(2, ml_dtypes.bfloat16)})
    assert out["b"].dtype == np.dtype(ml_dtypes.bfloat16)
