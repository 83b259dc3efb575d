"""Weight publication of the asynchronous mode: the trainer's weights to every searcher at once, in the background.

``WeightPublisher`` (trainer, main process) casts a state dict to the sampler's dtype and packs it
into byte buckets of ``gfn.publish_bucket_mb`` (pipeline.finetune.tba.weight_buckets): that copy is
the snapshot, taken before ``publish`` returns, so training goes on while a thread sends it:
- ``object_store``: one ``ray.put`` per bucket; the weights actor hands the same references and
  the layout to every searcher, which reads them when it next asks for newer weights (a searcher
  restarted by Ray reads the newest ones when it starts);
- ``collective``: one process group of the trainer and every searcher that answers
  (pipeline.finetune.tba.weight_transport), one broadcast per bucket. A searcher restarted by Ray has
  no group: the transfer is called off for all, a new group of every live searcher is formed and
  the weights sent again in the same publication; a searcher still starting joins at a later one.
The next publication waits for the previous one. ``WeightReceiver`` is the searcher's end.

What the trainer publishes is decided here too: ``published_weights`` (its export: the training
base's gathered stream, LoRA merged) in ``searcher_dtype`` (what a searcher's policy holds).

What each publication cost is kept (``Publication``) for the trainer's metrics. Ray is an
optional extra: imported inside the functions that need it.
"""

from __future__ import annotations

import dataclasses
import datetime
import logging
import threading
import time
import warnings

import torch

from pipeline.config.schema import Config, GFNConfig
from pipeline.finetune.policy import LMPolicy
from pipeline.finetune.tba.weight_buckets import BucketLayout
from pipeline.finetune.tba.weight_transport import TIMEOUT, PeerGone, WeightGroup
from pipeline.modeling import resolve_dtype
from pipeline.training import TrainingBase
from pipeline.training.gathering import load_streamed

log = logging.getLogger("stepflow.async")

PING_SECONDS = 2.0  # a searcher that does not answer within this is left out of a new group (it is starting)


@dataclasses.dataclass
class Publication:
    """One finished publication: the version, bytes and buckets sent, seconds from ``publish`` to
    every searcher holding it (collective) or to the references being handed out (object store),
    and how many searchers received it over the group (object store: None, they fetch)."""

    version: int
    bytes: int
    buckets: int
    seconds: float
    searchers: int | None = None


def bucket_bytes(megabytes: float) -> int:
    return max(1, int(megabytes * 2**20))


def searcher_dtype(config: Config, cfg: GFNConfig) -> torch.dtype:
    """The dtype a searcher's policy holds, which the trainer publishes in: model.dtype on the
    searcher's device (model.device, or with ``auto`` a GPU when gfn.searcher_gpus > 0: Ray hides
    the GPUs from an actor that asks for none), e.g. bfloat16 on a GPU, float32 on a CPU."""
    device = config.model.device if config.model.device != "auto" else ("cuda" if cfg.searcher_gpus else "cpu")
    return resolve_dtype(config.model.dtype, device)


def published_weights(policy: LMPolicy, base: TrainingBase, dtype: torch.dtype) -> dict[str, torch.Tensor] | None:
    """What the asynchronous trainer publishes (its ``export``): every process reads the gathered
    stream (``base.iter_full_state``) to its end (its gathers are collectives), in the searchers'
    ``dtype`` unless LoRA is merged first (``policy.plain_stream``, in the trained dtype); the main
    process keeps it whole (the publication plans its buckets from every tensor and packs a
    snapshot, cast to ``dtype``), the others keep nothing (None)."""
    kept: dict[str, torch.Tensor] = {}
    stream = base.iter_full_state(dtype if policy.lora_scaling is None else None)
    load_streamed(kept.update if base.is_main else lambda stream: None, policy.plain_stream(stream))
    return kept if base.is_main else None


class WeightPublisher:
    """Publishes a state dict to every searcher at once, in the background.

    transport:    "object_store" | "collective" (gfn.weight_transport)
    weights:      the run's weights actor (pipeline.finetune.tba.stores.WeightStore): it hands out the newest version
    dtype:        the sampler's dtype, floating tensors are cast to it (None: each keeps its own)
    bucket_bytes: the largest bucket (a larger tensor gets one of its own)
    backend:      the collective's, "gloo" | "nccl" (the buckets are packed on the GPU for NCCL)
    host:         an address of this machine every searcher can reach (collective)

    Searchers are Ray actors with ``join(address, rank, layout, version)`` and
    ``receive(version)`` calls that hand them to their ``WeightReceiver`` (collective), and a
    cheap ``status()`` call (asked before a group is formed).
    """

    def __init__(
        self,
        *,
        transport: str,
        weights,
        dtype: torch.dtype | None,
        bucket_bytes: int,
        backend: str = "gloo",
        host: str = "127.0.0.1",
        timeout: datetime.timedelta = TIMEOUT,
    ):
        self.transport, self.weights, self.dtype, self.bucket_bytes = transport, weights, dtype, bucket_bytes
        self.backend, self.host, self.timeout = backend, host, timeout
        self.layout: BucketLayout | None = None
        self.group: WeightGroup | None = None
        self.members: dict[int, int] = {}  # the group's ranks 1..: searcher index -> its process id
        self.group_layout: BucketLayout | None = None  # the layout the group's members were given when it formed
        self.thread: threading.Thread | None = None
        self.error: BaseException | None = None
        self.finished: list[Publication] = []
        self.finished_any = False  # whether one has reached searchers (until then, every searcher is waited for)
        self.lock = threading.Lock()

    @property
    def device(self) -> str:
        return "cuda" if self.transport == "collective" and self.backend == "nccl" else "cpu"

    def publish(self, state: dict[str, torch.Tensor], version: int, searchers: list) -> None:
        """Start publishing ``state`` as ``version`` to ``searchers``, once the previous publication
        has ended (its error, if any, is raised here). Returns when the snapshot is packed."""
        self.wait()
        start = time.monotonic()
        if self.layout is None or not self.layout.matches(state, dtype=self.dtype):
            self.layout = BucketLayout.plan(state, dtype=self.dtype, bucket_bytes=self.bucket_bytes)
        buckets = self.layout.pack(state, self.device)
        if self.device == "cuda":
            torch.cuda.synchronize()  # the snapshot is complete before the trainer's next update
        self.thread = threading.Thread(
            target=self._run, args=(buckets, version, list(searchers), start), name=f"publish-{version}", daemon=True
        )
        self.thread.start()

    def wait(self) -> None:
        """Until the running publication has ended; raises its error."""
        if self.thread is not None:
            self.thread.join()
            self.thread = None
        if self.error is not None:
            error, self.error = self.error, None
            raise RuntimeError(f"async: publishing the weights failed: {error}") from error

    def take_finished(self) -> list[Publication]:
        """The publications finished since the last call."""
        with self.lock:
            done, self.finished = self.finished, []
        return done

    def close(self) -> None:
        """Wait for the running publication (its error is logged, not raised) and drop the group."""
        try:
            self.wait()
        except RuntimeError as error:
            log.warning("%s", error)
        self.group, self.members, self.group_layout = None, {}, None

    def _run(self, buckets: list[torch.Tensor], version: int, searchers: list, start: float) -> None:
        try:
            reached = (
                self._send_collective(buckets, version, searchers)
                if self.transport == "collective"
                else self._send_object_store(buckets, version)
            )
            with self.lock:
                seconds = time.monotonic() - start
                self.finished.append(Publication(version, self.layout.total_bytes, len(buckets), seconds, reached))
        except BaseException as error:  # raised by the next publish() or wait()
            self.error = error

    def _send_object_store(self, buckets: list[torch.Tensor], version: int) -> None:
        import ray  # the optional extra (extra `distributed`)

        # raw bytes: Ray stores numpy arrays without pickling their data
        refs = [ray.put(bucket.numpy()) for bucket in buckets]
        ray.get(self.weights.publish.remote(version, refs, self.layout.to_json()))
        return None

    def needs_new_group(self, live: dict[int, int]) -> bool:
        """Whether this publication forms a new group: none yet, other members (``live``: searcher
        index -> process id), or another layout than the members were given when the group formed
        (they receive into buckets of the layout's sizes and read the tensors back by it: over the
        old group they would wait for the wrong bytes or misread them)."""
        return self.group is None or live != self.members or self.group_layout != self.layout

    def _live(self, searchers: list, first: bool) -> dict[int, int]:
        """The searchers that answer a status call: index -> process id (a searcher restarted by
        Ray answers from a new process). The first publication waits for every searcher to have
        started (up to the timeout): nothing can be sampled before it reaches them; a later one
        waits PING_SECONDS (a searcher still starting joins at a later publication), longer
        only when none answers."""
        import ray  # the optional extra (extra `distributed`)

        pings = {searchers[i].status.remote(): i for i in range(len(searchers))}
        limit = self.timeout.total_seconds()
        ready, _ = ray.wait(list(pings), num_returns=len(pings), timeout=limit if first else PING_SECONDS)
        if not ready:
            ready, _ = ray.wait(list(pings), num_returns=1, timeout=limit)
        live = {}
        for ref in ready:
            try:
                live[pings[ref]] = ray.get(ref)["pid"]
            except ray.exceptions.RayError:  # died since
                pass
        return dict(sorted(live.items()))

    def _send_collective(self, buckets: list[torch.Tensor], version: int, searchers: list) -> int:
        """Broadcast ``buckets`` to the group of every searcher that answers now: the group of the
        last publication when its members are the same processes, else a new one (a searcher
        restarted, left, or came back); once more with a new group when a member was gone during
        the handshake. Returns how many searchers received it."""
        import ray  # the optional extra (extra `distributed`)

        self.weights.publish.remote(version, None, None)  # searchers learn the version; the weights come over the group
        for attempt in range(2):
            live = self._live(searchers, first=not self.finished_any)
            fresh = self.needs_new_group(live)
            if fresh:
                self.group, self.members, self.group_layout = None, live, self.layout
                if not live:
                    log.warning("async: no searcher answers; version %d reaches them at a later publication", version)
                    return 0
                self.group = WeightGroup.host(self.host, self.backend, 1 + len(live), timeout=self.timeout)
                layout = self.layout.to_json()
                answers = [
                    searchers[i].join.remote(self.group.address, rank, layout, version)
                    for rank, i in enumerate(live, start=1)
                ]
            else:
                answers = [searchers[i].receive.remote(version) for i in live]
            gone = ended(answers)
            try:
                if fresh:
                    self.group.connect(gone)
                self.group.send(buckets, version, gone)
                if not all(ray.get(answers)):
                    raise PeerGone("a searcher was told the transfer was called off")
                self.finished_any = True
                return len(live)
            except (PeerGone, RuntimeError, OSError, ray.exceptions.RayError) as error:
                ray.wait(answers, num_returns=len(answers), timeout=self.timeout.total_seconds())  # the others returned
                cause = str(error).splitlines()[0] if str(error) else type(error).__name__
                log.warning(
                    "async: publication %d: %s; %s",
                    version,
                    cause,
                    "forming a new group" if attempt == 0 else "they get the weights at the next publication",
                )
                self.group = None
        return 0


def ended(answers: list):
    """The ranks (1..) whose Ray call has already ended: before the handshake is complete, that
    means it failed (the searcher died, or was restarted and has no group)."""
    import ray  # the optional extra (extra `distributed`)

    def gone() -> list[int]:
        done, _ = ray.wait(answers, num_returns=len(answers), timeout=0)
        return [answers.index(ref) + 1 for ref in done]

    return gone


class WeightReceiver:
    """A searcher's end: the group it belongs to (collective) and the newest weights received,
    staged until its sampling loop takes them."""

    def __init__(self, name: str = "searcher"):
        self.name = name
        self.group: WeightGroup | None = None
        self.layout: BucketLayout | None = None
        self.staged: tuple[int, dict] | None = None
        self.lock = threading.Lock()
        self.arrived = threading.Condition(self.lock)

    @property
    def backend(self) -> str | None:
        return self.group.backend if self.group is not None else None

    def join(self, address: tuple, rank: int, layout: dict, version: int) -> bool:
        """Become ``rank`` of the trainer's new group and receive ``version`` over it."""
        self.group = None
        self.layout = BucketLayout.from_json(layout)
        host, port, backend, world = address
        try:
            self.group = WeightGroup(host, port, backend, world, rank=rank).connect()
        except PeerGone:
            return False
        return self.receive(version)

    def receive(self, version: int) -> bool:
        """``version`` over the group, staged; False when the trainer called it off."""
        if self.group is None:
            raise RuntimeError(f"{self.name} has no weights group (it was restarted): the trainer forms a new one")
        buckets = self.group.receive(self.layout.sizes, version)
        if buckets is None:
            return False
        with self.lock:
            self.staged = (version, self.layout.unpack(buckets))
            self.arrived.notify_all()
        return True

    def fetch(self, version: int, refs: list, layout: dict) -> None:
        """Object store: the buckets of ``version`` (read without copying), staged."""
        import ray  # the optional extra (we run inside a Ray worker)

        arrays = ray.get(refs)
        # Ray's shared memory is read-only; the weights are only read (copied into the model)
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=".*not writable.*")
            buckets = [torch.from_numpy(array) for array in arrays]
        state = BucketLayout.from_json(layout).unpack(buckets)
        with self.lock:
            self.staged = (version, state)
            self.arrived.notify_all()

    def wait(self, timeout: float) -> bool:
        """Whether weights are staged, waiting up to ``timeout`` seconds for them."""
        with self.arrived:
            return self.arrived.wait_for(lambda: self.staged is not None, timeout)

    def take(self) -> tuple[int, dict] | None:
        """The newest staged (version, state), once."""
        with self.lock:
            staged, self.staged = self.staged, None
        return staged
