"""The searcher actor (a plain class; the trainer wraps it with ray.remote at start): round after
round it samples its share of the problems with the newest weights it has, scores them and sends
them to the store."""

from __future__ import annotations

import json
import os
import time
from collections.abc import Callable

import torch

from pipeline.finetune.sampling import TrajectorySampler
from pipeline.finetune.tba import ray_cluster
from pipeline.finetune.tba.cores import core_for, pin_process
from pipeline.finetune.tba.publication import WeightReceiver
from pipeline.finetune.tba.settings import searcher_share
from pipeline.finetune.tba.stores import WAIT_SECONDS

MakeSampler = Callable[
    [int, list], TrajectorySampler
]  # (searcher index, training problems as JSON) -> its sampler (built in the actor)


class Searcher:
    """Samples and scores round after round with the newest weights it can get.

    A threaded actor (two calls at a time): while ``run`` samples, the trainer's ``join`` and
    ``receive`` calls take collective weights into its receiver's staging slot, which ``run``
    picks up at the start of its next round (pipeline.finetune.tba.publication).
    """

    def __init__(
        self,
        index: int,
        make_sampler: MakeSampler,
        names: dict[str, str],
        cores: list[int] | None = None,
        *,
        searchers: int,
    ):
        """names: the store's and the weights actor's names in the run's namespace (looked up, not
        passed as handles: Ray keeps nothing of a restartable actor's arguments alive for its restarts);
        cores: gfn.searcher_cores (this searcher pins its process to core_for(index, cores));
        searchers: how many searchers the run has (this one samples its share of the problems:
        searcher_share)."""
        import ray  # the optional extra (we run inside a Ray worker)

        if cores:
            pin_process({core_for(index, cores)})
        torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
        store, weights = ray.get_actor(names["store"]), ray.get_actor(names["weights"])
        self.index, self.store, self.weights = index, store, weights
        self.restarted = ray.get_runtime_context().was_current_actor_reconstructed
        if self.restarted:
            store.count_restart.remote(index)
        # the problems by a reference the trainer holds: a restarted searcher reads the same object again
        problems = ray.get(ray.get(weights.problems.remote())[0])
        self.sampler = make_sampler(index, searcher_share(problems, index, searchers))
        self.version = self.sampled_version = -1
        self.receiver = WeightReceiver(f"searcher {index}")

    def join(self, address: tuple, rank: int, layout: dict, version: int) -> bool:
        """Become ``rank`` of the trainer's new weights group and receive ``version`` over it."""
        return self.receiver.join(address, rank, layout, version)

    def receive(self, version: int) -> bool:
        """The trainer's weights of ``version``, over the group, staged for the next round."""
        return self.receiver.receive(version)

    def status(self) -> dict:
        """The weights version this searcher samples with, the one its last sent trajectories carry,
        how its weights reach it, its process, the cores it may run on, whether Ray restarted it and
        where Ray placed it (placement group, bundle, GPU ids: ray_cluster.placement)."""
        return {
            "version": self.version,
            "sampled_version": self.sampled_version,
            "channel": self.receiver.backend,
            "pid": os.getpid(),
            "cores": sorted(os.sched_getaffinity(0)),
            "restarted": self.restarted,
            "placement": ray_cluster.placement(),
        }

    def take_weights(self, version: int, refs: list | None, layout: dict | None) -> bool:
        """The newest weights into the sampler's policy: the object store's ``refs`` of ``version``
        (when the weights actor has newer ones than this searcher), or those the group staged;
        whether any were loaded."""
        if refs is not None:
            self.receiver.fetch(version, refs, layout)
        staged = self.receiver.take()
        if staged is None or staged[0] <= self.version:
            return False
        self.sampler.policy.load_weights(staged[1], staged[0])
        self.version = staged[0]
        return True

    def run(self) -> int:
        """Until the run stops: returns the number of rounds sampled. A searcher that needs weights
        newer than its own (none yet, or its gfn.searcher_rounds_per_version rounds of them done)
        waits on the weights actor until they are published (with the collective transport, then on
        its receiver until they have come over the group), each wait at most WAIT_SECONDS, and asks
        again after it; one that does not takes whatever is newer at the start of its round."""
        import ray  # the optional extra (we run inside a Ray worker)

        rounds, rounds_of_version, idle, loading = 0, 0, 0.0, 0.0
        limit = self.sampler.cfg.searcher_rounds_per_version
        while True:
            needs = self.version < 0 or (limit is not None and rounds_of_version >= limit)
            start = time.monotonic()
            version, refs, layout, stopped = ray.get(
                self.weights.wait_newer.remote(self.version, WAIT_SECONDS if needs else 0.0)
            )
            if stopped:
                return rounds
            if needs and refs is None and version > self.version:  # announced; the weights come over the group
                self.receiver.wait(WAIT_SECONDS)
            if needs:
                idle += time.monotonic() - start
            start = time.monotonic()
            if self.take_weights(version, refs, layout):
                loading += time.monotonic() - start
                rounds_of_version = 0
            if self.version < 0 or (limit is not None and rounds_of_version >= limit):  # nothing (new) yet: wait again
                continue
            trajectories, _ = self.sampler.sample(rounds, version=self.version)
            # waiting for the store's answer bounds how far a searcher runs ahead of it
            ray.get(
                self.store.add.remote(
                    json.dumps([t.to_json() for t in trajectories]), self.index, idle, loading, version=self.version
                )
            )
            self.sampled_version = self.version
            rounds, rounds_of_version, idle, loading = rounds + 1, rounds_of_version + 1, 0.0, 0.0
