"""The dump formats gradpipe reads: one explicit, lazy table of readers.

Like numcodecs' ``registry.py``, the table names each format's reader as a
``"module:object"`` string and imports it on first use: reading a
safetensors file never imports the torch reader (nor torch). A format is known
because it is listed here, never because some module happened to be imported.

Every reader has the small interface of :class:`DumpReader`: parse the header
into :class:`~gradpipe.formats.spec.TensorSpec` objects (through
:func:`~gradpipe.formats.spec.parse_tensor_spec`, so every path validates the
same way) and read whole tensors.
"""

from __future__ import annotations

import importlib
from collections.abc import Mapping
from dataclasses import dataclass
from typing import IO, Final, Protocol, runtime_checkable

import numpy as np

from gradpipe.core.display import printable
from gradpipe.errors import InvalidInputError
from gradpipe.formats.spec import TensorSpec

__all__ = ["DUMP_FORMATS", "READERS", "DumpReader", "DumpSource", "get_reader"]

#: File extension → dump format name.
DUMP_FORMATS: Final[dict[str, str]] = {
    ".safetensors": "safetensors",
    ".npy": "npy",
    ".npz": "npz",
    ".pt": "torch",
    ".pth": "torch",
}

#: Dump format name → ``"module:object"`` of its reader, imported on first use.
READERS: Final[dict[str, str]] = {
    "safetensors": "gradpipe.formats.safetensors:READER",
    "npy": "gradpipe.formats.npy:READER",
    "npz": "gradpipe.formats.npz:READER",
    "torch": "gradpipe.formats.torch:READER",
}

_loaded: dict[str, DumpReader] = {}


@dataclass(frozen=True)
class DumpSource:
    """An open dump file, as a reader gets it.

    Attributes
    ----------
    file : binary file object
        Seekable, positioned anywhere.
    path : str
        The file's path on its filesystem, for messages.
    size : int
        File size in bytes.
    local_path : str or None
        An OS path that opens the very file ``file`` is (``/proc/self/fd/N``),
        so a reader may memory-map it; ``None`` for a remote file, or where the
        OS has no such path. Never ``path`` itself: by the time a reader opened
        it, it could name another file than the one checked.
    """

    file: IO[bytes]
    path: str
    size: int
    local_path: str | None


@runtime_checkable
class DumpReader(Protocol):
    """What every dump format provides."""

    #: The format's name, a key of :data:`READERS`.
    format: str
    #: Whether the header is read in small pieces (False: the reader loads the file).
    partial_header: bool

    def parse_header(self, source: DumpSource) -> tuple[tuple[TensorSpec, ...], dict[str, str]]:
        """The validated specs of every tensor, in file order, and the file's own metadata."""
        ...

    def read_tensors(
        self, source: DumpSource, specs: Mapping[str, TensorSpec]
    ) -> dict[str, np.ndarray]:
        """Canonical arrays of the tensors in ``specs``, validated as the header was."""
        ...


def get_reader(fmt: str) -> DumpReader:
    """The reader of a dump format, importing its module on first use.

    >>> get_reader("npy").format
    'npy'
    """
    reader = _loaded.get(fmt)
    if reader is not None:
        return reader
    try:
        target = READERS[fmt]
    except KeyError:
        raise InvalidInputError(
            f"no reader for dump format {printable(fmt)}; gradpipe reads {', '.join(READERS)}"
        ) from None
    module, _, name = target.partition(":")
    loaded = getattr(importlib.import_module(module), name)
    if not isinstance(loaded, DumpReader) or loaded.format != fmt:  # our own table's invariant
        raise TypeError(f"{target} is not the DumpReader of format {printable(fmt)}")
    _loaded[fmt] = loaded
    return loaded
