"""gradpipe: keep, inspect and reuse the gradients and training state of training runs.

>>> import gradpipe as gp
>>> store = gp.open_store("file:///tmp/gp-doc", mode="w")  # doctest: +SKIP

Operations (:func:`ingest`, :func:`aggregate`, :func:`gc`, :func:`verify`) return reports that
share one shape (:class:`Report`: ``ok``, ``to_dict()``, ``summary()``); those
that compute Dask graphs take ``runner=`` (:func:`runner`), so one cluster
serves many of them.

The names are imported on first use (PEP 562), so ``import gradpipe`` — and the
``gradpipe`` command's ``--help`` and ``--version`` — load neither numpy nor dask.
"""

from __future__ import annotations

import importlib
import sys
import types
from typing import TYPE_CHECKING, Any, Final

from gradpipe._version import __version__
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

if TYPE_CHECKING:
    from gradpipe.aggregate import AggregateReport, aggregate
    from gradpipe.core.aggregate_manifest import AggregateManifest
    from gradpipe.core.chunk_stats import ChunkStats
    from gradpipe.core.ref_entry import RefEntry
    from gradpipe.core.report import Report
    from gradpipe.core.run_manifest import (
        AggregateEntry,
        DumpEntry,
        DumpManifest,
        RunManifest,
        TensorSchema,
    )
    from gradpipe.core.snapshot_manifest import SnapshotManifest
    from gradpipe.core.tensor_manifest import TensorManifest
    from gradpipe.evaluate import EvaluationReport, evaluate_codecs
    from gradpipe.graph.discover import Failure
    from gradpipe.graph.runner import Runner, runner
    from gradpipe.ingest import IngestReport, ingest
    from gradpipe.rounds import RoundsReport, rounds
    from gradpipe.runs import (
        Aggregate,
        Dump,
        Run,
        export_aggregate,
        export_dump,
        list_runs,
        open_run,
    )
    from gradpipe.server import apply_server_update
    from gradpipe.snapshot import SnapshotInfo, restore, restore_steps, snapshot, snapshot_log
    from gradpipe.snapshot_prune import PruneReport, prune
    from gradpipe.stats import compression_stats, summarize_stats
    from gradpipe.stats_plot import plot_stats
    from gradpipe.storage import Refs, Store, WriteStats, open_store
    from gradpipe.storage.gc import GcReport, gc
    from gradpipe.storage.locks import Lease
    from gradpipe.storage.verify import VerifyReport, verify
    from gradpipe.storage.walk import Problem
    from gradpipe.workflow import WorkflowReport, run_workflow
    from gradpipe.xarray import open_dataset

#: Public name → the module that defines it, imported on first access.
_LAZY: Final[dict[str, str]] = {
    "Aggregate": "gradpipe.runs",
    "AggregateEntry": "gradpipe.core.run_manifest",
    "AggregateManifest": "gradpipe.core.aggregate_manifest",
    "AggregateReport": "gradpipe.aggregate",
    "ChunkStats": "gradpipe.core.chunk_stats",
    "Dump": "gradpipe.runs",
    "EvaluationReport": "gradpipe.evaluate",
    "DumpEntry": "gradpipe.core.run_manifest",
    "DumpManifest": "gradpipe.core.run_manifest",
    "Failure": "gradpipe.graph.discover",
    "GcReport": "gradpipe.storage.gc",
    "IngestReport": "gradpipe.ingest",
    "Lease": "gradpipe.storage.locks",
    "Problem": "gradpipe.storage.walk",
    "PruneReport": "gradpipe.snapshot_prune",
    "RefEntry": "gradpipe.core.ref_entry",
    "Refs": "gradpipe.storage",
    "Report": "gradpipe.core.report",
    "RoundsReport": "gradpipe.rounds",
    "Run": "gradpipe.runs",
    "RunManifest": "gradpipe.core.run_manifest",
    "Runner": "gradpipe.graph.runner",
    "SnapshotInfo": "gradpipe.snapshot",
    "SnapshotManifest": "gradpipe.core.snapshot_manifest",
    "Store": "gradpipe.storage",
    "TensorManifest": "gradpipe.core.tensor_manifest",
    "TensorSchema": "gradpipe.core.run_manifest",
    "VerifyReport": "gradpipe.storage.verify",
    "WorkflowReport": "gradpipe.workflow",
    "WriteStats": "gradpipe.storage",
    "aggregate": "gradpipe.aggregate",
    "apply_server_update": "gradpipe.server",
    "compression_stats": "gradpipe.stats",
    "evaluate_codecs": "gradpipe.evaluate",
    "export_aggregate": "gradpipe.runs",
    "export_dump": "gradpipe.runs",
    "gc": "gradpipe.storage.gc",
    "ingest": "gradpipe.ingest",
    "list_runs": "gradpipe.runs",
    "open_dataset": "gradpipe.xarray",
    "open_run": "gradpipe.runs",
    "open_store": "gradpipe.storage",
    "plot_stats": "gradpipe.stats_plot",
    "prune": "gradpipe.snapshot_prune",
    "restore": "gradpipe.snapshot",
    "restore_steps": "gradpipe.snapshot",
    "rounds": "gradpipe.rounds",
    "runner": "gradpipe.graph.runner",
    "snapshot": "gradpipe.snapshot",
    "snapshot_log": "gradpipe.snapshot",
    "run_workflow": "gradpipe.workflow",
    "summarize_stats": "gradpipe.stats",
    "verify": "gradpipe.storage.verify",
}

__all__ = [
    "Aggregate",
    "AggregateEntry",
    "AggregateManifest",
    "AggregateReport",
    "ChunkStats",
    "ConflictError",
    "Dump",
    "DumpEntry",
    "DumpManifest",
    "EvaluationReport",
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
    "PruneReport",
    "ReadOnlyError",
    "RefEntry",
    "Refs",
    "Report",
    "RoundsReport",
    "Run",
    "RunManifest",
    "Runner",
    "SnapshotInfo",
    "SnapshotManifest",
    "StorageError",
    "Store",
    "TensorManifest",
    "TensorSchema",
    "UnsupportedFormatError",
    "VerifyReport",
    "WorkflowReport",
    "WriteStats",
    "__version__",
    "aggregate",
    "apply_server_update",
    "compression_stats",
    "evaluate_codecs",
    "export_aggregate",
    "export_dump",
    "gc",
    "ingest",
    "list_runs",
    "open_dataset",
    "open_run",
    "open_store",
    "plot_stats",
    "prune",
    "restore",
    "restore_steps",
    "rounds",
    "run_workflow",
    "runner",
    "snapshot",
    "snapshot_log",
    "summarize_stats",
    "verify",
]


def __getattr__(name: str) -> Any:
    try:
        module = _LAZY[name]
    except KeyError:
        raise AttributeError(f"module 'gradpipe' has no attribute {name!r}") from None
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *_LAZY})


class _Package(types.ModuleType):
    """The gradpipe package, whose functions ``ingest`` and ``aggregate`` share their names
    with submodules."""

    def __setattr__(self, name: str, value: object) -> None:
        # Importing the submodule ``gradpipe.ingest`` sets the package attribute
        # ``ingest`` to that module; the public name is the function, as it was
        # when this package imported everything eagerly.
        if name in _LAZY and isinstance(value, types.ModuleType):
            return
        super().__setattr__(name, value)


sys.modules[__name__].__class__ = _Package
