"""Trajectory Balance with Asynchrony (TBA, Bartoldson et al.) on Ray: `make gfn` with gfn.mode=async.

Who does what (docs/async.md):
- searcher actors (gfn.searchers of them): each holds its own copy of the policy (HF generate, or
  a vLLM engine and no transformers copy) and the PRM scorer, or with gfn.scorer_actors > 0 no PRM;
  round after round it samples questions_per_step questions of its own share of the training
  problems (searcher_share: the shares are disjoint) x samples_per_question (S) solutions
  with the newest weights it has (at most gfn.searcher_rounds_per_version rounds per version),
  scores them (itself, or through a scorer actor) and sends them, tagged with that weights
  version, to the store;
- scorer actors (gfn.scorer_actors of them, default none): each holds the PRM and scores the rounds
  searchers send it (PooledScorer: a round to one actor, the actors in turn);
- the store actor: TBA's buffer (pipeline.finetune.grouped_replay): a question's newest
  gfn.buffer_per_question completions kept, gfn.buffer_size in all (FIFO), drawn as B questions x K
  distinct completions, a question's group from the newest weights' completions with probability m;
  it drops completions of weights older than gfn.max_staleness trainer steps;
- the weights actor: the newest published weights version (with the object store, the
  references of its buckets; with gfn.weight_transport=collective the buckets go over one NCCL
  or gloo group of the trainer and every searcher: pipeline.finetune.publication), a stop flag,
  and the reference to the training problems every searcher starts from;
- the trainer (this process, or every process of an accelerate group, of which only the main one
  talks to Ray and hands the others their share of each batch): the same training base,
  objective and update as the synchronous mode, on batches drawn from the store, re-scored under
  the current policy (and under the reference, which the trainer holds: a reset takes effect at
  once); every gfn.sync_every steps it publishes its weights in the sampler's dtype, in the
  background.

Only off-policy objectives (SubTB, TB, TB-VarGrad) may train on trajectories from older
policies; PPO in this mode is refused before anything starts. Trajectories travel between
processes as JSON text, weights as byte buckets (object store or collective). A searcher that dies is
restarted by Ray (up to gfn.searcher_max_restarts times) and rejoins: what it starts from (the
training problems) is an object the trainer put in Ray's object store once and holds for the
whole run, so a restart finds it whenever the death happens. A trainer that dies resumes from its
checkpoint, which holds the buffer (it is persisted, not refilled). Ray is an optional extra: it
is imported inside the functions that need it.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import os
import threading
import time
from collections.abc import Callable, Iterable

import torch

from pipeline.batches import check_divisible
from pipeline.config_loader import ConfigError
from pipeline.finetune import ray_cluster
from pipeline.finetune.grouped_replay import GroupedReplay
from pipeline.finetune.publication import WeightPublisher, WeightReceiver, bucket_bytes
from pipeline.finetune.rewards import StateLogRewards
from pipeline.finetune.sampling import TrajectorySampler
from pipeline.finetune.trainer import FinetuneTrainer
from pipeline.finetune.weight_transport import backend_for, check_transport
from pipeline.records import Trajectory

log = logging.getLogger("stepflow.async")

MakeSampler = Callable[
    [int, list], TrajectorySampler
]  # (searcher index, training problems as JSON) -> its sampler (built in the actor)
# the longest one wait on an actor lasts: the waiting side asks again after it (a searcher also learns
# of a stop at once; the trainer checks the searchers' loops for an error between its waits)
WAIT_SECONDS = 1.0
EMPTY_DRAW = json.dumps({"groups": [], "recent": 0})


def core_for(index: int, cores: Iterable[int] | None = None) -> int:
    """The core process ``index`` (a searcher's index, a torchrun LOCAL_RANK) runs on: the
    index-th of ``cores`` in increasing order (default: those this process may use), wrapping around."""
    ordered = sorted(os.sched_getaffinity(0) if cores is None else set(cores))
    return ordered[index % len(ordered)]


def pin_process(cores: set[int], key: str = "gfn.searcher_cores") -> None:
    """Pin every thread of this process to ``cores`` (os.sched_setaffinity; threads it starts later,
    and processes, inherit the mask). A core the machine lacks is a ValueError naming ``key``."""
    tasks = [int(tid) for tid in os.listdir("/proc/self/task")] if os.path.isdir("/proc/self/task") else [0]
    try:
        for tid in tasks:
            try:
                os.sched_setaffinity(tid, cores)
            except ProcessLookupError:  # a thread that ended meanwhile
                pass
    except OSError as error:
        raise ValueError(f"{key}: cannot pin process {os.getpid()} to cores {sorted(cores)}: {error}") from error


def searcher_config(cfg, index: int):
    """A searcher's copy of the section: its own seed, with which it shuffles its share of the problems
    (searcher_share) and samples (searcher 0 of one walks the synchronous trainer's cycle: lockstep
    equals sync, docs/async.md)."""
    return dataclasses.replace(cfg, seed=cfg.seed + 7919 * index)


def searcher_share(problems: list, index: int, searchers: int) -> list:
    """Searcher ``index``'s share of the training problems: those at positions index, index +
    searchers, ... (each problem in exactly one share; one searcher: all of them, so searcher 0 walks
    the synchronous trainer's cycle). Disjoint shares mean two searchers never sample a question at
    the same time: the rounds of one weights version hold searchers x questions_per_step distinct
    questions. With shared cycles two searchers meet on a question with probability about
    1 - exp(-(N q)^2 / 2P) per version (N searchers of q questions each, P problems), and then a
    version's rounds hold fewer questions than a batch of B = N q needs: under a staleness bound of
    one version the trainer waits for the next version's rounds and trains them twice."""
    if not 0 <= index < searchers:
        raise ValueError(f"searcher index {index}: expected 0 <= index < gfn.searchers = {searchers}")
    if 0 < len(problems) < searchers:
        raise ValueError(
            f"gfn.searchers = {searchers} exceeds the {len(problems)} training problems: each searcher walks its own "
            "share of them"
        )
    return problems[index::searchers]


def async_shape(cfg) -> tuple[int, int]:
    """(B questions per trainer step, K distinct completions per question) of the gfn section."""
    return cfg.async_questions or cfg.questions_per_step, cfg.async_samples_used or cfg.samples_per_question


def question_capacity(cfg) -> int:
    """The most completions the buffer keeps per question: gfn.buffer_per_question, default S."""
    return cfg.buffer_per_question or cfg.samples_per_question


def batch_key(cfg, section: str = "gfn") -> str:
    """The key B is read from: async_questions when set, else questions_per_step."""
    return f"{section}.async_questions" if cfg.async_questions else f"{section}.questions_per_step"


def smallest_buffer(cfg) -> int:
    """The smallest buffer_size that holds a batch whatever the order of the searchers' rounds:
    (B - 1) x c + K, c = question_capacity. A searcher adds a round question by question, S
    completions each, and the buffer keeps the newest; a question holds at most c of them, and
    only the oldest question in the buffer can hold fewer than its newest visit gave (>= K with
    S >= K and c >= K). So B questions with K completions each fit exactly when the B - 1 newest
    hold c each and the oldest K (docs/async.md, "The buffer")."""
    questions, used = async_shape(cfg)
    return (questions - 1) * question_capacity(cfg) + used


def check_async_settings(cfg, section: str = "gfn") -> None:
    """The asynchronous settings that only make sense together, checked before Ray starts;
    raises ConfigError naming the key."""
    questions, used = async_shape(cfg)
    capacity = question_capacity(cfg)
    if not 0.0 <= cfg.recency_fraction <= 1.0:
        raise ConfigError(f"{section}.recency_fraction = {cfg.recency_fraction}: expected m in [0, 1]")
    if used > cfg.samples_per_question:
        raise ConfigError(
            f"{section}.async_samples_used = {used} exceeds {section}.samples_per_question = {cfg.samples_per_question}: "
            "a question's K distinct completions come from the S >= K a searcher generates"
        )
    if cfg.loss == "tb_vargrad" and used < 2:
        raise ConfigError(
            f"{section}.async_samples_used = {used}: TB-VarGrad needs K >= 2 completions per question "
            "(a question with one row has zero loss)"
        )
    if cfg.async_initial_completions > cfg.buffer_size:
        raise ConfigError(
            f"{section}.async_initial_completions = {cfg.async_initial_completions} exceeds {section}.buffer_size = "
            f"{cfg.buffer_size}: training would never start"
        )
    if capacity < used:
        raise ConfigError(
            f"{section}.buffer_per_question = {capacity} is below {section}.async_samples_used = {used}: no question "
            "could hold a group of K distinct completions"
        )
    if cfg.buffer_size < smallest_buffer(cfg):
        raise ConfigError(
            f"{section}.buffer_size = {cfg.buffer_size} cannot hold a batch of {questions} questions "
            f"({batch_key(cfg, section)}) x {used} distinct completions: a searcher adds its round question by question, "
            f"{cfg.samples_per_question} completions each ({cfg.questions_per_step} x {cfg.samples_per_question} = "
            f"{cfg.questions_per_step * cfg.samples_per_question} at once), a question keeps up to {capacity} "
            f"({section}.buffer_per_question, default S) and the buffer the newest, so it needs "
            f"({questions} - 1) x {capacity} + {used} = {smallest_buffer(cfg)}"
        )
    if cfg.max_staleness is not None and cfg.max_staleness < cfg.sync_every - 1:
        raise ConfigError(
            f"{section}.max_staleness = {cfg.max_staleness} is below {section}.sync_every - 1 = {cfg.sync_every - 1}: "
            "the newest weights a searcher has are up to sync_every - 1 trainer steps old, so nothing could be trained on"
        )
    cores = os.cpu_count() or 1
    if cfg.searcher_cores is not None and cfg.ray_address is None and any(core >= cores for core in cfg.searcher_cores):
        raise ConfigError(f"{section}.searcher_cores = {cfg.searcher_cores}: this machine has cores 0 to {cores - 1}")
    if cfg.scorer_gpus and not cfg.scorer_actors:
        raise ConfigError(
            f"{section}.scorer_gpus = {cfg.scorer_gpus:g} with {section}.scorer_actors = 0: the searchers hold the PRM "
            f"(on their own GPUs); set {section}.scorer_actors to run the PRM in actors of its own"
        )
    if cfg.kl_coef_final is not None and not (cfg.kl_coef > 0 and cfg.kl_coef_final > 0):
        raise ConfigError(
            f"{section}.kl_coef_final = {cfg.kl_coef_final}: an annealed beta runs from {section}.kl_coef > 0 to a "
            f"value > 0 (got kl_coef = {cfg.kl_coef})"
        )


def share_sizes(problems: int, searchers: int) -> list[int]:
    """How many problems each searcher's share holds (searcher_share: positions i, i + N, ...)."""
    return [len(range(index, problems, searchers)) for index in range(searchers)]


def check_async_problems(cfg, problems: int, section: str = "gfn") -> None:
    """The asynchronous settings against the number of training problems, checked before Ray
    starts; raises ConfigError naming the key. A batch holds B distinct questions (the synchronous
    mode's cycle repeats questions within a step; a draw cannot), each searcher walks its own share,
    and with gfn.searcher_rounds_per_version = r the searchers sample r rounds of the first weights
    and then wait for the trainer's next ones: those rounds must hold a batch and the initial
    completions (every completion assumed distinct; repeats are found at run time)."""
    questions, used = async_shape(cfg)
    samples, per_round, capacity = cfg.samples_per_question, cfg.questions_per_step, question_capacity(cfg)
    if problems < cfg.searchers:
        raise ConfigError(
            f"{section}.searchers = {cfg.searchers} exceeds the {problems} training problems: each searcher walks its own "
            "share of them"
        )
    if problems < questions:
        raise ConfigError(
            f"{batch_key(cfg, section)} = {questions} exceeds the {problems} training problems: an asynchronous batch "
            f"holds {questions} distinct questions (the synchronous mode's cycle repeats questions within a step, a draw "
            "from the buffer cannot), so the trainer would wait for ever"
        )
    if cfg.async_initial_completions > problems * capacity:
        raise ConfigError(
            f"{section}.async_initial_completions = {cfg.async_initial_completions} exceeds what the buffer can hold of "
            f"{problems} problems: {problems} x {capacity} ({section}.buffer_per_question, default S) = "
            f"{problems * capacity}; training would never start"
        )
    rounds = cfg.searcher_rounds_per_version
    if rounds is None:
        return
    picks = rounds * per_round  # questions a searcher samples with one weights version
    shares = share_sizes(problems, cfg.searchers)
    distinct = sum(min(share, picks) for share in shares)
    if distinct < questions:
        raise ConfigError(
            f"{section}.searcher_rounds_per_version = {rounds}: with the first weights the searchers sample "
            f"{rounds} x {per_round} questions each of their shares of {shares} problems, {distinct} distinct in all, "
            f"and then wait for weights the trainer publishes only after training on a batch of {questions} "
            f"({batch_key(cfg, section)})"
        )
    held = 0
    for share in shares:  # a question sampled v times holds min(c, v x S)
        cycles, rest = divmod(picks, share)
        held += rest * min(capacity, (cycles + 1) * samples) + (share - rest) * min(capacity, cycles * samples)
    if min(held, cfg.buffer_size) < cfg.async_initial_completions:
        raise ConfigError(
            f"{section}.async_initial_completions = {cfg.async_initial_completions} exceeds the {min(held, cfg.buffer_size)} "
            f"completions the buffer holds after the first weights' {section}.searcher_rounds_per_version = {rounds} "
            "rounds of every searcher, after which they wait for weights the trainer publishes only once it has trained"
        )


# ----------------------------------------------------------------------------- the actors (plain classes; ray.remote at start)


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
    layout, pipeline.finetune.weight_buckets); and whether the run is over. An async actor: a
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


class Searcher:
    """Samples and scores round after round with the newest weights it can get.

    A threaded actor (two calls at a time): while ``run`` samples, the trainer's ``join`` and
    ``receive`` calls take collective weights into its receiver's staging slot, which ``run``
    picks up at the start of its next round (pipeline.finetune.publication).
    """

    def __init__(
        self,
        index: int,
        make_sampler: MakeSampler,
        names: dict[str, str],
        cores: list[int] | None = None,
        *,
        searchers: int,
    ):
        """names: the store's and the weights actor's names in the run's namespace (looked up, not
        passed as handles: Ray keeps nothing of a restartable actor's arguments alive for its restarts);
        cores: gfn.searcher_cores (this searcher pins its process to core_for(index, cores));
        searchers: how many searchers the run has (this one samples its share of the problems:
        searcher_share)."""
        import ray  # the optional extra (we run inside a Ray worker)

        if cores:
            pin_process({core_for(index, cores)})
        torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
        store, weights = ray.get_actor(names["store"]), ray.get_actor(names["weights"])
        self.index, self.store, self.weights = index, store, weights
        self.restarted = ray.get_runtime_context().was_current_actor_reconstructed
        if self.restarted:
            store.count_restart.remote(index)
        # the problems by a reference the trainer holds: a restarted searcher reads the same object again
        problems = ray.get(ray.get(weights.problems.remote())[0])
        self.sampler = make_sampler(index, searcher_share(problems, index, searchers))
        self.version = self.sampled_version = -1
        self.receiver = WeightReceiver(f"searcher {index}")

    def join(self, address: tuple, rank: int, layout: dict, version: int) -> bool:
        """Become ``rank`` of the trainer's new weights group and receive ``version`` over it."""
        return self.receiver.join(address, rank, layout, version)

    def receive(self, version: int) -> bool:
        """The trainer's weights of ``version``, over the group, staged for the next round."""
        return self.receiver.receive(version)

    def status(self) -> dict:
        """The weights version this searcher samples with, the one its last sent trajectories carry,
        how its weights reach it, its process, the cores it may run on, whether Ray restarted it and
        where Ray placed it (placement group, bundle, GPU ids: ray_cluster.placement)."""
        return {
            "version": self.version,
            "sampled_version": self.sampled_version,
            "channel": self.receiver.backend,
            "pid": os.getpid(),
            "cores": sorted(os.sched_getaffinity(0)),
            "restarted": self.restarted,
            "placement": ray_cluster.placement(),
        }

    def take_weights(self, version: int, refs: list | None, layout: dict | None) -> bool:
        """The newest weights into the sampler's policy: the object store's ``refs`` of ``version``
        (when the weights actor has newer ones than this searcher), or those the group staged;
        whether any were loaded."""
        if refs is not None:
            self.receiver.fetch(version, refs, layout)
        staged = self.receiver.take()
        if staged is None or staged[0] <= self.version:
            return False
        self.sampler.policy.load_weights(staged[1], staged[0])
        self.version = staged[0]
        return True

    def run(self) -> int:
        """Until the run stops: returns the number of rounds sampled. A searcher that needs weights
        newer than its own (none yet, or its gfn.searcher_rounds_per_version rounds of them done)
        waits on the weights actor until they are published (with the collective transport, then on
        its receiver until they have come over the group), each wait at most WAIT_SECONDS, and asks
        again after it; one that does not takes whatever is newer at the start of its round."""
        import ray  # the optional extra (we run inside a Ray worker)

        rounds, rounds_of_version, idle, loading = 0, 0, 0.0, 0.0
        limit = getattr(self.sampler.cfg, "searcher_rounds_per_version", None)
        while True:
            needs = self.version < 0 or (limit is not None and rounds_of_version >= limit)
            start = time.monotonic()
            version, refs, layout, stopped = ray.get(
                self.weights.wait_newer.remote(self.version, WAIT_SECONDS if needs else 0.0)
            )
            if stopped:
                return rounds
            if needs and refs is None and version > self.version:  # announced; the weights come over the group
                self.receiver.wait(WAIT_SECONDS)
            if needs:
                idle += time.monotonic() - start
            start = time.monotonic()
            if self.take_weights(version, refs, layout):
                loading += time.monotonic() - start
                rounds_of_version = 0
            if self.version < 0 or (limit is not None and rounds_of_version >= limit):  # nothing (new) yet: wait again
                continue
            trajectories, _ = self.sampler.sample(rounds, version=self.version)
            # waiting for the store's answer bounds how far a searcher runs ahead of it
            ray.get(
                self.store.add.remote(
                    json.dumps([t.to_json() for t in trajectories]), self.index, idle, loading, version=self.version
                )
            )
            self.sampled_version = self.version
            rounds, rounds_of_version, idle, loading = rounds + 1, rounds_of_version + 1, 0.0, 0.0


# ----------------------------------------------------------------------------- the PRM scorer actors (gfn.scorer_actors)


def scorer_name(index: int) -> str:
    """Scorer actor ``index``'s name in the run's namespace (searchers look the actors up by name)."""
    return f"scorer-{index}"


class ScorerActor:
    """The PRM in a process of its own (one of gfn.scorer_actors): scores what searchers send it,
    one call at a time, with the scorer ``make_scorer`` builds here (the one a searcher would build)."""

    def __init__(self, index: int, make_scorer: Callable):
        import ray  # the optional extra (we run inside a Ray worker)

        torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
        self.index, self.scorer = index, make_scorer()
        self.calls = self.solutions = 0
        self.restarted = ray.get_runtime_context().was_current_actor_reconstructed

    def log_scores_many(self, solutions: list) -> list[list[float]]:
        """log U of every step of each (question, steps): the PRM's own answer, in order."""
        self.calls, self.solutions = self.calls + 1, self.solutions + len(solutions)
        return self.scorer.log_scores_many([(question, list(steps)) for question, steps in solutions])

    def status(self) -> dict:
        """Calls and solutions scored, its process, whether Ray restarted it, where Ray placed it."""
        return {
            "index": self.index,
            "calls": self.calls,
            "solutions": self.solutions,
            "pid": os.getpid(),
            "restarted": self.restarted,
            "placement": ray_cluster.placement(),
        }


class PooledScorer:
    """A searcher's scorer when scorer actors hold the PRM: ``log_scores_many`` sends a round's
    (question, steps) pairs, all of them, to one actor (the PRM sees the batch it would see in the
    searcher, so the scores are the same) and returns its answer. Round robin: searcher i's calls go
    to actors i, i + 1, ... (mod gfn.scorer_actors). The actors are looked up by name at the first
    call (a restarted searcher finds them again); a restarting actor's calls are retried by Ray."""

    def __init__(self, actors: int, first: int = 0):
        if actors < 1:
            raise ValueError(f"gfn.scorer_actors={actors}: a pooled scorer needs at least one actor")
        self.actors, self.next, self.handles = actors, first % actors, None

    def log_scores_many(self, solutions) -> list[list[float]]:
        import ray  # the optional extra (we run inside a Ray worker)

        if self.handles is None:
            self.handles = [ray.get_actor(scorer_name(i)) for i in range(self.actors)]
        actor, self.next = self.handles[self.next], (self.next + 1) % self.actors
        return ray.get(actor.log_scores_many.remote([(question, list(steps)) for question, steps in solutions]))


# ----------------------------------------------------------------------------- the trainer


class AsyncFinetuneTrainer(FinetuneTrainer):
    """The synchronous trainer's update and bookkeeping on batches drawn from the searchers' store.

    make_sampler: builds a searcher's sampler inside its actor from its index and ``problems``
                  (picklable: a module-level function or functools.partial of one)
    export:       the trainer's current weights as the searchers load them (plain, LoRA merged),
                  called on every process (gathering may be a collective), used on the main one
    problems:     the training problems as JSON (Problem.to_json): put in Ray's object store once
                  and held by this trainer, so a searcher restarted at any moment reads them again
    make_scorer:  builds the PRM inside each scorer actor (gfn.scorer_actors > 0; picklable); the
                  searchers then score through PooledScorer
    publish_dtype: the dtype the searchers' policies hold (model.dtype resolved for their device):
                  floating weights are published in it (None: each tensor keeps its own)

    Only the main process talks to Ray: it starts the actors, draws every process's share of the
    batch from the store and sends it to the others over the trainer's own process group (JSON
    text), and publishes; the other processes never connect (docs/async.md, "Several trainer processes").
    """

    def __init__(
        self,
        base,
        sampler,
        objective,
        cfg,
        make_sampler: MakeSampler,
        export: Callable[[], dict | None],
        problems: list | None = None,
        run_name: str = "stepflow",
        progress: bool = True,
        publish_dtype: torch.dtype | None = None,
        make_scorer: Callable | None = None,
    ):
        super().__init__(base, sampler, objective, cfg, progress=progress)
        if not getattr(objective, "off_policy", False):
            raise ValueError(
                f"{objective.name} is on-policy: mode=async trains on trajectories of older policies "
                "(use gfn.loss=subtb | tb | tb_vargrad)"
            )
        if cfg.scorer_actors and make_scorer is None:
            raise ValueError(
                f"gfn.scorer_actors={cfg.scorer_actors}: the trainer needs make_scorer to build the PRM in each scorer actor"
            )
        self.make_sampler, self.export, self.run_name, self.make_scorer = make_sampler, export, run_name, make_scorer
        self.scorers: list = []
        self.problems, self.problems_ref = list(problems or []), None
        check_async_settings(cfg)
        if self.problems:
            check_async_problems(cfg, len(self.problems))
        self.questions, self.per_question = async_shape(cfg)
        check_divisible(self.questions, sampler.collective.world)
        check_transport(cfg.weight_transport)
        self.store = self.weights = None
        self.searchers: list = []
        self.publish_dtype, self.publisher = publish_dtype, None
        self.runs: list = []
        self._started_ray = False
        self.placement_group, self.trainer_gpu_ids = None, []  # the run's group; the GPUs Ray reserved for the trainer
        self.published = -1  # the version of the newest publication
        self._next_batch: BatchRequest | None = None  # the store request in flight (main process)
        self.publish_seconds = 0.0  # spent publishing since the last metrics record
        self._window = (0, 0.0, 0.0, time.monotonic())

    # ------------------------------------------------------------------ actors

    def start(self) -> None:
        """Main process: connect to Ray (a local instance by default, cfg.ray_address otherwise; once:
        a stage connects before loading models and this finds it connected) and start the actors of
        this run. Every process then meets at a barrier; the others never connect."""
        import ray  # the optional extra (extra `distributed`)

        collective = self.sampler.collective
        names = {"store": "store", "weights": "weights"}
        if self.base.is_main:
            self._started_ray = ray_cluster.connect(self.cfg, f"stepflow-{self.run_name}")
            buffer = {
                "capacity": self.cfg.buffer_size,
                "per_question": self.per_question,
                "priority": self.cfg.async_priority,
                "temperature": self.cfg.buffer_temperature,
                "recency": self.cfg.recency_fraction,
                "seed": self.cfg.seed,
                "question_capacity": question_capacity(self.cfg),
                "reward": StateLogRewards.of(self.cfg),  # the priority: the trained reward without the prior
            }
            self.store = ray.remote(num_cpus=0)(TrajectoryStore).options(name=names["store"]).remote(buffer)
            # Searchers read the problems through the weights actor, by a reference this process holds:
            # as a constructor argument of a restartable actor, a large object is freed once the actor
            # has started, and a searcher restarted later would have nothing to start from.
            self.problems_ref = ray.put(self.problems)
            self.weights = (
                ray.remote(num_cpus=0)(WeightStore).options(name=names["weights"]).remote([self.problems_ref])
            )
            self.reserve()
            self.start_scorers()
            searcher = ray.remote(
                num_cpus=1,
                num_gpus=self.cfg.searcher_gpus,
                max_restarts=self.cfg.searcher_max_restarts,
                max_concurrency=2,
            )(Searcher)
            self.searchers = [
                searcher.options(scheduling_strategy=ray_cluster.searcher_strategy(self.placement_group, i)).remote(
                    i, self.make_sampler, names, self.cfg.searcher_cores, searchers=self.cfg.searchers
                )
                for i in range(self.cfg.searchers)
            ]
            trainer_device = self.base.accelerator.device
            self.publisher = WeightPublisher(
                transport=self.cfg.weight_transport,
                weights=self.weights,
                dtype=self.publish_dtype,
                bucket_bytes=bucket_bytes(self.cfg.publish_bucket_mb),
                host=ray.util.get_node_ip_address(),
                backend=backend_for(trainer_device) if self.cfg.searcher_gpus else "gloo",
            )  # NCCL: GPU to GPU
        collective.barrier()

    def start_scorers(self) -> None:
        """gfn.scorer_actors actors holding the PRM, each in its own bundle of the run's placement
        group (ray_cluster.bundles), found by searchers under scorer_name(j); restarted by Ray like searchers."""
        import ray  # the optional extra (extra `distributed`)

        scorer = ray.remote(
            num_cpus=1, num_gpus=self.cfg.scorer_gpus, max_restarts=self.cfg.searcher_max_restarts, max_task_retries=-1
        )(ScorerActor)
        self.scorers = [
            scorer.options(
                name=scorer_name(j), scheduling_strategy=ray_cluster.scorer_strategy(self.placement_group, self.cfg, j)
            ).remote(j, self.make_scorer)
            for j in range(self.cfg.scorer_actors)
        ]

    def trainer_gpus(self) -> int:
        """GPUs the trainer's processes hold (one each on CUDA; they run on the main process's node)."""
        return self.sampler.collective.world if self.base.accelerator.device.type == "cuda" else 0

    def reserve(self) -> None:
        """The run's placement group (ray_cluster.bundles): the trainer's bundle, then one per searcher,
        so Ray never places a searcher on the trainer's GPUs. On CUDA, the GPUs Ray reserved for the
        trainer must be the ones its main process runs on, else the run is refused naming both."""
        gpus = self.trainer_gpus()
        self.placement_group, self.trainer_gpu_ids = ray_cluster.reserve(
            self.cfg, gpus, self.cfg.placement_timeout, ray_cluster.cluster_name(self.cfg)
        )
        device = self.base.accelerator.device
        if gpus and device.type == "cuda":
            visible = os.environ.get("CUDA_VISIBLE_DEVICES")
            index = device.index if device.index is not None else torch.cuda.current_device()
            own = visible.split(",")[index] if visible else str(index)
            if own not in self.trainer_gpu_ids:
                raise ValueError(
                    f"Ray reserved GPUs {self.trainer_gpu_ids} of this node for the trainer, but its main process runs "
                    f"on GPU {own}: searchers could be placed on it. Start the trainer on the node's first GPUs "
                    "(CUDA_VISIBLE_DEVICES unset, or the ids Ray reserves)"
                )

    def publish(self) -> None:
        """The trainer's weights, as of its current step, for every searcher: exported by every
        process (exporting may gather shards), packed by the main process and sent in the
        background (pipeline.finetune.publication); this waits for the previous publication."""
        start = time.monotonic()
        try:
            state = self.export()
            if self.base.is_main:
                self.publisher.publish(state, self.step, self.searchers)
        finally:
            self.published = self.step
            self.publish_seconds += time.monotonic() - start

    def keep_searching(self) -> None:
        """Start every searcher's loop (main process) and surface an error raised inside one. A
        searcher that dies is restarted by Ray (up to gfn.searcher_max_restarts times), and so is
        its loop (max_task_retries=-1): training goes on with the others meanwhile."""
        import ray  # the optional extra (extra `distributed`)

        if not self.base.is_main:
            return
        if not self.runs:
            self.runs = [s.run.options(max_task_retries=-1).remote() for s in self.searchers]
            return
        done, _ = ray.wait(self.runs, num_returns=len(self.runs), timeout=0)
        for ref in done:
            try:
                ray.get(ref)  # a loop ends before the stop only with an error in it: raised here
            except ray.exceptions.RayActorError as error:
                index = self.runs.index(ref)
                cause = next((line for line in str(error).splitlines() if line.strip()), type(error).__name__)
                restarts = ray.get(self.store.stats.remote())["restarts"]
                raise RuntimeError(
                    f"async: searcher {index} stopped and is not restarted again (Ray restarts a searcher at most "
                    f"gfn.searcher_max_restarts={self.cfg.searcher_max_restarts} times; this run's searchers were "
                    f"restarted {restarts} times in all): {cause}"
                ) from error

    def stop(self) -> None:
        """Stop the searchers and the actors; shut Ray down when this trainer started it, also when
        stopping fails (an actor already gone, a peer process dead)."""
        import ray  # the optional extra (extra `distributed`)

        try:
            self.close_request()  # a batch asked for a step that does not come
            if self.publisher is not None:
                self.publisher.close()  # the running publication ends first
            if self.base.is_main and self.weights is not None:
                ray.get(self.weights.stop.remote())
                ray.wait(self.runs, num_returns=len(self.runs), timeout=60)
                for actor in [*self.searchers, *self.scorers, self.store, self.weights]:
                    ray.kill(actor)
                if self.placement_group is not None:
                    ray.util.remove_placement_group(self.placement_group)
            self.sampler.collective.barrier()
        finally:
            if self._started_ray:
                ray.shutdown()

    # ------------------------------------------------------------------ the loop

    def loop_state(self) -> dict:
        """A checkpoint holds the whole buffer: a restarted trainer resumes with it."""
        import ray  # the optional extra (extra `distributed`)

        return {"store": ray.get(self.store.state_dict.remote()) if self.base.is_main else None}

    def load_loop_state(self, state: dict) -> None:
        self._resumed_store = state["store"]

    def prepare(self) -> None:
        """Start the actors, resume (the buffer too), publish the weights, set the searchers going."""
        import ray  # the optional extra (extra `distributed`)

        self._resumed_store = None
        self.start()
        self.resume()
        if self.base.is_main and self._resumed_store is not None:
            ray.get(self.store.load_state_dict.remote(self._resumed_store))
        self.publish()
        self.keep_searching()
        stats = self.store_stats()
        self._window = (
            stats["added"],
            stats["searcher_idle_seconds"],
            stats["searcher_weight_load_seconds"],
            time.monotonic(),
        )

    def store_stats(self) -> dict:
        """The store's counters (TrajectoryStore.stats), read by the main process, the same on every process."""
        import ray  # the optional extra (extra `distributed`)

        text = json.dumps(ray.get(self.store.stats.remote())) if self.base.is_main else None
        return json.loads(self.sampler.collective.broadcast_text(text))

    def train(self) -> list[dict]:
        try:
            return super().train()
        finally:
            self.stop()

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

    def train_step(self) -> dict:
        start = self.start_step()
        step, lr = self.step, self.base.lr
        collective = self.sampler.collective
        groups, recent, waited = self.draw()
        self.prefetch()  # the next batch is drawn and read while this update runs
        batch = [t for group in groups for t in group]
        totals, grad_norm = self.update(self.objective.plan(batch, 1 / len(batch)))
        self.after_update(step + 1)
        record = self.record(step + 1, lr, batch, totals, grad_norm, start)
        stats = self.store_stats()
        added, searcher_idle, searcher_loading, since = self._window
        now = time.monotonic()
        staleness = [step - t.policy_version for t in batch]
        behind = [(self.published - t.policy_version) // self.cfg.sync_every for t in batch]
        # what the batch holds, whatever the store meant to send: distinct completions per question;
        # TB-VarGrad gives the rows of a question with fewer than two distinct completions no gradient
        distinct: dict[str, set] = {}
        for t in batch:
            distinct.setdefault(t.problem_id, set()).add(tuple(t.steps))
        sizes = [len(completions) for completions in distinct.values()]
        zero = sum(len(distinct[t.problem_id]) < 2 for t in batch) if self.objective.name == "tb_vargrad" else 0
        summed = collective.sum(
            torch.tensor([sum(staleness), len(batch), zero, len(distinct), recent, waited], dtype=torch.float64)
        )
        histogram: dict[str, int] = {}
        for versions in behind:
            histogram[str(versions)] = histogram.get(str(versions), 0) + 1
        record.update(
            {
                "trained": int(summed[1]),
                "questions": int(summed[3]),
                "trajectories_per_question_min": int(-collective.max(-min(sizes))),
                "trajectories_per_question_max": int(collective.max(max(sizes))),
                "zero_gradient_fraction": float(summed[2] / summed[1]),
                "recent_questions": int(summed[4]),
                "staleness_mean": float(summed[0] / summed[1]),
                "staleness_max": int(collective.max(max(staleness))),
                "staleness_versions": histogram,  # versions behind the newest publication -> rows (this process's)
                "generated_per_trained": (stats["added"] - added) / float(summed[1]),
                "searcher_trajectories_per_s": (stats["added"] - added) / max(now - since, 1e-9),
                "trainer_idle_seconds": float(summed[5]) / collective.world,
                "searcher_idle_seconds": stats["searcher_idle_seconds"] - searcher_idle,
                "searcher_weight_load_seconds": stats["searcher_weight_load_seconds"] - searcher_loading,
                "buffer_size": stats["size"],
                "dropped_stale": stats["dropped_stale"],
                "evicted": stats["evicted"],
                "searcher_restarts": stats["restarts"],
            }
        )
        if self.step % self.cfg.sync_every == 0:
            self.publish()
        record["publish_seconds"] = (
            self.publish_seconds
        )  # the trainer's own time: export, pack, wait for the previous one
        if self.publisher is not None:  # publications that finished in the background since the last record
            done = self.publisher.take_finished()
            record.update(
                {
                    "publications": len(done),
                    "publication_bytes": sum(p.bytes for p in done),
                    "publication_seconds": sum(p.seconds for p in done),
                    "publication_buckets": sum(p.buckets for p in done),
                }
            )
        record["wall_time"] = time.time()  # when the step ended, its publication started
        self._window = (stats["added"], stats["searcher_idle_seconds"], stats["searcher_weight_load_seconds"], now)
        self.publish_seconds = 0.0
        self.base.log(record)
        self.keep_searching()
        return record
