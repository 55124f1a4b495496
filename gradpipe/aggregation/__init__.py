"""Aggregation: federated averages, robust methods, privacy, server optimizers and rounds.

- API: :mod:`~gradpipe.aggregation.api` (:func:`gradpipe.aggregate`),
  :mod:`~gradpipe.aggregation.report`, :mod:`~gradpipe.aggregation.rounds`
  (:func:`gradpipe.rounds`), :mod:`~gradpipe.aggregation.server_update`
  (:func:`gradpipe.apply_server_update`);
- math, pure numpy: :mod:`~gradpipe.aggregation.reduce` (sum, mean, FedAvg as partial states),
  :mod:`~gradpipe.aggregation.kernel`, :mod:`~gradpipe.aggregation.inputs`,
  :mod:`~gradpipe.aggregation.robust` (median, trimmed mean, Krum, Multi-Krum, Bulyan),
  :mod:`~gradpipe.aggregation.privacy` (clipping, DP noise), :mod:`~gradpipe.aggregation.server_opt`
  (FedAvgM, FedAdam, FedYogi, FedAdagrad), :mod:`~gradpipe.aggregation.exact`,
  :mod:`~gradpipe.aggregation.result_range`;
- graphs and their tasks: :mod:`~gradpipe.aggregation.plan`, :mod:`~gradpipe.aggregation.graph`,
  :mod:`~gradpipe.aggregation.tasks`, :mod:`~gradpipe.aggregation.clip`,
  :mod:`~gradpipe.aggregation.robust_graph`, :mod:`~gradpipe.aggregation.robust_tasks`,
  :mod:`~gradpipe.aggregation.server_opt_method`, :mod:`~gradpipe.aggregation.server_opt_graph`,
  :mod:`~gradpipe.aggregation.server_opt_tasks`.
"""
