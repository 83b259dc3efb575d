"""The asynchronous trainer as the tests run it: the production loop, with a deadline on its wait."""

from __future__ import annotations

import time

import ray

from pipeline.finetune.async_ray import AsyncFinetuneTrainer


class DeadlineTrainer(AsyncFinetuneTrainer):
    """AsyncFinetuneTrainer whose wait for a batch ends after ``deadline_seconds`` with a
    TimeoutError naming the step and the store's state: a test never hangs."""

    deadline_seconds = 120.0

    def draw(self):
        deadline, waited = time.monotonic() + self.deadline_seconds, 0.0
        while True:
            groups, recent, seconds = self.draw_once()
            waited += seconds
            if groups is not None:
                return groups, recent, waited
            if time.monotonic() > deadline:
                raise TimeoutError(
                    f"no batch within {self.deadline_seconds} s at step {self.step}: "
                    f"{ray.get(self.store.stats.remote())}"
                )
