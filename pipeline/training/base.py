"""The one training base: what every trainer of the project (the tiny world's bootstrap LM, the
PRM, GFlowNet and PPO fine-tuning) shares, built on accelerate's Accelerator.

- optimizer: AdamW with weight decay on matrices only; an objective's own parameters (log Z, a
  value head) in an AdamW of their own, stepped with the model's (``pipeline.training.optimizer``);
- sharding: under an FSDP accelerate config the base applies FSDP2 itself, on any device
  (``pipeline.training.sharding``); DDP and DeepSpeed go through ``accelerator.prepare``; sharded
  weights are read back whole as a stream (``pipeline.training.gathering``);
- schedule: ``pipeline.training.schedule.learning_rate`` (warmup, then cosine / linear / constant),
  set on every group from its own base rate before each step;
- gradient clipping over the model's and the objective's parameters together; gradient
  accumulation and mixed precision (bf16 autocast over float32 master weights on GPU) through
  accelerate (``pipeline.training.accelerator``);
- checkpoints: the trainable parameters, the optimizer, the objective, the RNG states and the
  loop's own JSON state (``pipeline.training.checkpoint_state``), written crash-safe
  (``pipeline.training.checkpoint_io``): FSDP2 shards through torch.distributed.checkpoint,
  DeepSpeed ZeRO as whole tensors per parameter (``pipeline.training.zero_state``), both loadable
  under another number of processes; ``resume`` loads the newest good one and trims
  metrics.jsonl to it;
- metrics.jsonl through ``MetricsLog`` (main process only), the same records to the experiment
  trackers of ``report_to`` (TensorBoard, W&B: ``pipeline.training.tracking``) and a progress bar;
- a wall-clock cap that is only a safety net: every run is bounded by its step count, and a run
  the cap stops says so loudly in the log and in its metrics (its result then depends on the
  machine's speed).

``fit`` is the supervised loop (bootstrap LM, PRM); the fine-tuning loop
(``pipeline.finetune.trainer``) samples and scores before each update and calls
``backward`` / ``optimizer_step`` / ``log`` / ``save_checkpoint`` itself.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import torch
from accelerate import Accelerator
from accelerate.optimizer import AcceleratedOptimizer
from accelerate.utils import DistributedType
from tqdm import tqdm

from pipeline.training import checkpoint_io
from pipeline.training.accelerator import configure_deepspeed
from pipeline.training.checkpoint_state import CheckpointMixin
from pipeline.training.collective_clock import CLOCK
from pipeline.training.distributed import fsdp_requested
from pipeline.training.gathering import WholeWeightsMixin, full_tensor
from pipeline.training.metrics import MetricsLog
from pipeline.training.optimizer import OptimizerSettings, make_optimizers
from pipeline.training.schedule import check_schedule, learning_rate
from pipeline.training.sharding import shard_model
from pipeline.training.tracking import Tracking

log = logging.getLogger("stepflow.training")


class TrainingBase(CheckpointMixin, WholeWeightsMixin):
    """Optimizer, schedule, clipping, accumulation, checkpoints, metrics and progress of one run.

    accelerator: from ``make_accelerator`` (the model must already be on its device)
    model:       the trained module (its trainable parameters are optimised and checkpointed)
    settings:    OptimizerSettings
    out_dir:     metrics.jsonl and checkpoints/ go here
    objective:   an optional module with parameters of its own (log Z, a value head), trained
                 with rate ``objective_lr`` (default settings.lr), checkpointed with the model
    updates_per_record: optimizer steps per logged "step" (PPO: ppo_epochs per training step),
                 so that resuming trims metrics.jsonl to the right record
    tracking:    the experiment trackers (``Tracking``; the one given to make_accelerator): every
                 metrics record goes to them too, started at the first one, closed by finish()
    """

    def __init__(
        self,
        accelerator: Accelerator,
        model: torch.nn.Module,
        settings: OptimizerSettings,
        out_dir: str | Path,
        *,
        objective: torch.nn.Module | None = None,
        objective_lr: float | None = None,
        micro_batch_size: int | None = None,
        save_every: int = 0,
        keep_checkpoints: int = 2,
        max_seconds: float | None = None,
        log_every: int = 1,
        updates_per_record: int = 1,
        progress: bool = True,
        desc: str = "train",
        tracking: Tracking | None = None,
    ):
        check_schedule(settings.schedule)
        self.accelerator = accelerator
        self.settings = settings
        self.out_dir = Path(out_dir)
        self.save_every = save_every
        self.keep_checkpoints = keep_checkpoints
        self.max_seconds = max_seconds
        self.log_every = max(1, log_every)
        self.updates_per_record = max(1, updates_per_record)
        self.progress = progress
        self.desc = desc
        self.step = 0
        self.stopped_by_time = False
        self._started = time.monotonic()
        if self.is_main:
            self.out_dir.mkdir(parents=True, exist_ok=True)
        self.metrics = MetricsLog(self.out_dir / "metrics.jsonl", enabled=self.is_main)
        self.tracking = tracking

        configure_deepspeed(
            accelerator,
            micro_batch_size=micro_batch_size,
            max_grad_norm=settings.max_grad_norm,
            save_every=save_every,
            desc=desc,
        )

        self.objective = objective.to(accelerator.device) if objective is not None else None
        self.sharded = fsdp_requested(accelerator)  # FSDP2, applied here (docs/scale.md)
        if self.sharded:
            model = shard_model(model, accelerator)  # before the optimizer: it holds the shards
        optimizer, objective_optimizer = make_optimizers(
            model, self.objective, settings, objective_lr, accelerator, sharded=self.sharded
        )
        if self.sharded:  # accelerate's wrapper only for its accumulation boundaries (fit)
            self.model, self.optimizer = model, AcceleratedOptimizer(optimizer, device_placement=False)
        else:
            self.model, self.optimizer = accelerator.prepare(model, optimizer)
            if CLOCK.enabled and isinstance(self.model, torch.nn.parallel.DistributedDataParallel):
                self.model.register_comm_hook(None, CLOCK.ddp_hook)  # torch's default all-reduce, timed
        self.objective_optimizer = (
            AcceleratedOptimizer(objective_optimizer, device_placement=False)
            if objective_optimizer is not None
            else None
        )
        self._set_lr()

    # ------------------------------------------------------------------ state

    @property
    def is_main(self) -> bool:
        return self.accelerator.is_main_process

    @property
    def unwrapped(self) -> torch.nn.Module:
        return self.accelerator.unwrap_model(self.model)

    @property
    def checkpoint_root(self) -> Path:
        return self.out_dir / checkpoint_io.CHECKPOINTS

    @property
    def lr(self) -> float:
        return self.optimizer.param_groups[0]["lr"]

    @property
    def optimizers(self) -> list:
        """The model's optimizer, then the objective's (when it has parameters)."""
        return [self.optimizer] + ([self.objective_optimizer] if self.objective_optimizer is not None else [])

    def _set_lr(self) -> None:
        s = self.settings
        for optimizer in self.optimizers:
            for group in optimizer.param_groups:
                group["lr"] = learning_rate(
                    self.step, group["initial_lr"], s.total_steps, s.warmup_steps, s.schedule, s.min_lr_ratio
                )

    def _trained_parameters(self) -> list[torch.nn.Parameter]:
        own = [p for p in self.objective.parameters() if p.requires_grad] if self.objective is not None else []
        return [p for p in self.model.parameters() if p.requires_grad] + own

    def out_of_time(self) -> bool:
        """True (and a loud warning, once) when the wall-clock safety net has run out."""
        if self.max_seconds is None or time.monotonic() - self._started < self.max_seconds:
            return False
        if not self.stopped_by_time:
            self.stopped_by_time = True
            log.warning(
                "%s: STOPPED BY THE WALL-CLOCK SAFETY NET after %d of %d steps (%.0f s): this run's result now depends "
                "on the machine's speed; raise the time limit or lower the step count",
                self.desc,
                self.step,
                self.settings.total_steps,
                self.max_seconds,
            )
        return True

    # ------------------------------------------------------------------ one update

    @contextlib.contextmanager
    def accumulating(self, last: bool):
        """Around the forward + backward of one micro-batch of an update: gradients are
        reduced over the processes at the ``last`` one only (DDP's no_sync before it; DeepSpeed
        takes its own step at that boundary). A no-op in one process."""
        accelerator = self.accelerator
        if accelerator.distributed_type == DistributedType.DEEPSPEED:
            # accelerate's DeepSpeed wrapper reads this flag in backward() to place the boundary
            accelerator.gradient_state._set_sync_gradients(last)
            yield
        elif (
            accelerator.num_processes > 1
            and not last
            and accelerator.distributed_type in (DistributedType.MULTI_GPU, DistributedType.MULTI_CPU)
        ):
            with accelerator.no_sync(self.model):
                yield
        else:
            yield

    def backward(self, loss: torch.Tensor) -> None:
        with CLOCK.ddp_backward():
            self.accelerator.backward(loss)

    def clip_gradients(self) -> torch.Tensor | None:
        """Average the objective's gradients over processes (DDP only averages the model's), then
        clip everything trained to settings.max_grad_norm; returns the norm before clipping."""
        if self.objective is not None and self.accelerator.num_processes > 1:
            for param in self.objective.parameters():
                if param.grad is not None:
                    with CLOCK.blocking():
                        param.grad = self.accelerator.reduce(param.grad, reduction="mean")
        if self.settings.max_grad_norm <= 0:
            return None
        if self.sharded:
            return self._clip_sharded(self.settings.max_grad_norm)
        return self.accelerator.clip_grad_norm_(self._trained_parameters(), self.settings.max_grad_norm)

    def _clip_sharded(self, max_norm: float) -> torch.Tensor:
        """clip_grad_norm_ over FSDP2-sharded model gradients (DTensors: their norm is reduced
        over the shards) and the objective's replicated ones, with torch's clip coefficient."""
        model_grads = [p.grad for p in self.model.parameters() if p.requires_grad and p.grad is not None]
        own = self.objective.parameters() if self.objective is not None else []
        own_grads = [p.grad for p in own if p.requires_grad and p.grad is not None]
        device = self.accelerator.device
        squares = torch.zeros((), dtype=torch.float32, device=device)
        if model_grads:
            squares = squares + full_tensor(torch.nn.utils.get_total_norm(model_grads)).float().square()
        if own_grads:
            squares = squares + torch.nn.utils.get_total_norm(own_grads).float().square()
        total = squares.sqrt()
        coef = min(float(max_norm / (total + 1e-6)), 1.0)
        with torch.no_grad():
            for grad in model_grads + own_grads:
                grad.mul_(coef)
        return total

    def optimizer_step(self) -> float | None:
        """Clip, step, zero the gradients, advance the schedule; returns the gradient norm."""
        norm = self.clip_gradients()
        for optimizer in self.optimizers:
            optimizer.step()
        for optimizer in self.optimizers:
            optimizer.zero_grad(set_to_none=True)
        self.step += 1
        self._set_lr()
        return None if norm is None else float(norm)

    # ------------------------------------------------------------------ the supervised loop

    def fit(
        self,
        micro_batches: Iterable,
        loss_fn: Callable[[torch.nn.Module, Any], tuple[torch.Tensor, dict[str, float]]],
        *,
        extra_record: Callable[[int], dict] | None = None,
        loop_state: Callable[[], dict] | None = None,
    ) -> dict:
        """Train on micro-batches until settings.total_steps optimizer steps (or the safety net).

        micro_batches: this process's micro-batches, starting where a resumed run stopped
        loss_fn(model, batch) -> (mean loss, counts): counts (e.g. examples, tokens) are summed
                       over a logging window and all processes and logged as <name>_per_s
        extra_record(step) -> fields added to each metrics record
        loop_state() -> JSON-able state of the caller's loop, saved in every checkpoint
        Returns {steps, resumed_from, seconds, loss (last logged window), counts (this process's
        totals since it started), stopped_by_time}.
        """
        accelerator = self.accelerator
        resumed_from = self.step
        bar = tqdm(
            total=self.settings.total_steps,
            initial=self.step,
            desc=self.desc,
            dynamic_ncols=True,
            disable=not (self.progress and self.is_main),
        )
        window_loss = torch.zeros((), dtype=torch.float64, device=accelerator.device)
        window_batches, window_counts, total_counts = 0, {}, {}
        window_start = train_start = time.monotonic()
        last_loss = float("nan")
        pending = 0  # micro-batches of the update in progress
        self.model.train()
        for batch in micro_batches:
            if self.step >= self.settings.total_steps:
                break
            if pending == 0 and self.out_of_time():
                break
            with accelerator.accumulate(self.model):
                loss, counts = loss_fn(self.model, batch)
                accelerator.backward(loss)
                if accelerator.sync_gradients:
                    self.clip_gradients()
                for optimizer in self.optimizers:
                    optimizer.step()
                for optimizer in self.optimizers:
                    optimizer.zero_grad(set_to_none=True)
            window_loss += loss.detach().double()  # stays on the device: read once per logged step
            window_batches += 1
            for name, value in counts.items():
                window_counts[name] = window_counts.get(name, 0.0) + float(value)
                total_counts[name] = total_counts.get(name, 0.0) + float(value)
            pending += 1
            if not accelerator.sync_gradients:
                continue
            pending = 0
            self.step += 1
            self._set_lr()
            bar.update(1)
            if self.step % self.log_every == 0 or self.step == self.settings.total_steps:
                names = sorted(window_counts)
                totals = torch.stack(
                    [
                        window_loss,
                        torch.tensor(float(window_batches), dtype=torch.float64, device=accelerator.device),
                        *(
                            torch.tensor(window_counts[n], dtype=torch.float64, device=accelerator.device)
                            for n in names
                        ),
                    ]
                )
                totals = accelerator.reduce(totals, reduction="sum")
                elapsed = max(time.monotonic() - window_start, 1e-9)
                last_loss = float(totals[0] / totals[1].clamp_min(1))
                record = {
                    "step": self.step,
                    "loss": last_loss,
                    "lr": self.lr,
                    **{f"{n}_per_s": float(totals[2 + i]) / elapsed for i, n in enumerate(names)},
                    **(extra_record(self.step) if extra_record else {}),
                }
                self.log(record)
                bar.set_postfix(loss=f"{last_loss:.4f}")
                window_loss = torch.zeros((), dtype=torch.float64, device=accelerator.device)
                window_batches, window_counts, window_start = 0, {}, time.monotonic()
            if self.save_every > 0 and self.step % self.save_every == 0 and self.step < self.settings.total_steps:
                self.save_checkpoint(loop_state() if loop_state else None)
        bar.close()
        return {
            "steps": self.step,
            "resumed_from": resumed_from,
            "seconds": time.monotonic() - train_start,
            "loss": last_loss,
            "counts": total_counts,
            "stopped_by_time": self.stopped_by_time,
        }

    def log(self, record: dict) -> None:
        """One metrics record (main process) to metrics.jsonl and the trackers; adds the
        safety-net flag once it has fired."""
        if self.stopped_by_time:
            record = {**record, "stopped_by_time": True}
        self.metrics.write(record)
        if self.tracking is not None:
            self.tracking.log(self.accelerator, record)

    def finish(self) -> None:
        """Once the final model is written: the resumable state only served an interrupted run;
        the trackers are closed."""
        if self.tracking is not None:
            self.tracking.finish(self.accelerator)
        self.accelerator.wait_for_everyone()
        if self.is_main:
            checkpoint_io.remove_all(self.checkpoint_root)
        self.accelerator.wait_for_everyone()
