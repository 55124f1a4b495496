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
from typing import TYPE_CHECKING, Any, Final

from gradpipe import _moved
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

_moved.install()

if TYPE_CHECKING:
    from gradpipe.aggregation.api import AggregateReport, aggregate
    from gradpipe.aggregation.rounds import RoundsReport, rounds
    from gradpipe.aggregation.server_update import apply_server_update
    from gradpipe.analytics.analyze import AnalysisReport, analyze
    from gradpipe.analytics.api import first_nonfinite, gradient_norms, norms_by, spikes
    from gradpipe.analytics.diff import DiffReport, diff
    from gradpipe.analytics.histograms import gradient_histograms
    from gradpipe.analytics.influence import influence
    from gradpipe.analytics.peers import noise_scale, peer_agreement
    from gradpipe.analytics.projections import project_gradients
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
    from gradpipe.evaluation.api import EvaluationReport, evaluate_codecs
    from gradpipe.graph.runner import Runner, runner
    from gradpipe.ingestion.api import ingest
    from gradpipe.ingestion.discover import Failure
    from gradpipe.ingestion.report import IngestReport
    from gradpipe.runs import (
        Aggregate,
        Dump,
        Run,
        export_aggregate,
        export_dump,
        list_runs,
        open_run,
    )
    from gradpipe.snapshots.api import SnapshotInfo, restore, restore_steps, snapshot, snapshot_log
    from gradpipe.snapshots.prune import PruneReport, prune
    from gradpipe.statistics.api import compression_stats, summarize_stats
    from gradpipe.statistics.plot import plot_stats
    from gradpipe.storage import Refs, Store, WriteStats, open_store
    from gradpipe.storage.gc import GcReport, gc
    from gradpipe.storage.locks import Lease
    from gradpipe.storage.verify import VerifyReport, verify
    from gradpipe.storage.walk import Problem
    from gradpipe.workflow import WorkflowReport, run_workflow
    from gradpipe.xarray.backend import open_dataset

#: Public name → the module that defines it, imported on first access.
_LAZY: Final[dict[str, str]] = {
    "Aggregate": "gradpipe.runs",
    "AggregateEntry": "gradpipe.core.run_manifest",
    "AggregateManifest": "gradpipe.core.aggregate_manifest",
    "AggregateReport": "gradpipe.aggregation.api",
    "AnalysisReport": "gradpipe.analytics.analyze",
    "ChunkStats": "gradpipe.core.chunk_stats",
    "Dump": "gradpipe.runs",
    "EvaluationReport": "gradpipe.evaluation.api",
    "DiffReport": "gradpipe.analytics.diff",
    "DumpEntry": "gradpipe.core.run_manifest",
    "DumpManifest": "gradpipe.core.run_manifest",
    "Failure": "gradpipe.ingestion.discover",
    "GcReport": "gradpipe.storage.gc",
    "IngestReport": "gradpipe.ingestion.report",
    "Lease": "gradpipe.storage.locks",
    "Problem": "gradpipe.storage.walk",
    "PruneReport": "gradpipe.snapshots.prune",
    "RefEntry": "gradpipe.core.ref_entry",
    "Refs": "gradpipe.storage",
    "Report": "gradpipe.core.report",
    "RoundsReport": "gradpipe.aggregation.rounds",
    "Run": "gradpipe.runs",
    "RunManifest": "gradpipe.core.run_manifest",
    "Runner": "gradpipe.graph.runner",
    "SnapshotInfo": "gradpipe.snapshots.api",
    "SnapshotManifest": "gradpipe.core.snapshot_manifest",
    "Store": "gradpipe.storage",
    "TensorManifest": "gradpipe.core.tensor_manifest",
    "TensorSchema": "gradpipe.core.run_manifest",
    "VerifyReport": "gradpipe.storage.verify",
    "WorkflowReport": "gradpipe.workflow",
    "WriteStats": "gradpipe.storage",
    "aggregate": "gradpipe.aggregation.api",
    "analyze": "gradpipe.analytics.analyze",
    "apply_server_update": "gradpipe.aggregation.server_update",
    "compression_stats": "gradpipe.statistics.api",
    "diff": "gradpipe.analytics.diff",
    "evaluate_codecs": "gradpipe.evaluation.api",
    "export_aggregate": "gradpipe.runs",
    "export_dump": "gradpipe.runs",
    "first_nonfinite": "gradpipe.analytics.api",
    "gc": "gradpipe.storage.gc",
    "gradient_histograms": "gradpipe.analytics.histograms",
    "gradient_norms": "gradpipe.analytics.api",
    "influence": "gradpipe.analytics.influence",
    "ingest": "gradpipe.ingestion.api",
    "list_runs": "gradpipe.runs",
    "noise_scale": "gradpipe.analytics.peers",
    "norms_by": "gradpipe.analytics.api",
    "open_dataset": "gradpipe.xarray.backend",
    "open_run": "gradpipe.runs",
    "open_store": "gradpipe.storage",
    "peer_agreement": "gradpipe.analytics.peers",
    "plot_stats": "gradpipe.statistics.plot",
    "project_gradients": "gradpipe.analytics.projections",
    "prune": "gradpipe.snapshots.prune",
    "restore": "gradpipe.snapshots.api",
    "restore_steps": "gradpipe.snapshots.api",
    "rounds": "gradpipe.aggregation.rounds",
    "runner": "gradpipe.graph.runner",
    "snapshot": "gradpipe.snapshots.api",
    "snapshot_log": "gradpipe.snapshots.api",
    "spikes": "gradpipe.analytics.api",
    "run_workflow": "gradpipe.workflow",
    "summarize_stats": "gradpipe.statistics.api",
    "verify": "gradpipe.storage.verify",
}

__all__ = [
    "Aggregate",
    "AggregateEntry",
    "AggregateManifest",
    "AggregateReport",
    "AnalysisReport",
    "ChunkStats",
    "ConflictError",
    "DiffReport",
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
    "analyze",
    "apply_server_update",
    "compression_stats",
    "diff",
    "evaluate_codecs",
    "export_aggregate",
    "export_dump",
    "first_nonfinite",
    "gc",
    "gradient_histograms",
    "gradient_norms",
    "influence",
    "ingest",
    "list_runs",
    "noise_scale",
    "norms_by",
    "open_dataset",
    "open_run",
    "open_store",
    "peer_agreement",
    "plot_stats",
    "project_gradients",
    "prune",
    "restore",
    "restore_steps",
    "rounds",
    "run_workflow",
    "runner",
    "snapshot",
    "snapshot_log",
    "spikes",
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
