"""The fakes, built inside Ray workers: the sleeping engine and constant scorer a searcher's real
TrajectorySampler runs over, and the store and weights actors with timings and a restart between
sweep points."""

from __future__ import annotations

import math
import os
import random
import re
import time

from perf.async_cluster_sim.settings import Calibration
from pipeline.finetune.policy import SampledSolution
from pipeline.finetune.sampling import TrainProblem, TrajectorySampler
from pipeline.finetune.tba.settings import searcher_config
from pipeline.finetune.tba.stores import TrajectoryStore, WeightStore


class SleepingEngine:
    """The policy a searcher samples with: sleeps the calibrated seconds of a round and returns
    distinct placeholder solutions (3 steps, no final answer); load_weights keeps the version and
    the byte count of what it was sent."""

    def __init__(self, searcher: int, calibration: Calibration, steps: int = 3):
        self.searcher, self.calibration, self.steps = searcher, calibration, steps
        self.version, self.loaded_bytes, self.rounds = -1, 0, 0
        self.rng = random.Random(searcher)

    def load_weights(self, state: dict, version: int) -> None:
        self.loaded_bytes = sum(value.numel() * value.element_size() for value in state.values())
        self.version = version

    def sample(self, prompts, n, temperature, seed):
        c = self.calibration
        low, high = c.tokens_per_trajectory // 2, c.tokens_per_trajectory + c.tokens_per_trajectory // 2
        tokens = [[self.rng.randint(low, high) for _ in range(n)] for _ in prompts]
        time.sleep(sum(c.trajectory_seconds + count * c.token_seconds for row in tokens for count in row))
        self.rounds += 1
        return [
            [
                SampledSolution(
                    steps=[
                        f"searcher {self.searcher} round {self.rounds} prompt {p} sample {j} step {k}"
                        for k in range(self.steps)
                    ],
                    finished=True,
                    num_tokens=tokens[p][j],
                )
                for j in range(n)
            ]
            for p in range(len(prompts))
        ]


class ConstantScorer:
    """The PRM: log U = log 0.9 for every step."""

    def log_scores_many(self, items):
        return [[math.log(0.9)] * len(steps) for _, steps in items]


def make_sampler(index: int, problems: list, *, gfn, calibration: Calibration):
    """Searcher ``index``'s real TrajectorySampler over the sleeping engine (inside its actor)."""

    train = [TrainProblem(p["problem_id"], p["question"], p["question"], p["answer"]) for p in problems]
    engine = SleepingEngine(index, calibration)
    return TrajectorySampler(engine, ConstantScorer(), train, "tiny", searcher_config(gfn, index))


VERSION_FIELD = re.compile(r'"policy_version": (\d+)')


def timed_store_class():
    """TrajectoryStore with the seconds spent inside add, and checking and drawing batches, counted
    (the store's own time, Ray's call overhead excluded), and a restart to an empty buffer between
    sweep points."""

    class TimedTrajectoryStore(TrajectoryStore):
        def __init__(self, buffer_kwargs: dict):
            self.restart(buffer_kwargs)

        def restart(self, buffer_kwargs: dict) -> None:
            TrajectoryStore.__init__(self, buffer_kwargs)
            self.add_seconds = self.sample_seconds = 0.0
            self.sampled_rows = 0
            self.arrivals: dict[int, list[float]] = {}  # weights version -> when each of its rounds arrived

        def add(
            self,
            payload: str,
            searcher: int,
            idle_seconds: float = 0.0,
            loading_seconds: float = 0.0,
            version: int | None = None,
        ) -> int:
            start = time.perf_counter()
            try:
                return super().add(payload, searcher, idle_seconds, loading_seconds, version=version)
            finally:
                self.add_seconds += time.perf_counter() - start
                version = VERSION_FIELD.search(payload)  # a round's trajectories share one version
                if version is not None:
                    self.arrivals.setdefault(int(version.group(1)), []).append(time.monotonic())

        def round_arrivals(self) -> dict[int, list[float]]:
            """Weights version -> the monotonic times (this machine's clock) its rounds reached the store."""
            return self.arrivals

        def pid(self) -> int:
            return os.getpid()

        def can_draw(self, questions, now, max_staleness, minimum) -> bool:
            start = time.perf_counter()
            try:
                return super().can_draw(questions, now, max_staleness, minimum)
            finally:
                self.sample_seconds += time.perf_counter() - start

        def draw(self, questions, latest) -> str:
            start = time.perf_counter()
            try:
                return super().draw(questions, latest)
            finally:
                self.sample_seconds += time.perf_counter() - start
                self.sampled_rows += questions * self.buffer.per_question  # drawn once can_draw holds

        def timings(self) -> dict:
            return {
                **self.stats(),
                "add_seconds": self.add_seconds,
                "sample_seconds": self.sample_seconds,
                "sampled_rows": self.sampled_rows,
            }

    return TimedTrajectoryStore


def reopenable_weights_class():
    """WeightStore whose stop can be lifted: the same searchers serve every sweep point."""

    class ReopenableWeightStore(WeightStore):
        def resume(self) -> None:
            self.stopped = False

        def pid(self) -> int:
            return os.getpid()

    return ReopenableWeightStore
