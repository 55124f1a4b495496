"""Per-task byte counts for Dask's Fine Performance Metrics, and nothing without ``distributed``.

Where gradpipe reads or writes bytes inside a task, it digests them through
``distributed.metrics.context_meter``: on a ``distributed`` worker each digest
is filed under the running task's prefix and span, summed on the scheduler,
and shown on the dashboard's *Fine Performance Metrics* page (unit "bytes")
and on the gradpipe page (:mod:`gradpipe.dashboard`), which reads them per
span to show an operation's live throughput. Outside a worker (local threads,
plain Python) no callback is listening and a digest costs a dictionary look-up;
``distributed`` is never imported here: if nothing imported it, no one listens.

The activities, all in bytes:

==================  ==============================================================
``gradpipe-read``   bytes read: a dump file's byte ranges, a stored block's frame
``gradpipe-write``  bytes of new blocks written to the store (dedup hits excluded)
``gradpipe-raw``    logical bytes of the chunks a task encoded for the store
==================  ==============================================================

``raw / write`` is what an ingest's report calls its ratio (dedup and
compression together).
"""

from __future__ import annotations

import sys
from typing import Final

__all__ = ["ACTIVITIES", "RAW", "READ", "WRITE", "digest_bytes"]

READ: Final = "gradpipe-read"
WRITE: Final = "gradpipe-write"
RAW: Final = "gradpipe-raw"
#: Every activity gradpipe digests, in the order the dashboard shows them.
ACTIVITIES: Final = (READ, WRITE, RAW)


def digest_bytes(activity: str, nbytes: int) -> None:
    """File ``nbytes`` under ``activity`` for the task running on this thread, if any.

    Call it on the task's own thread: ``context_meter`` listens through a
    context variable, which a thread pool's threads do not inherit.
    """
    if nbytes and "distributed" in sys.modules:
        from distributed.metrics import context_meter

        context_meter.digest_metric(activity, nbytes, "bytes")
