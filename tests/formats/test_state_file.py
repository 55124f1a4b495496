"""Tests of formats/state_file.py: state files written back exactly, unsafe ones refused."""

from __future__ import annotations

import io
import json
import pickle
import re
import zipfile
from collections import OrderedDict
from pathlib import Path
from typing import Any

import ml_dtypes
import numpy as np
import pytest
from safetensors.numpy import save_file

from gradpipe.core.encoding import to_json_bytes
from gradpipe.core.state import flatten_state, unflatten_state
from gradpipe.errors import InvalidInputError
from gradpipe.formats.state_file import StateFileInfo, read_state_file, write_state_file


def through_store(state: Any, info: StateFileInfo) -> tuple[Any, StateFileInfo]:
    """What a snapshot keeps and restore gives back: tree and info as canonical JSON."""
    flat = flatten_state(state)
    tree = json.loads(to_json_bytes(flat.to_dict()))
    kept = json.loads(to_json_bytes(info.to_dict()))
    return unflatten_state(tree, flat.arrays), StateFileInfo.from_dict(kept)


def assert_same_arrays(a: dict[str, np.ndarray], b: dict[str, np.ndarray]) -> None:
    assert list(a) == list(b)
    for k, arr in a.items():
        assert arr.dtype == b[k].dtype, k
        assert arr.shape == b[k].shape, k
        assert arr.tobytes() == b[k].tobytes(), k


def tensors() -> dict[str, np.ndarray]:
    rng = np.random.default_rng(0)
    return {
        "layer.0.weight": rng.standard_normal((3, 4)).astype(np.float32),
        "layer.0.bias": np.array([np.nan, -0.0, np.inf], np.float64),
        "embed": rng.integers(0, 9, (5,), dtype=np.int64),
        "mask": np.array([True, False]),
        "scalar": np.array(7, np.uint16),
    }


@pytest.mark.parametrize("metadata", [None, {"format": "pt", "step": "3", "z": "1", "a": "2"}])
def test_safetensors_from_the_reference_writer_come_back_byte_for_byte(
    tmp_path: Path, metadata: dict[str, str] | None
) -> None:
    src, out = tmp_path / "in.safetensors", tmp_path / "out.safetensors"
    save_file(tensors(), str(src), metadata=metadata)
    state, info = read_state_file(src)
    assert info.kind == "safetensors"
    assert info.metadata == (metadata or {})
    assert_same_arrays(state, {k: tensors()[k] for k in state})
    restored, info2 = through_store(state, info)
    assert list(info2.metadata) == list(info.metadata)  # the file's order survives JSON
    write_state_file(out, restored, info2)
    assert out.read_bytes() == src.read_bytes()


def test_safetensors_bfloat16_round_trip(tmp_path: Path) -> None:
    from gradpipe.formats.safetensors import write_safetensors

    bits = np.array([0x7FC1, 0x8000, 0x3F80], np.uint16)
    src, out = tmp_path / "a.safetensors", tmp_path / "b.safetensors"
    write_safetensors(src, {"w": bits.view(ml_dtypes.bfloat16)}, {"k": "v"})
    state, info = read_state_file(src)
    write_state_file(out, *through_store(state, info))
    assert out.read_bytes() == src.read_bytes()


@pytest.mark.parametrize("save", [np.savez, np.savez_compressed])
def test_npz_round_trip(tmp_path: Path, save: Any) -> None:
    src, out = tmp_path / "in.npz", tmp_path / "out.npz"
    arrays = {
        **tensors(),
        "big": np.arange(6, dtype=">i4").reshape(2, 3),
        "allow_pickle": np.ones(1),
    }
    save(src, **arrays)
    state, info = read_state_file(src)
    assert info == StateFileInfo("npz")
    write_state_file(out, *through_store(state, info))
    again, _ = read_state_file(out)
    assert_same_arrays(again, state)
    with np.load(out) as loaded:  # numpy reads what we wrote
        assert np.array_equal(loaded["big"], arrays["big"])


def test_npy_round_trip(tmp_path: Path) -> None:
    src, out = tmp_path / "w.npy", tmp_path / "o.npy"
    arr = np.asfortranarray(np.arange(12, dtype=">f8").reshape(3, 4))
    np.save(src, arr)
    state, info = read_state_file(src)
    assert list(state) == ["w"]
    assert state["w"].dtype == np.dtype("<f8")
    write_state_file(out, *through_store(state, info))
    assert np.load(out).tobytes() == state["w"].tobytes()
    assert np.array_equal(np.load(out), arr)


def test_flat_kinds_refuse_what_they_cannot_hold(tmp_path: Path) -> None:
    bf = np.zeros(2, ml_dtypes.bfloat16)
    with pytest.raises(InvalidInputError, match=r"'opt' is a dict.*\.pt"):
        write_state_file(
            tmp_path / "a.safetensors", {"opt": {"lr": 1.0}}, StateFileInfo("safetensors")
        )
    with pytest.raises(InvalidInputError, match=r"'w' is bfloat16"):
        write_state_file(tmp_path / "a.npz", {"w": bf}, StateFileInfo("npz"))
    with pytest.raises(InvalidInputError, match="one array"):
        write_state_file(
            tmp_path / "a.npy", {"a": np.ones(1), "b": np.ones(1)}, StateFileInfo("npy")
        )
    with pytest.raises(InvalidInputError, match=r"torch file; write it to a file ending in \.pt"):
        write_state_file(tmp_path / "a.safetensors", {}, StateFileInfo("torch"))
    assert not list(tmp_path.iterdir())  # nothing half-written


def test_bad_files_name_the_file(tmp_path: Path) -> None:
    bad = tmp_path / "x.safetensors"
    bad.write_bytes(b"\x05\x00\x00\x00\x00\x00\x00\x00{oops")
    with pytest.raises(InvalidInputError, match=re.escape(repr(str(bad)))):
        read_state_file(bad)
    with pytest.raises(InvalidInputError, match=r"x\.txt': not a known dump format"):
        read_state_file(tmp_path / "x.txt")
    obj = tmp_path / "o.npy"
    np.save(obj, np.array([{"a": 1}], dtype=object), allow_pickle=True)
    with pytest.raises(InvalidInputError, match="never unpickles"):
        read_state_file(obj)


def test_info_validates() -> None:
    info = StateFileInfo("safetensors", {"b": "1", "a": "2"})
    assert StateFileInfo.from_dict(info.to_dict()) == info
    with pytest.raises(InvalidInputError):
        StateFileInfo("zarr")
    for bad in (
        {"kind": "npz"},
        {"kind": "npz", "metadata": {"a": 1}},
        {"kind": "npz", "metadata": [["a", 1]]},
    ):
        with pytest.raises(ValueError):
            StateFileInfo.from_dict(bad)


# -- torch ----------------------------------------------------------------------------------

torch = pytest.importorskip("torch")


def trained() -> tuple[Any, Any]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))
    opt = torch.optim.Adam(model.parameters(), lr=1e-3, betas=(0.9, 0.99))
    for _ in range(2):
        opt.zero_grad()
        model(torch.randn(5, 4)).pow(2).sum().backward()
        opt.step()
    return model, opt


def same_torch(a: Any, b: Any) -> bool:
    if type(a) is not type(b):
        return False
    if isinstance(a, torch.Tensor):
        return (
            a.dtype == b.dtype
            and a.shape == b.shape
            and bool(
                torch.equal(a, b)
                or a.numel() == 0
                or a.view(-1).view(torch.uint8).equal(b.view(-1).view(torch.uint8))
            )
        )
    if isinstance(a, dict):
        if isinstance(a, OrderedDict) and getattr(a, "_metadata", None) != getattr(
            b, "_metadata", None
        ):
            return False
        return list(a) == list(b) and all(
            type(k1) is type(k2) and same_torch(a[k1], b[k2]) for k1, k2 in zip(a, b, strict=True)
        )
    if isinstance(a, list | tuple):
        return len(a) == len(b) and all(same_torch(x, y) for x, y in zip(a, b, strict=True))
    return bool(a == b) and type(a) is type(b)


def test_torch_checkpoint_round_trips_exactly(tmp_path: Path) -> None:
    model, opt = trained()
    checkpoint = {
        "model": model.state_dict(),
        "optimizer": opt.state_dict(),
        "epoch": 3,
        "half": torch.arange(4, dtype=torch.bfloat16) / 3,
        "rng": torch.get_rng_state(),
        "blob": b"\x00opaque",
    }
    src, out = tmp_path / "ckpt.pt", tmp_path / "back.pt"
    torch.save(checkpoint, src)
    state, info = read_state_file(src)
    assert info == StateFileInfo("torch")
    assert list(state["optimizer"]["state"]) == [0, 1, 2, 3]  # int keys stay int
    assert isinstance(state["optimizer"]["param_groups"][0]["betas"], tuple)
    assert state["half"].dtype == np.dtype(ml_dtypes.bfloat16)
    write_state_file(out, *through_store(state, info))
    back = torch.load(out, weights_only=True)
    assert same_torch(back, checkpoint)
    assert back["model"]._metadata == checkpoint["model"]._metadata
    model2, opt2 = trained()
    model2.load_state_dict(back["model"])
    opt2.load_state_dict(back["optimizer"])
    assert same_torch(opt2.state_dict(), opt.state_dict())


def save(path: Path, obj: object) -> Path:
    torch.save(obj, path)
    return path


class _Evil:
    def __reduce__(self) -> tuple[Any, ...]:
        return (Path.touch, (Path("/tmp/gradpipe-state-file-pwned"),))


def test_unpickling_code_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "evil.pt"
    path.write_bytes(pickle.dumps({"w": _Evil()}, protocol=2))
    marker = Path("/tmp/gradpipe-state-file-pwned")
    marker.unlink(missing_ok=True)
    with pytest.raises(InvalidInputError, match=str(path)):
        read_state_file(path)
    assert not marker.exists()
    zipped = save(tmp_path / "evil2.pt", {"w": _Evil()})
    with pytest.raises(InvalidInputError, match="refused for safety"):
        read_state_file(zipped)
    assert not marker.exists()


def test_unsafe_tensors_are_refused(tmp_path: Path) -> None:
    from gradpipe.formats.torch import SHARED_STORAGE_FACTOR

    expanded = save(tmp_path / "e.pt", {"opt": {0: {"w": torch.ones(1).expand(2**20)}}})
    with pytest.raises(InvalidInputError, match=r"\[0\]\['w'\].*stride 0.*clone"):
        read_state_file(expanded)
    base = torch.ones(1 << 18)
    shared = save(tmp_path / "s.pt", {"m": [base] * 64})
    with pytest.raises(InvalidInputError, match=f"{SHARED_STORAGE_FACTOR} x"):
        read_state_file(shared)
    buf = io.BytesIO()
    torch.save({"w": torch.zeros(1000)}, buf)
    src = zipfile.ZipFile(io.BytesIO(buf.getvalue()))
    deflated = tmp_path / "z.pt"
    with zipfile.ZipFile(deflated, "w", compression=zipfile.ZIP_DEFLATED) as dst:
        for item in src.infolist():
            dst.writestr(item.filename, src.read(item))
    with pytest.raises(InvalidInputError, match="is compressed"):
        read_state_file(deflated)
    not_dict = save(tmp_path / "t.pt", [torch.ones(1)])
    with pytest.raises(InvalidInputError, match="a state file is a dict"):
        read_state_file(not_dict)
    odd = save(tmp_path / "odd.pt", {"size": torch.Size([2, 3])})
    with pytest.raises(InvalidInputError, match=r"odd\.pt\['size'\]: holds a torch.Size"):
        read_state_file(odd)


def test_numpy_scalars_cannot_go_into_torch_files(tmp_path: Path) -> None:
    with pytest.raises(InvalidInputError, match="weights_only"):
        write_state_file(tmp_path / "a.pt", {"x": np.float32(1)}, StateFileInfo("torch"))
