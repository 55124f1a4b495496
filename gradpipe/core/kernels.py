"""The compiled per-element loops of the chunk pipeline, where they were built.

``native`` is the C extension :mod:`gradpipe.core._kernels` (``gradpipe/core/_kernels.c``):
byte planes split and joined with the sign moved in the same pass, and the float statistics
of a chunk, each one pass that runs without the GIL. ``pip install`` builds it where a C
compiler is found; without one, ``native`` is None and the callers run their numpy versions
of the same loops (:mod:`gradpipe.codecs._planes`, :mod:`gradpipe.core.chunk_stats`), which
give the same bytes and the same statistics but the last bits of float sums. Design note 015
says why a small C file and not numba or a library.

``GRADPIPE_NO_KERNELS=1`` in the environment leaves them unused (to compare the two).
"""

from __future__ import annotations

import importlib
import os
from types import ModuleType

__all__ = ["native"]


def _load() -> ModuleType | None:
    if os.environ.get("GRADPIPE_NO_KERNELS", "") not in ("", "0"):
        return None
    try:
        return importlib.import_module("gradpipe.core._kernels")
    except ImportError:  # built without a C compiler
        return None


#: The extension module, or None (not built, or turned off).
native: ModuleType | None = _load()
