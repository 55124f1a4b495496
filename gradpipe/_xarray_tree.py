"""Datasets as DataTree groups: tensor names with ``/`` become child groups.

A DataTree variable name cannot hold ``/`` (it would read as a path), and
tensor names often do: a training-state file ingested as a run has
``params/w``, ``exp_avg/w``, ``step/w``. :func:`nest` puts each such tensor
in the group its name spells (``params``, variable ``w``) below the dataset's
own group, which keeps the coordinates: children inherit them. A group or
variable name that would clash with a name it inherits (the coordinate
``step`` and a group ``step``) gets a ``_`` appended; every variable keeps
its full tensor name in ``attrs["tensor"]`` and every such group the prefix
it stands for in ``attrs["tensor_prefix"]``.
"""

from __future__ import annotations

from collections.abc import Hashable

import xarray as xr

__all__ = ["nest"]


def nest(path: str, dataset: xr.Dataset) -> dict[str, xr.Dataset]:
    """``dataset`` at ``path``, with its ``/``-named variables moved into child groups."""
    nested = [k for k in dataset.data_vars if "/" in str(k)]
    if not nested:
        return {path: dataset}
    inherited: set[Hashable] = {*dataset.coords, *dataset.dims}
    # Original group (tuple of segments) -> {leaf name: variable}.
    groups: dict[tuple[str, ...], dict[str, xr.Variable]] = {}
    for key in nested:
        *prefix, leaf = (s or "_" for s in str(key).split("/"))
        groups.setdefault(tuple(prefix), {})[leaf] = dataset[key].variable
    top = dataset.drop_vars(nested)
    names_at: dict[tuple[str, ...], set[Hashable]] = {(): set(top.variables)}
    for group, variables in groups.items():
        names_at.setdefault(group, set()).update(variables)
    resolved: dict[tuple[str, ...], str] = {(): path}
    children: dict[tuple[str, ...], set[str]] = {}
    out: dict[str, xr.Dataset] = {path: top}
    for group in sorted(groups, key=len):
        for depth in range(1, len(group) + 1):
            part = group[:depth]
            if part in resolved:
                continue
            parent = part[:-1]
            taken = {*inherited, *names_at.get(parent, set()), *children.get(parent, set())}
            segment = _free(part[-1], taken)
            children.setdefault(parent, set()).add(segment)
            resolved[part] = f"{resolved[parent]}/{segment}"
            out.setdefault(resolved[part], xr.Dataset(attrs={"tensor_prefix": "/".join(part)}))
        variables = {_free(leaf, inherited): v for leaf, v in groups[group].items()}
        out[resolved[group]] = xr.Dataset(variables, attrs={"tensor_prefix": "/".join(group)})
    return out


def _free(name: str, taken: set[Hashable]) -> str:
    while name in taken:
        name += "_"
    return name
