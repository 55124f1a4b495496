"""gradpipe: keep, inspect and reuse the gradients and training state of training runs.

>>> import gradpipe as gp
>>> store = gp.open_store("file:///tmp/gp-doc", mode="w")  # doctest: +SKIP
"""

from gradpipe._version import __version__
from gradpipe.errors import (
    ConflictError,
    GradpipeError,
    IntegrityError,
    InvalidInputError,
    NotFoundError,
    ReadOnlyError,
    StorageError,
    UnsupportedFormatError,
)
from gradpipe.ingest import IngestReport, ingest
from gradpipe.runs import Dump, Run, export_dump, list_runs, open_run
from gradpipe.storage import Store, open_store
from gradpipe.storage.gc import GcReport, gc
from gradpipe.storage.verify import VerifyReport, verify

__all__ = [
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
