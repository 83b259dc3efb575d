"""The collective weight transport of the asynchronous mode (gfn.weight_transport=collective).

The trainer sends its weights to each searcher over a process group of two members (trainer
rank 0, searcher rank 1): NCCL between GPUs, gloo otherwise. Each group is built from its own
TCPStore, outside torch.distributed's global state, so a trainer that is itself one process of an
accelerate group can hold one group per searcher, and a searcher that dies takes only its own
group down: the trainer drops it and opens a new one when Ray has restarted the searcher.

Tensors go one by one, in the order of a spec both ends agree on when the group opens (names,
shapes, dtypes): no pickling, nothing but raw tensor bytes on the wire.
"""

from __future__ import annotations

import datetime
import time
from typing import Callable

import torch
import torch.distributed as dist

from pipeline.config import WeightTransport
from pipeline.config_loader import check_choice

Spec = list[tuple[str, list[int], str]]  # (name, shape, dtype name) per tensor, in sending order
TIMEOUT = datetime.timedelta(minutes=10)  # a peer that is gone fails the send or receive after at most this
POLL_SECONDS = 0.05


def check_transport(name: str) -> str:
    return check_choice(name, WeightTransport, "gfn.weight_transport")


def state_spec(state: dict[str, torch.Tensor]) -> Spec:
    """The spec of a state dict: what the receiving end allocates, in the order the tensors are sent."""
    return [(name, list(value.shape), str(value.dtype).removeprefix("torch.")) for name, value in state.items()]


def backend_for(device: torch.device | str) -> str:
    """NCCL where the weights live on a GPU, gloo otherwise."""
    return "nccl" if torch.device(device).type == "cuda" else "gloo"


class PeerGone(RuntimeError):
    """The other end of a channel is not coming (it died, or its call failed before it arrived)."""


class WeightChannel:
    """One end of a two-member process group: rank 0 (the trainer) sends, rank 1 (a searcher) receives.

    The trainer opens it with ``WeightChannel.host()`` (which picks a free port) and hands
    ``address`` to the searcher, which calls ``WeightChannel(*address)``; both call ``connect()``.
    Before the group is built, and before every transfer, the searcher says it is there through
    the store, and the trainer waits for that word while watching ``gone`` (for instance: the
    searcher's Ray call has already ended, with an error): a searcher that died or is being
    restarted fails the trainer's call at once (``PeerGone``) instead of holding it in a
    collective until the timeout.
    """

    def __init__(self, host: str, port: int, backend: str, rank: int = 1, store: dist.Store | None = None,
                 timeout: datetime.timedelta = TIMEOUT):
        if backend not in ("gloo", "nccl"):
            raise ValueError(f"weight transport backend must be gloo or nccl, got {backend!r}")
        self.host, self.port, self.backend, self.rank, self.timeout = host, port, backend, rank, timeout
        self.store = store
        self.group = None

    @classmethod
    def host(cls, host: str, backend: str, timeout: datetime.timedelta = TIMEOUT) -> WeightChannel:
        """The sending end, listening on a free port of ``host`` (an address the searcher can reach)."""
        store = dist.TCPStore(host, 0, 2, True, timeout=timeout, wait_for_workers=False)
        return cls(host, store.port, backend, rank=0, store=store, timeout=timeout)

    @property
    def address(self) -> tuple[str, int, str]:
        return self.host, self.port, self.backend

    def _signal(self, word: str) -> None:
        """Rank 1: tell the trainer this end is at ``word``."""
        self.store.set(f"handshake/{word}", "1")

    def _await(self, word: str, gone: Callable[[], bool] | None) -> None:
        """Rank 0: until the searcher is at ``word``; PeerGone if ``gone()`` says it will not come."""
        deadline = time.monotonic() + self.timeout.total_seconds()
        while not self.store.check([f"handshake/{word}"]):
            if gone is not None and gone():
                raise PeerGone(f"the searcher left before '{word}'")
            if time.monotonic() > deadline:
                raise PeerGone(f"no searcher at '{word}' within {self.timeout}")
            time.sleep(POLL_SECONDS)

    def connect(self, gone: Callable[[], bool] | None = None) -> WeightChannel:
        if self.rank == 1:
            self.store = dist.TCPStore(self.host, self.port, 2, False, timeout=self.timeout)
            self._signal("arrived")
        else:
            self._await("arrived", gone)
        store = dist.PrefixStore("stepflow-weights", self.store)
        if self.backend == "nccl":
            options = dist.ProcessGroupNCCL.Options()
            options._timeout = self.timeout
            self.group = dist.ProcessGroupNCCL(store, self.rank, 2, options)
        else:
            self.group = dist.ProcessGroupGloo(store, self.rank, 2, self.timeout)
        return self

    def send(self, state: dict[str, torch.Tensor], version: int, gone: Callable[[], bool] | None = None) -> None:
        """Rank 0: every tensor of ``state`` (already on this backend's device), in the spec's order,
        once the searcher is ready to receive ``version``."""
        self._await(f"ready/{version}", gone)
        for value in state.values():
            self.group.broadcast(value.detach().contiguous(), 0).wait()
        if self.backend == "nccl":
            torch.cuda.synchronize()

    def receive(self, spec: Spec, device: torch.device | str, version: int) -> dict[str, torch.Tensor]:
        """Rank 1: the tensors of ``version`` the other end sends, allocated on ``device`` from ``spec``."""
        state = {name: torch.empty(shape, dtype=getattr(torch, dtype), device=device) for name, shape, dtype in spec}
        self._signal(f"ready/{version}")
        for value in state.values():
            self.group.broadcast(value, 0).wait()
        if self.backend == "nccl":
            torch.cuda.synchronize()
        return state

    def close(self) -> None:
        self.group = self.store = None
