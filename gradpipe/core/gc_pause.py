"""Running a function without Python's cyclic garbage collector.

Reading the manifests of a long run creates millions of small objects that
all stay alive until the caller is done (a dataset's arrays, a statistics
table); every collection the allocations trigger walks them all again, so the
cost grows with the square of the run. They hold no reference cycles, so
nothing is lost by collecting after the function returns (measured on 2,000
dumps x 105 tensors: opening them as a dataset took 2.5x the CPU time with the
collector on, their statistics 2.0x).
"""

from __future__ import annotations

import functools
import gc
from collections.abc import Callable
from typing import ParamSpec, TypeVar

__all__ = ["gc_paused"]

P = ParamSpec("P")
R = TypeVar("R")


def gc_paused(function: Callable[P, R]) -> Callable[P, R]:
    """``function``, run with the cyclic garbage collector disabled (re-enabled after)."""

    @functools.wraps(function)
    def paused(*args: P.args, **kwargs: P.kwargs) -> R:
        enabled = gc.isenabled()
        gc.disable()
        try:
            return function(*args, **kwargs)
        finally:
            if enabled:
                gc.enable()

    return paused
