"""The public API is what we mean it to be, and its errors travel between processes."""

from __future__ import annotations

import pickle
import subprocess
import sys

import pytest

import gradpipe as gp
from gradpipe import errors

PUBLIC = [
    "ConflictError",
    "Dump",
    "GcReport",
    "GradpipeError",
    "IngestReport",
    "IntegrityError",
    "InvalidInputError",
    "NotFoundError",
    "ReadOnlyError",
    "Run",
    "StorageError",
    "Store",
    "UnsupportedFormatError",
    "VerifyReport",
    "__version__",
    "export_dump",
    "gc",
    "ingest",
    "list_runs",
    "open_run",
    "open_store",
    "verify",
]


def test_public_names() -> None:
    assert gp.__all__ == PUBLIC
    assert sorted(gp.__all__) == gp.__all__
    for name in gp.__all__:
        assert hasattr(gp, name)


def test_import_is_light() -> None:
    """Integrations (xarray, distributed, ml_dtypes) load only when used."""
    code = "import sys, gradpipe; print(sorted({m.split('.')[0] for m in sys.modules}))"
    loaded = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True
    )
    for heavy in ("xarray", "distributed", "ml_dtypes", "s3fs", "torch"):
        assert f"'{heavy}'" not in loaded.stdout


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
