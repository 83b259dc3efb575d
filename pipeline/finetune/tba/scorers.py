"""The PRM scorer actors (gfn.scorer_actors > 0): the PRM in processes of its own (ScorerActor),
and the searcher's end of them (PooledScorer), found by name (scorer_name)."""

from __future__ import annotations

import os
from collections.abc import Callable

import torch

from pipeline.finetune.tba import ray_cluster


def scorer_name(index: int) -> str:
    """Scorer actor ``index``'s name in the run's namespace (searchers look the actors up by name)."""
    return f"scorer-{index}"


class ScorerActor:
    """The PRM in a process of its own (one of gfn.scorer_actors): scores what searchers send it,
    one call at a time, with the scorer ``make_scorer`` builds here (the one a searcher would build)."""

    def __init__(self, index: int, make_scorer: Callable):
        import ray  # the optional extra (we run inside a Ray worker)

        torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
        self.index, self.scorer = index, make_scorer()
        self.calls = self.solutions = 0
        self.restarted = ray.get_runtime_context().was_current_actor_reconstructed

    def log_scores_many(self, solutions: list) -> list[list[float]]:
        """log U of every step of each (question, steps): the PRM's own answer, in order."""
        self.calls, self.solutions = self.calls + 1, self.solutions + len(solutions)
        return self.scorer.log_scores_many([(question, list(steps)) for question, steps in solutions])

    def status(self) -> dict:
        """Calls and solutions scored, its process, whether Ray restarted it, where Ray placed it."""
        return {
            "index": self.index,
            "calls": self.calls,
            "solutions": self.solutions,
            "pid": os.getpid(),
            "restarted": self.restarted,
            "placement": ray_cluster.placement(),
        }


class PooledScorer:
    """A searcher's scorer when scorer actors hold the PRM: ``log_scores_many`` sends a round's
    (question, steps) pairs, all of them, to one actor (the PRM sees the batch it would see in the
    searcher, so the scores are the same) and returns its answer. Round robin: searcher i's calls go
    to actors i, i + 1, ... (mod gfn.scorer_actors). The actors are looked up by name at the first
    call (a restarted searcher finds them again); a restarting actor's calls are retried by Ray."""

    def __init__(self, actors: int, first: int = 0):
        if actors < 1:
            raise ValueError(f"gfn.scorer_actors={actors}: a pooled scorer needs at least one actor")
        self.actors, self.next, self.handles = actors, first % actors, None

    def log_scores_many(self, solutions) -> list[list[float]]:
        import ray  # the optional extra (we run inside a Ray worker)

        if self.handles is None:
            self.handles = [ray.get_actor(scorer_name(i)) for i in range(self.actors)]
        actor, self.next = self.handles[self.next], (self.next + 1) % self.actors
        return ray.get(actor.log_scores_many.remote([(question, list(steps)) for question, steps in solutions]))
