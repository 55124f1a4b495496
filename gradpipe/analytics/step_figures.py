"""What an analysis task returns for one step: its arrays, or why it failed."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

__all__ = ["StepFailure", "StepFigures"]


@dataclass
class StepFigures:
    """The figures of one step: arrays whose first two dims are ``(label, tensor)``.

    ``labels`` are the step's peers in the run's order (or the one aggregate's
    name), ``tensors`` the tensor names in the order the dumps list them.
    """

    step: int
    labels: list[str]
    tensors: list[str]
    arrays: dict[str, np.ndarray]
    #: Chunks decoded to compute them (inline ones included).
    chunks_read: int = 0


@dataclass(frozen=True)
class StepFailure:
    """A step whose figures could not be computed, and why."""

    step: int
    reason: str
