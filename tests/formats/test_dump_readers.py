"""Tests of the dump readers: headers, ranged bytes and whole reads, for every format."""

from __future__ import annotations

import io
import json
import pickle
import sys
import zipfile
from pathlib import Path

import fsspec
import ml_dtypes
import numpy as np
import pytest

from gradpipe.core.dtypes import DTYPE_NAMES, parse_dtype
from gradpipe.errors import InvalidInputError
from gradpipe.formats import (
    DUMP_FORMATS,
    DumpHeader,
    TensorSpec,
    dump_format,
    read_byte_range,
    read_dump_header,
    read_dump_tensors,
    write_safetensors,
)

NUMPY_DTYPES = [d for d in DTYPE_NAMES if d != "bfloat16"]
SHAPES = [(), (0,), (5,), (3, 4), (2, 3, 2)]
LOCAL = fsspec.filesystem("file")


def bits(a: np.ndarray) -> tuple[str, tuple[int, ...], bytes]:
    """Everything that makes two arrays bit-identical (values in C order)."""
    return str(a.dtype), a.shape, np.ascontiguousarray(a).reshape(-1).view(np.uint8).tobytes()


def canonical(a: np.ndarray) -> np.ndarray:
    """``a`` as gradpipe stores it: C order, little-endian, same bits."""
    if a.dtype.byteorder == ">":
        a = a.byteswap().view(a.dtype.newbyteorder("<"))
    return a.copy(order="C")  # not ascontiguousarray: it makes 0-d arrays 1-d


def sample(dtype: str, shape: tuple[int, ...], seed: int = 0) -> np.ndarray:
    """Arbitrary bit patterns (NaN payloads included) of the given dtype and shape."""
    dt = parse_dtype(dtype)
    rng = np.random.default_rng(seed)
    if dtype == "bool":
        return rng.integers(0, 2, shape).astype(bool)
    raw = rng.integers(0, 256, int(np.prod(shape)) * dt.itemsize, dtype=np.uint8)
    return raw.view(dt).reshape(shape)


def check_ranged(fs: fsspec.AbstractFileSystem, header: DumpHeader, expected: dict) -> None:
    """Each spec's byte range, viewed as its dtype, is the expected array."""
    assert header.ranged
    assert [t.name for t in header.tensors] == list(expected)
    for spec in header.tensors:
        assert spec.offset is not None
        raw = read_byte_range(fs, header.path, spec.offset, spec.offset + spec.nbytes)
        assert raw.dtype == np.uint8
        assert raw.size == spec.nbytes
        got = raw.view(parse_dtype(spec.dtype)).reshape(spec.shape)
        assert bits(got) == bits(canonical(expected[spec.name])), spec.name


def check_whole(fs: fsspec.AbstractFileSystem, header: DumpHeader, expected: dict) -> None:
    """read_dump_tensors returns canonical, C-contiguous, bit-exact arrays."""
    got = read_dump_tensors(fs, header.path, header)
    assert list(got) == [t.name for t in header.tensors]
    assert set(got) == set(expected)
    for name, arr in got.items():
        assert arr.flags.c_contiguous
        assert arr.dtype.byteorder in "<|="
        assert bits(arr) == bits(canonical(expected[name])), name


def read_everything(path: str) -> dict[str, np.ndarray]:
    """Header then whole tensors: some damage shows only when the data is read."""
    return read_dump_tensors(LOCAL, path, read_dump_header(LOCAL, path))


class Evil:
    """Pickles to a call that creates a marker file when unpickled."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple[object, tuple[str, str]]:
        return (open, (str(self.marker), "w"))


# -- formats by extension ---------------------------------------------------------------


@pytest.mark.parametrize(
    ("path", "fmt"),
    [
        ("a/peer0.safetensors", "safetensors"),
        ("s3://b/step=1/dense1.weight.npy", "npy"),
        ("x.NPZ", "npz"),
        ("ckpt.pt", "torch"),
        ("ckpt.pth", "torch"),
    ],
)
def test_dump_format(path: str, fmt: str) -> None:
    assert dump_format(path) == fmt


@pytest.mark.parametrize("path", ["peer0.safetensors.json", "peer0.bin", "noext", "dir.npy/"])
def test_dump_format_rejects_unknown(path: str) -> None:
    with pytest.raises(InvalidInputError, match=r"\.safetensors, \.npy, \.npz, \.pt, \.pth") as e:
        dump_format(path)
    assert path in str(e.value)
    assert sorted(DUMP_FORMATS) == [".npy", ".npz", ".pt", ".pth", ".safetensors"]


def test_specs_are_validated_and_pickle(tmp_path: Path) -> None:
    with pytest.raises(InvalidInputError, match="dtype"):
        TensorSpec("w", "complex64", (2,), 0)
    with pytest.raises(InvalidInputError, match="shape"):
        TensorSpec("w", "float32", (-1,), 0)
    spec = TensorSpec("w", "bfloat16", (3, 4), 128)
    assert spec.nbytes == 24
    header = DumpHeader("p.npy", "npy", (spec,), {"a": "1"}, 152)
    assert pickle.loads(pickle.dumps(header)) == header
    assert not DumpHeader("p", "torch", (TensorSpec("w", "int8", (1,), None),), {}, 9).ranged


# -- safetensors ------------------------------------------------------------------------


def test_safetensors_all_dtypes(tmp_path: Path) -> None:
    arrays = {f"t.{d}.{i}": sample(d, s, i) for d in DTYPE_NAMES for i, s in enumerate(SHAPES)}
    path = str(tmp_path / "peer0.safetensors")
    write_safetensors(path, arrays, {"num_examples": "12"})
    header = read_dump_header(LOCAL, path)
    assert header.format == "safetensors"
    assert header.metadata == {"num_examples": "12"}
    assert header.size == Path(path).stat().st_size
    offsets = [t.offset for t in header.tensors]
    assert offsets == sorted(offsets)  # file order
    assert {t.name: (t.dtype, t.shape) for t in header.tensors} == {
        k: (d, s) for d in DTYPE_NAMES for i, s in enumerate(SHAPES) for k in [f"t.{d}.{i}"]
    }
    order = [t.name for t in header.tensors]
    check_ranged(LOCAL, header, {n: arrays[n] for n in order})
    check_whole(LOCAL, header, arrays)


def test_read_selected_tensors_in_asked_order(tmp_path: Path) -> None:
    arrays = {"a": sample("float32", (3,)), "b": sample("int64", (2,)), "c": sample("uint8", ())}
    path = str(tmp_path / "p.safetensors")
    write_safetensors(path, arrays)
    header = read_dump_header(LOCAL, path)
    got = read_dump_tensors(LOCAL, path, header, ["c", "a"])
    assert list(got) == ["c", "a"]
    assert bits(got["a"]) == bits(arrays["a"])
    with pytest.raises(InvalidInputError, match=r"no tensor named 'zz'.*'a'") as e:
        read_dump_tensors(LOCAL, path, header, ["zz"])
    assert path in str(e.value)


def test_changed_file_is_detected(tmp_path: Path) -> None:
    path = str(tmp_path / "p.npz")
    np.savez(path, w=np.zeros(3, np.float32))
    header = read_dump_header(LOCAL, path)
    np.savez(path, w=np.zeros(4, np.float32))
    with pytest.raises(InvalidInputError, match="no longer matches"):
        read_dump_tensors(LOCAL, path, header)


# -- npy --------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", NUMPY_DTYPES)
@pytest.mark.parametrize("shape", SHAPES)
def test_npy_all_dtypes(tmp_path: Path, dtype: str, shape: tuple[int, ...]) -> None:
    arr = sample(dtype, shape)
    path = str(tmp_path / "dense1.weight.npy")
    np.save(path, arr)
    header = read_dump_header(LOCAL, path)
    assert header.format == "npy"
    assert header.tensors == (TensorSpec("dense1.weight", dtype, shape, header.tensors[0].offset),)
    assert header.metadata == {}
    check_ranged(LOCAL, header, {"dense1.weight": arr})
    check_whole(LOCAL, header, {"dense1.weight": arr})


@pytest.mark.parametrize(
    "arr",
    [
        np.asfortranarray(sample("float32", (3, 4))),
        sample("float64", (3, 4)).astype(">f8"),
        np.asfortranarray(sample("int32", (2, 3, 4)).astype(">i4")),
        sample("uint16", (5,)).astype(">u2"),
    ],
    ids=["fortran", "big-endian", "fortran-big-endian", "big-endian-1d"],
)
def test_npy_not_ranged_is_read_whole(tmp_path: Path, arr: np.ndarray) -> None:
    path = str(tmp_path / "w.npy")
    np.save(path, arr)
    header = read_dump_header(LOCAL, path)
    (spec,) = header.tensors
    assert spec.offset is None
    assert not header.ranged
    assert spec.dtype == arr.dtype.newbyteorder("<").name
    got = read_dump_tensors(LOCAL, path, header)["w"]
    assert got.dtype.byteorder in "<="
    assert got.flags.c_contiguous
    assert bits(got) == bits(canonical(arr))
    np.testing.assert_array_equal(got, arr)


def test_npy_single_byte_big_endian_spelling_is_ranged(tmp_path: Path) -> None:
    arr = sample("int8", (4, 3))
    path = str(tmp_path / "b.npy")
    np.save(path, arr)
    check_ranged(LOCAL, read_dump_header(LOCAL, path), {"b": arr})


def test_npy_bfloat16_is_refused_clearly(tmp_path: Path) -> None:
    """np.save writes bfloat16 as '<V2': the dtype is lost, so gradpipe refuses to guess."""
    path = str(tmp_path / "w.npy")
    np.save(path, np.arange(4, dtype=ml_dtypes.bfloat16))
    with pytest.raises(InvalidInputError, match=r"'<V2'.*bfloat16.*safetensors") as e:
        read_dump_header(LOCAL, path)
    assert path in str(e.value)


@pytest.mark.parametrize(
    ("arr", "descr"),
    [
        (np.zeros(3, np.complex64), "<c8"),
        (np.zeros(3, "datetime64[s]"), "<M8[s]"),
        (np.array(["ab", "c"]), "<U2"),
        (np.zeros(3, [("a", "<f4"), ("b", "<i2")]), "('a', '<f4')"),
        (np.zeros(2, "V3"), "|V3"),
        (np.zeros(2, ">c8"), "'>c8'"),
    ],
    ids=["complex", "datetime", "str", "structured", "void", "complex-be"],
)
def test_npy_unsupported_dtypes(tmp_path: Path, arr: np.ndarray, descr: str) -> None:
    path = str(tmp_path / "w.npy")
    np.save(path, arr)
    with pytest.raises(InvalidInputError) as e:
        read_dump_header(LOCAL, path)
    assert path in str(e.value)
    assert descr in str(e.value)


def test_pickled_npy_is_refused_without_unpickling(tmp_path: Path) -> None:
    marker = tmp_path / "pwned"
    path = str(tmp_path / "w.npy")
    np.save(path, np.array([Evil(marker), 1], dtype=object), allow_pickle=True)
    with pytest.raises(InvalidInputError, match=r"Python objects.*never unpickles") as e:
        read_dump_header(LOCAL, path)
    assert path in str(e.value)
    assert not marker.exists()


def _npy_bytes(arr: np.ndarray) -> bytes:
    buf = io.BytesIO()
    np.save(buf, arr)
    return buf.getvalue()


GOOD_NPY = _npy_bytes(np.arange(10, dtype=np.float32))


@pytest.mark.parametrize(
    ("data", "match"),
    [
        (b"", "not a valid .npy"),
        (b"\x93NUMPZ\x01\x00" + GOOD_NPY[8:], "not a valid .npy"),
        (GOOD_NPY[:40], "not a valid .npy"),
        (GOOD_NPY[:-1], "truncated"),
        (GOOD_NPY + b"\0", "padded"),
        (GOOD_NPY.replace(b"(10,)", b"(-1,)"), "negative shape"),
        (b"\x93NUMPY\x09\x00" + GOOD_NPY[8:], "not a valid .npy"),
        (_npy_bytes(np.array([0, 1], np.uint8)).replace(b"|u1", b"|b1")[:-1] + b"\x02", "bool"),
        (Path(__file__).read_bytes(), "not a valid .npy"),
    ],
    ids=["empty", "magic", "cut-header", "cut-data", "padded", "neg", "version", "bool", "text"],
)
def test_bad_npy(tmp_path: Path, data: bytes, match: str) -> None:
    path = str(tmp_path / "w.npy")
    Path(path).write_bytes(data)
    with pytest.raises(InvalidInputError, match=match) as e:
        read_everything(path)
    assert path in str(e.value)


# -- npz --------------------------------------------------------------------------------


def npz_arrays() -> dict[str, np.ndarray]:
    shapes = SHAPES * 3
    return {f"layer{i}.{d}": sample(d, shapes[i], i) for i, d in enumerate(NUMPY_DTYPES)}


def test_npz_stored_is_ranged(tmp_path: Path) -> None:
    arrays = npz_arrays()
    path = str(tmp_path / "peer1.npz")
    np.savez(path, **arrays)
    header = read_dump_header(LOCAL, path)
    assert header.format == "npz"
    assert [(t.name, t.dtype, t.shape) for t in header.tensors] == [
        (k, str(a.dtype) if a.dtype != bool else "bool", a.shape) for k, a in arrays.items()
    ]
    check_ranged(LOCAL, header, arrays)
    check_whole(LOCAL, header, arrays)


def test_npz_offsets_come_from_the_local_header(tmp_path: Path) -> None:
    """A local extra field longer than the central directory's must not shift offsets."""
    arr = sample("float32", (64,))
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w") as zf:
        info = zipfile.ZipInfo("w.npy")
        info.extra = b"\xfe\xca\x04\x00abcd"  # an unknown 8-byte extra block
        zf.writestr(info, _npy_bytes(arr))
    data = bytearray(buf.getvalue())
    # Drop the extra block from the central directory entry only.
    central = data.index(b"PK\x01\x02")
    assert data[central + 30 : central + 32] == b"\x08\x00"
    data[central + 30 : central + 32] = b"\x00\x00"
    del data[central + 46 + 5 : central + 46 + 5 + 8]
    eocd = data.index(b"PK\x05\x06")
    size = int.from_bytes(data[eocd + 12 : eocd + 16], "little")
    data[eocd + 12 : eocd + 16] = (size - 8).to_bytes(4, "little")
    path = tmp_path / "x.npz"
    path.write_bytes(bytes(data))
    with zipfile.ZipFile(path) as zf:
        assert zf.getinfo("w.npy").extra == b""
    header = read_dump_header(LOCAL, str(path))
    check_ranged(LOCAL, header, {"w": arr})
    check_whole(LOCAL, header, {"w": arr})


def test_npz_mixed_members(tmp_path: Path) -> None:
    arrays = {
        "c": sample("float32", (3, 4)),
        "f": np.asfortranarray(sample("float32", (3, 4), 1)),
        "be": sample("int64", (5,)).astype(">i8"),
    }
    path = str(tmp_path / "m.npz")
    np.savez(path, **arrays)
    header = read_dump_header(LOCAL, path)
    offsets = {t.name: t.offset for t in header.tensors}
    assert offsets["c"] is not None
    assert offsets["f"] is None
    assert offsets["be"] is None
    assert not header.ranged
    check_whole(LOCAL, header, arrays)


def test_npz_compressed_is_read_whole(tmp_path: Path) -> None:
    arrays = npz_arrays()
    path = str(tmp_path / "peer1.npz")
    np.savez_compressed(path, **arrays)
    header = read_dump_header(LOCAL, path)
    assert all(t.offset is None for t in header.tensors)
    assert not header.ranged
    check_whole(LOCAL, header, arrays)


def _zip(members: dict[str, bytes], compression: int = zipfile.ZIP_STORED) -> bytes:
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w", compression=compression) as zf:
        for name, data in members.items():
            zf.writestr(name, data)
    return buf.getvalue()


def _corrupt_crc() -> bytes:
    data = bytearray(_zip({"w.npy": _npy_bytes(np.zeros(1000, np.float32))}, zipfile.ZIP_DEFLATED))
    data[data.index(b"PK\x01\x02") - 20] ^= 0xFF  # flip a bit of the deflated stream
    return bytes(data)


GOOD_NPZ = _zip({"a.npy": GOOD_NPY, "b.npy": GOOD_NPY})


@pytest.mark.parametrize(
    ("data", "match"),
    [
        (b"", "not a readable zip"),
        (GOOD_NPY, "not a readable zip"),
        (GOOD_NPZ[:-30], "not a readable zip"),
        (GOOD_NPZ[:60] + GOOD_NPZ[200:], "npz"),
        (_zip({"readme.txt": b"hello"}), "'readme.txt' is not an .npy"),
        (_zip({"w.npy": b"not an array"}), "not a valid .npy"),
        (_zip({"w.npy": GOOD_NPY[:-4]}), "describes"),
        (_zip({"w.npy": GOOD_NPY[:-4]}, zipfile.ZIP_DEFLATED), "describes"),
        (_zip({"w.npy": _npy_bytes(np.zeros(2, np.complex128))}), "'<c16'"),
        (_corrupt_crc(), "damaged"),
    ],
    ids=["empty", "npy", "cut", "hole", "txt", "garbage", "short", "short-z", "complex", "crc"],
)
def test_bad_npz(tmp_path: Path, data: bytes, match: str) -> None:
    path = str(tmp_path / "peer.npz")
    Path(path).write_bytes(data)
    with pytest.raises(InvalidInputError, match=match) as e:
        read_everything(path)
    assert path in str(e.value)


def test_pickled_npz_member_is_refused(tmp_path: Path) -> None:
    marker = tmp_path / "pwned"
    path = str(tmp_path / "p.npz")
    np.savez(path, ok=np.zeros(2), evil=np.array([Evil(marker)], dtype=object))
    with pytest.raises(InvalidInputError, match="never unpickles") as e:
        read_dump_header(LOCAL, path)
    assert path in str(e.value)
    assert "'evil.npy'" in str(e.value)
    assert not marker.exists()


# -- torch ------------------------------------------------------------------------------


def test_torch_nested_checkpoint(tmp_path: Path) -> None:
    torch = pytest.importorskip("torch")
    gen = torch.Generator().manual_seed(0)
    model = {
        "dense1.weight": torch.randn(4, 3, generator=gen),
        "dense1.bias": torch.randn(4, generator=gen).to(torch.bfloat16),
        "emb": torch.randn(5, 2, generator=gen).to(torch.float16),
        "mask": torch.tensor([True, False]),
        "counts": torch.arange(6, dtype=torch.int64).reshape(2, 3),
        "u16": torch.tensor([1, 65535], dtype=torch.uint16),
    }
    optim = {
        "state": {0: {"step": torch.tensor(7.0), "exp_avg": torch.randn(4, 3, generator=gen)}},
        "param_groups": [{"lr": 0.001, "betas": (0.9, 0.999), "params": [0], "foreach": None}],
    }
    ckpt = {"model": model, "optim": optim, "step": 123_456_789_012, "tag": "r1", "ok": True}
    path = str(tmp_path / "ckpt.pt")
    torch.save(ckpt, path)
    header = read_dump_header(LOCAL, path)
    assert header.format == "torch"
    assert not header.ranged
    names = [*(f"model.{k}" for k in model), "optim.state.0.step", "optim.state.0.exp_avg"]
    assert [t.name for t in header.tensors] == names
    specs = {t.name: t for t in header.tensors}
    assert specs["model.dense1.bias"].dtype == "bfloat16"
    assert specs["model.counts"] == TensorSpec("model.counts", "int64", (2, 3), None)
    assert specs["optim.state.0.step"].shape == ()
    assert header.metadata == {
        "optim.param_groups.0.lr": "0.001",
        "optim.param_groups.0.betas.0": "0.9",
        "optim.param_groups.0.betas.1": "0.999",
        "optim.param_groups.0.params.0": "0",
        "optim.param_groups.0.foreach": "None",
        "step": "123456789012",
        "tag": "r1",
        "ok": "True",
    }

    def expected(t: torch.Tensor) -> np.ndarray:
        if t.dtype == torch.bfloat16:
            return t.view(torch.int16).numpy().view(ml_dtypes.bfloat16)
        return t.numpy()

    flat = {f"model.{k}": expected(v) for k, v in model.items()}
    flat["optim.state.0.step"] = expected(optim["state"][0]["step"])
    flat["optim.state.0.exp_avg"] = expected(optim["state"][0]["exp_avg"])
    check_whole(LOCAL, header, flat)
    got = read_dump_tensors(LOCAL, path, header, ["model.dense1.bias"])["model.dense1.bias"]
    assert got.dtype == np.dtype(ml_dtypes.bfloat16)


def test_torch_shared_storage_and_views(tmp_path: Path) -> None:
    torch = pytest.importorskip("torch")
    base = torch.arange(24, dtype=torch.float32).reshape(4, 6)
    half = torch.arange(12, dtype=torch.float32).to(torch.bfloat16).reshape(3, 4)
    views = {
        "base": base,
        "t": base.t(),
        "row": base[2],
        "col": base[:, 3],
        "step": base[::2, 1::2],
    }
    views |= {"half_t": half.t(), "half_col": half[:, 1]}
    path = str(tmp_path / "views.pth")
    torch.save(views, path)
    header = read_dump_header(LOCAL, path)
    got = read_dump_tensors(LOCAL, path, header)
    for name, t in views.items():
        assert got[name].flags.c_contiguous
        assert got[name].shape == tuple(t.shape)
        want = t.float().numpy() if t.dtype == torch.bfloat16 else t.numpy()
        np.testing.assert_array_equal(got[name].astype(np.float32), want, err_msg=name)


def test_torch_single_tensor_is_named_by_stem(tmp_path: Path) -> None:
    torch = pytest.importorskip("torch")
    path = str(tmp_path / "dense1.weight.pt")
    torch.save(torch.ones(2, 2, dtype=torch.float64), path)
    header = read_dump_header(LOCAL, path)
    assert header.tensors == (TensorSpec("dense1.weight", "float64", (2, 2), None),)


def test_malicious_torch_file_does_not_run(tmp_path: Path) -> None:
    torch = pytest.importorskip("torch")
    marker = tmp_path / "pwned"
    path = str(tmp_path / "evil.pt")
    torch.save({"w": torch.ones(2), "payload": Evil(marker)}, path)
    with pytest.raises(
        InvalidInputError, match=r"refused for safety.*torch\.save.*safetensors"
    ) as e:
        read_dump_header(LOCAL, path)
    assert path in str(e.value)
    assert not marker.exists()
    # A bare pickle (not torch.save's zip) with the same payload is refused too.
    Path(path).write_bytes(pickle.dumps({"payload": Evil(marker)}))
    with pytest.raises(InvalidInputError, match=r"unsafe unpickling|refused for safety"):
        read_dump_header(LOCAL, path)
    assert not marker.exists()


def _torch_bytes(obj: object) -> bytes:
    torch = pytest.importorskip("torch")
    buf = io.BytesIO()
    torch.save(obj, buf)
    return buf.getvalue()


@pytest.mark.parametrize(
    ("make", "match"),
    [
        (lambda t: {"c": t.zeros(2, dtype=t.complex64)}, r"'c' has dtype torch\.complex64"),
        (lambda t: {"m": {"f8": t.zeros(2, dtype=t.float8_e4m3fn)}}, r"'m\.f8'.*float8"),
        (lambda t: {"sp": t.eye(2).to_sparse()}, "'sp'.*dense"),
        (lambda t: {"dt": t.float32}, r"'dt' holds a dtype"),
        (lambda t: {"s": {1, 2}}, "'s' holds a set"),
        (lambda t: {"a.b": t.ones(1), "a": {"b": t.ones(1)}}, "same name 'a.b'"),
        (lambda t: {(1, 2): t.ones(1)}, "key \\(1, 2\\)"),
        (lambda t: 3, "holds a int"),
    ],
    ids=["complex", "float8", "sparse", "dtype", "set", "collision", "tuple-key", "scalar"],
)
def test_bad_torch_contents(tmp_path: Path, make: object, match: str) -> None:
    torch = pytest.importorskip("torch")
    path = tmp_path / "bad.pt"
    path.write_bytes(_torch_bytes(make(torch)))  # type: ignore[operator]
    with pytest.raises(InvalidInputError, match=match) as e:
        read_dump_header(LOCAL, str(path))
    assert str(path) in str(e.value)


@pytest.mark.parametrize("cut", [0, 10, 100, -30])
def test_damaged_torch_file(tmp_path: Path, cut: int) -> None:
    torch = pytest.importorskip("torch")
    data = _torch_bytes({"w": torch.ones(100)})
    path = tmp_path / "bad.pt"
    path.write_bytes(data[:cut])
    with pytest.raises(InvalidInputError, match="not a readable PyTorch file") as e:
        read_dump_header(LOCAL, str(path))
    assert str(path) in str(e.value)


def test_torch_missing(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = tmp_path / "w.pt"
    path.write_bytes(b"PK")
    monkeypatch.setitem(sys.modules, "torch", None)
    with pytest.raises(InvalidInputError, match=r"pip install 'gradpipe\[torch\]'"):
        read_dump_header(LOCAL, str(path))


@pytest.mark.parametrize(
    ("name", "source"),
    [("x.safetensors", "npz"), ("x.npy", "npz"), ("x.npz", "st"), ("x.pt", "st")],
)
def test_file_not_what_its_extension_says(tmp_path: Path, name: str, source: str) -> None:
    buf = io.BytesIO()
    if source == "npz":
        np.savez(buf, w=np.zeros(3))
    else:
        write_safetensors(buf, {"w": np.zeros(3)})
    path = tmp_path / name
    path.write_bytes(buf.getvalue())
    if name.endswith(".pt"):
        pytest.importorskip("torch")
    with pytest.raises(InvalidInputError) as e:
        read_everything(str(path))
    assert str(path) in str(e.value)


# -- sidecar ----------------------------------------------------------------------------


def test_sidecar_overrides_file_metadata(tmp_path: Path) -> None:
    path = tmp_path / "peer0.safetensors"
    write_safetensors(path, {"w": np.zeros(2, np.float32)}, {"num_examples": "5", "src": "a"})
    sidecar = {"num_examples": 7, "lr": 0.5, "final": True, "note": "re-weighted"}
    Path(f"{path}.json").write_text(json.dumps(sidecar))
    header = read_dump_header(LOCAL, str(path))
    assert header.metadata == {
        "num_examples": "7",
        "src": "a",
        "lr": "0.5",
        "final": "true",
        "note": "re-weighted",
    }


def test_sidecar_for_formats_without_metadata(tmp_path: Path) -> None:
    path = tmp_path / "w.npy"
    np.save(path, np.zeros(2))
    Path(f"{path}.json").write_text('{"num_examples": "3"}')
    assert read_dump_header(LOCAL, str(path)).metadata == {"num_examples": "3"}


@pytest.mark.parametrize(
    ("text", "match"),
    [
        ("[1, 2]", "must be a JSON object"),
        ('"x"', "must be a JSON object"),
        ('{"a": {"b": 1}}', "'a'.*strings, numbers or booleans"),
        ('{"a": [1]}', "'a'"),
        ('{"a": null}', "'a'"),
        ("{not json", "not valid JSON"),
        ('{"a": "1", "a": "2"}', "duplicate"),
    ],
)
def test_bad_sidecar(tmp_path: Path, text: str, match: str) -> None:
    path = tmp_path / "w.npy"
    np.save(path, np.zeros(2))
    Path(f"{path}.json").write_text(text)
    with pytest.raises(InvalidInputError, match=match) as e:
        read_dump_header(LOCAL, str(path))
    assert f"{path}.json" in str(e.value)


# -- byte ranges ------------------------------------------------------------------------


def test_read_byte_range_checks(tmp_path: Path) -> None:
    path = tmp_path / "f.npy"
    path.write_bytes(bytes(range(100)))
    assert read_byte_range(LOCAL, str(path), 10, 14).tolist() == [10, 11, 12, 13]
    assert read_byte_range(LOCAL, str(path), 7, 7).size == 0
    with pytest.raises(InvalidInputError, match=r"truncated.*\[90, 120\)") as e:
        read_byte_range(LOCAL, str(path), 90, 120)
    assert str(path) in str(e.value)
    with pytest.raises(InvalidInputError, match="truncated"):
        read_byte_range(LOCAL, str(path), 200, 210)
    with pytest.raises(InvalidInputError, match="invalid byte range"):
        read_byte_range(LOCAL, str(path), 5, 4)


def test_byte_range_past_the_end_is_refused_before_allocating(tmp_path: Path) -> None:
    """A range from a header the file no longer backs (it shrank) costs no memory.

    Before, the range's length was zero-filled first (256 MiB for a 100-byte file).
    """
    import tracemalloc

    path = tmp_path / "f.npy"
    path.write_bytes(bytes(range(100)))
    tracemalloc.start()
    try:
        with pytest.raises(InvalidInputError, match=r"truncated.*\[10, 268435466\)") as e:
            read_byte_range(LOCAL, str(path), 10, 10 + (256 << 20))
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 1 << 20
    assert "holds 100 bytes" in str(e.value)


# -- S3 ---------------------------------------------------------------------------------


@pytest.mark.s3
@pytest.mark.usefixtures("s3")
def test_s3_headers_and_ranges() -> None:
    fs = fsspec.filesystem("s3")
    st_arrays = {"w": sample("bfloat16", (16, 8)), "b": sample("float32", (8,))}
    buf = io.BytesIO()
    write_safetensors(buf, st_arrays, {"num_examples": "4"})
    fs.pipe("gradpipe-test/run/step=1/peer=0.safetensors", buf.getvalue())
    fs.pipe("gradpipe-test/run/step=1/peer=0.safetensors.json", b'{"num_examples": 9}')
    npz_buf = io.BytesIO()
    npz = {"w": sample("float16", (4, 4)), "n": sample("int64", (3,))}
    np.savez(npz_buf, **npz)
    fs.pipe("gradpipe-test/run/step=1/peer=1.npz", npz_buf.getvalue())

    header = read_dump_header(fs, "gradpipe-test/run/step=1/peer=0.safetensors")
    assert header.metadata == {"num_examples": "9"}
    assert header.size == len(buf.getvalue())
    check_ranged(fs, header, {t.name: st_arrays[t.name] for t in header.tensors})
    check_whole(fs, header, st_arrays)

    header = read_dump_header(fs, "gradpipe-test/run/step=1/peer=1.npz")
    assert header.metadata == {}
    check_ranged(fs, header, npz)
    with pytest.raises(InvalidInputError, match="truncated"):
        read_byte_range(fs, header.path, header.size - 4, header.size + 4)


def test_oversized_sidecar_is_refused_without_reading_it(tmp_path: Path) -> None:
    from gradpipe.formats.dump import MAX_SIDECAR_BYTES

    path = tmp_path / "w.npy"
    np.save(path, np.zeros(2))
    # Valid JSON, but more than a sidecar of metadata fields can need.
    Path(f"{path}.json").write_text('{"num_examples": 3}' + " " * MAX_SIDECAR_BYTES)
    with pytest.raises(InvalidInputError, match="sidecar") as e:
        read_dump_header(LOCAL, str(path))
    assert f"{path}.json" in str(e.value)
    assert str(MAX_SIDECAR_BYTES) in str(e.value)


def test_sidecar_that_is_a_device_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "w.npy"
    np.save(path, np.zeros(2))
    # /dev/null, not /dev/zero: a reader without the check must fail this test, not
    # fill the memory of the machine the tests share.
    Path(f"{path}.json").symlink_to("/dev/null")
    with pytest.raises(InvalidInputError, match="character device, not a regular file") as e:
        read_dump_header(LOCAL, str(path))
    assert f"{path}.json" in str(e.value)


# -- files swapped for a FIFO after a check -----------------------------------------------


def _without_hanging(func: object, fifo: Path) -> BaseException | None:
    """Run ``func()`` in a thread; if it blocks on ``fifo``, unblock it and fail the test."""
    import os
    import threading

    outcome: list[BaseException | None] = []

    def run() -> None:
        try:
            func()  # type: ignore[operator]
            outcome.append(None)
        except BaseException as exc:  # handed to the test
            outcome.append(exc)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(20)
    if thread.is_alive():
        os.close(os.open(fifo, os.O_WRONLY | os.O_NONBLOCK))  # EOF for the blocked reader
        thread.join(20)
        pytest.fail(f"a read blocked on the FIFO {fifo}")
    return outcome[0]


@pytest.mark.parametrize("where", ["header", "tensors", "range", "sidecar"])
def test_a_path_swapped_for_a_fifo_after_the_stat_is_refused_from_what_was_opened(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, where: str
) -> None:
    import os

    import gradpipe.formats.dump as dump_module

    path = tmp_path / "w.safetensors"
    write_safetensors(path, {"w": np.arange(4, dtype=np.float32)}, {})
    header = read_dump_header(LOCAL, str(path))
    # The race: the path was a regular file when stat looked, a FIFO when opened.
    monkeypatch.setattr(dump_module, "check_regular_file", lambda *a, **k: None)
    fifo = Path(f"{path}.json") if where == "sidecar" else path
    fifo.unlink(missing_ok=True)
    os.mkfifo(fifo)
    calls = {
        "header": lambda: read_dump_header(LOCAL, str(path)),
        "tensors": lambda: read_dump_tensors(LOCAL, str(path), header),
        "range": lambda: read_byte_range(LOCAL, str(path), 8, 16),
        "sidecar": lambda: read_dump_header(LOCAL, str(path)),
    }
    error = _without_hanging(calls[where], fifo)
    assert isinstance(error, InvalidInputError), error
    assert f"'{fifo}' is a named pipe (FIFO), not a regular file" in str(error)
