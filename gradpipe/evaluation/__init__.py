"""Codec evaluation: candidate codecs measured on a sample of a run's stored chunks.

- :mod:`~gradpipe.evaluation.api` (:func:`gradpipe.evaluate_codecs`) and
  :mod:`~gradpipe.evaluation.report`;
- :mod:`~gradpipe.evaluation.sampling`: the seeded, stratified sample of chunks;
- :mod:`~gradpipe.evaluation.graph` and :mod:`~gradpipe.evaluation.tasks`: the graph and what runs
  on workers; :mod:`~gradpipe.evaluation.result` and :mod:`~gradpipe.evaluation.fidelity`: what
  the chunks add up to, per candidate.
"""
