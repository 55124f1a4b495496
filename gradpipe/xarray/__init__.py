"""The xarray integration: ``xr.open_dataset(STORE, engine="gradpipe", run=RUN)``.

- :mod:`~gradpipe.xarray.backend`: the ``gradpipe`` engine and :func:`open_dataset`;
- :mod:`~gradpipe.xarray.datasets`: the datasets of runs, aggregates and snapshot chains;
- :mod:`~gradpipe.xarray.array`: one tensor of many dumps as one lazy array;
- :mod:`~gradpipe.xarray.tree`, :mod:`~gradpipe.xarray.view_names`: DataTree groups and the
  names tensors take in a view.
"""

from gradpipe.xarray.backend import GradpipeBackendEntrypoint, Kind, open_dataset

__all__ = ["GradpipeBackendEntrypoint", "Kind", "open_dataset"]
