"""The asynchronous trainer (AsyncFinetuneTrainer): the synchronous trainer's update on batches
drawn from the searchers' store; its main process starts the actors and publishes the weights
(the package docstring says who does what)."""

from __future__ import annotations

import json
import os
import time
from collections.abc import Callable

import torch

from pipeline.batches import check_divisible
from pipeline.finetune.tba import ray_cluster
from pipeline.finetune.tba.drawing import BatchDrawing, BatchRequest
from pipeline.finetune.tba.publication import WeightPublisher, bucket_bytes
from pipeline.finetune.tba.scorers import ScorerActor, scorer_name
from pipeline.finetune.tba.searcher import MakeSampler, Searcher
from pipeline.finetune.tba.settings import (
    async_shape,
    check_async_problems,
    check_async_settings,
    store_buffer_settings,
)
from pipeline.finetune.tba.stores import TrajectoryStore, WeightStore
from pipeline.finetune.tba.weight_transport import backend_for, check_transport
from pipeline.finetune.trainer import FinetuneTrainer


class AsyncFinetuneTrainer(BatchDrawing, FinetuneTrainer):
    """The synchronous trainer's update and bookkeeping on batches drawn from the searchers' store.

    make_sampler: builds a searcher's sampler inside its actor from its index and ``problems``
                  (picklable: a module-level function or functools.partial of one)
    export:       the trainer's current weights as the searchers load them (plain, LoRA merged),
                  called on every process (gathering may be a collective), used on the main one
    problems:     the training problems as JSON (Problem.to_json): put in Ray's object store once
                  and held by this trainer, so a searcher restarted at any moment reads them again
    make_scorer:  builds the PRM inside each scorer actor (gfn.scorer_actors > 0; picklable); the
                  searchers then score through PooledScorer
    publish_dtype: the dtype the searchers' policies hold (model.dtype resolved for their device):
                  floating weights are published in it (None: each tensor keeps its own)

    Only the main process talks to Ray: it starts the actors, draws every process's share of the
    batch from the store and sends it to the others over the trainer's own process group (JSON
    text), and publishes; the other processes never connect (docs/async.md, "Several trainer processes").
    """

    def __init__(
        self,
        base,
        sampler,
        objective,
        cfg,
        make_sampler: MakeSampler,
        export: Callable[[], dict | None],
        problems: list | None = None,
        run_name: str = "stepflow",
        progress: bool = True,
        publish_dtype: torch.dtype | None = None,
        make_scorer: Callable | None = None,
    ):
        super().__init__(base, sampler, objective, cfg, progress=progress)
        if not objective.off_policy:
            raise ValueError(
                f"{objective.name} is on-policy: mode=async trains on trajectories of older policies "
                "(use gfn.loss=subtb | tb | tb_vargrad)"
            )
        if cfg.scorer_actors and make_scorer is None:
            raise ValueError(
                f"gfn.scorer_actors={cfg.scorer_actors}: the trainer needs make_scorer to build the PRM in each scorer actor"
            )
        self.make_sampler, self.export, self.run_name, self.make_scorer = make_sampler, export, run_name, make_scorer
        self.scorers: list = []
        self.problems, self.problems_ref = list(problems or []), None
        check_async_settings(cfg)
        if self.problems:
            check_async_problems(cfg, len(self.problems))
        self.questions, self.per_question = async_shape(cfg)
        check_divisible(self.questions, sampler.collective.world)
        check_transport(cfg.weight_transport)
        self.store = self.weights = None
        self.searchers: list = []
        self.publish_dtype, self.publisher = publish_dtype, None
        self.runs: list = []
        self._started_ray = False
        self.placement_group, self.trainer_gpu_ids = None, []  # the run's group; the GPUs Ray reserved for the trainer
        self.published = -1  # the version of the newest publication
        self._next_batch: BatchRequest | None = None  # the store request in flight (main process)
        self.publish_seconds = 0.0  # spent publishing since the last metrics record
        self._window = (0, 0.0, 0.0, time.monotonic())

    # ------------------------------------------------------------------ actors

    def start(self) -> None:
        """Main process: connect to Ray (a local instance by default, cfg.ray_address otherwise; once:
        a stage connects before loading models and this finds it connected) and start the actors of
        this run. Every process then meets at a barrier; the others never connect."""
        import ray  # the optional extra (extra `distributed`)

        collective = self.sampler.collective
        names = {"store": "store", "weights": "weights"}
        if self.base.is_main:
            self._started_ray = ray_cluster.connect(self.cfg, f"stepflow-{self.run_name}")
            buffer = store_buffer_settings(self.cfg)
            self.store = ray.remote(num_cpus=0)(TrajectoryStore).options(name=names["store"]).remote(buffer)
            # Searchers read the problems through the weights actor, by a reference this process holds:
            # as a constructor argument of a restartable actor, a large object is freed once the actor
            # has started, and a searcher restarted later would have nothing to start from.
            self.problems_ref = ray.put(self.problems)
            self.weights = (
                ray.remote(num_cpus=0)(WeightStore).options(name=names["weights"]).remote([self.problems_ref])
            )
            self.reserve()
            self.start_scorers()
            searcher = ray.remote(
                num_cpus=1,
                num_gpus=self.cfg.searcher_gpus,
                max_restarts=self.cfg.searcher_max_restarts,
                max_concurrency=2,
            )(Searcher)
            self.searchers = [
                searcher.options(scheduling_strategy=ray_cluster.searcher_strategy(self.placement_group, i)).remote(
                    i, self.make_sampler, names, self.cfg.searcher_cores, searchers=self.cfg.searchers
                )
                for i in range(self.cfg.searchers)
            ]
            trainer_device = self.base.accelerator.device
            self.publisher = WeightPublisher(
                transport=self.cfg.weight_transport,
                weights=self.weights,
                dtype=self.publish_dtype,
                bucket_bytes=bucket_bytes(self.cfg.publish_bucket_mb),
                host=ray.util.get_node_ip_address(),
                backend=backend_for(trainer_device) if self.cfg.searcher_gpus else "gloo",
            )  # NCCL: GPU to GPU
        collective.barrier()

    def start_scorers(self) -> None:
        """gfn.scorer_actors actors holding the PRM, each in its own bundle of the run's placement
        group (ray_cluster.bundles), found by searchers under scorer_name(j); restarted by Ray like searchers."""
        import ray  # the optional extra (extra `distributed`)

        scorer = ray.remote(
            num_cpus=1, num_gpus=self.cfg.scorer_gpus, max_restarts=self.cfg.searcher_max_restarts, max_task_retries=-1
        )(ScorerActor)
        self.scorers = [
            scorer.options(
                name=scorer_name(j), scheduling_strategy=ray_cluster.scorer_strategy(self.placement_group, self.cfg, j)
            ).remote(j, self.make_scorer)
            for j in range(self.cfg.scorer_actors)
        ]

    def trainer_gpus(self) -> int:
        """GPUs the trainer's processes hold (one each on CUDA; they run on the main process's node)."""
        return self.sampler.collective.world if self.base.accelerator.device.type == "cuda" else 0

    def reserve(self) -> None:
        """The run's placement group (ray_cluster.bundles): the trainer's bundle, then one per searcher,
        so Ray never places a searcher on the trainer's GPUs. On CUDA, the GPUs Ray reserved for the
        trainer must be the ones its main process runs on, else the run is refused naming both."""
        gpus = self.trainer_gpus()
        self.placement_group, self.trainer_gpu_ids = ray_cluster.reserve(
            self.cfg, gpus, self.cfg.placement_timeout, ray_cluster.cluster_name(self.cfg)
        )
        device = self.base.accelerator.device
        if gpus and device.type == "cuda":
            visible = os.environ.get("CUDA_VISIBLE_DEVICES")
            index = device.index if device.index is not None else torch.cuda.current_device()
            own = visible.split(",")[index] if visible else str(index)
            if own not in self.trainer_gpu_ids:
                raise ValueError(
                    f"Ray reserved GPUs {self.trainer_gpu_ids} of this node for the trainer, but its main process runs "
                    f"on GPU {own}: searchers could be placed on it. Start the trainer on the node's first GPUs "
                    "(CUDA_VISIBLE_DEVICES unset, or the ids Ray reserves)"
                )

    def publish(self) -> None:
        """The trainer's weights, as of its current step, for every searcher: exported by every
        process (exporting may gather shards), packed by the main process and sent in the
        background (pipeline.finetune.tba.publication); this waits for the previous publication."""
        start = time.monotonic()
        try:
            state = self.export()
            if self.base.is_main:
                self.publisher.publish(state, self.step, self.searchers)
        finally:
            self.published = self.step
            self.publish_seconds += time.monotonic() - start

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
                raise RuntimeError(
                    f"async: searcher {index} stopped and is not restarted again (Ray restarts a searcher at most "
                    f"gfn.searcher_max_restarts={self.cfg.searcher_max_restarts} times; this run's searchers were "
                    f"restarted {restarts} times in all): {cause}"
                ) from error

    def stop(self) -> None:
        """Stop the searchers and the actors; shut Ray down when this trainer started it, also when
        stopping fails (an actor already gone, a peer process dead)."""
        import ray  # the optional extra (extra `distributed`)

        try:
            self.close_request()  # a batch asked for a step that does not come
            if self.publisher is not None:
                self.publisher.close()  # the running publication ends first
            if self.base.is_main and self.weights is not None:
                ray.get(self.weights.stop.remote())
                ray.wait(self.runs, num_returns=len(self.runs), timeout=60)
                for actor in [*self.searchers, *self.scorers, self.store, self.weights]:
                    ray.kill(actor)
                if self.placement_group is not None:
                    ray.util.remove_placement_group(self.placement_group)
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
        stats = self.store_stats()
        self._window = (
            stats["added"],
            stats["searcher_idle_seconds"],
            stats["searcher_weight_load_seconds"],
            time.monotonic(),
        )

    def store_stats(self) -> dict:
        """The store's counters (TrajectoryStore.stats), read by the main process, the same on every process."""
        import ray  # the optional extra (extra `distributed`)

        text = json.dumps(ray.get(self.store.stats.remote())) if self.base.is_main else None
        return json.loads(self.sampler.collective.broadcast_text(text))

    def train(self) -> list[dict]:
        try:
            return super().train()
        finally:
            self.stop()

    def train_step(self) -> dict:
        start = self.start_step()
        step, lr = self.step, self.base.lr
        collective = self.sampler.collective
        groups, recent, waited = self.draw()
        self.prefetch()  # the next batch is drawn and read while this update runs
        batch = [t for group in groups for t in group]
        totals, grad_norm = self.update(self.objective.plan(batch, 1 / len(batch)))
        self.after_update(step + 1)
        record = self.record(step + 1, lr, batch, totals, grad_norm, start)
        stats = self.store_stats()
        added, searcher_idle, searcher_loading, since = self._window
        now = time.monotonic()
        staleness = [step - t.policy_version for t in batch]
        behind = [(self.published - t.policy_version) // self.cfg.sync_every for t in batch]
        # what the batch holds, whatever the store meant to send: distinct completions per question;
        # TB-VarGrad gives the rows of a question with fewer than two distinct completions no gradient
        distinct: dict[str, set] = {}
        for t in batch:
            distinct.setdefault(t.problem_id, set()).add(tuple(t.steps))
        sizes = [len(completions) for completions in distinct.values()]
        zero = sum(len(distinct[t.problem_id]) < 2 for t in batch) if self.objective.name == "tb_vargrad" else 0
        summed = collective.sum(
            torch.tensor([sum(staleness), len(batch), zero, len(distinct), recent, waited], dtype=torch.float64)
        )
        histogram: dict[str, int] = {}
        for versions in behind:
            histogram[str(versions)] = histogram.get(str(versions), 0) + 1
        record.update(
            {
                "trained": int(summed[1]),
                "questions": int(summed[3]),
                "trajectories_per_question_min": int(-collective.max(-min(sizes))),
                "trajectories_per_question_max": int(collective.max(max(sizes))),
                "zero_gradient_fraction": float(summed[2] / summed[1]),
                "recent_questions": int(summed[4]),
                "staleness_mean": float(summed[0] / summed[1]),
                "staleness_max": int(collective.max(max(staleness))),
                "staleness_versions": histogram,  # versions behind the newest publication -> rows (this process's)
                "generated_per_trained": (stats["added"] - added) / float(summed[1]),
                "searcher_trajectories_per_s": (stats["added"] - added) / max(now - since, 1e-9),
                "trainer_idle_seconds": float(summed[5]) / collective.world,
                "searcher_idle_seconds": stats["searcher_idle_seconds"] - searcher_idle,
                "searcher_weight_load_seconds": stats["searcher_weight_load_seconds"] - searcher_loading,
                "buffer_size": stats["size"],
                "dropped_stale": stats["dropped_stale"],
                "evicted": stats["evicted"],
                "searcher_restarts": stats["restarts"],
            }
        )
        if self.step % self.cfg.sync_every == 0:
            self.publish()
        record["publish_seconds"] = (
            self.publish_seconds
        )  # the trainer's own time: export, pack, wait for the previous one
        if self.publisher is not None:  # publications that finished in the background since the last record
            done = self.publisher.take_finished()
            record.update(
                {
                    "publications": len(done),
                    "publication_bytes": sum(p.bytes for p in done),
                    "publication_seconds": sum(p.seconds for p in done),
                    "publication_buckets": sum(p.buckets for p in done),
                }
            )
        record["wall_time"] = time.time()  # when the step ended, its publication started
        self._window = (stats["added"], stats["searcher_idle_seconds"], stats["searcher_weight_load_seconds"], now)
        self.publish_seconds = 0.0
        self.base.log(record)
        self.keep_searching()
        return record
