"""Exact JSON encodings of state leaves, and the one validating decoder of state trees.

Split from :mod:`gradpipe.core.state`, which documents the node format. The
decoder is the only reader of trees: it validates (a tree comes from a store,
so anything malformed raises ``ValueError``, ``KeyError`` or ``TypeError`` for
the caller to report as damage) and rebuilds the value in one walk.
"""

from __future__ import annotations

import base64
import binascii
import math
import re
import struct
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Final

import numpy as np

from gradpipe.core.display import printable
from gradpipe.core.dtypes import check_values, dtype_name, parse_dtype
from gradpipe.core.names import parse_tensor_name
from gradpipe.errors import InvalidInputError, UnsupportedFormatError

__all__ = [
    "MAX_DEPTH",
    "TREE_VERSION",
    "Decoded",
    "Node",
    "Placeholder",
    "decode_tree",
    "encode_leaf",
    "segment",
]

#: Version of the tree encoding, stored in every tree.
TREE_VERSION: Final = 1
#: Deepest nesting accepted (a config is a few levels; this keeps recursion bounded).
MAX_DEPTH: Final = 100
#: Ints beyond this magnitude are written as hex text: JSON readers other than
#: Python's turn larger numbers into doubles.
_JSON_INT: Final = 2**53
_HEX_INT: Final = re.compile(r"-?0x[0-9a-f]+")
_HEX: Final = re.compile(r"(?:[0-9a-f]{2})*")
_DOUBLE: Final = struct.Struct(">d")
_KEY_TYPES: Final = frozenset({"none", "bool", "int", "float", "str"})
_FIELDS: Final[dict[str, tuple[frozenset[str], ...]]] = {
    "none": (frozenset(),),
    "bool": (frozenset({"v"}),),
    "int": (frozenset({"v"}), frozenset({"hex"})),
    "float": (frozenset({"v"}), frozenset({"bits"})),
    "str": (frozenset({"v"}), frozenset({"utf8"})),
    "bytes": (frozenset({"b64"}), frozenset({"key", "size"})),
    "bytearray": (frozenset({"b64"}), frozenset({"key", "size"})),
    "scalar": (frozenset({"dtype", "bits"}),),
    "array": (frozenset({"key", "dtype", "shape"}),),
    "list": (frozenset({"items"}),),
    "tuple": (frozenset({"items"}),),
    "dict": tuple(
        frozenset({"items", *extra}) for extra in ((), ("ordered",), ("ordered", "attrs"))
    ),
}

Node = dict[str, Any]


def encode_leaf(obj: object) -> Node | None:  # noqa: PLR0911 - one return per leaf type
    """The exact tree node of a plain leaf, or ``None`` if ``obj`` is not one.

    Raises ``InvalidInputError`` for a numpy scalar of a dtype gradpipe does not store.
    """
    kind = type(obj)
    if obj is None:
        return {"t": "none"}
    if kind is bool:
        return {"t": "bool", "v": obj}
    if kind is int:
        value: int = obj  # type: ignore[assignment]
        # hex, not str: str() of a huge int is refused (sys.int_info.str_digits_check_threshold).
        return (
            {"t": "int", "v": value}
            if -_JSON_INT < value < _JSON_INT
            else {"t": "int", "hex": hex(value)}
        )
    if isinstance(obj, np.generic):  # before float: np.float64 is a float subclass
        arr = np.asarray(obj)
        name = dtype_name(arr.dtype)
        check_values(arr, where="numpy scalar")
        return {"t": "scalar", "dtype": name, "bits": arr.astype(parse_dtype(name)).tobytes().hex()}
    if kind is float:
        number: float = obj  # type: ignore[assignment]
        if math.isnan(number):  # its sign and payload live in the bits only
            return {"t": "float", "bits": _DOUBLE.pack(number).hex()}
        return {"t": "float", "v": repr(number)}  # repr round-trips every non-NaN exactly
    if kind is str:
        text: str = obj  # type: ignore[assignment]
        try:
            text.encode("utf-8")
        except UnicodeEncodeError:  # lone surrogates (e.g. os.fsdecode of bad bytes)
            raw = text.encode("utf-8", "surrogatepass")
            return {"t": "str", "utf8": base64.b64encode(raw).decode("ascii")}
        return {"t": "str", "v": text}
    if kind in (bytes, bytearray):
        return {"t": kind.__name__, "b64": base64.b64encode(obj).decode("ascii")}  # type: ignore[arg-type]
    return None


def segment(key: object) -> str:
    """The dotted-path segment of a dict key or list index."""
    if isinstance(key, int) and not isinstance(key, bool) and not -(10**100) < key < 10**100:
        return hex(key)  # str() of a huge int is refused
    if isinstance(key, float):
        return repr(key)
    return str(key)


@dataclass
class Decoded:
    """What one walk of a tree gives: the value and indexes of its nodes."""

    value: Any = None
    specs: dict[str, tuple[str, tuple[int, ...]]] = field(default_factory=dict)
    addresses: set[str] = field(default_factory=set)  # dotted paths and array keys
    top: list[str] = field(default_factory=list)  # top-level segments
    keys: dict[int, object] = field(default_factory=dict)  # id(key node) -> decoded key


def _check(cond: bool, what: str) -> None:
    if not cond:
        raise ValueError(f"malformed state tree: {what}")


def _b64(text: object, what: str) -> bytes:
    _check(isinstance(text, str), f"{what} is not base64 text")
    return base64.b64decode(text, validate=True)  # type: ignore[arg-type]


def _int(v: object, what: str) -> int:
    _check(isinstance(v, int) and not isinstance(v, bool), f"{what} is not an int")
    return v  # type: ignore[return-value]


#: Builds what stands for an array when a tree is decoded without arrays: ``(key, dtype, shape)``.
Placeholder = Callable[[str, str, tuple[int, ...]], Any]


class _Decoder:
    def __init__(
        self, arrays: dict[str, np.ndarray] | None, placeholder: Placeholder | None = None
    ) -> None:
        self.arrays = arrays
        self.placeholder = placeholder
        self.out = Decoded()

    def node(self, node: object, path: tuple[str, ...]) -> Any:
        where = ".".join(path) or "the root"
        _check(isinstance(node, dict) and isinstance(node.get("t"), str), f"{where} is not a node")
        kind: str = node["t"]  # type: ignore[index]
        _check(kind in _FIELDS, f"{where} has unknown type {printable(kind)}")
        _check(len(path) <= MAX_DEPTH + 1, f"{where} is nested too deeply")
        fields = set(node) - {"t"}  # type: ignore[call-overload]
        _check(fields in _FIELDS[kind], f"{where} ({kind}) has fields {sorted(fields)}")
        if path:
            self.out.addresses.add(".".join(path))
        return getattr(self, f"n_{kind}")(node, path, where)

    def n_none(self, node: Node, path: tuple[str, ...], where: str) -> None:
        return None

    def n_bool(self, node: Node, path: tuple[str, ...], where: str) -> bool:
        _check(isinstance(node["v"], bool), f"{where} is not a bool")
        return bool(node["v"])

    def n_int(self, node: Node, path: tuple[str, ...], where: str) -> int:
        if "v" in node:
            return _int(node["v"], where)
        text = node["hex"]
        _check(isinstance(text, str) and _HEX_INT.fullmatch(text) is not None, f"{where} hex")
        return int(text, 16)

    def n_float(self, node: Node, path: tuple[str, ...], where: str) -> float:
        if "bits" in node:
            bits = node["bits"]
            _check(isinstance(bits, str) and len(bits) == 16 and bool(_HEX.fullmatch(bits)), where)
            value: float = _DOUBLE.unpack(bytes.fromhex(bits))[0]
            return value
        _check(isinstance(node["v"], str), f"{where} is not float text")
        number = float(node["v"])
        _check(number == number, f"{where} is a NaN without its bits")  # noqa: PLR0124
        return number

    def n_str(self, node: Node, path: tuple[str, ...], where: str) -> str:
        if "utf8" in node:
            return _b64(node["utf8"], where).decode("utf-8", "surrogatepass")
        _check(isinstance(node["v"], str), f"{where} is not text")
        return str(node["v"])

    def n_bytes(self, node: Node, path: tuple[str, ...], where: str) -> Any:
        make = bytes if node["t"] == "bytes" else bytearray
        if "b64" in node:
            return make(_b64(node["b64"], where))
        size = _int(node["size"], f"{where} size")
        arr = self.array(node["key"], "uint8", [size], where)
        if self.placeholder is not None:
            return arr  # the stand-in of the bytes' array
        return make(arr.tobytes()) if arr is not None else make()

    n_bytearray = n_bytes

    def n_scalar(self, node: Node, path: tuple[str, ...], where: str) -> np.generic:
        _check(isinstance(node["dtype"], str), f"{where} dtype")
        dtype = parse_dtype(node["dtype"])
        bits = node["bits"]
        _check(isinstance(bits, str) and _HEX.fullmatch(bits) is not None, f"{where} bits")
        raw = bytes.fromhex(bits)
        _check(len(raw) == dtype.itemsize, f"{where} has {len(raw)} bytes for {dtype}")
        arr = np.frombuffer(raw, dtype=dtype)
        check_values(arr, where=where)
        return arr[0]  # type: ignore[no-any-return]

    def n_array(self, node: Node, path: tuple[str, ...], where: str) -> Any:
        return self.array(node["key"], node["dtype"], node["shape"], where)

    def array(self, key: object, dtype: object, shape: object, where: str) -> Any:
        if not (isinstance(key, str) and isinstance(dtype, str) and isinstance(shape, list)):
            raise TypeError(f"malformed state tree: {where} has a bad key, dtype or shape")
        parse_tensor_name(key, where=where)
        _check(key not in self.out.specs, f"array key {printable(key)} is used twice")
        parse_dtype(dtype)
        dims = tuple(_int(d, f"{where} shape") for d in shape)
        _check(all(d >= 0 for d in dims), f"{where} has a negative dimension")
        self.out.specs[key] = (dtype, dims)
        self.out.addresses.add(key)
        if self.arrays is None:
            return None if self.placeholder is None else self.placeholder(key, dtype, dims)
        if key not in self.arrays:
            raise KeyError(f"array {printable(key)} of the state tree is missing")
        arr = self.arrays[key]
        if dtype_name(arr.dtype) != dtype or arr.shape != dims:
            raise ValueError(
                f"array {printable(key)} is {arr.dtype} {list(arr.shape)}; the tree says "
                f"{dtype} {shape}"
            )
        return arr

    def items(self, node: Node, where: str) -> list[Any]:
        items = node["items"]
        _check(isinstance(items, list), f"{where} items")
        return items  # type: ignore[no-any-return]

    def n_list(self, node: Node, path: tuple[str, ...], where: str) -> list[Any] | tuple[Any, ...]:
        values = [self.node(v, (*path, str(i))) for i, v in enumerate(self.items(node, where))]
        return values if node["t"] == "list" else tuple(values)

    n_tuple = n_list

    def n_dict(self, node: Node, path: tuple[str, ...], where: str) -> dict[Any, Any]:
        ordered = node.get("ordered", False)
        _check(ordered is True or "ordered" not in node, f"{where} ordered")
        out: dict[Any, Any] = OrderedDict() if ordered else {}
        for pair in self.items(node, where):
            _check(isinstance(pair, list) and len(pair) == 2, f"{where} item is not a pair")
            key_node, value = pair
            _check(isinstance(key_node, dict) and key_node.get("t") in _KEY_TYPES, f"{where} key")
            key = self.node(key_node, ())
            _check(key not in out, f"{where} has the key {printable(key)} twice")
            self.out.keys[id(key_node)] = key
            if not path:
                self.out.top.append(segment(key))
            out[key] = self.node(value, (*path, segment(key)))
        for pair in node.get("attrs", []):
            _check(isinstance(pair, list) and len(pair) == 2, f"{where} attr is not a pair")
            name, value = pair
            _check(isinstance(name, str), f"{where} attr name")
            setattr(out, name, self.node(value, (*path, name)))
        return out


def decode_tree(
    tree: object, arrays: dict[str, np.ndarray] | None, placeholder: Placeholder | None = None
) -> Decoded:
    """Validate a tree and rebuild its value.

    Without ``arrays``, each array is left ``None``, or is what ``placeholder``
    makes of its key, dtype and shape.
    """
    _check(isinstance(tree, dict) and set(tree) == {"version", "root"}, "not a state tree")
    version = tree["version"]  # type: ignore[index]
    _check(isinstance(version, int) and not isinstance(version, bool), "version")
    if version > TREE_VERSION:
        raise UnsupportedFormatError(
            f"state tree version {version} was written by a newer gradpipe (this one reads "
            f"up to {TREE_VERSION}); upgrade gradpipe"
        )
    _check(version == TREE_VERSION, f"unknown version {version}")
    root = tree["root"]  # type: ignore[index]
    _check(isinstance(root, dict) and root.get("t") == "dict", "the root is not a dict")
    decoder = _Decoder(arrays, placeholder)
    try:
        decoder.out.value = decoder.node(root, ())
    except InvalidInputError as exc:  # from parse_dtype and friends: still a damaged tree
        raise ValueError(f"malformed state tree: {exc}") from None
    except (binascii.Error, UnicodeDecodeError) as exc:
        raise ValueError(f"malformed state tree: {exc}") from None
    return decoder.out
