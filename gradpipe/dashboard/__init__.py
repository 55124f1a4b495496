"""The gradpipe page of the Dask dashboard, loaded with ``--preload gradpipe.dashboard``.

- :mod:`~gradpipe.dashboard.plugin`: the scheduler plugin, its routes and ``dask_setup``;
- :mod:`~gradpipe.dashboard.board`: operations rebuilt from their scheduler events;
- :mod:`~gradpipe.dashboard.page`: the ``/gradpipe`` page, rendered on the server.
"""

from gradpipe.dashboard.plugin import (
    JSON_ROUTE,
    NAME,
    PAGE_ROUTE,
    GradpipeDashboard,
    dask_setup,
    route_prefix,
)

__all__ = ["JSON_ROUTE", "NAME", "PAGE_ROUTE", "GradpipeDashboard", "dask_setup", "route_prefix"]
