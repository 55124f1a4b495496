"""gradpipe: keep, inspect and reuse the gradients and training state of training runs.

>>> import gradpipe as gp
>>> store = gp.open_store("file:///tmp/gp-doc", mode="w")  # doctest: +SKIP

Operations (:func:`ingest`, :func:`gc`, :func:`verify`) return reports that
share one shape (:class:`Report`: ``ok``, ``to_dict()``, ``summary()``); those
that compute Dask graphs take ``runner=`` (:func:`runner`), so one cluster
serves many of them.
"""

from gradpipe._version import __version__
from gradpipe.core.chunk_stats import ChunkStats
from gradpipe.core.ref_entry import RefEntry
from gradpipe.core.report import Report
from gradpipe.core.run_manifest import DumpEntry, DumpManifest, RunManifest, TensorSchema
from gradpipe.core.tensor_manifest import TensorManifest
from gradpipe.errors import (
    ConflictError,
    FormatError,
    GradpipeError,
    IntegrityError,
    InvalidInputError,
    LockedError,
    NotFoundError,
    ReadOnlyError,
    StorageError,
    UnsupportedFormatError,
)
from gradpipe.graph.discover import Failure
from gradpipe.graph.runner import Runner, runner
from gradpipe.ingest import IngestReport, ingest
from gradpipe.runs import Dump, Run, export_dump, list_runs, open_run
from gradpipe.storage import Refs, Store, WriteStats, open_store
from gradpipe.storage.gc import GcReport, gc
from gradpipe.storage.locks import Lease
from gradpipe.storage.verify import VerifyReport, verify
from gradpipe.storage.walk import Problem

__all__ = [
    "ChunkStats",
    "ConflictError",
    "Dump",
    "DumpEntry",
    "DumpManifest",
    "Failure",
    "FormatError",
    "GcReport",
    "GradpipeError",
    "IngestReport",
    "IntegrityError",
    "InvalidInputError",
    "Lease",
    "LockedError",
    "NotFoundError",
    "Problem",
    "ReadOnlyError",
    "RefEntry",
    "Refs",
    "Report",
    "Run",
    "RunManifest",
    "Runner",
    "StorageError",
    "Store",
    "TensorManifest",
    "TensorSchema",
    "UnsupportedFormatError",
    "VerifyReport",
    "WriteStats",
    "__version__",
    "export_dump",
    "gc",
    "ingest",
    "list_runs",
    "open_run",
    "open_store",
    "runner",
    "verify",
]
