"""Thread counts for a training loop: a stage's own torch threads while it trains."""

from __future__ import annotations

import logging
from contextlib import contextmanager

import torch

log = logging.getLogger("stepflow.training")


@contextmanager
def training_threads(count: int, what: str):
    """Run the block with ``count`` torch threads (0: leave them as they are), logged as ``what``'s
    training threads; the count before is restored after, also on error.

    A training loop that runs alone can use more threads than the rest of its stage (each stage's
    count is model.torch_threads): the thread count changes a run's float rounding, so it is a
    setting of the stage's config section (bootstrap.torch_threads, prm.torch_threads), never
    chosen from the machine."""
    before = torch.get_num_threads()
    if count > 0:
        torch.set_num_threads(count)
        log.info("%s: training with %d torch threads (%s.torch_threads)", what, torch.get_num_threads(), what)
    try:
        yield
    finally:
        torch.set_num_threads(before)
