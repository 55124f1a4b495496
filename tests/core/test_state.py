"""Tests of core/state.py: bit-exact round trips of nested training state, errors, selection."""

from __future__ import annotations

import json
import math
import struct
from collections import OrderedDict
from typing import Any

import ml_dtypes
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from gradpipe.core import state as state_mod
from gradpipe.core.dtypes import dtype_name
from gradpipe.core.encoding import to_json_bytes
from gradpipe.core.state import FlatState, flatten_state, select_state, unflatten_state
from gradpipe.errors import InvalidInputError, NotFoundError, UnsupportedFormatError

BF16 = np.dtype(ml_dtypes.bfloat16)


def same(a: Any, b: Any) -> bool:
    """Equal in type, structure, key types and order, dtypes and bits."""
    if type(a) is not type(b):
        return False
    if isinstance(a, np.ndarray):  # b is the original: compare with its canonical form
        if b.dtype.byteorder == ">":
            b = b.byteswap().view(b.dtype.newbyteorder("<"))
        return a.dtype == b.dtype and a.shape == b.shape and a.tobytes() == b.tobytes()
    if isinstance(a, np.generic):
        return a.dtype == b.dtype and a.tobytes() == b.tobytes()
    if isinstance(a, float):
        return struct.pack(">d", a) == struct.pack(">d", b)
    if isinstance(a, dict):
        if isinstance(a, OrderedDict) and not same(vars(a), vars(b)):
            return False
        ka, kb = list(a), list(b)
        return len(ka) == len(kb) and all(
            same(x, y) and same(a[x], b[y]) for x, y in zip(ka, kb, strict=True)
        )
    if isinstance(a, list | tuple):
        return len(a) == len(b) and all(same(x, y) for x, y in zip(a, b, strict=True))
    return bool(a == b)


def round_trip(state: Any) -> Any:
    flat = flatten_state(state)
    stored = json.loads(to_json_bytes(flat.to_dict()))  # as a manifest would keep it
    restored = FlatState.from_dict(stored, flat.arrays)
    return unflatten_state(restored.tree, restored.arrays)


# -- hypothesis strategies ------------------------------------------------------------------

floats = st.one_of(
    st.floats(allow_nan=False),
    st.integers(0, 2**64 - 1).map(lambda b: struct.unpack(">d", b.to_bytes(8, "big"))[0]),
)
texts = st.text(st.characters(codec=None, exclude_categories=()), max_size=8)
keys = st.one_of(texts, st.integers(-(2**70), 2**70), st.booleans(), st.none(), floats)
dtypes = st.sampled_from(
    ["bool", "<i1", "<i2", "<i4", ">i8", "<u1", "<u2", ">u4", "<u8", "<f2", ">f4", "<f8"]
).map(np.dtype)


@st.composite
def arrays(draw: st.DrawFn) -> np.ndarray:
    if draw(st.booleans()):
        bits = draw(hnp.arrays(np.uint16, hnp.array_shapes(min_dims=0, max_side=3)))
        return bits.view(BF16)
    dtype = draw(dtypes)
    shape = draw(hnp.array_shapes(min_dims=0, max_dims=3, min_side=0, max_side=4))
    if dtype.kind == "b":
        return draw(hnp.arrays(dtype, shape))
    raw = draw(hnp.arrays(np.uint8, (int(np.prod(shape)) * dtype.itemsize,)))
    return raw.view(dtype).reshape(shape)


scalars = st.one_of(
    arrays().filter(lambda a: a.size > 0).map(lambda a: a.reshape(-1)[0]),
    st.sampled_from([np.float32(1.5), np.bool_(True), np.int64(-3), ml_dtypes.bfloat16(2)]),
)
leaves = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-(2**80), 2**80),
    floats,
    texts,
    st.binary(max_size=16),
    st.binary(max_size=16).map(bytearray),
    scalars,
    arrays(),
)


def nested(children: st.SearchStrategy[Any]) -> st.SearchStrategy[Any]:
    return st.one_of(
        st.lists(children, max_size=4),
        st.lists(children, max_size=4).map(tuple),
        st.dictionaries(keys, children, max_size=4),
        st.dictionaries(keys, children, max_size=4).map(OrderedDict),
    )


states = st.dictionaries(keys, st.recursive(leaves, nested, max_leaves=20), max_size=6)


@settings(max_examples=300, deadline=None)
@given(states)
def test_round_trip_is_exact(state: dict[Any, Any]) -> None:
    assert same(round_trip(state), state)


@settings(max_examples=100, deadline=None)
@given(states)
def test_keys_are_unique_valid_tensor_names(state: dict[Any, Any]) -> None:
    from gradpipe.core.names import parse_tensor_name

    flat = flatten_state(state)
    for key, arr in flat.arrays.items():
        assert parse_tensor_name(key, where="test") == key
        assert arr.flags.c_contiguous
        assert arr.dtype.byteorder in "<|="
    assert list(flat.array_specs) == list(flat.arrays)


# -- examples -------------------------------------------------------------------------------


def test_keys_are_dotted_paths_and_flat_names_stay() -> None:
    a = np.zeros(2, np.float32)
    flat = flatten_state({"model": {"fc.weight": a}, "layer.0.weight": a, "opt": {0: [a, a]}})
    assert list(flat.arrays) == ["model.fc.weight", "layer.0.weight", "opt.0.0", "opt.0.1"]


def test_colliding_and_invalid_paths_get_recorded_stand_ins() -> None:
    a, b, c = np.zeros(1), np.ones(1), np.full(1, 2.0)
    state = {1: a, "1": b, "x\n": c, "1~1": a}
    flat = flatten_state(state)
    assert list(flat.arrays) == ["1", "1~2", "x_~1", "1~1"]  # "1~1" is someone's own name
    assert same(round_trip(state), state)


def test_special_values_are_exact() -> None:
    nan = struct.unpack(">d", bytes.fromhex("fff8000000000abc"))[0]
    od: OrderedDict[str, Any] = OrderedDict(w=np.arange(3, dtype=">f4"))
    od._metadata = {"": {"version": 1}}  # type: ignore[attr-defined]
    state = {
        "nan": nan,
        "neg0": -0.0,
        "inf": -math.inf,
        "big": -(3**500),
        "huge": 7**6000,  # str() of it is refused by Python; hex is not
        "flag": True,
        "one": 1,
        "f32": np.float32(1.5),
        "bf": ml_dtypes.bfloat16(0.5),
        "zero_d": np.array(3, np.int16),
        "surrogate": "\udc80x",
        "model": od,
        "blob": bytes(range(256)) * 300,
        "small": b"\x00\x01",
    }
    back = round_trip(state)
    assert same(back, state)
    assert back["model"]._metadata == {"": {"version": 1}}
    assert back["model"]["w"].dtype == np.dtype("<f4")  # canonical little-endian


def test_large_bytes_become_uint8_arrays_and_small_stay_in_the_tree(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(state_mod, "INLINE_BYTES_LIMIT", 4)
    flat = flatten_state({"big": b"12345", "small": b"1234", "ba": bytearray(b"abcdefg")})
    assert list(flat.arrays) == ["big", "ba"]
    assert flat.arrays["big"].dtype == np.uint8
    assert "1234" not in json.dumps(flat.tree)  # base64, not raw
    back = unflatten_state(flat.tree, flat.arrays)
    assert back == {"big": b"12345", "small": b"1234", "ba": bytearray(b"abcdefg")}
    assert type(back["ba"]) is bytearray


@pytest.mark.parametrize(
    ("state", "match"),
    [
        ({"a": {1, 2}}, r"state\['a'\]: holds a builtins.set \(store a sorted list"),
        ({"a": [object()]}, r"state\['a'\]\[0\]: holds a builtins.object"),
        ({"a": {(1, 2): 3}}, r"state\['a'\]\[\(1, 2\)\]: a dict key is a tuple"),
        ({"a": np.array(["x"])}, r"state\['a'\]: unsupported dtype"),
        ({"a": np.array([object()])}, r"state\['a'\]: unsupported dtype 'object'"),
        ({"a": np.zeros(2, "i4,f4")}, r"state\['a'\]: unsupported dtype"),
        ({"a": np.complex64(1)}, r"state\['a'\]: unsupported dtype"),
        ({"a": np.array([2], np.uint8).view(np.bool_)}, r"other than 0 and 1"),
        ({"a": 1j}, r"holds a builtins.complex"),
        ({"a": np.ma.masked_array([1])}, r"holds a numpy.ma.*MaskedArray"),
    ],
)
def test_unsupported_values_are_refused_naming_the_path(state: Any, match: str) -> None:
    with pytest.raises(InvalidInputError, match=match):
        flatten_state(state)


def test_cycles_deep_nesting_and_non_mappings_are_refused() -> None:
    loop: list[Any] = []
    loop.append(loop)
    with pytest.raises(InvalidInputError, match=r"state\['a'\]\[0\]: the state contains itself"):
        flatten_state({"a": loop})
    deep: Any = 1
    for _ in range(200):
        deep = [deep]
    with pytest.raises(InvalidInputError, match="deeper than 100"):
        flatten_state({"a": deep})
    with pytest.raises(InvalidInputError, match="a state is a dict"):
        flatten_state([1, 2])  # type: ignore[arg-type]
    shared = [1]
    assert round_trip({"a": shared, "b": shared}) == {"a": [1], "b": [1]}  # not a cycle


def test_torch_tensors_get_a_hint() -> None:
    torch = pytest.importorskip("torch")
    with pytest.raises(InvalidInputError, match="from_torch"):
        flatten_state({"w": torch.zeros(1)})


# -- stored trees ---------------------------------------------------------------------------


def _tree() -> dict[str, Any]:
    flat = flatten_state({"m": {"w": np.zeros(2, np.float32)}, "n": 3})
    return json.loads(to_json_bytes(flat.to_dict()))


@pytest.mark.parametrize(
    "damage",
    [
        lambda t: t.pop("root"),
        lambda t: t["root"].update(t="list"),
        lambda t: t["root"]["items"][1][1].update(t="complex"),
        lambda t: t["root"]["items"][1][1].update(v="3"),
        lambda t: t["root"]["items"][1][1].update(v=True),
        lambda t: t["root"]["items"][1].append(1),
        lambda t: t["root"]["items"][0][1]["items"][0][1].update(dtype="float128"),
        lambda t: t["root"]["items"][0][1]["items"][0][1].update(shape=[-1]),
        lambda t: t["root"]["items"][0][1]["items"][0][1].update(key="a\x00"),
        lambda t: t["root"]["items"][0][1]["items"][0][1].update(extra=1),
        lambda t: t["root"]["items"].append(t["root"]["items"][1]),  # duplicate key
        lambda t: t["root"]["items"][1].__setitem__(1, {"t": "float", "v": "nan"}),
        lambda t: t["root"]["items"][1].__setitem__(1, {"t": "bytes", "b64": "!!"}),
        lambda t: t["root"]["items"][1].__setitem__(1, {"t": "float", "bits": "xyz"}),
        lambda t: t["root"]["items"][1].__setitem__(
            1, {"t": "scalar", "dtype": "int8", "bits": "0102"}
        ),
    ],
)
def test_malformed_trees_raise_value_key_or_type_errors(damage: Any) -> None:
    tree = _tree()
    damage(tree)
    with pytest.raises((ValueError, KeyError, TypeError)):
        FlatState.from_dict(tree)


def test_newer_tree_versions_are_unsupported() -> None:
    tree = _tree()
    tree["version"] = 99
    with pytest.raises(UnsupportedFormatError, match="newer gradpipe"):
        FlatState.from_dict(tree)


def test_arrays_must_match_the_tree() -> None:
    tree = _tree()
    with pytest.raises(KeyError, match=r"m\.w"):
        unflatten_state(tree, {})
    with pytest.raises(ValueError, match=r"m\.w"):
        unflatten_state(tree, {"m.w": np.zeros(3, np.float32)})
    with pytest.raises(ValueError, match=r"m\.w"):
        FlatState.from_dict(tree, {"m.w": np.zeros(2, np.float64)})
    assert FlatState.from_dict(tree).array_specs == {"m.w": ("float32", (2,))}


# -- selection ------------------------------------------------------------------------------


def _optimizer_state() -> dict[str, Any]:
    a = np.arange(4, dtype=np.float32)
    return {
        "model": {"fc.weight": a, "fc.bias": a[:2].copy()},
        "optimizer": {
            "state": {0: {"step": np.array(2.0, np.float32), "exp_avg": a}, 1: {"exp_avg": a}},
            "param_groups": [{"lr": 0.001, "betas": (0.9, 0.999), "params": [0, 1]}],
        },
        "layers": [a, a],
        "epoch": 3,
    }


@pytest.mark.parametrize(
    ("keys", "expected", "arrays"),
    [
        (["epoch"], {"epoch": 3}, []),
        (["model"], None, ["model.fc.weight", "model.fc.bias"]),
        (["model.fc.bias"], None, ["model.fc.bias"]),
        (["optimizer.state.0"], None, ["optimizer.state.0.step", "optimizer.state.0.exp_avg"]),
        (["optimizer.state.1.exp_avg", "epoch"], None, ["optimizer.state.1.exp_avg"]),
        (["layers.1"], None, ["layers.0", "layers.1"]),  # a list stays whole
        (["optimizer.param_groups.0.lr"], None, []),
        (["model", "model.fc.bias"], None, ["model.fc.weight", "model.fc.bias"]),
    ],
)
def test_select_prunes_to_the_named_entries(
    keys: list[str], expected: dict[str, Any] | None, arrays: list[str]
) -> None:
    state = _optimizer_state()
    flat = flatten_state(state)
    tree, needed = select_state(flat.tree, keys)
    assert needed == arrays
    part = unflatten_state(tree, {k: flat.arrays[k] for k in needed})
    if expected is not None:
        assert part == expected
    for key in keys:  # every selected entry comes back as it was
        node_full, node_part = state, part
        rest = key
        while rest:  # walk by the longest key that prefixes what is left (keys hold dots)
            k = max(
                (k for k in node_full if rest == str(k) or rest.startswith(f"{k}."))
                if isinstance(node_full, dict)
                else [int(rest.split(".")[0])],
                key=lambda k: len(str(k)),
            )
            node_full, node_part = node_full[k], node_part[k]
            rest = rest[len(str(k)) + 1 :]
        assert same(node_part, node_full)
    assert set(part) <= set(state)


def test_select_unknown_keys_lists_what_exists() -> None:
    flat = flatten_state(_optimizer_state())
    with pytest.raises(NotFoundError, match=r"'modle'.*'model', 'optimizer', 'layers', 'epoch'"):
        select_state(flat.tree, ["modle", "model"])
    with pytest.raises(KeyError):
        select_state(flat.tree, ["optimizer.state.2"])


def _specs_of(state: Any) -> Any:
    """``state`` with every array replaced by its ArraySpec stand-in."""
    if isinstance(state, np.ndarray):
        return state_mod.ArraySpec(dtype_name(state.dtype), state.shape)
    if isinstance(state, dict):
        return {k: _specs_of(v) for k, v in state.items()}
    if isinstance(state, list | tuple):
        return type(state)(_specs_of(v) for v in state)
    return state


def test_a_skeleton_flattens_to_the_tree_and_keys_of_the_arrays() -> None:
    a = np.arange(6, dtype="f4").reshape(2, 3)
    state = {
        "params": {"fc.w": a, 1: a[0], "1": a[1], "bad\nname": np.zeros(2, "f8")},
        "server_optimizer": {"m": {"fc.w": a}, "t": 3, "config": {"lr": 0.1, "beta": None}},
        "rows": [a, (a, 2.5)],
    }
    flat = flatten_state(state)
    tree, specs = state_mod.flatten_skeleton(_specs_of(state))
    assert tree == flat.tree
    assert list(specs) == list(flat.arrays)
    for key, spec in specs.items():
        assert (spec.dtype, spec.shape) == (
            dtype_name(flat.arrays[key].dtype),
            flat.arrays[key].shape,
        )
    skeleton = state_mod.state_skeleton(tree)
    assert skeleton["server_optimizer"]["t"] == 3
    assert skeleton["server_optimizer"]["config"] == {"lr": 0.1, "beta": None}
    assert skeleton["params"]["fc.w"] == state_mod.ArraySpec("float32", (2, 3), "params.fc.w")
    keys = {skeleton["params"][1].key, skeleton["params"]["1"].key}
    assert keys <= set(flat.arrays)
    assert len(keys) == 2  # the colliding paths got distinct keys, as flatten_state gives them
    assert isinstance(skeleton["rows"][1], tuple)


def test_arrays_are_refused_in_a_skeleton_and_specs_in_a_state() -> None:
    with pytest.raises(InvalidInputError, match="skeleton holds ArraySpecs"):
        state_mod.flatten_skeleton({"w": np.zeros(2)})
    with pytest.raises(InvalidInputError, match="ArraySpec"):
        flatten_state({"w": state_mod.ArraySpec("float32", (2,))})
