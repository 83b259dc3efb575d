"""Trajectory Balance with Asynchrony (TBA, Bartoldson et al.) on Ray: `make gfn` with gfn.mode=async.

Who does what (docs/async.md):
- searcher actors (gfn.searchers of them): each holds its own copy of the policy (HF generate or
  a vLLM engine), the PRM scorer and, when needed, the frozen reference; round after round it
  samples questions_per_step questions x samples_per_question solutions with the newest weights
  it has, scores them and sends them, tagged with that weights version, to the store;
- the store actor: the project's prioritized replay buffer (recency fraction m plus
  reward-priority draws); it drops trajectories older than gfn.max_staleness trainer steps;
- the weights actor: the newest published weights (an object in Ray's object store, or with
  gfn.weight_transport=collective only their version: the tensors then go over a two-member
  NCCL or gloo group per searcher, pipeline.finetune.weight_transport), a stop flag, and the
  reference to the training problems every searcher starts from;
- the trainer (this process, or every process of an accelerate group): the same training base,
  objective and update as the synchronous mode, on batches drawn from the store, re-scored under
  the current policy; every gfn.sync_every steps it publishes its weights.

Only off-policy objectives (SubTB, TB, TB-VarGrad) may train on trajectories from older
policies; PPO in this mode is refused before anything starts. Trajectories travel between
processes as JSON text, weights as tensors (object store or collective). A searcher that dies is
restarted by Ray (up to gfn.searcher_max_restarts times) and rejoins: what it starts from (the
training problems) is an object the trainer put in Ray's object store once and holds for the
whole run, so a restart finds it whenever the death happens. A trainer that dies resumes from its
checkpoint, which holds the buffer (it is persisted, not refilled). Ray is an optional extra: it
is imported inside the functions that need it.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import threading
import time
from typing import Callable

import torch

from pipeline.finetune import ray_cluster
from pipeline.finetune.replay_buffer import ReplayBuffer
from pipeline.finetune.sampling import TrajectorySampler
from pipeline.finetune.trainer import FinetuneTrainer
from pipeline.finetune.weight_transport import Spec, WeightChannel, backend_for, check_transport, state_spec
from pipeline.records import Trajectory

log = logging.getLogger("stepflow.async")

MakeSampler = Callable[[int, list], TrajectorySampler]  # (searcher index, training problems as JSON) -> its sampler (built in the actor)
POLL_SECONDS = 0.05


def searcher_config(cfg, index: int):
    """A searcher's copy of the section: its own seed, so searchers walk different question cycles."""
    return dataclasses.replace(cfg, seed=cfg.seed + 7919 * (index + 1))


# ----------------------------------------------------------------------------- the actors (plain classes; ray.remote at start)


class WeightStore:
    """What a searcher starts from and samples with: the training problems ([object ref]), the
    newest published weights (version, [object ref]); and whether the run is over."""

    def __init__(self, problems: list | None = None):
        self.version, self.refs, self.stopped = -1, None, False
        self.problem_refs = problems  # a list, so the object is passed by reference

    def problems(self) -> list | None:
        return self.problem_refs

    def publish(self, version: int, refs: list) -> None:
        self.version, self.refs = version, refs  # refs: a list, so the object is passed by reference

    def latest(self, known: int) -> tuple[int, list | None, bool]:
        """(version, refs if newer than ``known`` else None, stopped)."""
        return self.version, (self.refs if self.version > known else None), self.stopped

    def stop(self) -> None:
        self.stopped = True


class TrajectoryStore:
    """The replay buffer every searcher fills and the trainer draws from (one per run)."""

    def __init__(self, buffer_kwargs: dict):
        self.buffer = ReplayBuffer(**buffer_kwargs)
        self.added, self.dropped, self.per_searcher, self.restarts = 0, 0, {}, 0
        self.started = time.monotonic()

    def add(self, payload: str, searcher: int) -> int:
        trajectories = [Trajectory.from_json(obj, f"trajectories from searcher {searcher}") for obj in json.loads(payload)]
        self.buffer.add(trajectories)
        self.added += len(trajectories)
        self.per_searcher[searcher] = self.per_searcher.get(searcher, 0) + len(trajectories)
        return len(self.buffer)

    def count_restart(self, searcher: int) -> None:
        self.restarts += 1
        log.warning("async: searcher %d was restarted by Ray and rejoins", searcher)

    def sample(self, n: int, now: int, max_staleness: int | None) -> str:
        if max_staleness is not None:
            self.dropped += self.buffer.forget_before(now - max_staleness)
        return json.dumps([t.to_json() for t in self.buffer.sample(n)] if len(self.buffer) else [])

    def stats(self) -> dict:
        return {"size": len(self.buffer), "added": self.added, "dropped_stale": self.dropped,
                "per_searcher": dict(self.per_searcher), "restarts": self.restarts, "seconds": time.monotonic() - self.started}

    def state_dict(self) -> dict:
        return {"buffer": self.buffer.state_dict(), "added": self.added, "dropped": self.dropped}

    def load_state_dict(self, state: dict) -> None:
        self.buffer.load_state_dict(state["buffer"])
        self.added, self.dropped = state["added"], state["dropped"]


class Searcher:
    """Samples and scores round after round with the newest weights it can get.

    A threaded actor (two calls at a time): while ``run`` samples, the trainer's ``join`` and
    ``receive`` calls take collective weights into a staging slot that ``run`` picks up at the
    start of its next round.
    """

    def __init__(self, index: int, make_sampler: MakeSampler, names: dict[str, str]):
        """names: the store's and the weights actor's names in the run's namespace (looked up, not
        passed as handles: Ray keeps nothing of a restartable actor's arguments alive for its restarts)."""
        import ray  # the optional extra (we run inside a Ray worker)

        torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
        store, weights = ray.get_actor(names["store"]), ray.get_actor(names["weights"])
        self.index, self.store, self.weights = index, store, weights
        self.restarted = ray.get_runtime_context().was_current_actor_reconstructed
        if self.restarted:
            store.count_restart.remote(index)
        # the problems by a reference the trainer holds: a restarted searcher reads the same object again
        self.sampler = make_sampler(index, ray.get(ray.get(weights.problems.remote())[0]))
        self.version = self.sampled_version = -1
        self.channel: WeightChannel | None = None
        self.spec: Spec = []
        self.staged: tuple[int, dict] | None = None
        self.lock = threading.Lock()

    def join(self, host: str, port: int, backend: str, spec: Spec, version: int) -> None:
        """Open the collective channel the trainer listens on, and take the weights it sends first."""
        if self.channel is not None:
            self.channel.close()
        self.channel = WeightChannel(host, port, backend).connect()
        self.spec = [tuple(entry) for entry in spec]
        self.receive(version)

    def receive(self, version: int) -> None:
        """The trainer's weights of ``version``, over the collective channel, staged for the next round."""
        if self.channel is None:
            raise RuntimeError(f"searcher {self.index} has no weights channel (it was restarted): the trainer opens a new one")
        state = self.channel.receive(self.spec, "cuda" if self.channel.backend == "nccl" else "cpu", version)
        with self.lock:
            self.staged = (version, state)

    def status(self) -> dict:
        """The weights version this searcher samples with, the one its last sent trajectories carry,
        how its weights reach it, its process and whether Ray restarted it."""
        return {"version": self.version, "sampled_version": self.sampled_version,
                "channel": self.channel.backend if self.channel is not None else None, "pid": os.getpid(), "restarted": self.restarted}

    def _take_staged(self) -> tuple[int, dict] | None:
        with self.lock:
            staged, self.staged = self.staged, None
        return staged

    def run(self) -> int:
        """Until the run stops: returns the number of rounds sampled."""
        import ray  # the optional extra (we run inside a Ray worker)

        rounds = 0
        while True:
            version, refs, stopped = ray.get(self.weights.latest.remote(self.version))
            if stopped:
                return rounds
            if refs is not None:
                self.sampler.policy.load_weights(ray.get(refs[0]), version)
                self.version = version
            staged = self._take_staged()
            if staged is not None:
                self.sampler.policy.load_weights(staged[1], staged[0])
                self.version = staged[0]
            if self.version < 0:  # nothing published yet
                time.sleep(POLL_SECONDS)
                continue
            trajectories, _ = self.sampler.sample(rounds, version=self.version)
            # waiting for the store's answer bounds how far a searcher runs ahead of it
            ray.get(self.store.add.remote(json.dumps([t.to_json() for t in trajectories]), self.index))
            self.sampled_version = self.version
            rounds += 1


# ----------------------------------------------------------------------------- the trainer


def ended(answer) -> Callable[[], bool]:
    """Whether a Ray call has ended (before its peer's handshake, that means it failed)."""
    import ray  # the optional extra (extra `distributed`)

    return lambda: bool(ray.wait([answer], timeout=0)[0])


class AsyncFinetuneTrainer(FinetuneTrainer):
    """The synchronous trainer's update and bookkeeping on batches drawn from the searchers' store.

    make_sampler: builds a searcher's sampler inside its actor from its index and ``problems``
                  (picklable: a module-level function or functools.partial of one)
    export:       the trainer's current weights as the searchers load them (plain, LoRA merged)
    problems:     the training problems as JSON (Problem.to_json): put in Ray's object store once
                  and held by this trainer, so a searcher restarted at any moment reads them again
    """

    def __init__(self, base, sampler, objective, cfg, make_sampler: MakeSampler, export: Callable[[], dict],
                 problems: list | None = None, run_name: str = "stepflow", progress: bool = True):
        super().__init__(base, sampler, objective, cfg, progress=progress)
        if not getattr(objective, "off_policy", False):
            raise ValueError(f"{objective.name} is on-policy: mode=async trains on trajectories of older policies "
                             "(use gfn.loss=subtb | tb | tb_vargrad)")
        self.make_sampler, self.export, self.run_name = make_sampler, export, run_name
        self.problems, self.problems_ref = list(problems or []), None
        self.batch_size = cfg.async_batch_size or cfg.questions_per_step * cfg.samples_per_question
        check_transport(cfg.weight_transport)
        self.store = self.weights = None
        self.searchers: list = []
        self.channels: list[WeightChannel | None] = []
        self.runs: list = []
        self._started_ray = False
        self._window = (0, time.monotonic())

    # ------------------------------------------------------------------ actors

    def start(self) -> None:
        """Connect to Ray (a local instance by default, cfg.ray_address otherwise) and start (main
        process) or find (other processes) the actors of this run."""
        import ray  # the optional extra (extra `distributed`)

        self._started_ray = ray_cluster.connect(self.cfg, f"stepflow-{self.run_name}")
        collective = self.sampler.collective
        names = {"store": "store", "weights": "weights"}
        if self.base.is_main:
            buffer = {"capacity": self.cfg.buffer_size, "priority": self.cfg.buffer_priority, "temperature": self.cfg.buffer_temperature,
                      "recency_fraction": self.cfg.recency_fraction, "seed": self.cfg.seed}
            self.store = ray.remote(num_cpus=0)(TrajectoryStore).options(name=names["store"]).remote(buffer)
            # Searchers read the problems through the weights actor, by a reference this process holds:
            # as a constructor argument of a restartable actor, a large object is freed once the actor
            # has started, and a searcher restarted later would have nothing to start from.
            self.problems_ref = ray.put(self.problems)
            self.weights = ray.remote(num_cpus=0)(WeightStore).options(name=names["weights"]).remote([self.problems_ref])
            searcher = ray.remote(num_cpus=1, num_gpus=self.cfg.searcher_gpus, max_restarts=self.cfg.searcher_max_restarts,
                                  max_concurrency=2)(Searcher)
            self.searchers = [searcher.remote(i, self.make_sampler, names) for i in range(self.cfg.searchers)]
            self.channels = [None] * len(self.searchers)
        collective.barrier()
        if not self.base.is_main:
            self.store, self.weights = ray.get_actor(names["store"]), ray.get_actor(names["weights"])

    def publish(self) -> None:
        """The trainer's weights, as of its current step, for every searcher (sent by the main process)."""
        import ray  # the optional extra (extra `distributed`)

        state = self.export()  # every process: exporting may gather shards
        if not self.base.is_main:
            return
        if self.cfg.weight_transport == "object_store":
            cpu = {name: value.detach().to("cpu") for name, value in state.items()}
            ray.get(self.weights.publish.remote(self.step, [ray.put(cpu)]))
            return
        trainer_device = self.base.accelerator.device
        backend = backend_for(trainer_device) if self.cfg.searcher_gpus else "gloo"  # NCCL: GPU to GPU
        device = trainer_device if backend == "nccl" else "cpu"
        state = {name: value.detach().to(device) for name, value in state.items()}
        ray.get(self.weights.publish.remote(self.step, None))
        for index in range(len(self.searchers)):
            self.send_weights(index, state, backend)

    def send_weights(self, index: int, state: dict, backend: str) -> None:
        """Collective transport: ``state`` to searcher ``index`` over its channel, or over a new one
        when it has none (the first publication) or its other end is gone (Ray restarted the
        searcher). A searcher that cannot be reached now gets the weights at the next publication."""
        import ray  # the optional extra (extra `distributed`)

        searcher = self.searchers[index]
        for _ in range(2):
            fresh, channel = self.channels[index] is None, self.channels[index]
            try:
                if fresh:
                    channel = WeightChannel.host(ray.util.get_node_ip_address(), backend)
                    answer = searcher.join.remote(*channel.address, state_spec(state), self.step)
                    channel.connect(gone=ended(answer))
                    self.channels[index] = channel
                else:
                    answer = searcher.receive.remote(self.step)
                channel.send(state, self.step, gone=ended(answer))
                ray.get(answer)
                return
            except (RuntimeError, OSError, ray.exceptions.RayError) as error:
                channel.close()
                self.channels[index] = None
                if fresh:
                    log.warning("async: no weights channel to searcher %d yet (%s); it gets the weights at the next publication",
                                index, str(error).splitlines()[0] if str(error) else type(error).__name__)
                    return

    def keep_searching(self) -> None:
        """Start every searcher's loop (main process) and surface an error raised inside one. A
        searcher that dies is restarted by Ray (up to gfn.searcher_max_restarts times), and so is
        its loop (max_task_retries=-1): training goes on with the others meanwhile."""
        import ray  # the optional extra (extra `distributed`)

        if not self.base.is_main:
            return
        if not self.runs:
            self.runs = [s.run.options(max_task_retries=-1).remote() for s in self.searchers]
            return
        done, _ = ray.wait(self.runs, num_returns=len(self.runs), timeout=0)
        for ref in done:
            try:
                ray.get(ref)  # a loop ends before the stop only with an error in it: raised here
            except ray.exceptions.RayActorError as error:
                index = self.runs.index(ref)
                cause = next((line for line in str(error).splitlines() if line.strip()), type(error).__name__)
                restarts = ray.get(self.store.stats.remote())["restarts"]
                raise RuntimeError(f"async: searcher {index} stopped and is not restarted again (Ray restarts a searcher at most "
                                   f"gfn.searcher_max_restarts={self.cfg.searcher_max_restarts} times; this run's searchers were "
                                   f"restarted {restarts} times in all): {cause}") from error

    def stop(self) -> None:
        """Stop the searchers and the actors; shut Ray down when this trainer started it, also when
        stopping fails (an actor already gone, a peer process dead)."""
        import ray  # the optional extra (extra `distributed`)

        try:
            if self.base.is_main and self.weights is not None:
                ray.get(self.weights.stop.remote())
                ray.wait(self.runs, num_returns=len(self.runs), timeout=60)
                for actor in [*self.searchers, self.store, self.weights]:
                    ray.kill(actor)
                for channel in self.channels:
                    if channel is not None:
                        channel.close()
            self.sampler.collective.barrier()
        finally:
            if self._started_ray:
                ray.shutdown()

    # ------------------------------------------------------------------ the loop

    def loop_state(self) -> dict:
        """A checkpoint holds the whole buffer: a restarted trainer resumes with it."""
        import ray  # the optional extra (extra `distributed`)

        return {"store": ray.get(self.store.state_dict.remote()) if self.base.is_main else None}

    def load_loop_state(self, state: dict) -> None:
        self._resumed_store = state["store"]

    def prepare(self) -> None:
        """Start the actors, resume (the buffer too), publish the weights, set the searchers going."""
        import ray  # the optional extra (extra `distributed`)

        self._resumed_store = None
        self.start()
        self.resume()
        if self.base.is_main and self._resumed_store is not None:
            ray.get(self.store.load_state_dict.remote(self._resumed_store))
        self.publish()
        self.keep_searching()
        self._window = (ray.get(self.store.stats.remote())["added"], time.monotonic())

    def train(self) -> list[dict]:
        try:
            return super().train()
        finally:
            self.stop()

    def train_step(self) -> dict:
        import ray  # the optional extra (extra `distributed`)

        start = time.monotonic()
        step, lr = self.step, self.base.lr
        collective = self.sampler.collective
        share = self.batch_size // collective.world
        batch: list[Trajectory] = []
        while len(batch) < share:  # the store is still filling up (first steps, or every trajectory too stale)
            self.keep_searching()
            payload = ray.get(self.store.sample.remote(share, step, self.cfg.max_staleness))
            batch = [Trajectory.from_json(obj, "trajectories from the store") for obj in json.loads(payload)]
            if len(batch) < share:
                batch = []
                time.sleep(POLL_SECONDS)
        totals, grad_norm = self.update(self.objective.plan(batch, 1 / share))
        staleness = torch.tensor([step - t.policy_version for t in batch], dtype=torch.float64)
        record = self.record(step + 1, lr, batch, totals, grad_norm, start)
        stats = ray.get(self.store.stats.remote())
        added, since = self._window
        now = time.monotonic()
        summed = collective.sum(torch.stack([staleness.sum(), torch.tensor(float(len(batch)), dtype=torch.float64)]))
        record.update({
            "staleness_mean": float(summed[0] / summed[1]),
            "staleness_max": int(collective.max(int(staleness.max()))),
            "searcher_trajectories_per_s": (stats["added"] - added) / max(now - since, 1e-9),
            "buffer_size": stats["size"],
            "dropped_stale": stats["dropped_stale"],
            "searcher_restarts": stats["restarts"],
        })
        self._window = (stats["added"], now)
        self.base.log(record)
        if self.step % self.cfg.sync_every == 0:
            self.publish()
        self.keep_searching()
        return record
