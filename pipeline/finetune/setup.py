"""Every choice of a fine-tuning run, made once: ``resolve(config, stage, launch) -> FinetuneSetup``.

A fine-tuning run crosses the objective (gfn | ppo), the mode (sync | async), the sampling backend
(hf | vllm) and how the trained weights are sharded over the launch's processes (none, DDP,
DeepSpeed, ZeRO-3, FSDP2). ``resolve`` is a pure function of the config and the launch that makes
every choice (which sampler, where the reference policy lives, the dtype an asynchronous trainer
publishes in, ...) and raises every refusal of a combination that cannot work, once, as a
``SetupError`` (a ConfigError) naming the key. Its readers:

    preflight(config, stage)            the stage, before any model loads: resolve under the launch
                                        this process runs in, then what only this machine can say
    planner.costs.finetune_stage        make plan: resolve under the accelerate file it names
    pipeline.finetune.run               the builder: straight-line code over the setup

For example, configs/tiny.yaml's gfn section under an FSDP2 accelerate config of 8 processes:

    resolve(load_config("configs/tiny.yaml"), "gfn", FinetuneLaunch(8, {"ACCELERATE_USE_FSDP": "true",
                                                                        "FSDP_VERSION": "2"}))
    -> FinetuneSetup(stage='gfn', objective='tb_vargrad', mode='sync', backend='hf', sampler='hf_copy',
                     sharding='fsdp', processes=8, reference='objective', start_weights=True,
                     publish_dtype=None, ceiling=True, value_head=False)
"""

from __future__ import annotations

import importlib.util
import os
from collections.abc import Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

import torch

from pipeline.batches import check_divisible
from pipeline.config.loader import ConfigError, check_choice, config_checks
from pipeline.config.schema import Config, GenerationBackend, GFNConfig, PPOConfig, TrainingMode
from pipeline.finetune.objectives import needs_reference, objective_name
from pipeline.finetune.tba.publication import searcher_dtype
from pipeline.finetune.tba.settings import check_async_settings
from pipeline.finetune.tba.weight_transport import check_transport
from pipeline.generation import BACKENDS, check_served_models
from pipeline.generation.vllm_servable import adapter_config, lora_scaling
from pipeline.training import process_count
from pipeline.training.tracking import tracker_names

# What samples the trajectories (FinetuneSetup.sampler), how the trained weights are held over the
# processes (FinetuneSetup.sharding), where the frozen reference policy is used (FinetuneSetup.reference).
Sampler = Literal["policy", "vllm", "hf_copy", "searchers"]
Sharding = Literal["none", "ddp", "deepspeed", "zero3", "fsdp"]
Reference = Literal["none", "objective", "sampler"]

# The variables `accelerate launch` exports for its config file that the fine-tuning setup reads
ACCELERATE_VARIABLES = (
    "ACCELERATE_USE_FSDP",
    "FSDP_VERSION",
    "ACCELERATE_USE_DEEPSPEED",
    "ACCELERATE_DEEPSPEED_ZERO_STAGE",
)


class SetupError(ConfigError):
    """A fine-tuning run its config and launch cannot make; the message names the key(s).
    ``key``: the config key make plan files it under; None when the launch (its accelerate config)
    is what cannot work."""

    def __init__(self, message: str, key: str | None = None):
        super().__init__(message)
        self.key = key


@dataclass(frozen=True)
class FinetuneLaunch:
    """How a fine-tuning stage is launched: its trainer processes and the variables ``accelerate
    launch`` exports for its accelerate config (ACCELERATE_VARIABLES; any other is dropped). The
    running stage passes its own (process_count, os.environ: ``preflight``); make plan the ones the
    file it names would export (pipeline.training.launch_settings.file_environment)."""

    processes: int = 1
    environ: Mapping[str, str] = field(default_factory=dict)

    def __post_init__(self):
        kept = {name: str(self.environ[name]) for name in ACCELERATE_VARIABLES if name in self.environ}
        object.__setattr__(self, "environ", kept)

    def _on(self, name: str) -> bool:
        return self.environ.get(name, "false").lower() in ("1", "true", "yes")

    @property
    def fsdp_version(self) -> str | None:
        """The FSDP version asked for (accelerate's default "1" when unsaid); None without FSDP."""
        if not self._on("ACCELERATE_USE_FSDP"):
            return None
        return self.environ.get("FSDP_VERSION", "1")

    @property
    def zero_stage(self) -> str | None:
        """The DeepSpeed ZeRO stage asked for (accelerate's default "2" when unsaid); None without DeepSpeed."""
        if not self._on("ACCELERATE_USE_DEEPSPEED"):
            return None
        return self.environ.get("ACCELERATE_DEEPSPEED_ZERO_STAGE", "2")

    @property
    def sharding(self) -> Sharding:
        """How the trained weights are held: "none" (one process), "ddp" (whole on every process),
        "deepspeed" (ZeRO 0-2: whole weights, gradients and optimizer state sharded), "zero3" or
        "fsdp" (sharded weights: no process holds the whole policy between forwards)."""
        if self.processes < 2:
            return "none"
        if self.fsdp_version is not None:
            return "fsdp"
        if self.zero_stage is not None:
            return "zero3" if self.zero_stage == "3" else "deepspeed"
        return "ddp"


@dataclass(frozen=True)
class FinetuneSetup:
    """Every choice of one fine-tuning run (``resolve``); the builder (pipeline.finetune.run), the
    stage's preflight and make plan read it.

    stage:       "gfn" | "ppo": the config section (its keys' prefix), the run folder, the logs' label
    objective:   the objective's registry name (objectives.OBJECTIVES): subtb, tb, tb_vargrad or ppo
    mode:        "sync" (this process samples, then trains) | "async" (searcher actors on Ray sample
                 while it trains; docs/async.md)
    backend:     generation.backend of whatever samples: "hf" | "vllm"
    sampler:     what samples the trajectories:
                 "policy"    HF generate on the trained model itself (each process holds it whole)
                 "vllm"      a vLLM engine in each process, given the trained weights after every update
                 "hf_copy"   an HF copy of the policy in model.dtype, given the gathered weights after
                             every update (FSDP2: no process holds the whole policy between forwards)
                 "searchers" the asynchronous searchers, each with its own ``backend`` sampler
    sharding:    FinetuneLaunch.sharding of the trained weights over the ``processes``
    processes:   trainer processes; each samples questions_per_step / processes questions a step
    reference:   where the frozen reference policy is used: "none" (the objective needs none),
                 "objective" (scored at training time, reset every gfn.reference_reset_every
                 steps: the GFlowNet), "sampler" (its log-probs stored with each trajectory: PPO)
    start_weights: the sampler is given the trained weights before the first step (its copy
                 starts from model.policy alone: an HF copy; a vLLM engine beside a model.policy_adapter)
    publish_dtype: async: the searchers' dtype, which the trainer publishes in
                 (publication.searcher_dtype: model.dtype auto on a GPU is bfloat16 where this
                 machine's CUDA supports it); None in sync mode
    ceiling:     the base policy's reweighting ceiling is measured before training (gfn.ceiling_questions > 0)
    value_head:  the objective has a value head, saved beside the model (PPO)
    """

    stage: str
    objective: str
    mode: TrainingMode
    backend: GenerationBackend
    sampler: Sampler
    sharding: Sharding
    processes: int
    reference: Reference
    start_weights: bool
    publish_dtype: torch.dtype | None
    ceiling: bool
    value_head: bool


@contextmanager
def _filed_under(key: str | None):
    """A delegated check's refusal (a ValueError naming its key) as a SetupError filed under ``key``."""
    try:
        yield
    except SetupError:
        raise
    except ValueError as error:  # ConfigError included
        raise SetupError(str(error), key) from None


def check_accelerate_launch(stage: str, cfg, backend: str, processes: int, environ: Mapping[str, str]) -> None:
    """The accelerate config this run is launched with (as ``accelerate launch`` passes it on:
    ACCELERATE_USE_FSDP, FSDP_VERSION, ACCELERATE_USE_DEEPSPEED, ACCELERATE_DEEPSPEED_ZERO_STAGE)
    against the objective's settings and the sampling backend: a combination that cannot work is
    refused, naming the config that works (docs/scale.md)."""
    launch = FinetuneLaunch(processes, environ)
    if launch.fsdp_version not in (None, "2"):
        raise ValueError(
            f"the accelerate config asks for FSDP version {launch.fsdp_version}: the training base "
            "shards the policy with FSDP2 only; use configs/accelerate/policy_fsdp.yaml (fsdp_version: 2)"
        )
    stage_of_zero = launch.zero_stage
    if stage_of_zero is None:
        return
    if cfg.save_every > 0 and stage_of_zero not in ("1", "2", "3"):
        raise ValueError(
            f"{stage}.save_every={cfg.save_every} under DeepSpeed ZeRO stage {stage_of_zero}: resumable checkpoints "
            f"are written from a ZeRO optimizer (stage 1, 2 or 3); use configs/accelerate/deepspeed_zero2.yaml, or "
            f"set {stage}.save_every=0"
        )
    if stage_of_zero == "3" and backend != "vllm" and cfg.mode != "async":
        raise ValueError(
            "DeepSpeed ZeRO-3 with generation.backend=hf: no process holds the whole policy between forwards and "
            "the trainer gathers no copy for HF sampling; use generation.backend=vllm (the trainer gathers the "
            "weights for the engine), configs/accelerate/policy_fsdp.yaml (FSDP2, HF or vLLM sampling) or "
            "deepspeed_zero2.yaml"
        )


def resolve(config: Config, stage: str, launch: FinetuneLaunch) -> FinetuneSetup:
    """The setup of fine-tuning stage ``stage`` ("gfn" | "ppo") with ``config`` under ``launch``
    (FinetuneSetup), or a SetupError naming the key of the first setting that cannot work with the
    others: the mode (PPO is on-policy: no async), the asynchronous mode's settings (its weight
    transport, a cluster address under several trainer processes, the buffer and batch settings),
    questions_per_step against the processes, the launch against the backend
    (check_accelerate_launch), the backend, a vLLM sampler's tensor parallelism. Reads no file and
    loads nothing: what only the machine can say is ``preflight``'s."""
    cfg = config.finetune_section(stage)
    processes = launch.processes
    with _filed_under(f"{stage}.mode"):
        mode = check_choice(cfg.mode, TrainingMode, f"{stage}.mode")
    if mode == "async":
        if isinstance(cfg, PPOConfig):
            raise SetupError(
                f"{stage}.mode=async: PPO is on-policy (its ratio and advantages assume the trajectories come from the "
                "policy being updated); the asynchronous mode is for the off-policy GFlowNet objectives (make gfn)",
                f"{stage}.mode",
            )
        with _filed_under(f"{stage}.weight_transport"):
            check_transport(cfg.weight_transport)
        if processes > 1 and cfg.ray_address is None:
            raise SetupError(
                f"{stage}.mode=async under {processes} trainer processes needs {stage}.ray_address: the main process "
                "joins a Ray cluster started beside the trainer's launch (the other processes never connect; they get "
                "their batches from it) and reserves the trainer's GPUs there, on one machine or several. Start "
                f"one first (`ray start --head`) and pass {stage}.ray_address=auto (or host:port)",
                f"{stage}.ray_address",
            )
        with _filed_under(stage):  # each names its own key
            check_async_settings(cfg, stage)
    with _filed_under(f"{stage}.questions_per_step"):
        check_divisible(cfg.questions_per_step, processes, key=f"{stage}.questions_per_step")
    backend = config.generation.backend
    with _filed_under(None):
        check_accelerate_launch(stage, cfg, backend, processes, launch.environ)
    if backend not in BACKENDS:
        raise SetupError(
            f"generation.backend is {backend!r}; expected one of {', '.join(BACKENDS)}", "generation.backend"
        )
    tensor_parallel = config.generation.vllm_tensor_parallel_size
    if backend == "vllm" and tensor_parallel > 1:
        raise SetupError(
            f"generation.vllm_tensor_parallel_size={tensor_parallel}: a fine-tuning sampler's weights are replaced in "
            "its own process after every update (vLLM's reload_weights there reaches that process's shard only); "
            "use 1 (one engine per training process or searcher, data parallel over the processes)",
            "generation.vllm_tensor_parallel_size",
        )
    sharding = launch.sharding
    if mode == "async":
        sampler: Sampler = "searchers"
    elif backend == "vllm":
        sampler = "vllm"
    elif sharding == "fsdp":
        sampler = "hf_copy"
    else:  # ZeRO-3 with HF sampling was refused above (check_accelerate_launch)
        sampler = "policy"
    reference: Reference = "none"
    if needs_reference(cfg):  # the GFlowNet scores its reference at training time (it may be reset)
        reference = "sampler" if isinstance(cfg, PPOConfig) else "objective"
    return FinetuneSetup(
        stage=stage,
        objective=objective_name(cfg),
        mode=mode,
        backend=backend,
        sampler=sampler,
        sharding=sharding,
        processes=processes,
        reference=reference,
        start_weights=sampler == "hf_copy" or (sampler == "vllm" and bool(config.model.policy_adapter)),
        publish_dtype=searcher_dtype(config, cfg) if mode == "async" else None,
        ceiling=isinstance(cfg, GFNConfig) and cfg.ceiling_questions > 0,
        value_head=isinstance(cfg, PPOConfig),
    )


@config_checks
def preflight(config: Config, stage: str) -> FinetuneSetup:
    """What can be checked before any model is loaded (a ConfigError, not a crash halfway): the
    run's setup under the launch this process runs in (``resolve``: under ``accelerate launch``
    each process samples a whole share of the questions), then what only this machine can say: Ray
    installed for the asynchronous mode, gfn.trainer_cores among its cores, the GPU searchers'
    vLLM share set (a stage derives it before this), the sampling backend's package, the policy
    folder its engine serves (check_served_models), a model.policy_adapter a vLLM sampler merges
    (lora_scaling) and the trackers (report_to). The searchers are checked against the cluster once
    it is joined (pipeline.finetune.run.check_cluster), still before any model is loaded.
    Returns the setup."""
    processes = process_count(config.model)  # also gives each process its GPU before anything is loaded on it
    setup = resolve(config, stage, FinetuneLaunch(processes, os.environ))
    cfg = config.finetune_section(stage)
    if setup.mode == "async":
        if importlib.util.find_spec("ray") is None:
            raise ValueError("gfn.mode=async needs Ray: pip install -e '.[distributed]'")
        if setup.backend == "vllm" and cfg.searcher_gpus and cfg.searcher_vllm_memory_share is None:
            raise ConfigError(
                "gfn.searcher_vllm_memory_share is unset with GPU searchers (gfn.searcher_gpus="
                f"{cfg.searcher_gpus:g}): the stage (python -m stages.train_gfn) derives it from what shares a "
                "searcher's GPU before anything loads (planner.searchers.searcher_stage); outside a stage, set it"
            )
    cores = os.cpu_count() or 1
    if cfg.trainer_cores is not None and any(core >= cores for core in cfg.trainer_cores):
        raise ValueError(f"{stage}.trainer_cores = {cfg.trainer_cores}: this machine has cores 0 to {cores - 1}")
    check_served_models(config, {"model.policy": config.resolve(config.model.policy)})  # the sampler's engine serves it
    adapter = config.resolve(config.model.policy_adapter)
    if setup.backend == "vllm" and adapter and Path(adapter).is_dir():
        lora_scaling(adapter_config(adapter))  # merged into the weights the engine is given: one alpha / r
    tracker_names(config.report_to)
    return setup
