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
from gradpipe.testing.transformer import (
    TransformerBatch,
    TransformerConfig,
    TransformerRun,
    TransformerStep,
    train_transformer,
    write_transformer_run,
)

__all__ = [
    "SampleRun",
    "StepResult",
    "TrainingConfig",
    "TrainingState",
    "TransformerBatch",
    "TransformerConfig",
    "TransformerRun",
    "TransformerStep",
    "loss_and_gradients",
    "sample_gradients",
    "train",
    "train_transformer",
    "write_sample_run",
    "write_transformer_run",
]
