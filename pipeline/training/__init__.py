"""The training base shared by every trainer (docs/design.md, "Training base"): optimizer, schedule,
clipping, accumulation, mixed precision, crash-safe checkpoints, metrics, experiment trackers and progress, on accelerate."""

from pipeline.training.accelerator import make_accelerator, mixed_precision, process_count
from pipeline.training.base import TrainingBase
from pipeline.training.optimizer import OptimizerSettings, parameter_groups
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
