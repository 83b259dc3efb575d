"""The one training base: what every trainer of the project (the tiny world's bootstrap LM, the
PRM, GFlowNet and PPO fine-tuning) shares, built on accelerate's Accelerator.

- optimizer: AdamW with weight decay on matrices only (none on biases, norms, embeddings' 1-D
  parameters); an objective's own parameters (log Z, a value head) in an AdamW of their own,
  with the same betas and schedule at their own base rate, stepped and zeroed together with the
  model's: DDP, FSDP2 and DeepSpeed only ever see the model's parameters in the optimizer they
  wrap (FSDP2 and ZeRO map an optimizer's parameters to their shards and refuse any other);
  fused on CUDA where the parameters are plain or DDP-replicated;
- sharding: under an FSDP accelerate config with several processes the base applies torch's
  FSDP2 ``fully_shard`` itself (each decoder layer, then the root) on any device, so CPU (gloo)
  and GPU runs share one code path (docs/scale.md, "FSDP2"); DDP and DeepSpeed go through
  ``accelerator.prepare``;
- schedule: ``pipeline.training.schedule.learning_rate`` (warmup, then cosine / linear / constant),
  set on every group from its own base rate before each step;
- gradient clipping over the model's and the objective's parameters together; gradient
  accumulation and mixed precision (bf16 autocast over float32 master weights on GPU) through
  accelerate;
- checkpoints: the trainable parameters, the optimizer, the objective, the RNG states and the
  loop's own JSON state, written crash-safe (``pipeline.training.checkpoint``): FSDP2 shards
  through torch.distributed.checkpoint, DeepSpeed ZeRO as whole tensors per parameter
  (``pipeline.training.zero_state``), both loadable under another number of processes;
  ``resume`` loads the newest good one and trims metrics.jsonl to it;
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
import json
import logging
import os
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from accelerate import Accelerator, PartialState
from accelerate.optimizer import AcceleratedOptimizer
from accelerate.utils import DistributedType
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor
from tqdm import tqdm

from pipeline.modeling import resolve_device
from pipeline.training import checkpoint, zero_state
from pipeline.training.collective_clock import CLOCK
from pipeline.training.distributed import fsdp_requested
from pipeline.training.launch_settings import check_launch_environment
from pipeline.training.metrics import MetricsLog
from pipeline.training.schedule import check_schedule, learning_rate
from pipeline.training.tracking import Tracking

log = logging.getLogger("stepflow.training")

CHECKPOINTS = "checkpoints"


@dataclass
class OptimizerSettings:
    """What the base needs of a trainer's config (each trainer maps its own section onto it)."""

    lr: float
    total_steps: int  # optimizer steps of the whole run
    weight_decay: float = 0.0
    betas: tuple[float, float] = (0.9, 0.999)
    schedule: str = "cosine"  # cosine | linear | constant, after warmup
    warmup_steps: int = 0
    min_lr_ratio: float = 0.0  # the decay ends at lr * min_lr_ratio
    max_grad_norm: float = 1.0  # 0: no clipping


def mixed_precision(model_config) -> str:
    """accelerate's mixed_precision for a ModelConfig: bf16 autocast on a GPU that has it (unless
    model.dtype is float32), none on CPU. One rule for every trainer: accelerate's state is one
    per process, and the demo runs every stage in one."""
    device = resolve_device(model_config.device)
    if device.type == "cuda" and model_config.dtype != "float32" and torch.cuda.is_bf16_supported():
        return "bf16"
    return "no"


def process_count(model_config) -> int:
    """How many processes this run has (``accelerate launch`` / torchrun), without building an
    Accelerator: initialises the process group the way make_accelerator will (CPU: gloo) and
    gives each process its GPU, so it is safe to call before any model is loaded."""
    return PartialState(cpu=resolve_device(model_config.device).type == "cpu").num_processes


def make_accelerator(
    model_config, accumulation: int = 1, compile: bool = False, tracking: Tracking | None = None
) -> Accelerator:
    """The Accelerator of one trainer (device from model.device; every process of an
    ``accelerate launch`` gets its own GPU). ``tracking``: its trackers become ``log_with``
    (pass the same object to TrainingBase, which starts them)."""
    device = resolve_device(model_config.device)
    # what an accelerate config file set and the base would not apply is refused, not ignored
    check_launch_environment(model_config, os.environ, compile, applied=mixed_precision(model_config))
    return Accelerator(
        mixed_precision=mixed_precision(model_config),
        cpu=device.type == "cpu",
        dynamo_backend="inductor" if compile else "no",
        gradient_accumulation_steps=max(1, accumulation),
        log_with=tracking.trackers if tracking is not None and tracking.trackers else None,
    )


def parameter_groups(model: torch.nn.Module, weight_decay: float) -> list[dict]:
    """AdamW groups: decay on trainable matrices, none on 1-D parameters and biases."""
    decay, no_decay = [], []
    for name, param in model.named_parameters():
        if param.requires_grad:
            (no_decay if param.ndim < 2 or name.endswith(".bias") else decay).append(param)
    return [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]


def decoder_layer_classes(model: torch.nn.Module) -> set[str]:
    """The class names a transformers model never splits (its own ``_no_split_modules``, found on
    the model or any submodule: a peft wrapper, a PRM around its backbone): FSDP2's units."""
    names: set[str] = set()
    for module in model.modules():
        names.update(getattr(module, "_no_split_modules", None) or [])
    return names


def shard_model(model: torch.nn.Module, accelerator: Accelerator) -> torch.nn.Module:
    """FSDP2 full sharding of ``model`` over every process (in place; returns it): each decoder
    layer, then the root. The accelerate config's FSDP plugin, where accelerate built one (GPU
    runs), gives reshard_after_forward and activation checkpointing; bf16 mixed precision keeps
    float32 master shards, gathers bf16 weights and reduces float32 gradients."""
    plugin = getattr(accelerator.state, "fsdp_plugin", None)
    version = int(getattr(plugin, "fsdp_version", None) or os.environ.get("FSDP_VERSION", "2"))
    if version != 2:
        raise ValueError(
            f"fsdp_version {version}: the training base shards with FSDP2 only; set fsdp_config.fsdp_version: 2 "
            "(configs/accelerate/policy_fsdp.yaml)"
        )
    reshard = bool(getattr(plugin, "reshard_after_forward", True)) if plugin is not None else True
    if (
        plugin is not None
        and getattr(plugin, "activation_checkpointing", False)
        and hasattr(model, "gradient_checkpointing_enable")
    ):
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    mixed = (
        MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        if accelerator.mixed_precision == "bf16"
        else MixedPrecisionPolicy()
    )
    mesh = init_device_mesh(accelerator.device.type, (accelerator.num_processes,))
    layers = decoder_layer_classes(model)
    units = 0
    for module in list(model.modules()):
        if module is not model and type(module).__name__ in layers:
            fully_shard(module, mesh=mesh, reshard_after_forward=reshard, mp_policy=mixed)
            units += 1
    fully_shard(model, mesh=mesh, reshard_after_forward=reshard, mp_policy=mixed)
    if CLOCK.enabled:  # the weak-scaling benchmark's collective timing (pipeline.training.collective_clock)
        CLOCK.time_fsdp([module for module in model.modules() if isinstance(module, FSDPModule)])
    log.info(
        "the model is sharded with FSDP2 over %d processes (%d %s units and the root)",
        accelerator.num_processes,
        units,
        "/".join(sorted(layers)) or "layer",
    )
    return model


def _full(tensor: torch.Tensor) -> torch.Tensor:
    """A DTensor's whole value (a collective: every process calls it), a plain tensor as is."""
    if not isinstance(tensor, DTensor):
        return tensor
    with CLOCK.blocking():
        return tensor.full_tensor()


def _unit_places(unit: torch.nn.Module) -> list[tuple[torch.nn.Module, str]]:
    """(module, attribute) of every parameter an FSDP2 unit manages itself: those of its
    submodules that no nested unit (a decoder layer under the root) holds; a parameter registered
    in two modules (tied embeddings and lm_head) appears under each."""
    places, stack = [], [unit]
    while stack:
        module = stack.pop()
        places.extend((module, name) for name, _ in module.named_parameters(recurse=False))
        stack.extend(child for child in module.children() if not isinstance(child, FSDPModule))
    return places


def _unit_copies(unit: torch.nn.Module, dtype: torch.dtype | None) -> tuple[dict[int, torch.Tensor], bool]:
    """One FSDP2 unit (a decoder layer, or the root's own embeddings, norm and head) made whole by
    its own ``unshard`` (one all-gather of the unit's flat shards, its copies in and out, as in a
    forward), each parameter copied (cast to ``dtype``: floating ones; None keeps each its own),
    and resharded: ({id(sharded parameter): its whole copy}, whether the unit gathers in another
    dtype than the one kept, mixed precision's bf16 when the trained float32 is asked for: those
    parameters are left out). A collective: every process calls it. A unit found whole (not
    resharded after its forward) is read as it is."""
    copies: dict[int, torch.Tensor] = {}
    places = _unit_places(unit)
    shards = [getattr(owner, name) for owner, name in places]
    sharded = any(isinstance(shard, DTensor) for shard in shards)
    other_dtype = False
    if sharded:
        unit.unshard()
    try:
        for (owner, name), shard in zip(places, shards):
            whole = getattr(owner, name).detach()
            if id(shard) in copies or isinstance(whole, DTensor):
                continue
            target = dtype if dtype is not None and whole.is_floating_point() else shard.dtype
            if whole.dtype in (shard.dtype, target):
                copies[id(shard)] = whole.to(target, copy=True)
            else:
                other_dtype = True
    finally:
        if sharded:
            unit.reshard()
    return copies, other_dtype


def iter_gathered(
    module: torch.nn.Module,
    dtype: torch.dtype | None = None,
    gather: Callable[[list[torch.nn.Parameter]], contextlib.AbstractContextManager] | None = None,
) -> Iterator[tuple[str, torch.Tensor]]:
    """``module``'s whole state dict as a stream of (name, tensor), gathered piece by piece as it
    is read (a collective: every process must read the whole stream, in order; see
    ``load_streamed``). An FSDP2 model is gathered one FSDP unit at a time (``_unit_copies``: one
    all-gather per decoder layer, then one for the root, where a DTensor's full_tensor would be one
    per tensor), its tensors yielded in the module's own order (a LoRA module's weight, lora_A and
    lora_B together); from the first unit that gathers in another dtype than the one kept (mixed
    precision), and for anything no unit holds, one tensor at a time: a DTensor made whole by
    full_tensor; with ``gather`` (DeepSpeed ZeRO-3: ``GatheredParameters(params,
    modifier_rank=None)``), ``gather([p])`` makes parameter p whole for the time of a with block,
    and the tensor yielded is a copy taken inside it (the gathered storage is freed when it ends).
    Each tensor is cast to ``dtype`` (floating ones; None: each keeps its own) at once, and the
    stream drops its own references as it yields, so a process holds what its reader keeps plus one
    gathered unit or tensor, never a copy of the whole model. No gather is open while a tensor is
    yielded. Tied weights (embeddings and lm_head) are gathered once and yielded under each of
    their names, one right after the other."""
    state = module.state_dict(keep_vars=True)
    names: dict[int, list[str]] = {}
    for name, value in state.items():
        names.setdefault(id(value), []).append(name)
    if gather is None and isinstance(module, FSDPModule):
        units = [unit for unit in module.modules() if isinstance(unit, FSDPModule)]
        for unit in reversed(units):  # the layers first, the root's (embeddings) last
            copies, other_dtype = _unit_copies(unit, dtype)
            for value in state.values():
                kept = copies.pop(id(value), None)
                if kept is None:
                    continue
                for alias in names.pop(id(value)):
                    yield alias, kept
                del kept
            if other_dtype:  # every process stops at the same unit: the rest one tensor at a time
                break
    for value in state.values():
        aliases = names.pop(id(value), None)
        if aliases is None:  # yielded already (by its unit, or under a tied tensor's first name)
            continue
        gathering = gather is not None and isinstance(value, torch.nn.Parameter)
        with gather([value]) if gathering else contextlib.nullcontext():
            full = _full(value.detach())
            target = dtype if dtype is not None and full.is_floating_point() else full.dtype
            kept = full.to(target, copy=gathering)
            del full  # a DTensor's whole float32 value, freed before the next gather
        for alias in aliases:
            yield alias, kept
        del kept


def gathered_state_dict(
    module: torch.nn.Module,
    dtype: torch.dtype | None = None,
    gather: Callable[[list[torch.nn.Parameter]], contextlib.AbstractContextManager] | None = None,
) -> dict[str, torch.Tensor]:
    """``iter_gathered`` kept whole, in the module's own order: a whole copy of the model in
    ``dtype`` on every process (what a checkpoint or a publication needs; a sampler takes the
    stream instead). Tied weights stay one tensor."""
    gathered = dict(iter_gathered(module, dtype, gather))
    return {name: gathered[name] for name in module.state_dict(keep_vars=True)}


def load_streamed(load: Callable[[Iterator[tuple[str, torch.Tensor]]], Any], weights: Iterable) -> None:
    """``load(stream)`` over ``weights`` (e.g. ``iter_gathered``), then the rest of the stream read
    to its end, also when ``load`` raised an Exception (which is then raised): the gathers are
    collectives, so a process that stopped reading half-way would leave the others waiting in the
    next one. A stream that itself raised (a failed gather) is over, and nothing more is read."""
    stream = iter(weights)
    try:
        load(stream)
    except Exception:
        for _ in stream:
            pass
        raise
    for _ in stream:
        pass


class TrainingBase:
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

        deepspeed = getattr(accelerator.state, "deepspeed_plugin", None)
        if deepspeed is not None and save_every > 0 and deepspeed.zero_stage not in (1, 2, 3):
            raise ValueError(
                f"{desc}: resumable checkpoints under DeepSpeed are written from its ZeRO optimizer (whole tensors "
                f"per parameter), and this config has zero_stage {deepspeed.zero_stage}: use zero_stage 1, 2 or 3 "
                "(configs/accelerate/deepspeed_zero2.yaml), or set save_every=0"
            )
        if deepspeed is not None:  # no prepared dataloader to infer these from (accelerate's documented route)
            deepspeed.deepspeed_config["train_micro_batch_size_per_gpu"] = micro_batch_size or 1
            deepspeed.deepspeed_config["gradient_accumulation_steps"] = accelerator.gradient_accumulation_steps
            deepspeed.deepspeed_config["gradient_clipping"] = settings.max_grad_norm

        self.objective = objective.to(accelerator.device) if objective is not None else None
        self.sharded = fsdp_requested(accelerator)  # FSDP2, applied here (docs/scale.md)
        if self.sharded:
            model = shard_model(model, accelerator)  # before the optimizer: it holds the shards
        # fused: one kernel per step; CUDA, plain or DDP parameters only (FSDP and DeepSpeed
        # shard or replace them and keep the default implementation)
        fused = (
            accelerator.device.type == "cuda"
            and not self.sharded
            and accelerator.distributed_type in (DistributedType.NO, DistributedType.MULTI_GPU)
        )
        optimizer = torch.optim.AdamW(
            parameter_groups(model, settings.weight_decay), lr=settings.lr, betas=tuple(settings.betas), fused=fused
        )
        # the objective's parameters: an AdamW of their own, outside every wrapper, replicated on
        # every process (their gradients are averaged in clip_gradients), so they stay identical
        own = [p for p in self.objective.parameters() if p.requires_grad] if self.objective is not None else []
        objective_optimizer = None
        if own:
            objective_optimizer = torch.optim.AdamW(
                [{"params": own, "weight_decay": 0.0}],
                betas=tuple(settings.betas),
                lr=objective_lr if objective_lr is not None else settings.lr,
                fused=accelerator.device.type == "cuda" and own[0].device.type == "cuda",
            )
        for opt in (optimizer, objective_optimizer):
            for group in opt.param_groups if opt is not None else []:
                group["initial_lr"] = group["lr"]
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
        return self.out_dir / CHECKPOINTS

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
            squares = squares + _full(torch.nn.utils.get_total_norm(model_grads)).float().square()
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

    # ------------------------------------------------------------------ checkpoints

    def _model_tensors(self) -> dict[str, torch.Tensor]:
        """The trainable parameters by name (a sharded model's are gathered: every process calls this)."""
        names = [name for name, p in self.unwrapped.named_parameters() if p.requires_grad]
        if self.accelerator.distributed_type in (DistributedType.FSDP, DistributedType.DEEPSPEED):
            full = self.accelerator.get_state_dict(self.model)
            return {name: full[name] for name in names if name in full} if full else {}
        params = dict(self.unwrapped.named_parameters())
        return {name: params[name] for name in names}

    def _gathered_from(self) -> tuple[torch.nn.Module, Callable | None] | None:
        """(module, gather) for ``iter_gathered`` when the weights are sharded (FSDP2, DeepSpeed
        ZeRO-3); None when every process holds them whole."""
        if self.sharded:
            return self.model, None
        plugin = getattr(self.accelerator.state, "deepspeed_plugin", None)
        if self.accelerator.distributed_type == DistributedType.DEEPSPEED and plugin.zero_stage == 3:
            import deepspeed  # installed wherever accelerate runs DeepSpeed

            return self.unwrapped, lambda params: deepspeed.zero.GatheredParameters(params, modifier_rank=None)
        return None

    def _whole_state_dict(self) -> dict[str, torch.Tensor]:
        """The state dict of weights every process holds whole: the live tensors (no copy)."""
        if self.accelerator.distributed_type == DistributedType.FSDP:
            return get_model_state_dict(self.model, options=StateDictOptions(full_state_dict=True))
        return {name: value.detach() for name, value in self.unwrapped.state_dict().items()}

    def iter_full_state(self, dtype: torch.dtype | None = None) -> Iterator[tuple[str, torch.Tensor]]:
        """The model's whole state dict as a stream of (name, tensor) on EVERY process: what a
        sampler with its own copy of the weights (a colocated vLLM engine, an HF copy) reloads.
        Under FSDP2 and DeepSpeed ZeRO-3 each tensor is gathered as it is read (``iter_gathered``:
        full_tensor, or GatheredParameters, a collective: every process reads the whole stream,
        through ``load_streamed``) and cast to ``dtype`` (the sampler's) at once, so a process holds
        one gathered tensor beyond what its reader keeps, never a copy of the whole model;
        unsharded (DDP, ZeRO-1/2: every process holds the whole weights), the live tensors
        themselves (no copy, ``dtype`` left to the reader)."""
        source = self._gathered_from()
        if source is not None:
            return iter_gathered(source[0], dtype, gather=source[1])
        return iter(self._whole_state_dict().items())

    def full_state_dict(self, dtype: torch.dtype | None = None) -> dict[str, torch.Tensor]:
        """``iter_full_state`` kept whole (every process calls it): gathered from shards, a whole
        copy of the model in ``dtype`` on every process, for what needs every tensor at once (a
        saved model, an asynchronous publication's buckets); unsharded, the live tensors."""
        source = self._gathered_from()
        if source is not None:
            return gathered_state_dict(source[0], dtype, gather=source[1])
        return self._whole_state_dict()

    def final_state_dict(self) -> dict[str, torch.Tensor]:
        """The model's whole state dict for saving it (every process calls this; gathered from
        FSDP2 / DeepSpeed shards, whole on the main process at least)."""
        if self.sharded:
            moved: dict[int, torch.Tensor] = {}  # tied weights stay one tensor (save_pretrained drops the tied copy)
            return {name: moved.setdefault(id(value), value.cpu()) for name, value in self.full_state_dict().items()}
        return self.accelerator.get_state_dict(self.model)

    def save_checkpoint(self, loop_state: dict | None = None) -> Path | None:
        """A resumable checkpoint of this step (crash-safe; the newest ``keep_checkpoints`` kept).
        Every process calls it; the main one commits."""
        accelerator = self.accelerator
        staging = None
        if self.is_main:
            staging = checkpoint.staging_dir(self.checkpoint_root, self.step)
        accelerator.wait_for_everyone()
        staging = staging or self.checkpoint_root / f"{checkpoint.STAGING}{checkpoint.PREFIX}{self.step:08d}"
        if self.sharded:  # every process writes its own shards (torch.distributed.checkpoint)
            self._save_sharded(staging)
        elif self._zero:  # gathered whole, one parameter at a time; the main process writes
            self._save_full(staging)
        else:  # replicated: the main process writes the one copy
            model_tensors = self._model_tensors()
            optimizer_state = self._optimizer_state()
        if self.is_main:
            if not self.sharded and not self._zero:
                checkpoint.write_tensors(staging / "model.safetensors", model_tensors)
                checkpoint.write_state(staging, "optimizer", optimizer_state)
            if self.objective is not None:
                checkpoint.write_state(staging, "objective", self.objective.state_dict())
            if self.objective_optimizer is not None:
                checkpoint.write_state(staging, "objective_optimizer", self.objective_optimizer.state_dict())
            checkpoint.write_state(
                staging, "trainer", {"step": self.step, "processes": accelerator.num_processes, "loop": loop_state}
            )
        checkpoint.write_state(staging, f"rng-rank{accelerator.process_index}", checkpoint.rng_state())
        accelerator.wait_for_everyone()
        committed = None
        if self.is_main:
            committed = checkpoint.commit(staging, self.step, keep=self.keep_checkpoints)
            log.info("%s: checkpoint at step %d in %s", self.desc, self.step, committed)
        accelerator.wait_for_everyone()
        return committed

    def _trainable_names(self) -> list[str]:
        return [name for name, p in self.unwrapped.named_parameters() if p.requires_grad]

    @property
    def _zero(self) -> bool:
        """A DeepSpeed (ZeRO) run: its checkpoints hold whole tensors per parameter (zero_state)."""
        return self.accelerator.distributed_type == DistributedType.DEEPSPEED

    def _layout(self) -> str:
        """This run's layout, as a checkpoint mismatch names it."""
        processes = self.accelerator.num_processes
        if self._zero:
            stage = self.accelerator.state.deepspeed_plugin.zero_stage
            return f"DeepSpeed ZeRO-{stage}, {processes} process(es)"
        return f"FSDP2 shards, {processes} process(es)" if self.sharded else f"unsharded, {processes} process(es)"

    def _save_full(self, staging: Path) -> None:
        """DeepSpeed: every trainable parameter's float32 master weight and AdamW moments, gathered
        whole one parameter at a time (a collective: every process calls this), written by the
        main process into staging/full/ with the AdamW step count in full/index.json."""
        names = self._trainable_names()
        checkpoint.write_full(
            staging,
            zero_state.gathered(self.model, self.unwrapped, names),
            {
                "written_under": self._layout(),
                "processes": self.accelerator.num_processes,  # whole tensors: loads under any number
                "loads_under": "any number of processes (whole tensors per parameter)",
                "optimizer_step": zero_state.optimizer_step(self.model),
                "parameters": names,
                "moments": list(zero_state.MOMENTS),
            },
            write=self.is_main,
        )

    def _read_full(self, directory: Path) -> dict:
        """A DeepSpeed checkpoint's index, checked against this model (names and whole shapes)
        before anything is loaded; refused (CheckpointMismatch) unless this run is under DeepSpeed."""
        if not self._zero:
            raise checkpoint.CheckpointMismatch(
                f"{directory}: written under DeepSpeed ZeRO (whole tensors per parameter, {checkpoint.FULL}/), and this "
                f"run is {self._layout()}: resume it under a DeepSpeed config (any number of processes), or move it "
                "away to train afresh"
            )
        params = dict(self.unwrapped.named_parameters())
        shapes = {
            key: tuple(getattr(params[name], "ds_shape", params[name].shape))  # ZeRO-3: the whole shape
            for key in zero_state.keys(self._trainable_names())
            for name in [zero_state.split_key(key)[1]]
        }
        return checkpoint.read_full_index(directory, shapes, self._layout())

    def _load_full(self, directory: Path, index: dict) -> None:
        """Set a checked DeepSpeed checkpoint into the engine, one tensor at a time (every process
        reads the files itself and calls this: the setters are collectives under ZeRO-3)."""
        zero_state.prepare_state(self.model, int(index.get("optimizer_step") or 0))
        wanted = zero_state.keys(self._trainable_names())
        zero_state.load(
            self.model, self.unwrapped, checkpoint.iter_full(directory, index, wanted), self.accelerator.device
        )

    def _save_sharded(self, staging: Path) -> None:
        """FSDP2: the trainable weights' and the optimizer's shards of every process into
        staging/sharded/ (torch.distributed.checkpoint), the optimizer state's skeleton and the
        parameter names as JSON (sharded.json, main process)."""
        names = self._trainable_names()
        model_state = get_model_state_dict(self.model)
        skeleton, optimizer_tensors = checkpoint.flatten_state(
            get_optimizer_state_dict(self.model, self.optimizer.optimizer), to_cpu=False
        )
        checkpoint.write_sharded(
            staging,
            {
                **{f"model.{n}": model_state[n] for n in names},
                **{f"optimizer.{k}": v for k, v in optimizer_tensors.items()},
            },
        )
        if self.is_main:
            checkpoint.write_json(
                staging / "sharded.json",
                {"model": names, "optimizer": skeleton, "processes": self.accelerator.num_processes},
            )

    def _read_sharded(self, directory: Path) -> tuple[dict[str, torch.Tensor], dict]:
        """A sharded checkpoint's trainable weights and optimizer state, loaded into copies laid
        out as this run holds them (its shards under FSDP2, whole tensors otherwise): resharded
        from however many processes wrote it. Every process calls this."""
        try:
            meta = json.loads((directory / "sharded.json").read_text(encoding="utf-8"))
            names, skeleton = list(meta["model"]), meta["optimizer"]
        except (OSError, ValueError, KeyError, TypeError) as error:
            raise checkpoint.CheckpointError(f"{directory}: cannot read sharded.json ({error})") from error
        self._check_names(set(names), directory)
        model_now = get_model_state_dict(self.model)
        _, optimizer_now = checkpoint.flatten_state(
            get_optimizer_state_dict(self.model, self.optimizer.optimizer), to_cpu=False
        )
        paths = checkpoint.tensor_paths(skeleton)
        if paths != set(optimizer_now):
            raise checkpoint.CheckpointError(
                f"{directory}: its optimizer state (written by {meta.get('processes')} processes) does not match this run's "
                f"optimizer ({len(paths)} tensors against {len(optimizer_now)}); it was written by another model or config"
            )
        targets = {
            **{f"model.{n}": model_now[n].detach().clone() for n in names},
            **{f"optimizer.{k}": optimizer_now[k].clone() for k in paths},
        }
        checkpoint.read_sharded(directory, targets)  # into copies: a failure leaves the model untouched
        return (
            {n: targets[f"model.{n}"] for n in names},
            checkpoint.unflatten_state(skeleton, {k: targets[f"optimizer.{k}"] for k in paths}),
        )

    def _optimizer_state(self) -> dict:
        if self.sharded or self.accelerator.distributed_type == DistributedType.FSDP:
            options = StateDictOptions(full_state_dict=True, cpu_offload=True)
            return get_optimizer_state_dict(self.model, self.optimizer.optimizer, options=options)
        return self.optimizer.state_dict()

    def resume(self) -> dict | None:
        """Load the newest good checkpoint under out_dir/checkpoints: trainable parameters,
        optimizer, objective, RNG states and step; trims metrics.jsonl to that step. Returns the
        loop state saved with it, or None when there is none (metrics.jsonl then starts empty).
        A checkpoint that fails its manifest or cannot be read is reported and the one before it
        used; with none left, training restarts from step 0 and the log says so."""
        accelerator = self.accelerator
        if self.is_main:
            checkpoint.remove_staging(self.checkpoint_root)
        accelerator.wait_for_everyone()

        def read(
            directory: Path,
        ) -> tuple:  # everything before anything is applied: a bad file leaves the model untouched
            trainer = checkpoint.read_state(directory, "trainer")
            if checkpoint.is_full(directory):  # DeepSpeed: checked here, loaded tensor by tensor below
                weights, optimizer_state = self._read_full(directory), None
            elif self._zero:
                raise checkpoint.CheckpointMismatch(
                    f"{directory}: written by a run without DeepSpeed ({trainer.get('processes')} process(es); "
                    f"{'FSDP2 shards' if checkpoint.is_sharded(directory) else 'one whole copy'}), and this run is "
                    f"{self._layout()}, which reads whole tensors per parameter ({checkpoint.FULL}/): resume it with "
                    "the config that wrote it, or move it away to train afresh"
                )
            elif checkpoint.is_sharded(directory):
                weights, optimizer_state = self._read_sharded(directory)
            else:
                weights, optimizer_state = (
                    checkpoint.read_tensors(directory / "model.safetensors"),
                    checkpoint.read_state(directory, "optimizer"),
                )
            return (
                trainer,
                weights,
                optimizer_state,
                checkpoint.read_state(directory, "objective") if self.objective is not None else None,
                checkpoint.read_state(directory, "objective_optimizer")
                if self.objective_optimizer is not None
                else None,
            )

        loaded = checkpoint.newest(self.checkpoint_root, read, self.desc)
        if loaded is None:
            if checkpoint.committed(self.checkpoint_root):
                log.warning(
                    "%s: no usable checkpoint in %s: training restarts from step 0", self.desc, self.checkpoint_root
                )
            self.metrics.trim(0)
            return None
        directory, (trainer, saved, optimizer_state, objective_state, objective_optimizer_state) = loaded
        if checkpoint.is_full(directory):
            self._load_full(directory, saved)
        else:
            self._load_model_tensors(saved, directory)
            self._load_optimizer_state(optimizer_state, by_name=checkpoint.is_sharded(directory))
        if self.objective is not None:
            self.objective.load_state_dict(objective_state)
        if self.objective_optimizer is not None:
            self.objective_optimizer.load_state_dict(objective_optimizer_state)
        rank_rng = f"rng-rank{accelerator.process_index}"
        if checkpoint.has_state(directory, rank_rng):
            checkpoint.restore_rng(checkpoint.read_state(directory, rank_rng))
        self.step = int(trainer["step"])
        self._set_lr()
        self.metrics.trim(self.step // self.updates_per_record)
        log.info("%s: resumed from %s (step %d of %d)", self.desc, directory, self.step, self.settings.total_steps)
        return trainer.get("loop") or {}

    def _check_names(self, saved: set[str], directory: Path) -> None:
        trainable = set(self._trainable_names())
        missing, unexpected = sorted(trainable - saved), sorted(saved - trainable)
        if missing or unexpected:
            raise checkpoint.CheckpointError(
                f"{directory}: its parameters do not match this model's trainable ones (missing {missing[:3]}, "
                f"unexpected {unexpected[:3]}); it was written by another model or config: move it away to train afresh"
            )

    def _load_model_tensors(self, saved: dict[str, torch.Tensor], directory: Path) -> None:
        self._check_names(set(saved), directory)
        if self.sharded or self.accelerator.distributed_type == DistributedType.FSDP:
            whole = not any(isinstance(v, DTensor) for v in saved.values())
            set_model_state_dict(self.model, saved, options=StateDictOptions(full_state_dict=whole, strict=False))
            return
        params = dict(self.unwrapped.named_parameters())
        with torch.no_grad():
            for name, value in saved.items():
                params[name].copy_(value.to(params[name].device, params[name].dtype))

    def _load_optimizer_state(self, state: dict, by_name: bool = False) -> None:
        """by_name: ``state`` is keyed by parameter names (torch.distributed.checkpoint's layout,
        a sharded checkpoint), already laid out as this run holds it."""
        if by_name:
            whole = not any(isinstance(v, DTensor) for per in state.get("state", {}).values() for v in per.values())
            set_optimizer_state_dict(
                self.model, self.optimizer.optimizer, state, options=StateDictOptions(full_state_dict=whole)
            )
            return
        if self.sharded or self.accelerator.distributed_type == DistributedType.FSDP:
            set_optimizer_state_dict(
                self.model, self.optimizer.optimizer, state, options=StateDictOptions(full_state_dict=True)
            )
            return
        self.optimizer.load_state_dict(state)

    def finish(self) -> None:
        """Once the final model is written: the resumable state only served an interrupted run;
        the trackers are closed."""
        if self.tracking is not None:
            self.tracking.finish(self.accelerator)
        self.accelerator.wait_for_everyone()
        if self.is_main:
            checkpoint.remove_all(self.checkpoint_root)
        self.accelerator.wait_for_everyone()
