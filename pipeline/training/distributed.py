"""The processes of a run, as the fine-tuning loop and its objectives see them.

One process (a plain ``python -m stages.train_gfn``) or N of them (``accelerate launch``): each
has a rank and sees the world size; ``sum`` adds a tensor over all processes; ``gather`` collects
records from every process in rank order; ``broadcast_text`` gives rank 0's text to every process.
Records and texts travel as JSON / UTF-8 bytes in uint8 tensors, so nothing received from another
process is ever unpickled.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import TypeVar

import torch
from accelerate import Accelerator
from accelerate.utils import DistributedType, parse_flag_from_env

from pipeline.records import Record
from pipeline.training.collective_clock import CLOCK

R = TypeVar("R", bound=Record)


def fsdp_requested(accelerator: Accelerator | None) -> bool:
    """Whether this run shards the trained model with FSDP2 (docs/scale.md, "FSDP2"): several
    processes, and an accelerate config with ``distributed_type: FSDP`` (which ``accelerate
    launch`` passes on as ACCELERATE_USE_FSDP=true; accelerate itself turns FSDP on only on GPUs,
    the training base applies ``fully_shard`` itself on any device)."""
    if accelerator is None or accelerator.num_processes < 2:
        return False
    return accelerator.distributed_type == DistributedType.FSDP or parse_flag_from_env(
        "ACCELERATE_USE_FSDP", default=False
    )


class Collective:
    """accelerator: the run's Accelerator (None: one process, every operation the identity)."""

    def __init__(self, accelerator: Accelerator | None = None):
        self.accelerator = accelerator

    @property
    def rank(self) -> int:
        return self.accelerator.process_index if self.accelerator is not None else 0

    @property
    def world(self) -> int:
        return self.accelerator.num_processes if self.accelerator is not None else 1

    @property
    def lockstep(self) -> bool:
        """Whether every process must run the same number of forward and backward passes of
        the trained model: under FSDP and DeepSpeed ZeRO they are collectives."""
        return self.world > 1 and (
            fsdp_requested(self.accelerator) or self.accelerator.distributed_type == DistributedType.DEEPSPEED
        )

    @property
    def sharded_parameters(self) -> bool:
        """Whether no process holds the trained model's whole weights between forwards (FSDP,
        ZeRO-3): generating with it would need every process in lockstep at every token."""
        if self.world == 1:
            return False
        if fsdp_requested(self.accelerator):
            return True
        plugin = getattr(self.accelerator.state, "deepspeed_plugin", None)
        return plugin is not None and plugin.zero_stage == 3

    @property
    def device(self) -> torch.device:
        return self.accelerator.device if self.accelerator is not None else torch.device("cpu")

    def barrier(self) -> None:
        if self.world > 1:
            with CLOCK.blocking():
                self.accelerator.wait_for_everyone()

    def sum(self, values: torch.Tensor) -> torch.Tensor:
        """``values`` added over all processes (a copy on the run's device)."""
        values = values.to(self.device)
        if self.world == 1:
            return values.clone()
        with CLOCK.blocking():
            return self.accelerator.reduce(values, reduction="sum")

    def max(self, value: int) -> int:
        """The largest of every process's ``value``."""
        if self.world == 1:
            return value
        with CLOCK.blocking():
            return int(self.accelerator.reduce(torch.tensor([value], device=self.device), reduction="max")[0])

    def broadcast_text(self, text: str | None) -> str:
        """Rank 0's ``text`` on every process (the others pass None): UTF-8 bytes in a uint8 tensor."""
        if self.world == 1:
            return text
        with CLOCK.blocking():
            return self._broadcast_text(text)

    def _broadcast_text(self, text: str | None) -> str:
        payload = text.encode("utf-8") if self.rank == 0 else b""
        length = torch.tensor([len(payload)], dtype=torch.int64, device=self.device)
        torch.distributed.broadcast(length, 0)
        if int(length[0]) == 0:  # "" (torch.frombuffer refuses an empty buffer): nothing more to send
            return ""
        buffer = torch.zeros(int(length[0]), dtype=torch.uint8, device=self.device)
        if self.rank == 0:
            buffer.copy_(torch.frombuffer(bytearray(payload), dtype=torch.uint8))
        torch.distributed.broadcast(buffer, 0)
        return buffer.cpu().numpy().tobytes().decode("utf-8")

    def gather(self, records: Sequence[R], record_type: type[R]) -> list[list[R]]:
        """Every process's records, one list per rank (rank order)."""
        if self.world == 1:
            return [list(records)]
        payload = json.dumps([r.to_json() for r in records]).encode("utf-8")
        length = torch.tensor([len(payload)], device=self.device)
        with CLOCK.blocking():
            lengths = self.accelerator.gather(length).tolist()
        buffer = torch.zeros(max(lengths), dtype=torch.uint8, device=self.device)
        buffer[: len(payload)] = torch.frombuffer(bytearray(payload), dtype=torch.uint8).to(self.device)
        with CLOCK.blocking():
            gathered = self.accelerator.gather(buffer).view(self.world, -1).cpu()
        return [
            [
                record_type.from_json(obj, f"records from process {rank}")
                for obj in json.loads(gathered[rank, : lengths[rank]].numpy().tobytes().decode("utf-8"))
            ]
            for rank in range(self.world)
        ]

    def per_process(self, values: Sequence[float]) -> list[list[float]]:
        """Every process's ``values`` (the same length on each), one list per rank (rank order)."""
        local = torch.tensor([float(v) for v in values], dtype=torch.float64, device=self.device)
        if self.world == 1:
            return [local.tolist()]
        return self.accelerator.gather(local).view(self.world, -1).cpu().tolist()
