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
from gradpipe.storage import Store, open_store
from gradpipe.storage.gc import GcReport, gc
from gradpipe.storage.verify import VerifyReport, verify

__all__ = [
    "ConflictError",
    "GcReport",
    "GradpipeError",
    "IntegrityError",
    "InvalidInputError",
    "NotFoundError",
    "ReadOnlyError",
    "StorageError",
    "Store",
    "UnsupportedFormatError",
    "VerifyReport",
    "__version__",
    "gc",
    "open_store",
    "verify",
]
