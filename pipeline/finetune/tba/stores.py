"""The two actors every run has besides its searchers (plain classes; the trainer wraps them with
ray.remote at start): the weights actor (WeightStore: the training problems, the newest published
weights, the stop flag) and the store actor (TrajectoryStore: TBA's buffer, which searchers fill and
the trainer draws from); Changes wakes the calls waiting in either."""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import Callable

from pipeline.finetune.tba.grouped_replay import GroupedReplay

log = logging.getLogger("stepflow.async")

# the longest one wait on an actor lasts: the waiting side asks again after it (a searcher also learns
# of a stop at once; the trainer checks the searchers' loops for an error between its waits)
WAIT_SECONDS = 1.0
EMPTY_DRAW = json.dumps({"groups": [], "recent": 0})


class Changes:
    """Wakes the calls waiting in an async actor when its state changes. Ray runs every method of an
    actor that has an ``async def`` one on the actor's one event loop (a plain method as a coroutine
    that does not yield): a method that changes the state calls ``notify``, a waiting method awaits
    ``until`` while the other calls run."""

    def __init__(self):
        self.event = asyncio.Event()

    def notify(self) -> None:
        self.event.set()
        self.event = asyncio.Event()

    async def until(self, ready: Callable[[], object], timeout: float) -> object:
        """``ready()``'s first answer that is not None, checked now and after every change; None
        after ``timeout`` seconds without one."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        while True:
            event = self.event
            answer = ready()
            left = deadline - loop.time()
            if answer is not None or left <= 0:
                return answer
            try:
                await asyncio.wait_for(event.wait(), left)
            except TimeoutError:
                pass


class WeightStore:
    """What a searcher starts from and samples with: the training problems ([object ref]), the
    newest published weights (version; with the object store, the buckets' references and their
    layout, pipeline.finetune.tba.weight_buckets); and whether the run is over. An async actor: a
    searcher waiting for newer weights (``wait_newer``) holds none of the other calls up."""

    def __init__(self, problems: list | None = None):
        self.version, self.refs, self.layout, self.stopped = -1, None, None, False
        self.problem_refs = problems  # a list, so the object is passed by reference
        self.changes = Changes()

    def problems(self) -> list | None:
        return self.problem_refs

    def publish(self, version: int, refs: list | None, layout: dict | None) -> None:
        """refs: one object per bucket (in a list, so the objects are passed by reference); None
        when the weights go over the collective group."""
        self.version, self.refs, self.layout = version, refs, layout
        self.changes.notify()

    def latest(self, known: int) -> tuple[int, list | None, dict | None, bool]:
        """(version, refs and layout if newer than ``known`` else None, stopped)."""
        newer = self.version > known and self.refs is not None
        return self.version, (self.refs if newer else None), (self.layout if newer else None), self.stopped

    async def wait_newer(self, known: int, timeout: float = WAIT_SECONDS) -> tuple[int, list | None, dict | None, bool]:
        """``latest(known)`` as soon as a version newer than ``known`` is published or the run
        stops; after ``timeout`` seconds without either, ``latest(known)`` all the same (no refs:
        the caller asks again, so a trainer that is gone holds no searcher for ever)."""
        answer = await self.changes.until(
            lambda: self.latest(known) if self.stopped or self.version > known else None, timeout
        )
        return answer if answer is not None else self.latest(known)

    def stop(self) -> None:
        self.stopped = True
        self.changes.notify()


class TrajectoryStore:
    """The buffer every searcher fills and the trainer draws from (one per run)."""

    def __init__(self, buffer_kwargs: dict):
        self.buffer = GroupedReplay(**buffer_kwargs)
        self.added, self.dropped, self.evicted, self.per_searcher, self.restarts = 0, 0, 0, {}, 0
        self.rounds: dict[int, tuple[int | None, int]] = {}  # searcher -> (weights version, rounds of it sent)
        self.searcher_idle = self.searcher_loading = 0.0
        self.started = time.monotonic()
        self.changes = Changes()

    def add(
        self,
        payload: str,
        searcher: int,
        idle_seconds: float = 0.0,
        loading_seconds: float = 0.0,
        version: int | None = None,
    ) -> int:
        """A searcher's round, how long it waited for new weights before it and how long it spent
        taking weights in (fetching, loading them into its policy), the weights version it sampled
        with (counted per searcher: ``stalled``); returns the buffer's size."""
        objects = json.loads(payload)
        last, count = self.rounds.get(searcher, (None, 0))
        self.rounds[searcher] = (version, count + 1 if version == last else 1)
        # each record built and checked once, by the buffer
        self.evicted += self.buffer.add_json(objects, f"trajectories from searcher {searcher}")
        self.added += len(objects)
        self.searcher_idle += idle_seconds
        self.searcher_loading += loading_seconds
        self.per_searcher[searcher] = self.per_searcher.get(searcher, 0) + len(objects)
        self.changes.notify()
        return len(self.buffer)

    def count_restart(self, searcher: int) -> None:
        self.restarts += 1
        log.warning("async: searcher %d was restarted by Ray and rejoins", searcher)

    def sample(self, questions: int, latest: int, now: int, max_staleness: int | None, minimum: int = 0) -> str:
        """JSON {"groups": [[trajectory, ...] x K] x questions, "recent": n}, or no groups while the
        buffer holds fewer than ``minimum`` completions or fewer than ``questions`` eligible questions."""
        if not self.can_draw(questions, now, max_staleness, minimum):
            return EMPTY_DRAW
        return self.draw(questions, latest)

    async def wait_sample(
        self,
        questions: int,
        latest: int,
        now: int,
        max_staleness: int | None,
        minimum: int = 0,
        timeout: float = WAIT_SECONDS,
    ) -> str:
        """``sample``'s answer as soon as the buffer can give the groups (checked now and after every
        round added); no groups after ``timeout`` seconds without them."""
        answer = await self.changes.until(
            lambda: self.draw(questions, latest) if self.can_draw(questions, now, max_staleness, minimum) else None,
            timeout,
        )
        return EMPTY_DRAW if answer is None else answer

    def can_draw(self, questions: int, now: int, max_staleness: int | None, minimum: int) -> bool:
        """Whether the buffer holds ``minimum`` completions and ``questions`` eligible questions once
        completions older than ``now - max_staleness`` are dropped (the staleness bound)."""
        if max_staleness is not None:
            self.dropped += self.buffer.forget_before(now - max_staleness)
        return len(self.buffer) >= max(minimum, 1) and self.buffer.eligible() >= questions

    def stalled(
        self,
        questions: int,
        now: int,
        max_staleness: int | None,
        minimum: int,
        version: int,
        rounds: int,
        searchers: int,
    ) -> str | None:
        """Why the draw under these conditions can never be served, or None: every one of the
        ``searchers`` has sent its ``rounds`` rounds of weights ``version`` (gfn.searcher_rounds_per_version)
        and waits for newer ones, which the trainer publishes only after it trains, and the buffer
        cannot give the batch. Checked in one actor call, so no round arrives in between."""
        if self.can_draw(questions, now, max_staleness, minimum):
            return None
        sent = [self.rounds.get(index, (None, 0)) for index in range(searchers)]
        if any(sent_version != version or count < rounds for sent_version, count in sent):
            return None
        return (
            f"every searcher has sent its gfn.searcher_rounds_per_version = {rounds} rounds of weights version {version} "
            f"and waits for newer ones, which the trainer publishes only after this step; the buffer holds "
            f"{len(self.buffer)} completions (at least {minimum} needed) and {self.buffer.eligible()} questions with "
            f"{self.buffer.per_question} distinct completions ({questions} needed) after dropping those older than "
            f"step {now} - gfn.max_staleness = {max_staleness}"
        )

    def draw(self, questions: int, latest: int) -> str:
        groups, recent = self.buffer.sample_json(questions, latest)
        return json.dumps({"groups": groups, "recent": recent})

    def stats(self) -> dict:
        return {
            "size": len(self.buffer),
            "added": self.added,
            "dropped_stale": self.dropped,
            "evicted": self.evicted,
            "per_searcher": dict(self.per_searcher),
            "restarts": self.restarts,
            "searcher_idle_seconds": self.searcher_idle,
            "searcher_weight_load_seconds": self.searcher_loading,
            "seconds": time.monotonic() - self.started,
        }

    def state_dict(self) -> dict:
        return {"buffer": self.buffer.state_dict(), "added": self.added, "dropped": self.dropped}

    def load_state_dict(self, state: dict) -> None:
        self.buffer.load_state_dict(state["buffer"])
        self.added, self.dropped = state["added"], state["dropped"]
