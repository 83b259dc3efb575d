"""What every benchmark of `make bench` shares: a wall-clock timer and the machine's description.

Each library benchmarks its own batched design against a one-at-a-time reference
(pipeline.rollouts.bench, pipeline.finetune.bench, pipeline.generation.bench, prm.bench); each
returns {ours_s, reference_s, ratio = reference_s / ours_s, ...} and stages.bench writes them to
docs/benchmarks.md. Benchmarks measure; tests never time anything.
"""

from __future__ import annotations

import os
import platform
import time
from typing import Callable

import torch


def timed(fn: Callable[[], object]) -> float:
    """Seconds one call of ``fn`` takes."""
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def machine_description() -> str:
    if torch.cuda.is_available():
        return f"{torch.cuda.get_device_name(0)} (torch {torch.__version__})"
    return f"CPU {platform.machine()} x{os.cpu_count()} cores, torch {torch.__version__} ({torch.get_num_threads()} threads)"
