"""Datasets as DataTree groups: tensor names with ``/`` become child groups.

A DataTree variable name cannot hold ``/`` (it would read as a path), and
tensor names often do: a training-state file ingested as a run has
``params/w``, ``exp_avg/w``, ``step/w``. :func:`nest` puts each such tensor
in the group its name spells (``params``, variable ``w``) below the dataset's
own group, which keeps the coordinates: children inherit them. Where a group
on the way would not be a plain name of its own (``..``, ``""``, a name taken
by a coordinate, a dimension or another variable: ``step/w`` beside the
coordinate ``step``), the tensor stays in the dataset's group with its ``/``
escaped (``step%2Fw``); :func:`gradpipe.xarray.view_names.tree_layout` has the
rules. Every variable keeps its full tensor name in ``attrs["tensor"]`` and
every child group the prefix it stands for in ``attrs["tensor_prefix"]``.

A variable whose escaped name is another's (possible only for datasets not
built by gradpipe's views, whose names are escaped already) is left out with
a warning naming it; the rest of the tree opens.
"""

from __future__ import annotations

import warnings

import xarray as xr

from gradpipe.core.display import printable
from gradpipe.xarray.view_names import tree_layout

__all__ = ["nest"]


def nest(path: str, dataset: xr.Dataset) -> dict[str, xr.Dataset]:
    """``dataset`` at ``path``, with its ``/``-named variables moved into child groups."""
    names = [*dataset.coords, *dataset.data_vars]
    if not any(isinstance(k, str) and "/" in k for k in names):
        return {path: dataset}
    coords = set(dataset.coords)
    layout = tree_layout(list(dataset.data_vars), list(dataset.coords), set(dataset.dims))
    for name in layout.left_out:
        # ``path`` is a group gradpipe built from run, aggregate and snapshot names, which
        # the name rule keeps printable; the variable's name came from a dump.
        warnings.warn(
            f"{path}: variable {printable(name)} is left out of the "
            f"DataTree: its name with '/' escaped ({printable(str(name).replace('/', '%2F'))}) "
            "is another variable's; open the dataset itself (xr.open_dataset) to see it",
            UserWarning,
            stacklevel=2,
        )
    # Variables, not DataArrays: a DataArray would bring its coordinates back unescaped.
    top = xr.Dataset(
        {shown: dataset[k].variable for shown, k in layout.top.items() if k in dataset.data_vars},
        coords={shown: dataset[k].variable for shown, k in layout.top.items() if k in coords},
        attrs=dataset.attrs,
    )
    out: dict[str, xr.Dataset] = {path: top}
    for group in sorted(layout.groups, key=len):  # parents first
        data = {leaf: dataset[name].variable for leaf, name in layout.groups[group].items()}
        # Group segments are plain names (no escapes): the prefix is the tensor names' own.
        prefix = "/".join(group)
        out[f"{path}/{prefix}"] = xr.Dataset(data, attrs={"tensor_prefix": prefix})
    return out
