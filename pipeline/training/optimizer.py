"""The optimizers of one run: AdamW with weight decay on matrices only (none on biases, norms,
embeddings' 1-D parameters); an objective's own parameters (log Z, a value head) in an AdamW of
their own, with the same betas and schedule at their own base rate, stepped and zeroed together
with the model's: DDP, FSDP2 and DeepSpeed only ever see the model's parameters in the optimizer
they wrap (FSDP2 and ZeRO map an optimizer's parameters to their shards and refuse any other);
fused on CUDA where the parameters are plain or DDP-replicated."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from accelerate import Accelerator
from accelerate.utils import DistributedType


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


def parameter_groups(model: torch.nn.Module, weight_decay: float) -> list[dict]:
    """AdamW groups: decay on trainable matrices, none on 1-D parameters and biases."""
    decay, no_decay = [], []
    for name, param in model.named_parameters():
        if param.requires_grad:
            (no_decay if param.ndim < 2 or name.endswith(".bias") else decay).append(param)
    return [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]


def make_optimizers(
    model: torch.nn.Module,
    objective: torch.nn.Module | None,
    settings: OptimizerSettings,
    objective_lr: float | None,
    accelerator: Accelerator,
    sharded: bool,
) -> tuple[torch.optim.AdamW, torch.optim.AdamW | None]:
    """(the model's AdamW, the objective's AdamW or None when it has no trainable parameters),
    each group's ``initial_lr`` set to its base rate (the schedule scales it). ``model``: as the
    optimizer will see it (FSDP2: already sharded, ``sharded``); ``objective``: on its device."""
    # fused: one kernel per step; CUDA, plain or DDP parameters only (FSDP and DeepSpeed
    # shard or replace them and keep the default implementation)
    fused = (
        accelerator.device.type == "cuda"
        and not sharded
        and accelerator.distributed_type in (DistributedType.NO, DistributedType.MULTI_GPU)
    )
    optimizer = torch.optim.AdamW(
        parameter_groups(model, settings.weight_decay), lr=settings.lr, betas=tuple(settings.betas), fused=fused
    )
    # the objective's parameters: an AdamW of their own, outside every wrapper, replicated on
    # every process (their gradients are averaged in clip_gradients), so they stay identical
    own = [p for p in objective.parameters() if p.requires_grad] if objective is not None else []
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
    return optimizer, objective_optimizer
