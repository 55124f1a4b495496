"""Snapshots: training state saved, restored and pruned as versions of a named chain.

- :mod:`~gradpipe.snapshots.api`: :func:`gradpipe.snapshot`, :func:`gradpipe.restore`,
  :func:`gradpipe.restore_steps`, :func:`gradpipe.snapshot_log`;
- :mod:`~gradpipe.snapshots.content`: what a snapshot holds, as one id;
- :mod:`~gradpipe.snapshots.prune`: retention (:func:`gradpipe.prune`).
"""
