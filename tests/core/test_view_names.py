"""How names are shown in the xarray views: injective, reversible, clear of what a view reserves.

The views' own tests (tests/test_xarray.py) open real stores with such names;
these check the rules themselves over many more names.
"""

from __future__ import annotations

import re

from hypothesis import given, settings
from hypothesis import strategies as st

from gradpipe.xarray.datasets import RUN_RESERVED, SNAPSHOT_RESERVED
from gradpipe.xarray.view_names import (
    coordinate_name,
    dim_name,
    original_name,
    tree_layout,
    variable_name,
)

#: Pieces that clash with reserved names, dimensions, path steps and escapes.
PIECES = (
    *("/", ".", "..", "%", "%2F", "%25", "%5F", "%73", "%2E", "_", "_dim", "_dim0", "_dim12"),
    *sorted(RUN_RESERVED | SNAPSHOT_RESERVED),
    *("metadata_", "w", "a", "é", "😀", " ", "0"),
)
names = st.one_of(
    st.lists(st.sampled_from(PIECES), min_size=1, max_size=5).map("".join),
    st.text(alphabet="/._%dim0aé", min_size=1, max_size=10),
    st.text(min_size=1, max_size=10).filter(lambda s: s.isprintable()),
)
RESERVED = (RUN_RESERVED, SNAPSHOT_RESERVED)
DIM = re.compile(r"_dim[0-9]+\Z")


def test_the_views_reserve_plain_names() -> None:
    """Reserved names hold no '%' and no dimension tail, so no escaped name can equal one."""
    for reserved in RESERVED:
        for name in reserved:
            assert name.isascii(), name
            assert "%" not in name, name
            assert not DIM.search(name), name


@settings(max_examples=500, deadline=None)
@given(st.lists(names, min_size=1, max_size=8, unique=True), st.sampled_from(RESERVED))
def test_shown_names_are_distinct_reversible_and_clear_of_reserved_names(
    tensors: list[str], reserved: frozenset[str]
) -> None:
    shown = [variable_name(n, reserved) for n in tensors]
    assert len(set(shown)) == len(tensors)  # injective
    dims = {dim_name(s, axis) for s in shown for axis in range(3)}
    assert len(dims) == 3 * len(shown)
    for name, s in zip(tensors, shown, strict=True):
        assert original_name(s) == name
        assert s not in reserved
        assert s not in dims  # never a dimension of another variable
        assert s not in (".", "..")
        assert "%2F" not in s  # what the DataTree escapes '/' to is never made here
        if (
            "%" not in name
            and name not in reserved
            and name not in (".", "..")
            and (not DIM.search(name))
        ):
            assert s == name  # an ordinary name is shown as it is


@settings(max_examples=300, deadline=None)
@given(st.lists(names, max_size=8, unique=True), st.lists(names, max_size=3))
def test_coordinate_names_take_no_name_taken_already(keys: list[str], taken: list[str]) -> None:
    used = set(taken) | {"step", "peer"}
    for key in keys:
        name = coordinate_name(key, used)
        assert name not in used
        assert "%2F" not in name
        assert name not in ("", ".", "..")
        used.add(name)


@settings(max_examples=500, deadline=None)
@given(
    st.lists(names, min_size=1, max_size=8, unique=True),
    st.lists(names, max_size=3, unique=True),
)
def test_tree_layout_is_valid_and_places_every_variable_once(
    tensors: list[str], keys: list[str]
) -> None:
    """No name holds '/', no group is a path step or clashes, every variable is placed once."""
    data_vars = [variable_name(n, RUN_RESERVED) for n in tensors] + ["present"]
    dims = {"step", "peer"} | {dim_name(v, 0) for v in data_vars}
    coords = ["step", "peer"]
    taken = {*data_vars, *coords, *dims}
    for key in keys:
        coords.append(coordinate_name(key, taken))
        taken.add(coords[-1])
    layout = tree_layout(data_vars, coords, dims)
    assert layout.left_out == []
    placed = list(layout.top.values()) + [
        v for variables in layout.groups.values() for v in variables.values()
    ]
    assert sorted(placed) == sorted([*data_vars, *coords])
    for name, variable in layout.top.items():
        assert "/" not in name
        assert original_name(name) == original_name(variable)
    top_groups = {path[0] for path in layout.groups}
    assert not top_groups & set(layout.top)  # a group is never a variable of its parent
    for path, variables in layout.groups.items():
        for segment in path:
            assert segment not in ("", ".", "..")
            assert "/" not in segment
            assert segment not in taken  # nor a coordinate or dimension it inherits
        children = {p[len(path)] for p in layout.groups if p[: len(path)] == path and p != path}
        assert not children & set(variables)
        for leaf, variable in variables.items():
            assert "/" not in leaf
            assert leaf not in ("", ".", "..")
            assert leaf not in coords
            assert leaf not in dims
            assert "/".join((*path, leaf)) == variable
