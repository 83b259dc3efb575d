"""The fine-tuning loop, written once for every objective (GFlowNet SubTB / TB / TB-VarGrad, PPO).

One training step, read top to bottom: take the step's questions, sample K solutions for each
from the current policy and score every step with the PRM (``TrajectorySampler``; with N
processes each samples its share), gather every process's trajectories, let the objective build
this process's micro-batches (``rollout``), then for each of its ``updates_per_rollout``
optimizer steps: loss and backward per micro-batch (gradients reduced over the processes at the
last one), clip, step (the training base); tell the policy its weights changed (a vLLM sampler
reloads them); log one metrics record (main process); checkpoint every ``save_every`` steps. A checkpoint holds
the trainable weights, the optimizer, the objective (log Z, value head, replay buffer), the RNG
states and the sampler's question cycle, so a stopped run resumes where it was and ends with the
weights an uninterrupted run would have.
"""

from __future__ import annotations

import math
import time

import numpy as np
import torch
from tqdm import tqdm

from pipeline.finetune.objectives import reference_reset_every
from pipeline.finetune.rewards import CORRECT_ANSWER
from pipeline.finetune.sampling import TrajectorySampler
from pipeline.records import Trajectory
from pipeline.training import TrainingBase
from pipeline.training.collective_clock import CLOCK
from pipeline.training.gathering import load_streamed


class FinetuneTrainer:
    """base: the TrainingBase over the policy's model and the objective; sampler; objective;
    cfg: the objective's config section (num_train_steps, save_every, seed)."""

    def __init__(self, base: TrainingBase, sampler: TrajectorySampler, objective, cfg, progress: bool = True):
        self.base, self.sampler, self.objective, self.cfg = base, sampler, objective, cfg
        self.progress = progress
        # snapshot(step) saves the policy of training step ``step`` (every process calls it), every
        # cfg.snapshot_every steps before the last (none when it is 0); snapshot.discard_after(step)
        # removes those of a later step (an earlier run's) when training starts; None: neither
        # (pipeline.finetune.run.PolicySnapshots, set by the stage after the trainer is built)
        self.snapshot = None
        self._collectives_at_start = CLOCK.snapshot()

    @property
    def step(self) -> int:
        """Training steps done (each is objective.updates_per_rollout optimizer steps)."""
        return self.base.step // self.objective.updates_per_rollout

    def resume(self) -> bool:
        """Load the newest checkpoint (if any); the policy's sampler gets the weights it holds."""
        state = self.base.resume()
        if state is not None:
            self.load_loop_state(state)
            self.sampler.policy.after_update(self.step, self.base.iter_full_state)
        return state is not None

    def loop_state(self) -> dict:
        """What a checkpoint holds besides the base's state: the question cycle."""
        return {"sampler": self.sampler.state_dict()}

    def load_loop_state(self, state: dict) -> None:
        self.sampler.load_state_dict(state["sampler"])

    def prepare(self) -> None:
        """Before the first step: resume from the newest checkpoint, if any."""
        self.resume()

    def train(self) -> list[dict]:
        """Train to cfg.num_train_steps (resuming from the newest checkpoint); returns the records logged."""
        self.prepare()
        bar = tqdm(
            total=self.cfg.num_train_steps,
            initial=self.step,
            desc=f"{self.objective.name} steps",
            dynamic_ncols=True,
            disable=not (self.progress and self.base.is_main),
        )
        history = []
        if self.snapshot is not None:  # a fresh run (step 0) or a resumed one: later snapshots are an earlier run's
            self.snapshot.discard_after(self.step)
        while self.step < self.cfg.num_train_steps and not self.base.out_of_time():
            record = self.train_step()
            history.append(record)
            bar.update(1)
            bar.set_postfix(loss=f"{record.get('loss', float('nan')):.3g}", reward=f"{record['avg_reward']:.3f}")
            every = self.cfg.snapshot_every
            if self.snapshot is not None and every and self.step % every == 0 and self.step < self.cfg.num_train_steps:
                self.snapshot(self.step)
            if self.cfg.save_every and self.step % self.cfg.save_every == 0 and self.step < self.cfg.num_train_steps:
                self.base.save_checkpoint(self.loop_state())
        bar.close()
        return history

    def start_step(self) -> float:
        """A training step starts: its start time (monotonic seconds), and the collective clock's
        reading (benchmarks only) that record() subtracts."""
        self._collectives_at_start = CLOCK.snapshot()
        return time.monotonic()

    def train_step(self) -> dict:
        start = self.start_step()
        step = self.step
        lr = self.base.lr
        collective = self.sampler.collective
        fresh, info = self.sampler.sample(step)
        everyone = collective.gather(fresh, Trajectory)
        sampled = time.monotonic()
        every = [t for part in everyone for t in part]
        if not every:
            raise RuntimeError("every sampled solution was empty: the policy stops at s_0")
        totals, grad_norm = self.update(self.objective.rollout(fresh, everyone))
        self.after_update(step + 1)
        counts = collective.sum(torch.tensor([info["sampled"], info["empty_solutions"]], dtype=torch.float64))
        record = self.record(step + 1, lr, every, totals, grad_norm, start)
        # trained: the rows of the update (fresh and replayed); sample_seconds: the part of
        # `seconds` spent sampling and scoring (the rest trains); wall_time: when the step ended
        record.update(
            sampled=int(counts[0]),
            empty_solutions=int(counts[1]),
            trained=len(every) + int(record.get("replayed", 0)),
            sample_seconds=sampled - start,
            wall_time=time.time(),
        )
        self.base.log(record)
        return record

    def after_update(self, step: int) -> None:
        """Training step ``step`` is done: the policy's sampler reloads the weights (vLLM), and
        every gfn.reference_reset_every steps the reference becomes the current policy."""
        policy = self.sampler.policy
        policy.after_update(step, self.base.iter_full_state)
        every = reference_reset_every(self.cfg)
        if every and step % every == 0:  # streamed into the reference, read to its end on every process
            load_streamed(
                lambda weights: self.objective.reset_reference(weights, step),
                policy.plain_stream(self.base.iter_full_state()),
            )

    def update(self, micro_batches: list) -> tuple[dict[str, float], float | None]:
        """The objective's optimizer steps on this process's micro-batches: (its loss terms,
        summed over micro-batches and averaged over the steps; the last gradient norm)."""
        collective = self.sampler.collective
        self.objective.begin_update(self.step)
        if collective.lockstep:  # sharded models: every process runs as many forward passes as the busiest one
            count = collective.max(len(micro_batches))
            micro_batches = micro_batches + [
                self.objective.filler(micro_batches) for _ in range(count - len(micro_batches))
            ]
        updates = self.objective.updates_per_rollout
        totals: dict[str, float] = {}
        grad_norm = None
        for _ in range(updates):
            for index, micro in enumerate(micro_batches):
                with self.base.accumulating(last=index == len(micro_batches) - 1):
                    loss, metrics = self.objective.loss(micro)
                    self.base.backward(loss)
                for name, value in metrics.items():
                    totals[name] = totals.get(name, 0.0) + value / updates
            grad_norm = self.base.optimizer_step()
        return totals, grad_norm

    def record(
        self,
        step: int,
        lr: float,
        trajectories: list[Trajectory],
        totals: dict[str, float],
        grad_norm: float | None,
        start: float,
    ) -> dict:
        """One metrics record: the trained trajectories' statistics, every process's loss terms
        and the objective's summary."""
        collective = self.sampler.collective
        names = sorted(totals)
        summed = collective.sum(torch.tensor([totals[n] for n in names], dtype=torch.float64)) if names else []
        seconds = time.monotonic() - start
        timed = {}
        if CLOCK.enabled:  # the weak-scaling benchmark: each process's step seconds, collective wait and in flight
            (wait, in_flight), (wait0, in_flight0) = CLOCK.snapshot(), self._collectives_at_start
            per = collective.per_process([seconds, wait - wait0, in_flight - in_flight0])
            timed = {
                "collectives": {key: [p[i] for p in per] for i, key in enumerate(("seconds", "wait", "in_flight"))}
            }
        return {
            "step": step,
            "lr": lr,
            "avg_reward": float(np.mean([math.exp(t.log_reward) for t in trajectories])),
            "avg_log_reward": float(np.mean([t.log_reward for t in trajectories])),
            "accuracy": float(np.mean([t.answer_flags[-1] == CORRECT_ANSWER for t in trajectories])),
            "finished_fraction": float(np.mean([t.finished for t in trajectories])),
            "solution_length": float(np.mean([len(t.steps) for t in trajectories])),
            "seconds": seconds,
            # each process's loss terms are weighted world / batch: their sum over processes is world x the batch mean
            **{name: float(summed[i]) / collective.world for i, name in enumerate(names)},
            "grad_norm": grad_norm,
            **self.objective.summary(),
            **timed,
        }
