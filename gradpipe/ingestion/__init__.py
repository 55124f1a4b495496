"""Ingest: gradient dumps into a run of the store (:func:`gradpipe.ingest`).

- :mod:`~gradpipe.ingestion.api`: ``ingest`` and its report;
- :mod:`~gradpipe.ingestion.discover`: dump files found from a ``{step}``/``{peer}`` pattern;
- :mod:`~gradpipe.ingestion.plan`: each dump cut into read units on chunk boundaries;
- :mod:`~gradpipe.ingestion.graph`: the graph builders; :mod:`~gradpipe.ingestion.tasks` and
  :mod:`~gradpipe.ingestion.chains`: what runs on workers (plain and ``--delta`` dumps).
"""
