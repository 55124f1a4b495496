"""Training state as a JSON skeleton plus named arrays, and back, bit-exact (pure, no I/O).

A snapshot's ``state`` is a nested mapping: parameters, an optimizer's
``state_dict()`` (int keys, tuples such as ``betas``), RNG state, a data-loader
position, a config, opaque per-parameter blobs. :func:`flatten_state` splits it
into a :class:`FlatState`: a *tree* (JSON-able, every non-array leaf encoded
exactly) and *arrays* (array key -> canonical little-endian array), which the
snapshot layer stores as a manifest field and as chunked tensors.
:func:`unflatten_state` is the exact inverse: types, dict key types and order,
tuple vs list, bool vs int, float bit patterns (NaN payloads, -0.0), big ints,
numpy scalar types and ``OrderedDict`` (with the ``_metadata`` torch keeps on
a ``state_dict()``) all come back as they were. Arrays come back as numpy
arrays in canonical byte order; objects shared between two places come back
as two copies.

An array's key is its dotted path (``{"model": {"fc.weight": a}}`` ->
``model.fc.weight``), so a flat safetensors file keeps its names. Where that
is not a valid tensor name or collides with another (``{1: a, "1": b}``), a
deterministic ``<path>~<n>`` is chosen; every key is recorded in the tree, so
reading never depends on the rule. Bytes longer than :data:`INLINE_BYTES_LIMIT`
become ``uint8`` arrays (chunked and delta-encoded like any tensor); shorter
ones live in the tree as base64.

Tree nodes are objects with a type tag ``"t"``: ``none``, ``bool`` (``v``),
``int`` (``v``, or ``hex`` beyond 2**53, where JSON readers lose precision),
``float`` (``v``: its repr, exact for every non-NaN; ``bits`` for NaN),
``str`` (``v``, or ``utf8`` base64 for text with lone surrogates), ``bytes``
and ``bytearray`` (``b64``, or ``key`` + ``size``), ``scalar`` (numpy scalar:
``dtype`` + little-endian ``bits``), ``array`` (``key``, ``dtype``,
``shape``), ``list`` and ``tuple`` (``items``), and ``dict`` (``items`` as
``[key node, value node]`` pairs; ``ordered`` and ``attrs`` for an
``OrderedDict``).
"""

from __future__ import annotations

import copy
from collections import OrderedDict
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any, Final

import numpy as np

from gradpipe.core._state_codec import (
    MAX_DEPTH,
    TREE_VERSION,
    Node,
    decode_tree,
    encode_leaf,
    segment,
)
from gradpipe.core.display import printable
from gradpipe.core.dtypes import canonical_dtype, check_values, dtype_name
from gradpipe.core.names import MAX_NAME_LENGTH, parse_tensor_name
from gradpipe.errors import InvalidInputError, NotFoundError

__all__ = [
    "INLINE_BYTES_LIMIT",
    "MAX_DEPTH",
    "TREE_VERSION",
    "ArraySpec",
    "FlatState",
    "flat_array_names",
    "flatten_skeleton",
    "flatten_state",
    "select_state",
    "state_skeleton",
    "unflatten_state",
]

#: Bytes values longer than this are stored as ``uint8`` arrays, not in the tree.
INLINE_BYTES_LIMIT: Final = 64 * 1024
_SUPPORTED: Final = (
    "a state holds dicts and OrderedDicts (keys str, int, float, bool or None), lists, "
    "tuples, numpy arrays and scalars, str, bytes, bytearray, int, float, bool and None"
)


@dataclass(frozen=True)
class FlatState:
    """A state split into a JSON-able tree and the arrays it refers to.

    Attributes
    ----------
    tree : dict
        ``{"version": 1, "root": node}``; see the module docstring for nodes.
    arrays : dict of str to numpy.ndarray
        Array key -> C-contiguous little-endian array (empty after
        :meth:`from_dict` without ``arrays``).
    """

    tree: dict[str, Any]
    arrays: dict[str, np.ndarray]

    @property
    def array_specs(self) -> dict[str, tuple[str, tuple[int, ...]]]:
        """Array key -> (gradpipe dtype name, shape), in tree order, from the tree alone."""
        return decode_tree(self.tree, None).specs

    def to_dict(self) -> dict[str, Any]:
        """The tree, for a manifest (the arrays are stored apart, by key)."""
        return copy.deepcopy(self.tree)

    @classmethod
    def from_dict(
        cls, data: Mapping[str, Any], arrays: Mapping[str, np.ndarray] | None = None
    ) -> FlatState:
        """Validate a stored tree (and, if given, the arrays it refers to).

        Raises
        ------
        ValueError, KeyError or TypeError
            If the tree is malformed, or ``arrays`` lacks a key or holds an array
            of another dtype or shape than the tree says.
        UnsupportedFormatError
            If the tree was written by a newer gradpipe.
        """
        tree = copy.deepcopy(dict(data))
        decode_tree(tree, None if arrays is None else dict(arrays))
        return cls(tree, dict(arrays or {}))


@dataclass(frozen=True)
class ArraySpec:
    """An array known by its dtype and shape only: what stands for it in a state skeleton.

    A graph that computes a state chunk by chunk plans it with these
    (:func:`flatten_skeleton`) and reads the state it starts from as these
    (:func:`state_skeleton`, which fills in ``key``).
    """

    dtype: str  # a gradpipe dtype name
    shape: tuple[int, ...]
    key: str = ""  # its array key in a stored tree ("" when planned)


class _Flattener:
    """Walks a state, building tree nodes and collecting array leaves."""

    def __init__(self, where: str, *, specs: bool = False) -> None:
        self.where = where
        self.specs = specs  # ArraySpec leaves stand for arrays (flatten_skeleton)
        self.leaves: list[tuple[Node, str, Any]] = []  # node, natural key, array (or spec)
        self.active: set[int] = set()  # containers on the current path: cycle detection

    def show(self, path: tuple[object, ...]) -> str:
        return self.where + "".join(f"[{printable(k)}]" for k in path)

    def refuse(self, path: tuple[object, ...], what: str) -> InvalidInputError:
        return InvalidInputError(f"{self.show(path)}: {what}; {_SUPPORTED}")

    def node(self, obj: object, path: tuple[object, ...]) -> Node:
        if len(path) > MAX_DEPTH:
            raise self.refuse(path, f"nesting is deeper than {MAX_DEPTH} levels")
        kind = type(obj)
        if kind is np.ndarray:
            return self.array(obj, path)  # type: ignore[arg-type]
        if kind is ArraySpec and self.specs:
            spec: ArraySpec = obj  # type: ignore[assignment]
            node = {"t": "array", "dtype": spec.dtype, "shape": list(spec.shape)}
            return self.leaf(node, path, spec)
        if kind in (bytes, bytearray) and len(obj) > INLINE_BYTES_LIMIT:  # type: ignore[arg-type]
            data = np.frombuffer(bytes(obj), dtype=np.uint8)  # type: ignore[call-overload]
            return self.leaf({"t": kind.__name__, "size": data.size}, path, data)
        if kind in (dict, OrderedDict, list, tuple):
            if id(obj) in self.active:
                raise self.refuse(path, "the state contains itself (a cycle)")
            self.active.add(id(obj))
            try:
                if isinstance(obj, dict):
                    return self.mapping(obj, path)
                seq: list[object] | tuple[object, ...] = obj  # type: ignore[assignment]
                items = [self.node(v, (*path, i)) for i, v in enumerate(seq)]
                return {"t": kind.__name__, "items": items}
            finally:
                self.active.discard(id(obj))
        try:
            leaf = encode_leaf(obj)
        except InvalidInputError as exc:
            raise InvalidInputError(f"{self.show(path)}: {exc}") from None
        if leaf is None:
            hint = ""
            if isinstance(obj, set | frozenset):
                hint = " (store a sorted list instead)"
            elif kind.__module__.startswith("torch") and hasattr(obj, "numpy"):
                hint = " (convert torch tensors: gradpipe.formats.state_file.from_torch)"
            raise self.refuse(path, f"holds a {kind.__module__}.{kind.__qualname__}{hint}")
        return leaf

    def mapping(self, obj: dict[object, object], path: tuple[object, ...]) -> Node:
        items = []
        for k, v in obj.items():
            if type(k) not in (str, int, float, bool, type(None)):
                raise self.refuse(
                    (*path, k), f"a dict key is a {type(k).__qualname__} (keys must be plain)"
                )
            items.append([encode_leaf(k), self.node(v, (*path, k))])
        node: Node = {"t": "dict", "items": items}
        if type(obj) is OrderedDict:
            node["ordered"] = True
            # torch keeps per-module versions in a state_dict's ``_metadata``: keep them.
            attrs = vars(obj)
            if attrs:
                node["attrs"] = [[name, self.node(v, (*path, name))] for name, v in attrs.items()]
        return node

    def array(self, arr: np.ndarray, path: tuple[object, ...]) -> Node:
        try:
            name = dtype_name(arr.dtype)
        except InvalidInputError as exc:
            raise InvalidInputError(
                f"{self.show(path)}: {exc}; structured, object and string arrays are not arrays "
                "gradpipe stores (save fields as separate arrays, text as str)"
            ) from None
        canon = canonical_dtype(arr.dtype)
        if arr.dtype != canon:
            arr = arr.byteswap().view(canon)  # moves bits, never values: NaN payloads stay
        if not arr.flags.c_contiguous:
            arr = arr.copy(order="C")  # not ascontiguousarray: it makes 0-d arrays 1-d
        check_values(arr, where=self.show(path))
        return self.leaf({"t": "array", "dtype": name, "shape": list(arr.shape)}, path, arr)

    def leaf(self, node: Node, path: tuple[object, ...], arr: np.ndarray | ArraySpec) -> Node:
        self.leaves.append((node, ".".join(segment(k) for k in path), arr))
        return node

    def assign_keys(self) -> dict[str, Any]:
        """Give every array leaf its key: its dotted path, or a deterministic stand-in."""
        reserved = {path for _, path, _ in self.leaves if _valid(path)}
        arrays: dict[str, Any] = {}
        for node, path, arr in self.leaves:
            key = path
            if not _valid(path) or path in arrays:
                base = _usable(path)
                n = 1
                while (key := f"{base}~{n}") in arrays or key in reserved:
                    n += 1
            node["key"] = key
            arrays[key] = arr
        return arrays


def _valid(name: str) -> bool:
    try:
        parse_tensor_name(name, where="state")
    except InvalidInputError:
        return False
    return True


def _usable(path: str) -> str:
    """A valid base for a stand-in key: control characters and lone surrogates replaced."""
    text = path.encode("utf-8", "replace").decode("utf-8")
    text = "".join("_" if ord(c) < 32 or 127 <= ord(c) < 160 else c for c in text)
    return text[: MAX_NAME_LENGTH - 24] or "array"


def flatten_state(state: Mapping[Any, Any], *, where: str = "state") -> FlatState:
    """Split a nested state into a JSON-able tree and canonical arrays.

    Parameters
    ----------
    state : dict or OrderedDict
        Nested dicts, lists and tuples of numpy arrays and scalars, str, bytes,
        int, float, bool and None.
    where : str
        Names the state in error messages (``state['optimizer']['state'][0]``).

    Returns
    -------
    FlatState

    Raises
    ------
    InvalidInputError
        For anything else (sets, cycles, arbitrary objects, torch tensors,
        unsupported dtypes, keys that are not plain values), naming the path.

    Examples
    --------
    >>> flat = flatten_state({"model": {"w": np.zeros(2, "f4")}, "step": 3})
    >>> list(flat.arrays)
    ['model.w']
    >>> unflatten_state(flat.tree, flat.arrays)["step"]
    3
    """
    if type(state) not in (dict, OrderedDict):
        raise InvalidInputError(
            f"{where}: is a {type(state).__qualname__}; a state is a dict (or OrderedDict) of "
            "named entries, e.g. {'model': model_state, 'optimizer': optim_state, 'epoch': 3}"
        )
    flat = _Flattener(where)
    root = flat.node(state, ())
    arrays = flat.assign_keys()
    return FlatState({"version": TREE_VERSION, "root": root}, arrays)


def flatten_skeleton(
    state: Mapping[Any, Any], *, where: str = "state"
) -> tuple[dict[str, Any], dict[str, ArraySpec]]:
    """:func:`flatten_state` of a state whose arrays are :class:`ArraySpec` stand-ins.

    The tree, and each array key's spec, in tree order: the keys are the ones
    :func:`flatten_state` gives the same state with real arrays, so a state
    computed chunk by chunk is stored as one written whole would be.

    >>> tree, specs = flatten_skeleton({"params": {"w": ArraySpec("float32", (2, 3))}, "t": 1})
    >>> specs
    {'params.w': ArraySpec(dtype='float32', shape=(2, 3), key='')}
    """
    if type(state) not in (dict, OrderedDict):
        raise InvalidInputError(f"{where}: is a {type(state).__qualname__}, not a dict")
    flat = _Flattener(where, specs=True)
    root = flat.node(state, ())
    specs = flat.assign_keys()
    for key, spec in specs.items():
        if not isinstance(spec, ArraySpec):
            raise InvalidInputError(f"{where}: {key} is an array; a skeleton holds ArraySpecs")
    return {"version": TREE_VERSION, "root": root}, specs


def state_skeleton(tree: Mapping[str, Any]) -> Any:
    """The state a stored tree describes, each array an :class:`ArraySpec` with its key.

    Reads no array: for planning work on a snapshot from its manifest alone.
    Raises ``ValueError``, ``KeyError`` or ``TypeError`` for a malformed tree.

    >>> tree, _ = flatten_skeleton({"params": {"w": ArraySpec("float32", (2,))}, "t": 1})
    >>> state_skeleton(tree)
    {'params': {'w': ArraySpec(dtype='float32', shape=(2,), key='params.w')}, 't': 1}
    """
    return decode_tree(tree, None, lambda key, dtype, shape: ArraySpec(dtype, shape, key)).value


def unflatten_state(tree: Mapping[str, Any], arrays: Mapping[str, np.ndarray]) -> Any:
    """The exact inverse of :func:`flatten_state`: rebuild the state from its tree and arrays.

    ``arrays`` must hold every key the tree refers to (more are ignored); a
    missing key raises ``KeyError``, a malformed tree or an array of another
    dtype or shape ``ValueError`` or ``TypeError``, so the caller can report
    damaged stored data.
    """
    return decode_tree(tree, dict(arrays)).value


def flat_array_names(tree: Mapping[str, Any]) -> list[str] | None:
    """The names, in order, when a tree is a plain ``{name: array}`` keyed by those names.

    That is what a flat file (safetensors, npz) becomes: a writer can then
    stream its arrays by key without rebuilding the state. None otherwise.
    """
    root = tree.get("root")
    if not isinstance(root, dict) or root.get("t") != "dict" or set(root) != {"t", "items"}:
        return None
    names = []
    for item in root["items"]:
        key, value = item
        name = key.get("v") if key.get("t") == "str" and set(key) == {"t", "v"} else None
        if not isinstance(name, str) or value.get("t") != "array" or value.get("key") != name:
            return None
        names.append(name)
    return names


def select_state(tree: Mapping[str, Any], keys: Iterable[str]) -> tuple[dict[str, Any], list[str]]:
    """Prune a tree to some entries, for reading part of a snapshot.

    Parameters
    ----------
    tree : mapping
        A :attr:`FlatState.tree`.
    keys : iterable of str
        Top-level entry names (``"model"``), dotted paths (``"optimizer.state.0"``,
        a prefix selects the subtree) or array keys. A selection inside a list
        or tuple keeps the whole sequence, so indices keep their meaning.

    Returns
    -------
    tree : dict
        The pruned tree, for :func:`unflatten_state`.
    array_keys : list of str
        The arrays it refers to, in tree order: the ones to read.

    Raises
    ------
    NotFoundError
        If a key names nothing in the state; the message lists what exists.
    """
    wanted = [keys] if isinstance(keys, str) else list(dict.fromkeys(keys))
    decoded = decode_tree(tree, None)  # validates the tree first
    missing = [k for k in wanted if k not in decoded.addresses]
    if missing:
        top = list(dict.fromkeys(decoded.top))
        shown = ", ".join(map(repr, top[:8])) + (", ..." if len(top) > 8 else "")
        raise NotFoundError(
            f"no entry {', '.join(map(repr, missing))} in the state; its top-level entries are "
            f"{shown or 'none'}. Select top-level names, dotted paths (optimizer.state.0) or "
            "array keys"
        )
    want = set(wanted)

    def prune(node: Node, path: tuple[str, ...]) -> Node | None:
        if path and (".".join(path) in want or node.get("key") in want):
            return node
        kind = node["t"]
        if kind == "dict":
            kept = []
            for key_node, value in node["items"]:
                sub = prune(value, (*path, segment(decoded.keys[id(key_node)])))
                if sub is not None:
                    kept.append([key_node, sub])
            return {**node, "items": kept} if kept else None
        if kind in ("list", "tuple"):
            hit = any(prune(v, (*path, str(i))) is not None for i, v in enumerate(node["items"]))
            return node if hit else None
        return None

    root = prune(tree["root"], ()) or {**tree["root"], "items": []}
    pruned = {"version": tree["version"], "root": root}
    return copy.deepcopy(pruned), list(decode_tree(pruned, None).specs)
