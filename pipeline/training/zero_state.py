"""Resumable checkpoints of a DeepSpeed ZeRO run (stages 1, 2 and 3): whole tensors per parameter.

Saving: every trainable parameter's float32 master weight and its two AdamW moments (exp_avg,
exp_avg_sq) are gathered whole, one parameter at a time, through deepspeed.utils'
``safe_get_full_fp32_param`` / ``safe_get_full_optimizer_state`` (collectives under ZeRO: every
process calls them, in the order of the model's named parameters), and the main process writes
them as safetensors (``checkpoint_io.write_full``); the AdamW step count goes into the JSON index.
Loading: the base AdamW's state is created on the flat float32 partitions DeepSpeed steps (as
torch creates it at a first step, with the saved step count) and linked to the parameters the way
DeepSpeed links it after its first step, then every tensor is set back with
``safe_set_full_fp32_param`` / ``safe_set_full_optimizer_state`` (ZeRO-3: this process's
partition of it with ``safe_set_local_*``), and each weight is copied into the model's own
parameter (bfloat16 or float32; under ZeRO-3 its partition).

Whole tensors carry no sharding, so a checkpoint written by N processes loads under M, and under
ZeRO-1, 2 or 3 alike. The cost: each process holds one whole float32 parameter (and one moment)
at a time on its GPU, and the main process one file's bucket on its CPU.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator

import torch

MOMENTS = ("exp_avg", "exp_avg_sq")  # torch AdamW's per-parameter state beside "step"


def keys(names: Iterable[str]) -> list[str]:
    """The checkpoint's tensor keys for the trainable parameters ``names``, in the order every
    process gathers and sets them: model.<name>, then each moment's <moment>.<name>."""
    return [key for name in names for key in (f"model.{name}", *(f"{moment}.{name}" for moment in MOMENTS))]


def split_key(key: str) -> tuple[str, str]:
    """(kind, parameter name) of a key from ``keys``: kind is "model" or a moment."""
    kind, _, name = key.partition(".")
    return kind, name


def _zero_optimizer(engine):
    """The ZeRO optimizer a DeepSpeed engine wraps the base AdamW in, and the flat float32
    partitions that AdamW steps (its state is keyed by them)."""
    zero = getattr(engine, "optimizer", None)
    for attribute in ("single_partition_of_fp32_groups", "fp32_partitioned_groups_flat"):  # ZeRO-1/2, ZeRO-3
        if hasattr(zero, attribute):
            return zero, list(getattr(zero, attribute))
    raise ValueError(
        f"resumable checkpoints under DeepSpeed need a ZeRO optimizer (stage 1, 2 or 3); this engine's is "
        f"{type(zero).__name__}: set zero_stage to 1, 2 or 3 in the accelerate config, or save_every=0"
    )


def _link(zero, masters: list[torch.Tensor]) -> None:
    """ZeRO-1/2: point every parameter's optimizer-state fragments at the base AdamW's state of its
    own group's flat partition. DeepSpeed 0.19.8 links them once, right after stepping the first
    of its groups, when the later groups (here the 1-D parameters without weight decay) have no
    state yet, so their fragments stay empty; linking again is idempotent (views, no copies)."""
    if not hasattr(zero, "bit16_groups"):  # ZeRO-3 reads the state by partition, nothing to link
        return
    # deepspeed: a heavy optional dependency, present only where a DeepSpeed launch runs this
    from deepspeed.utils import lazy_init_hp_params_optimizer_state

    for params, master in zip(zero.bit16_groups, masters):
        lazy_init_hp_params_optimizer_state(params, master, zero.optimizer.state)


def optimizer_step(engine) -> int:
    """The base AdamW's step count (the same on every flat partition)."""
    zero, masters = _zero_optimizer(engine)
    steps = {int(zero.optimizer.state[m]["step"]) for m in masters if "step" in zero.optimizer.state.get(m, {})}
    if len(steps) != 1:
        raise RuntimeError(f"DeepSpeed optimizer: step counts {sorted(steps)} on its partitions, expected one")
    return steps.pop()


def gathered(engine, model: torch.nn.Module, names: list[str]) -> Iterator[tuple[str, torch.Tensor]]:
    """(key, whole float32 tensor) for ``keys(names)``, one at a time; every process iterates it
    to its end (each tensor is a collective)."""
    # deepspeed: a heavy optional dependency, present only where a DeepSpeed launch runs this
    from deepspeed.utils import safe_get_full_fp32_param, safe_get_full_optimizer_state

    _link(*_zero_optimizer(engine))
    params = dict(model.named_parameters())
    for key in keys(names):
        kind, name = split_key(key)
        param = params[name]
        value = safe_get_full_fp32_param(param) if kind == "model" else safe_get_full_optimizer_state(param, kind)
        if value is None:
            raise RuntimeError(f"DeepSpeed holds no {kind} for parameter {name} (is it in the optimizer?)")
        yield key, value


def prepare_state(engine, step: int) -> None:
    """Give the base AdamW its state before its first step, as torch would create it (a float
    step count on the CPU, zero moments shaped like each flat partition), with ``step`` as the
    count, and link the parameters' fragments to it (ZeRO-1/2 do this after their first step)."""
    zero, masters = _zero_optimizer(engine)
    scalar = torch.float64 if torch.get_default_dtype() == torch.float64 else torch.float32  # torch's own rule
    for master in masters:
        state = zero.optimizer.state[master]
        for moment in MOMENTS:
            if moment not in state:
                state[moment] = torch.zeros_like(master, memory_format=torch.preserve_format)
        state["step"] = torch.tensor(float(step), dtype=scalar)
    _link(zero, masters)


def _local_partition(param, value: torch.Tensor) -> torch.Tensor:
    """ZeRO-3: this process's partition of a whole tensor, as DeepSpeed lays it out (the flattened
    tensor cut into equal partitions, the last padded with zeros). deepspeed 0.19.8's
    ``safe_set_full_*`` cut the whole tensor without that padding and fail whenever the size does
    not divide by the number of processes, so the partition is cut here and set with the local API."""
    # deepspeed: a heavy optional dependency, present only where a DeepSpeed launch runs this
    from deepspeed import comm

    size = param.ds_tensor.numel()
    start = size * comm.get_rank(group=getattr(param, "ds_process_group", None))
    local = value.flatten()[start : start + size]
    return torch.nn.functional.pad(local, (0, size - local.numel()))


def load(engine, model: torch.nn.Module, tensors: Iterable[tuple[str, torch.Tensor]], device) -> None:
    """Set every (key, whole tensor) of ``tensors`` (in ``keys`` order, the same on every process)
    into the engine: master weights and moments, and each weight into the model's parameter."""
    # deepspeed: a heavy optional dependency, present only where a DeepSpeed launch runs this
    from deepspeed.utils import (
        safe_set_full_fp32_param,
        safe_set_full_optimizer_state,
        safe_set_local_fp32_param,
        safe_set_local_optimizer_state,
    )

    params = dict(model.named_parameters())
    for key, value in tensors:
        kind, name = split_key(key)
        param, value = params[name], value.to(device=device, dtype=torch.float32)
        if hasattr(param, "ds_id"):  # ZeRO-3: every process sets its own partition (no collective)
            local = _local_partition(param, value)
            if kind != "model":
                safe_set_local_optimizer_state(param, local, kind)
                continue
            safe_set_local_fp32_param(param, local)
            with torch.no_grad():  # and the model's own (bit16 or float32) partition of the weight
                param.ds_tensor.data.copy_(local.view_as(param.ds_tensor.data))
            continue
        if kind != "model":
            safe_set_full_optimizer_state(param, value, kind)
            continue
        safe_set_full_fp32_param(param, value)
        with torch.no_grad():  # ZeRO-1/2: every process holds the whole (bit16 or float32) parameter
            param.data.copy_(value.view_as(param.data))
