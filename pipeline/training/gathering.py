"""A model's weights made whole, as a stream: FSDP2 shards gathered one unit at a time, DeepSpeed
ZeRO-3 partitions one parameter at a time, each tensor cast to the reader's dtype as it is read,
so a process never holds a second copy of the whole model (docs/scale.md). The gathers are
collectives: every process reads the whole stream, in order (``load_streamed``)."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import torch
from accelerate.utils import DistributedType
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor

from pipeline.training.collective_clock import CLOCK


def full_tensor(tensor: torch.Tensor) -> torch.Tensor:
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
            full = full_tensor(value.detach())
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


class WholeWeightsMixin:
    """``TrainingBase``'s whole weights on every process: the stream a sampler reloads
    (``iter_full_state``), a whole copy (``full_state_dict``) and what the final model saves
    (``final_state_dict``). It reads the trainer's accelerator, model, unwrapped and sharded."""

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
