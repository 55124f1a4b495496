"""Compression statistics of runs, aggregates and snapshot chains, from manifests alone.

- :mod:`~gradpipe.statistics.api`: :func:`gradpipe.compression_stats`,
  :func:`gradpipe.summarize_stats`;
- :mod:`~gradpipe.statistics.tensor_stats`: the figures of one stored tensor;
- :mod:`~gradpipe.statistics.plot`: :func:`gradpipe.plot_stats` (the ``plot`` extra).
"""
