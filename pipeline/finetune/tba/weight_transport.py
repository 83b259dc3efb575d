"""The collective weight transport of the asynchronous mode (gfn.weight_transport=collective).

One process group holds the trainer (rank 0) and every searcher it reaches (ranks 1..n): NCCL
between GPUs, gloo otherwise; a publication is one broadcast per bucket
(pipeline.finetune.tba.weight_buckets), received by every searcher at once. The group is built from
its own TCPStore, outside torch.distributed's global state, so a trainer that is itself one
process of an accelerate group can hold it, and a new group (new port) replaces it when its
membership changes (a searcher restarted by Ray).

No member enters a collective unless every member is known to be there: before the group is
built and before every transfer, each searcher says so through the store (``arrived/<rank>``,
``ready/<version>/<rank>``), then waits for the trainer's answer: ``formed`` / ``go/<version>``
when all have, ``abort`` / ``abort/<version>`` when one is known gone (its Ray call ended). So a
dead member fails the publication within a poll, and the others return without weights instead
of waiting in a broadcast until the timeout. Only raw bucket bytes go over the wire.
"""

from __future__ import annotations

import datetime
import time
from collections.abc import Callable

import torch
import torch.distributed as dist

from pipeline.config.asynchronous import WeightTransport
from pipeline.config.loader import check_choice

TIMEOUT = datetime.timedelta(minutes=10)  # a peer that is gone fails the send or receive after at most this
POLL_SECONDS = 0.01

Gone = Callable[[], list[int]]  # the ranks known not to come (their Ray calls have ended)


def check_transport(name: str) -> str:
    return check_choice(name, WeightTransport, "gfn.weight_transport")


def backend_for(device: torch.device | str) -> str:
    """NCCL where the weights live on a GPU, gloo otherwise."""
    return "nccl" if torch.device(device).type == "cuda" else "gloo"


class PeerGone(RuntimeError):
    """Members of the group are not coming (they died, or their call failed before they arrived);
    ``ranks`` names them (empty: the trainer called the transfer off)."""

    def __init__(self, message: str, ranks: list[int] | None = None):
        super().__init__(message)
        self.ranks = list(ranks or [])


class WeightGroup:
    """One member of the trainer's group: rank 0 (the trainer) sends, ranks 1..world-1 (searchers) receive.

    The trainer opens it with ``WeightGroup.host()`` (which picks a free port) and hands
    ``address`` and a rank to each searcher, which calls ``WeightGroup(*address, rank=r)``; all
    call ``connect()``.
    """

    def __init__(
        self,
        host: str,
        port: int,
        backend: str,
        world: int,
        rank: int = 1,
        store: dist.Store | None = None,
        timeout: datetime.timedelta = TIMEOUT,
    ):
        if backend not in ("gloo", "nccl"):
            raise ValueError(f"weight transport backend must be gloo or nccl, got {backend!r}")
        if not 0 <= rank < world:
            raise ValueError(f"rank {rank} is outside a group of {world}")
        self.host, self.port, self.backend, self.world, self.rank = host, port, backend, world, rank
        self.timeout = timeout
        self.store = store
        self.group = None

    @classmethod
    def host(cls, host: str, backend: str, world: int, timeout: datetime.timedelta = TIMEOUT) -> WeightGroup:
        """The sending end of a group of ``world`` members, listening on a free port of ``host``
        (an address every searcher can reach)."""
        store = dist.TCPStore(host, 0, world, True, timeout=timeout, wait_for_workers=False)
        return cls(host, store.port, backend, world, rank=0, store=store, timeout=timeout)

    @property
    def address(self) -> tuple[str, int, str, int]:
        return self.host, self.port, self.backend, self.world

    @property
    def device(self) -> str:
        return "cuda" if self.backend == "nccl" else "cpu"

    def _await_all(self, word: str, gone: Gone | None) -> None:
        """Rank 0: until every other member has said ``word``; PeerGone naming the ranks ``gone()``
        reports (or those still missing at the timeout)."""
        keys = [f"{word}/{rank}" for rank in range(1, self.world)]
        deadline = time.monotonic() + self.timeout.total_seconds()
        while not self.store.check(keys):
            left = gone() if gone is not None else []
            if left:
                raise PeerGone(f"searchers of ranks {sorted(left)} left before '{word}'", left)
            if time.monotonic() > deadline:
                missing = [rank for rank, key in enumerate(keys, start=1) if not self.store.check([key])]
                raise PeerGone(f"no searchers of ranks {missing} at '{word}' within {self.timeout}", missing)
            time.sleep(POLL_SECONDS)

    def _answer(self, go: str, stop: str) -> bool:
        """Ranks 1..: the trainer's answer, ``go`` (True) or ``stop`` (False)."""
        deadline = time.monotonic() + self.timeout.total_seconds()
        while True:
            if self.store.check([go]):
                return True
            if self.store.check([stop]):
                return False
            if time.monotonic() > deadline:
                raise PeerGone(f"no answer from the trainer to rank {self.rank} within {self.timeout}")
            time.sleep(POLL_SECONDS)

    def _call_off(self, word: str, gone: Gone | None) -> None:
        """Rank 0: wait for every member at ``word``; if one is gone, tell the others (``abort...``) and raise."""
        try:
            self._await_all(word, gone)
        except PeerGone:
            self.store.set("abort" if word == "arrived" else f"abort/{word.removeprefix('ready/')}", "1")
            raise

    def connect(self, gone: Gone | None = None) -> WeightGroup:
        """Build the group once every member has arrived. Ranks 1..: PeerGone when the trainer called it off."""
        if self.rank > 0:
            self.store = dist.TCPStore(self.host, self.port, self.world, False, timeout=self.timeout)
            self.store.set(f"arrived/{self.rank}", "1")
            if not self._answer("formed", "abort"):
                raise PeerGone("the trainer called the group off: a member did not arrive")
        else:
            self._call_off("arrived", gone)
            self.store.set("formed", "1")
        store = dist.PrefixStore("stepflow-weights", self.store)
        if self.backend == "nccl":
            options = dist.ProcessGroupNCCL.Options()
            options._timeout = self.timeout
            self.group = dist.ProcessGroupNCCL(store, self.rank, self.world, options)
        else:
            self.group = dist.ProcessGroupGloo(store, self.rank, self.world, self.timeout)
        return self

    def send(self, buckets: list[torch.Tensor], version: int, gone: Gone | None = None) -> None:
        """Rank 0: every bucket (uint8, on this backend's device), one broadcast each, once every
        member is ready to receive ``version``."""
        self._call_off(f"ready/{version}", gone)
        self.store.set(f"go/{version}", "1")
        for bucket in buckets:
            self.group.broadcast(bucket, 0).wait()
        if self.backend == "nccl":
            torch.cuda.synchronize()

    def receive(self, sizes: list[int] | tuple[int, ...], version: int) -> list[torch.Tensor] | None:
        """Ranks 1..: the buckets of ``version`` (``sizes`` bytes each, on this backend's device), or
        None when the trainer called this transfer off (a member was gone)."""
        buckets = [torch.empty(size, dtype=torch.uint8, device=self.device) for size in sizes]
        self.store.set(f"ready/{version}/{self.rank}", "1")
        if not self._answer(f"go/{version}", f"abort/{version}"):
            return None
        for bucket in buckets:
            self.group.broadcast(bucket, 0).wait()
        if self.backend == "nccl":
            torch.cuda.synchronize()
        return buckets

    def close(self) -> None:
        self.group = self.store = None
