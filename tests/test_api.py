"""The public API is what we mean it to be, and its errors travel between processes."""

from __future__ import annotations

import pickle
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import gradpipe as gp
from gradpipe import errors
from gradpipe.core.ids import block_key

PUBLIC = [
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


def test_public_names() -> None:
    assert gp.__all__ == PUBLIC
    assert sorted(gp.__all__) == gp.__all__
    for name in gp.__all__:
        assert hasattr(gp, name)


def test_public_calls_return_exported_types(tmp_path: Path) -> None:
    """What the public calls return is of the types exported here (so users can annotate it)."""
    dumps = tmp_path / "dumps"
    dumps.mkdir()
    np.savez(dumps / "step=1.npz", w=np.arange(6, dtype=np.float32).reshape(2, 3))
    (dumps / "step=2.npz").write_bytes(b"not a zip")
    store = gp.open_store(tmp_path / "store", mode="w")
    with gp.runner(workers=2) as runner:
        assert isinstance(runner, gp.Runner)
        report = gp.ingest(store, str(dumps / "step={step}.npz"), run="r", runner=runner)
    assert isinstance(report, gp.Report)
    assert isinstance(report.writes, gp.WriteStats)
    [failure] = report.failures
    assert isinstance(failure, gp.Failure)
    assert failure.step == 2
    run = gp.open_run(store, "r")
    assert isinstance(run.manifest, gp.RunManifest)
    [entry] = run
    assert isinstance(entry, gp.DumpEntry)
    assert isinstance(run.schema["w"], gp.TensorSchema)
    dump = run.dump(1, entry.peer)
    assert isinstance(dump.manifest, gp.DumpManifest)
    info = dump.info("w")
    assert isinstance(info, gp.TensorManifest)
    assert isinstance(info.summary(), gp.ChunkStats)
    aggregated = gp.aggregate(store, run="r", method="mean")
    assert isinstance(aggregated, gp.AggregateReport)
    assert isinstance(aggregated, gp.Report)
    view = gp.open_run(store, "r").aggregate("mean", step=1)
    assert isinstance(view, gp.Aggregate)
    assert isinstance(view.manifest, gp.AggregateManifest)
    assert isinstance(gp.open_run(store, "r").aggregates[0], gp.AggregateEntry)
    evaluated = gp.evaluate_codecs(store, run="r", codecs="bf16", sample=1)
    assert isinstance(evaluated, gp.EvaluationReport)
    assert isinstance(evaluated, gp.Report)
    assert isinstance(store.refs, gp.Refs)
    assert isinstance(store.refs.entry("runs/r"), gp.RefEntry)
    with store.writing("api test") as lease:
        assert isinstance(lease, gp.Lease)
    verified = gp.verify(store)
    assert isinstance(verified, gp.VerifyReport)
    assert isinstance(gp.gc(store, dry_run=True), gp.GcReport)
    block = next(iter(info.data_children()), None) or store.refs.get("runs/r")
    store.backend.delete(block_key(block))
    [problem] = gp.verify(store).problems
    assert isinstance(problem, gp.Problem)
    assert problem.id == block
    assert issubclass(gp.UnsupportedFormatError, gp.FormatError)
    assert issubclass(gp.LockedError, gp.ConflictError)


def test_import_is_light() -> None:
    """Integrations (xarray, distributed, ml_dtypes, torch) load only when used."""
    code = "import sys, gradpipe; print(sorted({m.split('.')[0] for m in sys.modules}))"
    loaded = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True
    )
    for heavy in ("xarray", "distributed", "ml_dtypes", "s3fs", "torch"):
        assert f"'{heavy}'" not in loaded.stdout
    # Nor the torch adapter, even after the whole public API has been touched.
    code = (
        "import sys, gradpipe; [getattr(gradpipe, n) for n in gradpipe.__all__]; "
        "print(sorted(sys.modules))"
    )
    loaded = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True
    )
    assert "'gradpipe.snapshots.api'" in loaded.stdout
    assert "'gradpipe.torch'" not in loaded.stdout
    assert "'torch'" not in loaded.stdout


@pytest.mark.parametrize("name", errors.__all__)
def test_errors_pickle_and_keep_their_message(name: str) -> None:
    cls = getattr(errors, name)
    error = cls("tensor 'w' of step 3, peer p1: shape (2,) != (3,)")
    back = pickle.loads(pickle.dumps(error))
    assert type(back) is cls
    assert str(back) == str(error)
    assert isinstance(back, errors.GradpipeError)


def test_error_tree_mixes_in_builtins() -> None:
    assert issubclass(errors.NotFoundError, KeyError)
    assert issubclass(errors.InvalidInputError, ValueError)
    assert issubclass(errors.StorageError, OSError)
    assert issubclass(errors.UnsupportedFormatError, errors.FormatError)
    assert not issubclass(errors.FormatError, ValueError)
    assert issubclass(errors.LockedError, errors.ConflictError)
    # KeyError quotes its message; ours reads like every other error.
    assert str(errors.NotFoundError("no run 'x'")) == "no run 'x'"
