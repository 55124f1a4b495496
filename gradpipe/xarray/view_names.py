"""How names from dumps appear in the xarray views: variable, dimension and DataTree names.

Tensor names are any text without control characters
(:func:`gradpipe.core.names.parse_tensor_name`), and metadata keys any text;
xarray is stricter, and some of its rules lose data silently:

- a data variable named like a dimension becomes a coordinate, and one named
  like a coordinate replaces it;
- DataTree variable and group names cannot hold ``/``; a group named ``""``,
  ``"."`` or ``".."`` is read as a step of a path (and lands elsewhere); a node
  cannot have a variable and a child group of one name; a child's variable
  named like a coordinate it inherits is dropped.

So every name is shown through a **percent escape**, reversible by
construction: ``%`` itself is always written ``%25``, so every ``%`` in a
shown name starts an escape gradpipe made, and :func:`original_name` gives
the name back. A name that would clash is escaped, never suffixed: a tensor
named like a reserved coordinate has its first character escaped (``step``
is shown ``%73tep``), a name ending like a dimension (``_dim0``) has that
``_`` escaped (``w%5Fdim0``), ``.`` and ``..`` become ``%2E`` and ``%2E.``.
Distinct names therefore never share a shown name, and an ordinary name
(``encoder.layer.0.attention.self.query.weight``, ``params/w``) is shown as
it is. The shown name of a tensor depends on its name and the kind of view
only, never on the other tensors, so it is the same in every dump of a run.

In a DataTree, :func:`tree_layout` puts a tensor whose shown name holds ``/``
(``params/w``) in the child group its name spells, where every group on the
way is a plain name that clashes with nothing; any other ``/`` is escaped
(``%2F``) and the tensor stays in its dataset's own group.

This module is pure (no xarray): the views in :mod:`gradpipe.xarray.datasets`
and :mod:`gradpipe.xarray.tree` apply it.
"""

from __future__ import annotations

import re
from collections.abc import Collection, Hashable, Sequence
from dataclasses import dataclass, field
from typing import Final

__all__ = [
    "TreeLayout",
    "coordinate_name",
    "dim_name",
    "original_name",
    "tree_layout",
    "variable_name",
]

#: A shown name ending like this would equal a dimension of another variable (``w_dim0``).
_DIM_TAIL: Final = re.compile(r"_(dim[0-9]+)\Z")
_ESCAPE: Final = re.compile(r"%([0-9A-F]{2})")
#: Names that a DataTree path reads as steps, not as names.
_PATH_STEPS: Final = frozenset({"", ".", ".."})


def variable_name(name: str, reserved: Collection[str] = ()) -> str:
    """The name tensor ``name`` is shown as in a Dataset (see the module doc).

    Parameters
    ----------
    name : str
        The tensor name (non-empty).
    reserved : collection of str
        The coordinate and dimension names of the view (plain ASCII names
        without ``%``, none ending like a dimension).

    Examples
    --------
    >>> variable_name("encoder.layer.0.weight", {"step", "peer"})
    'encoder.layer.0.weight'
    >>> variable_name("step", {"step", "peer"}), variable_name("100%")
    ('%73tep', '100%25')
    >>> variable_name("w_dim0"), variable_name("..")
    ('w%5Fdim0', '%2E.')
    """
    shown = name.replace("%", "%25")
    tail = _DIM_TAIL.search(shown)
    if tail is not None:
        shown = f"{shown[: tail.start()]}%5F{tail.group(1)}"
    if shown in (".", "..") or shown in reserved:
        shown = f"{_escape(shown[0])}{shown[1:]}"
    return shown


def dim_name(variable: str, axis: int) -> str:
    """The dimension of axis ``axis`` of the tensor shown as ``variable``.

    No shown name ends like one (:func:`variable_name` escapes that ``_``), and
    the last ``_dim`` of a dimension name is the one added here, so dimensions
    of distinct variables never clash with each other or with a variable.

    >>> dim_name("dense1.weight", 1)
    'dense1.weight_dim1'
    """
    return f"{variable}_dim{axis}"


def original_name(shown: str) -> str:
    """The name a shown name stands for: every escape undone.

    >>> original_name("%73tep"), original_name("a%2Fb%25")
    ('step', 'a/b%')
    """
    return _ESCAPE.sub(lambda m: chr(int(m.group(1), 16)), shown)


def coordinate_name(key: str, taken: Collection[str]) -> str:
    """The coordinate a metadata key (or aggregate parameter) is shown as.

    ``%`` is escaped as in a variable name; a key taken already (by a tensor,
    a dimension, a coordinate) or read as a path step gets the prefix
    ``metadata_``, then a ``_`` until it is free. Metadata yields to tensors,
    so a tensor's shown name never depends on the metadata beside it.

    >>> coordinate_name("lr", {"step"}), coordinate_name("step", {"step"})
    ('lr', 'metadata_step')
    """
    shown = key.replace("%", "%25")
    if shown in taken or shown in _PATH_STEPS:
        shown = f"metadata_{shown}"
    while shown in taken:
        shown += "_"
    return shown


@dataclass(frozen=True)
class TreeLayout:
    """Where the variables of one dataset go in a DataTree (:func:`tree_layout`).

    Attributes
    ----------
    top : dict
        Name in the dataset's own group -> the variable's name in the dataset.
    groups : dict
        Child group (a tuple of path segments) -> {name in that group: the
        variable's name in the dataset}; every group on the way to one is a key.
    left_out : list
        Variables that cannot be shown: their escaped name is another's.
    """

    top: dict[Hashable, Hashable] = field(default_factory=dict)
    groups: dict[tuple[str, ...], dict[str, str]] = field(default_factory=dict)
    left_out: list[Hashable] = field(default_factory=list)


def tree_layout(
    data_vars: Sequence[Hashable], coords: Sequence[Hashable], dims: Collection[Hashable]
) -> TreeLayout:
    """Place a dataset's variables in its DataTree group and child groups.

    A data variable whose name holds ``/`` goes to the child group its name
    spells (``params/w``: variable ``w`` of group ``params``) when every group
    segment is a plain name (not ``""``, ``.`` or ``..``, no ``%``) taken by
    no variable, coordinate or dimension of the dataset, no group on the way is
    itself a variable (``params`` beside ``params/w``), and the last segment is
    neither a path step nor a name the group inherits (a coordinate or
    dimension). Any other ``/`` is escaped as ``%2F`` and the variable stays
    in the dataset's group. Names shown by :func:`variable_name` and
    :func:`coordinate_name` hold no ``%2F``, so this never makes two of them
    one; a name that would (from another source) is in ``left_out``.

    >>> layout = tree_layout(["params/w", "loss", "./x"], ["step"], ["step"])
    >>> layout.groups, layout.top
    ({('params',): {'w': 'params/w'}}, {'step': 'step', 'loss': 'loss', '.%2Fx': './x'})
    """
    names = {*data_vars, *coords}
    inherited = {*coords, *dims}
    blocked = names | inherited
    nested: dict[str, tuple[tuple[str, ...], str]] = {}
    for name in data_vars:
        if not isinstance(name, str) or "/" not in name:
            continue
        *path, leaf = name.split("/")
        plain = all(s not in _PATH_STEPS and "%" not in s and s not in blocked for s in path)
        free = all("/".join(path[:depth]) not in names for depth in range(1, len(path) + 1))
        if plain and free and leaf not in _PATH_STEPS and leaf not in inherited:
            nested[name] = (tuple(path), leaf)
    layout = TreeLayout()
    escaped: list[tuple[str, Hashable]] = []
    # Names shown as they are first: an escaped name yields to a real one.
    for name in (*coords, *data_vars):
        if name in nested:
            continue
        if isinstance(name, str) and "/" in name:
            escaped.append((name.replace("/", "%2F"), name))
        else:
            layout.top[name] = name
    for shown, name in escaped:
        if shown in layout.top:
            layout.left_out.append(name)
        else:
            layout.top[shown] = name
    for name, (group, leaf) in nested.items():
        for depth in range(1, len(group)):
            layout.groups.setdefault(group[:depth], {})
        layout.groups.setdefault(group, {})[leaf] = name
    return layout


def _escape(char: str) -> str:
    return "".join(f"%{byte:02X}" for byte in char.encode("utf-8"))
