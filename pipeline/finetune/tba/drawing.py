"""The trainer's batches from the store: one step's request (BatchRequest, a thread that waits on the
store and reads its reply), the next step's asked for while the update runs (prefetch), and the wait
for a batch that tells one that can end from one that cannot (BatchDrawing, a base of
AsyncFinetuneTrainer)."""

from __future__ import annotations

import json
import logging
import threading
import time

from pipeline.finetune.tba.stores import EMPTY_DRAW, WAIT_SECONDS
from pipeline.records import Trajectory

log = logging.getLogger("stepflow.async")


def published_after(step: int, published: int, sync_every: int) -> int:
    """The newest publication once the update of training step ``step`` is done: the trainer
    publishes after every ``sync_every``-th update (AsyncFinetuneTrainer.train_step), so step
    + 1 when it is one of them, else ``published``, the newest one now."""
    return step + 1 if (step + 1) % sync_every == 0 else published


class BatchRequest:
    """One step's batch asked of the store: TrajectoryStore.wait_sample under ``conditions``
    (questions, latest, now, max_staleness, minimum), asked again every WAIT_SECONDS until the
    store gives the ``questions`` groups, by a thread of its own that also reads the reply (JSON,
    the groups ``rows`` selects built as Trajectory records). The trainer asks for the next batch
    as an update starts and takes it when the update ends (docs/async.md, "The next batch, drawn
    during the update"); only Ray calls run in the thread, never a collective of the trainer.

    ``result(timeout)`` waits at most ``timeout`` seconds: (reply text, groups read, recent
    groups), or None while the store cannot give the batch (the request goes on). ``close``
    cancels the store's wait in progress and ends the thread (within about WAIT_SECONDS)."""

    def __init__(self, store, conditions: tuple, rows: slice = slice(None)):
        self.store, self.conditions, self.rows = store, tuple(conditions), rows
        self.answer: tuple[str, list[list[Trajectory]], int] | None = None
        self.error: BaseException | None = None
        self.asks, self.read_seconds = 0, 0.0  # the store calls made; seconds spent reading the reply
        self._ref, self._closed, self._lock = None, threading.Event(), threading.Lock()
        self.thread = threading.Thread(target=self._fetch, name="stepflow-batch-request", daemon=True)
        self.thread.start()

    def _fetch(self) -> None:
        import ray  # the optional extra (extra `distributed`)

        questions = self.conditions[0]
        try:
            while not self._closed.is_set():
                with self._lock:
                    if self._closed.is_set():
                        return
                    self._ref = self.store.wait_sample.remote(*self.conditions, WAIT_SECONDS)
                    self.asks += 1
                text = ray.get(self._ref)
                started = time.monotonic()
                answer = json.loads(text)
                if len(answer["groups"]) >= questions:
                    groups = [
                        [Trajectory.from_json(obj, "trajectories from the store") for obj in group]
                        for group in answer["groups"][self.rows]
                    ]
                    self.read_seconds += time.monotonic() - started
                    self.answer = (text, groups, answer["recent"])
                    return
        except BaseException as error:  # noqa: BLE001 - raised by result() in the trainer's thread
            if not self._closed.is_set():  # a cancelled wait raises too: that is the close
                self.error = error

    def result(self, timeout: float) -> tuple[str, list[list[Trajectory]], int] | None:
        self.thread.join(timeout)
        if self.error is not None:
            raise self.error
        return self.answer

    def close(self) -> None:
        import ray  # the optional extra (extra `distributed`)

        with self._lock:
            self._closed.set()
            ref = self._ref
        if ref is not None and self.answer is None and self.thread.is_alive():
            try:
                ray.cancel(ref)
            except Exception as error:  # noqa: BLE001 - an actor already gone: its call ends by itself
                log.debug("async: cancelling the store's wait: %s", error)
        self.thread.join(WAIT_SECONDS + 10.0)


class BatchDrawing:
    """How AsyncFinetuneTrainer gets each step's batch from the store. A base of the trainer, not a
    trainer: it reads the trainer's cfg, base, sampler, step, published, store, runs, questions,
    per_question and _next_batch (the request in flight), and calls its keep_searching."""

    def draw_conditions(self, step: int, published: int) -> tuple:
        """What the store is asked for training step ``step`` with ``published`` the newest
        publication: (questions, latest, now, max_staleness, minimum); the first step asks for
        gfn.async_initial_completions in the buffer."""
        minimum = self.cfg.async_initial_completions if step == 0 else 0
        return self.questions, published, step, self.cfg.max_staleness, minimum

    def request_batch(self, step: int, published: int) -> BatchRequest:
        """Main process: the store asked for step ``step``'s batch, this process's share read (the first)."""
        share = self.questions // self.sampler.collective.world
        return BatchRequest(self.store, self.draw_conditions(step, published), slice(0, share))

    def prefetch(self) -> None:
        """Main process, as the update of the current step starts: ask the store for the next
        step's batch under the conditions the draw after the update carries (published_after: the
        publication this step ends with), so the store's wait and draw and the reading of the reply
        run while the update does. None after the last step, nor before a checkpoint (it holds the
        buffer as a trainer that draws after the update would leave it)."""
        following = self.step + 1
        every = self.cfg.save_every
        if not self.base.is_main or following >= self.cfg.num_train_steps or (every and following % every == 0):
            return
        self.close_request()
        self._next_batch = self.request_batch(
            following, published_after(self.step, self.published, self.cfg.sync_every)
        )

    def close_request(self) -> None:
        """Cancel the store request in flight, if any, and end its thread."""
        request, self._next_batch = self._next_batch, None
        if request is not None:
            request.close()

    def draw_once(self) -> tuple[list[list[Trajectory]] | None, int, float]:
        """One wait (main process, at most WAIT_SECONDS) for the step's B questions x K completions
        from the store: the request made as the previous update started (prefetch) when its
        conditions are this step's, else a new one, kept until it answers; every process's share
        sent to it: (this process's B / world groups or None while the store fills up, how many of
        the batch's groups came from the newest weights (main process; 0 on the others), seconds
        spent). Every process calls it the same number of times."""
        start = time.monotonic()
        collective = self.sampler.collective
        text, answer = None, None
        if self.base.is_main:
            self.keep_searching()
            conditions = self.draw_conditions(self.step, self.published)
            if self._next_batch is not None and self._next_batch.conditions != conditions:
                self.close_request()
            if self._next_batch is None:
                self._next_batch = self.request_batch(self.step, self.published)
            # the batch as soon as the store holds it, or nothing after WAIT_SECONDS (the request goes on)
            answer = self._next_batch.result(WAIT_SECONDS)
            if answer is not None:
                self._next_batch = None
            text = answer[0] if answer is not None else EMPTY_DRAW
        text = collective.broadcast_text(text)
        if self.base.is_main:
            if answer is None:
                return None, 0, time.monotonic() - start
            return answer[1], answer[2], time.monotonic() - start
        reply = json.loads(text)
        if len(reply["groups"]) < self.questions:
            return None, 0, time.monotonic() - start
        share = self.questions // collective.world
        mine = reply["groups"][collective.rank * share : (collective.rank + 1) * share]
        groups = [[Trajectory.from_json(obj, "trajectories from the store") for obj in group] for group in mine]
        return groups, 0, time.monotonic() - start

    def draw(self) -> tuple[list[list[Trajectory]], int, float]:
        """The step's groups, waiting as long as the store can still give them: (groups, recent,
        seconds waited). A wait that cannot end (no searcher loop running; every searcher waiting for
        weights the trainer publishes only after this step while the buffer cannot give the batch)
        ends the run with a RuntimeError naming the cause, on every process."""
        waited, warned = 0.0, False
        while True:
            groups, recent, seconds = self.draw_once()
            waited += seconds
            if groups is not None:
                return groups, recent, waited
            cause = self.sampler.collective.broadcast_text(self.stall_cause() if self.base.is_main else None)
            if cause:
                raise RuntimeError(
                    f"async: step {self.step} cannot get {self.questions} questions x {self.per_question} distinct "
                    f"completions: {cause}"
                )
            if waited > 60 and not warned:  # a wait that can end: searchers still send rounds (repeats, drops)
                import ray  # the optional extra (extra `distributed`)

                warned = True
                log.warning(
                    "async: step %d has waited %.0f s for %d questions x %d distinct completions; the store: %s",
                    self.step,
                    waited,
                    self.questions,
                    self.per_question,
                    ray.get(self.store.stats.remote()) if self.base.is_main else "(read by the main process)",
                )

    def stall_cause(self) -> str:
        """Main process: why the store can never give this step's batch, or "" while it still can."""
        import ray  # the optional extra (extra `distributed`)

        done, _ = ray.wait(self.runs, num_returns=len(self.runs), timeout=0)
        if self.runs and len(done) == len(
            self.runs
        ):  # a loop ends before the stop only with an error, raised by keep_searching
            return "no searcher loop is running"
        rounds = self.cfg.searcher_rounds_per_version
        if rounds is None:
            return ""
        questions, _, now, max_staleness, minimum = self.draw_conditions(self.step, self.published)
        cause = self.store.stalled.remote(
            questions, now, max_staleness, minimum, self.published, rounds, self.cfg.searchers
        )
        return ray.get(cause) or ""
