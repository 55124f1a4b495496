"""Where gradpipe's graphs run, and what every feature's graphs share.

- :mod:`~gradpipe.graph.runner`: a :class:`~gradpipe.graph.runner.Runner` over one Dask scheduler
  (threads, local processes, an in-process cluster, an address or a ``Client``);
- :mod:`~gradpipe.graph.process_pool`: local single-threaded worker processes;
- :mod:`~gradpipe.graph.warmup`, :mod:`~gradpipe.graph.warmup_plugin`: worker start-up;
- :mod:`~gradpipe.graph.telemetry`: what operations tell the scheduler (the dashboard's data);
- :mod:`~gradpipe.graph.arrays`, :mod:`~gradpipe.graph.chains`: stored tensors and chains read
  as Dask graphs.
"""
