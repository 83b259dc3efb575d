"""The learning-rate schedule every trainer uses: linear warmup, then cosine, linear or constant.

    lr(step) = base_lr * (step + 1) / warmup                                  step < warmup
    lr(step) = base_lr * (m + (1 - m) * decay(min(step / total, 1)))          otherwise

with decay(p) = (1 + cos(pi p)) / 2 (cosine), 1 - p (linear) or 1 (constant), m = min_lr_ratio,
and ``step`` the number of optimizer steps already taken (0 for the first). The decay runs over
the whole run's progress step / total, so the last step's rate is base_lr * m whatever the warmup.
"""

from __future__ import annotations

import math
import typing

from pipeline.config.schema import Schedule

SCHEDULES = typing.get_args(Schedule)


def check_schedule(name: str, key: str = "scheduler") -> None:
    if name not in SCHEDULES:
        raise ValueError(f"{key} must be one of {' | '.join(SCHEDULES)}, got {name!r}")


def learning_rate(
    step: int,
    base_lr: float,
    total_steps: int,
    warmup_steps: int = 0,
    schedule: str = "cosine",
    min_lr_ratio: float = 0.0,
) -> float:
    """The rate of optimizer step ``step`` (module docstring)."""
    check_schedule(schedule)
    if step < warmup_steps:
        return base_lr * (step + 1) / warmup_steps
    if schedule == "constant":
        return base_lr
    progress = min(step / max(total_steps, 1), 1.0)
    decay = 0.5 * (1.0 + math.cos(math.pi * progress)) if schedule == "cosine" else 1.0 - progress
    return base_lr * (min_lr_ratio + (1.0 - min_lr_ratio) * decay)
