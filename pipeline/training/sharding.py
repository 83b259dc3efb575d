"""FSDP2 sharding of a trained model: under an FSDP accelerate config with several processes the
training base applies torch's FSDP2 ``fully_shard`` itself (each decoder layer, then the root) on
any device, so CPU (gloo) and GPU runs share one code path (docs/scale.md, "FSDP2"); DDP and
DeepSpeed go through ``accelerator.prepare``. Reading the sharded weights back whole is
``pipeline.training.gathering``."""

from __future__ import annotations

import logging
import os

import torch
from accelerate import Accelerator
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard

from pipeline.training.collective_clock import CLOCK

log = logging.getLogger("stepflow.training")


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
