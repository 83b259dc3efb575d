"""Wall time spent in collectives, per process: what the weak-scaling benchmark
(perf/gfn_step_scaling.py) reports beside its ratio. Off unless ``$STEPFLOW_TIME_COLLECTIVES=1``;
off, no hook is installed and each wrapped call costs one context manager's entry and exit.

Two quantities per training step, because DDP's gradient all-reduce runs on gloo's own thread
while backward goes on computing:

- wait: seconds the training thread is blocked in a collective. A synchronous collective (the
  run's ``Collective``: gathering trajectories, summing counts; the training base's clip-norm
  reduction and any FSDP2 ``full_tensor`` gather; FSDP2's own all-gathers (the sampler's
  unit-by-unit gathers among them) and reduce-scatters, which
  on CPU it issues synchronously) counts whole. DDP's all-reduce counts from the moment the last
  gradient bucket is handed to the hook (every gradient is computed then) until ``backward``
  returns: the time the thread waits in DDP's finalize for the reductions still in flight.
  Waiting includes a process's wait for a slower one to arrive at the collective.
- in flight: seconds from each collective's launch to its completion, summed; a synchronous one
  counts as its wait, an asynchronous one (DDP's buckets, timed by a comm hook's future) also
  while it overlaps computation.

Timing wraps the calls the stage code already makes (a DDP comm hook equal to torch's default
``allreduce_hook`` plus a clock; FSDP2's documented ``set_custom_all_gather`` /
``set_custom_reduce_scatter`` with torch's default collectives plus a clock) rather than
profiling: torch.profiler's per-operator overhead on the tiny model's thousands of small
sampling ops would change the step time the share is taken of.
"""

from __future__ import annotations

import contextlib
import importlib
import os
import statistics
import threading
import time
from collections.abc import Iterator, Sequence

import torch
from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook

# torch's default FSDP2 collectives live in a private module (tested: torch 2.13): imported only when
# the benchmark turns the clock on, so a torch that moves them breaks this timing alone, not training.
FSDP_COLLECTIVES = "torch.distributed.fsdp._fully_shard._fsdp_collectives"

ENV = "STEPFLOW_TIME_COLLECTIVES"


class CollectiveClock:
    """Running totals of one process's collective wait and in-flight seconds (thread-safe: DDP's
    completions are timed on gloo's thread)."""

    def __init__(self, enabled: bool):
        self.enabled = enabled
        self.wait = 0.0
        self.in_flight = 0.0
        self.calls = 0
        self._lock = threading.Lock()
        self._last_bucket: float | None = None

    def add(self, wait: float, in_flight: float) -> None:
        with self._lock:
            self.wait += wait
            self.in_flight += in_flight
            self.calls += 1

    def snapshot(self) -> tuple[float, float]:
        """(wait, in flight) so far; the difference of two snapshots is what happened between."""
        with self._lock:
            return self.wait, self.in_flight

    @contextlib.contextmanager
    def blocking(self) -> Iterator[None]:
        """Around a synchronous collective in the training thread."""
        if not self.enabled:
            yield
            return
        start = time.perf_counter()
        try:
            yield
        finally:
            spent = time.perf_counter() - start
            self.add(spent, spent)

    # ------------------------------------------------------------------ DDP

    def ddp_hook(self, process_group, bucket):  # no annotations: DDP compares them as objects, not strings
        """A DDP comm hook: torch's default all-reduce (average over the processes), its launch to
        completion timed; returns the future DDP waits on.

        Its callbacks are Python, released on gloo's worker thread under the GIL, as with any
        Python comm hook: free the DDP module while its process group is still registered (the
        stages never destroy the group). A DDP module freed after ``destroy_process_group`` drops the
        group's last reference holding the GIL, and gloo's destructor then joins a worker thread
        that may be waiting for the GIL: a deadlock."""
        start = time.perf_counter()
        self._last_bucket = start

        def done(future: torch.futures.Future) -> torch.Tensor:
            self.add(0.0, time.perf_counter() - start)
            return future.value()

        return allreduce_hook(process_group, bucket).then(done)

    @contextlib.contextmanager
    def ddp_backward(self) -> Iterator[None]:
        """Around a backward that may reduce gradients (DDP): the wait is from the last bucket's
        launch to the return."""
        if not self.enabled:
            yield
            return
        self._last_bucket = None
        start = time.perf_counter()
        yield
        end = time.perf_counter()
        if self._last_bucket is not None and self._last_bucket >= start:
            self.add(end - self._last_bucket, 0.0)

    # ------------------------------------------------------------------ FSDP2

    def time_fsdp(self, modules: Sequence[torch.nn.Module]) -> None:
        """Every FSDP2 module's all-gather and reduce-scatter: torch's defaults, timed."""
        try:
            collectives = importlib.import_module(FSDP_COLLECTIVES)
            DefaultAllGather, DefaultReduceScatter = collectives.DefaultAllGather, collectives.DefaultReduceScatter
        except (ImportError, AttributeError) as error:
            raise RuntimeError(
                f"{ENV}=1 times FSDP2's collectives through torch's private {FSDP_COLLECTIVES} "
                f"(DefaultAllGather, DefaultReduceScatter), which this torch {torch.__version__} lacks: {error}; "
                f"unset {ENV} to train without the timing"
            ) from error
        clock = self

        class TimedAllGather(DefaultAllGather):
            def __call__(self, output_tensor, input_tensor, group, async_op=False):
                with clock.blocking():
                    return super().__call__(output_tensor, input_tensor, group, async_op=async_op)

        class TimedReduceScatter(DefaultReduceScatter):
            def __call__(self, output_tensor, input_tensor, group, op, async_op=False):
                with clock.blocking():
                    return super().__call__(output_tensor, input_tensor, group, op, async_op=async_op)

        for module in modules:
            module.set_custom_all_gather(TimedAllGather())
            module.set_custom_reduce_scatter(TimedReduceScatter())


CLOCK = CollectiveClock(os.environ.get(ENV, "") == "1")


def collective_shares(steps: Sequence[dict], reference_step_s: float) -> dict:
    """The weak-scaling loss of one multi-process run, per process and averaged over them.

    steps: the run's metrics records (first step excluded by the caller), each with
           ``collectives``: {"seconds", "wait", "in_flight"}: one value per process
    reference_step_s: the mean step seconds of the 1-process run with the same per-process work

    Per process, means over the steps (so a share is the sum of its seconds over the sum of the
    steps' seconds: the waits alternate between the processes, whichever sampled less waiting
    for the other, and a median would drop them): step seconds t, wait w, in flight f;
    wait_share = w / t, in_flight_share = f / t, and other = t - w - reference_step_s, the
    slowdown against one process that collectives do not explain (memory bandwidth and caches
    shared with the other process, ...); slowdown = t / reference_step_s - 1 = (w + other) /
    reference_step_s. The averages are means over processes.
    """
    if not steps:
        raise ValueError("collective_shares: no steps to measure")
    processes = len(steps[0]["collectives"]["seconds"])
    per = []
    for rank in range(processes):
        t = statistics.fmean(float(s["collectives"]["seconds"][rank]) for s in steps)
        w = statistics.fmean(float(s["collectives"]["wait"][rank]) for s in steps)
        f = statistics.fmean(float(s["collectives"]["in_flight"][rank]) for s in steps)
        per.append(
            {
                "step_s": t,
                "wait_s": w,
                "in_flight_s": f,
                "wait_share": w / t,
                "in_flight_share": f / t,
                "other_s": t - w - reference_step_s,
                "slowdown": t / reference_step_s - 1.0,
            }
        )
    mean = {key: statistics.fmean(p[key] for p in per) for key in per[0]}
    return {**mean, "reference_step_s": reference_step_s, "per_process": per}
