"""The one exception tree of gradpipe.

Every error gradpipe raises derives from :class:`GradpipeError`; the builtin
mix-ins let callers catch what they already expect (``KeyError`` for a missing
object, ``ValueError`` for bad input). Exceptions keep only their message in
``args`` so they pickle: Dask ships them between processes.
"""

from __future__ import annotations

__all__ = [
    "ConflictError",
    "FormatError",
    "GradpipeError",
    "IntegrityError",
    "InvalidInputError",
    "LockedError",
    "NotFoundError",
    "ReadOnlyError",
    "StorageError",
    "UnsupportedFormatError",
]


class GradpipeError(Exception):
    """Base class of every error raised by gradpipe."""

    def __str__(self) -> str:
        # KeyError's __str__ would quote the message; one message style for all.
        return str(self.args[0]) if self.args else self.__class__.__name__


class NotFoundError(GradpipeError, KeyError):
    """A store, block, ref, run, step or peer does not exist."""


class InvalidInputError(GradpipeError, ValueError):
    """An argument, a name or an input file is not acceptable."""


class FormatError(GradpipeError):
    """Data is in a format, or a version of one, that this gradpipe cannot read."""


class UnsupportedFormatError(FormatError):
    """Data was written by a newer gradpipe, or is not in a format gradpipe knows."""


class IntegrityError(GradpipeError):
    """Stored bytes do not match their id: a block is corrupt or truncated."""


class ConflictError(GradpipeError):
    """A compare-and-swap lost: someone else moved the ref first."""


class LockedError(ConflictError):
    """The store is locked by another job (gc holds it exclusively, or writers hold it)."""


class ReadOnlyError(GradpipeError, PermissionError):
    """A write was attempted on a store opened with ``mode="r"``."""


class StorageError(GradpipeError, OSError):
    """The storage backend failed (I/O error, permission, network)."""
