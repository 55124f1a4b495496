"""Realistic data generators and shared test helpers, shipped with gradpipe."""

from gradpipe.testing.training import (
    SampleRun,
    StepResult,
    TrainingConfig,
    TrainingState,
    loss_and_gradients,
    sample_gradients,
    train,
    write_sample_run,
)

__all__ = [
    "SampleRun",
    "StepResult",
    "TrainingConfig",
    "TrainingState",
    "loss_and_gradients",
    "sample_gradients",
    "train",
    "write_sample_run",
]
