"""The training base shared by every trainer (docs/design.md, "Training base"): optimizer, schedule,
clipping, accumulation, mixed precision, crash-safe checkpoints, metrics, experiment trackers and progress, on accelerate."""

from pipeline.training.base import (
    OptimizerSettings,
    TrainingBase,
    make_accelerator,
    mixed_precision,
    parameter_groups,
    process_count,
)
from pipeline.training.schedule import SCHEDULES, learning_rate
from pipeline.training.tracking import Tracking

__all__ = [
    "OptimizerSettings",
    "SCHEDULES",
    "TrainingBase",
    "learning_rate",
    "make_accelerator",
    "mixed_precision",
    "parameter_groups",
    "process_count",
    "Tracking",
]
