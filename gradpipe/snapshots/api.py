"""Training-state snapshots: save, restore and list the versions of a named chain.

>>> sid = gp.snapshot(store, "run1", {"model": params, "epoch": 3}, step=100)  # doctest: +SKIP
>>> state = gp.restore(store, "run1")                                           # doctest: +SKIP

The public functions, gathered from where they are made: saving in
:mod:`gradpipe.snapshots.save`, restoring in :mod:`gradpipe.snapshots.restore`, the chain's
versions in :mod:`gradpipe.snapshots.chain`, retention (``prune``) in
:mod:`gradpipe.snapshots.prune`.
"""

from __future__ import annotations

from gradpipe.snapshots.chain import (
    SnapshotInfo,
    find_snapshot,
    snapshot_head,
    snapshot_log,
    snapshot_ref,
    snapshot_tensor,
    snapshot_versions,
)
from gradpipe.snapshots.restore import restore, restore_steps
from gradpipe.snapshots.save import SnapshotWrite, commit_snapshot, snapshot, write_snapshot

__all__ = [
    "SnapshotInfo",
    "SnapshotWrite",
    "commit_snapshot",
    "find_snapshot",
    "restore",
    "restore_steps",
    "snapshot",
    "snapshot_head",
    "snapshot_log",
    "snapshot_ref",
    "snapshot_tensor",
    "snapshot_versions",
    "write_snapshot",
]
