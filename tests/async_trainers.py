"""The asynchronous trainer as the tests run it: the production loop, with a deadline on its wait."""

from __future__ import annotations

import time

import ray

from pipeline.finetune.tba.trainer import AsyncFinetuneTrainer


class DeadlineTrainer(AsyncFinetuneTrainer):
    """AsyncFinetuneTrainer whose wait for a batch ends after ``deadline_seconds`` with a
    TimeoutError naming the step and the store's state: a test never hangs."""

    deadline_seconds = 120.0

    def draw(self):
        self.deadline = time.monotonic() + self.deadline_seconds
        return super().draw()  # the production wait, which ends a wait that cannot end with its own error

    def draw_once(self):
        groups, recent, seconds = super().draw_once()
        if groups is None and time.monotonic() > self.deadline:
            raise TimeoutError(
                f"no batch within {self.deadline_seconds} s at step {self.step}: {ray.get(self.store.stats.remote())}"
            )
        return groups, recent, seconds
