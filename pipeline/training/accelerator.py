"""The Accelerator of one trainer: the device, the mixed precision every trainer shares, and the
settings an accelerate plugin needs from the training base (DeepSpeed's batch, accumulation and
clipping, which no prepared dataloader infers here)."""

from __future__ import annotations

import os

import torch
from accelerate import Accelerator, PartialState

from pipeline.modeling import resolve_device
from pipeline.training.launch_settings import check_launch_environment
from pipeline.training.tracking import Tracking


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


def configure_deepspeed(
    accelerator: Accelerator, *, micro_batch_size: int | None, max_grad_norm: float, save_every: int, desc: str
) -> None:
    """Under DeepSpeed: the micro-batch size, accumulation and clipping written into its config,
    and a ZeRO stage that cannot write resumable checkpoints refused when ``save_every`` asks for
    them. A no-op without DeepSpeed."""
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
        deepspeed.deepspeed_config["gradient_clipping"] = max_grad_norm
