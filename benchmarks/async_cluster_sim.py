"""async_cluster_sim: the asynchronous mode's Ray machinery with 1 to 32 searchers on one machine,
the generation engine and the trainer's update replaced by sleeps of measured length.

    python -m benchmarks.async_cluster_sim --config configs/tiny.yaml

What runs for real (pipeline.finetune.async_ray, ray_cluster, grouped_replay, sampling):
- the run's placement group (ray_cluster.reserve: the trainer's bundle, then one CPU bundle per
  searcher) and each searcher in its bundle (ray_cluster.searcher_strategy);
- the Searcher actors and their loop (wait for and fetch the newest weights, sample, score, send to the store),
  each with a real TrajectorySampler (its share of the problems, question cycle, scoring, grading,
  Trajectory records), started anew for each store policy (rounds per version is theirs);
- the TrajectoryStore actor and its GroupedReplay buffer (ingest, staleness bound, grouped draws);
- the WeightStore actor, and the weight publication through the trainer's own WeightPublisher
  (``publisher_for``: packed, sent in the background, the next publication waiting for the previous).

What is simulated:
- the engine (SleepingEngine): a round of n trajectories sleeps n x (per-trajectory seconds +
  tokens x per-token seconds) and returns distinct placeholder steps; the scorer returns a
  constant log score per step;
- the trainer's update (this process): it draws its batch from the store as the real trainer does
  (a BatchRequest: TrajectoryStore.wait_sample with the newest published version, its step and the
  staleness bound, asked for as the previous update started and read by the request's thread),
  sleeps the measured seconds of one update, then publishes (WeightPublisher.publish: packed, then
  sent in the background while the next update waits for its batch, as AsyncFinetuneTrainer.publish).

The times come from this project's measurements on the 2-core CPU (CALIBRATION): a round of
4 questions x 4 solutions costs G = 0.911 s (generation + scoring), an update of 16 rows costs
T = 1.024 s (docs/async.md, "Measured"); per token 2.282 s / (64 x 16 x 48) tokens
(docs/benchmarks.md, generation_shared_prompt, CPU). The trainer's batch grows with the searchers
(one round of each per update: B = 4 N questions x K = 4) and its update takes T whatever the
batch, as a trainer with a rank per 16 rows would: the ideal is then N x 16 / max(G, T).

Measured per N: trained trajectories per second (each trajectory counted the first time it is
trained: fresh) and rows trained per second (replays too: whether the trainer is kept fed) against
the ideal, question groups of a batch that mix two searchers' completions, the staleness of
trained rows (trainer steps), the store's ingest and sample throughput (achieved, and per second of the store's own time: its capacity), the
publication's seconds for the sweep's payload, and where the time goes (breakdown_table: the
trainer's wall seconds per update, each role's CPU seconds from /proc, Linux only, the machine's busy
share); once after the sweep, a 1B-parameter bf16 payload
(a real 2e9-byte tensor set) published and fetched by one reader. Two store policies: the config's
asynchronous settings (replay allowed) and NO_REPLAY (one round per searcher per version). About
6.5 minutes on the 2-core machine, most of it the 32 searchers' two starts and Ray's shutdown
(docs/benchmarks.md, "Simulated cluster").
"""

from __future__ import annotations

import dataclasses
import functools
import json
import logging
import math
import os
import random
import re
import shutil
import sys
import time
from pathlib import Path

import torch
from matplotlib.figure import Figure

from benchmarks.common import machine_description
from pipeline.finetune.policy import SampledSolution
from pipeline.finetune.sampling import TrainProblem, TrajectorySampler
from pipeline.finetune.tba import ray_cluster
from pipeline.finetune.tba.drawing import BatchRequest, published_after
from pipeline.finetune.tba.publication import WeightPublisher, WeightReceiver, bucket_bytes
from pipeline.finetune.tba.searcher import Searcher
from pipeline.finetune.tba.settings import searcher_config
from pipeline.finetune.tba.stores import WAIT_SECONDS, TrajectoryStore, WeightStore
from stages.common import parse_args

log = logging.getLogger("stepflow.bench")

NAME = "async_cluster_sim"
REPO = Path(__file__).resolve().parent.parent


@dataclasses.dataclass(frozen=True)
class Calibration:
    """Measured seconds the simulation sleeps (sources in ``source``).

    round_seconds:          G, one searcher round (generation + scoring) of trajectories_per_round
    trajectories_per_round: questions_per_round x samples_per_question of that measurement
    update_seconds:         T, one trainer update (of rows_measured rows on that machine)
    token_seconds:          per generated token, batched generation
    tokens_per_trajectory:  mean tokens of a simulated trajectory (uniform in [tokens/2, 3 tokens/2])
    """

    round_seconds: float = 0.911
    trajectories_per_round: int = 16
    update_seconds: float = 1.024
    token_seconds: float = 2.282 / (64 * 16 * 48)
    tokens_per_trajectory: int = 48
    source: str = (
        "2-core CPU, 2026-11-26: G and T from docs/async.md 'Measured' (make gfn, 4 questions x 4 "
        "trajectories, sync run, updates 3-20, 3 seeds); per token from docs/benchmarks.md "
        "generation_shared_prompt (CPU, 64 prompts x 16 x 48 tokens in 2.282 s)"
    )

    @property
    def trajectory_seconds(self) -> float:
        """Per trajectory besides its tokens, so that a round of mean length costs G."""
        return self.round_seconds / self.trajectories_per_round - self.tokens_per_trajectory * self.token_seconds


CALIBRATION = Calibration()


@dataclasses.dataclass(frozen=True)
class StorePolicy:
    """How the trainer publishes, what the store keeps and draws, and how many rounds a searcher
    samples per published version (the gfn keys of the same names).

    buffer_size: completions kept; None: buffer_batches trainer batches
    """

    name: str
    sync_every: int
    max_staleness: int | None
    recency_fraction: float
    async_priority: str
    buffer_size: int | None = None
    buffer_batches: int = 4
    searcher_rounds_per_version: int | None = None


def config_policy(gfn) -> StorePolicy:
    """The config's own asynchronous settings (what `make gfn gfn.mode=async` would run): replay allowed."""
    return StorePolicy(
        "config",
        gfn.sync_every,
        gfn.max_staleness,
        gfn.recency_fraction,
        gfn.async_priority,
        gfn.buffer_size,
        searcher_rounds_per_version=gfn.searcher_rounds_per_version,
    )


# No replay, as in the project's equal-work measurement (docs/async.md, "Measured"): a publication
# after every update, completions of weights more than one update old dropped, one round per
# searcher per published version, so update t trains the rounds sampled with the weights of update
# t - 1 while the searchers sample the next ones. Without the one-round limit a searcher that ends a
# round before the next publication starts another with the same weights; that round ends after the
# trainer has drawn its batch and is too stale for the next one (docs/benchmarks.md, "Simulated cluster").
NO_REPLAY = StorePolicy(
    "no_replay",
    sync_every=1,
    max_staleness=1,
    recency_fraction=1.0,
    async_priority="uniform",
    searcher_rounds_per_version=1,
)


@dataclasses.dataclass(frozen=True)
class SimSettings:
    """The sweep's shape. questions_per_round x samples_per_question trajectories per searcher round;
    the trainer draws searchers x questions_per_round questions x samples_per_question per update.
    policies: None = the config's asynchronous settings, then NO_REPLAY."""

    searcher_counts: tuple[int, ...] = (1, 2, 4, 8, 16, 32)
    policies: tuple[StorePolicy, ...] | None = None
    questions_per_round: int = 4
    samples_per_question: int = 4
    warmup_updates: int = 2  # not measured: the first rounds of every searcher
    measured_updates: int = 8
    problems: int = 4096
    sweep_payload_parameters: int = 1_000_000  # bf16 weights published every sync_every updates in the sweep
    full_payload_parameters: int = 1_000_000_000  # the 1B-parameter bf16 publication, measured once after the sweep
    placement_timeout: float = 120.0
    draw_timeout: float = 120.0  # a trainer step that cannot get its batch this long fails the run


# ----------------------------------------------------------------------------- the arithmetic


def ideal_rate(
    searchers: int, *, round_seconds: float, trajectories_per_round: int, update_seconds: float, rows_per_update: int
) -> float:
    """Trajectories trained per second with no overhead anywhere: the searchers' generation rate,
    capped by the trainer's.

        ideal(N) = min(N x trajectories_per_round / round_seconds, rows_per_update / update_seconds)
    """
    generation = searchers * trajectories_per_round / round_seconds
    training = rows_per_update / update_seconds
    return min(generation, training)


def percentile(values: list[float], q: float) -> float:
    """The q-th percentile (0-100), linear between the two nearest ranks (numpy's default)."""
    if not values:
        return float("nan")
    ordered = sorted(values)
    position = (len(ordered) - 1) * q / 100
    low, high = math.floor(position), math.ceil(position)
    return ordered[low] + (ordered[high] - ordered[low]) * (position - low)


# ----------------------------------------------------------------------------- the fakes (built inside Ray workers)


class SleepingEngine:
    """The policy a searcher samples with: sleeps the calibrated seconds of a round and returns
    distinct placeholder solutions (3 steps, no final answer); load_weights keeps the version and
    the byte count of what it was sent."""

    def __init__(self, searcher: int, calibration: Calibration, steps: int = 3):
        self.searcher, self.calibration, self.steps = searcher, calibration, steps
        self.version, self.loaded_bytes, self.rounds = -1, 0, 0
        self.rng = random.Random(searcher)

    def load_weights(self, state: dict, version: int) -> None:
        self.loaded_bytes = sum(value.numel() * value.element_size() for value in state.values())
        self.version = version

    def sample(self, prompts, n, temperature, seed):
        c = self.calibration
        low, high = c.tokens_per_trajectory // 2, c.tokens_per_trajectory + c.tokens_per_trajectory // 2
        tokens = [[self.rng.randint(low, high) for _ in range(n)] for _ in prompts]
        time.sleep(sum(c.trajectory_seconds + count * c.token_seconds for row in tokens for count in row))
        self.rounds += 1
        return [
            [
                SampledSolution(
                    steps=[
                        f"searcher {self.searcher} round {self.rounds} prompt {p} sample {j} step {k}"
                        for k in range(self.steps)
                    ],
                    finished=True,
                    num_tokens=tokens[p][j],
                )
                for j in range(n)
            ]
            for p in range(len(prompts))
        ]


class ConstantScorer:
    """The PRM: log U = log 0.9 for every step."""

    def log_scores_many(self, items):
        return [[math.log(0.9)] * len(steps) for _, steps in items]


def make_sampler(index: int, problems: list, *, gfn, calibration: Calibration):
    """Searcher ``index``'s real TrajectorySampler over the sleeping engine (inside its actor)."""

    train = [TrainProblem(p["problem_id"], p["question"], p["question"], p["answer"]) for p in problems]
    engine = SleepingEngine(index, calibration)
    return TrajectorySampler(engine, ConstantScorer(), train, "tiny", searcher_config(gfn, index))


def timed_store_class():
    """TrajectoryStore with the seconds spent inside add, and checking and drawing batches, counted
    (the store's own time, Ray's call overhead excluded), and a restart to an empty buffer between
    sweep points."""

    class TimedTrajectoryStore(TrajectoryStore):
        def __init__(self, buffer_kwargs: dict):
            self.restart(buffer_kwargs)

        def restart(self, buffer_kwargs: dict) -> None:
            TrajectoryStore.__init__(self, buffer_kwargs)
            self.add_seconds = self.sample_seconds = 0.0
            self.sampled_rows = 0
            self.arrivals: dict[int, list[float]] = {}  # weights version -> when each of its rounds arrived

        def add(
            self,
            payload: str,
            searcher: int,
            idle_seconds: float = 0.0,
            loading_seconds: float = 0.0,
            version: int | None = None,
        ) -> int:
            start = time.perf_counter()
            try:
                return super().add(payload, searcher, idle_seconds, loading_seconds, version=version)
            finally:
                self.add_seconds += time.perf_counter() - start
                version = VERSION_FIELD.search(payload)  # a round's trajectories share one version
                if version is not None:
                    self.arrivals.setdefault(int(version.group(1)), []).append(time.monotonic())

        def round_arrivals(self) -> dict[int, list[float]]:
            """Weights version -> the monotonic times (this machine's clock) its rounds reached the store."""
            return self.arrivals

        def pid(self) -> int:
            return os.getpid()

        def can_draw(self, questions, now, max_staleness, minimum) -> bool:
            start = time.perf_counter()
            try:
                return super().can_draw(questions, now, max_staleness, minimum)
            finally:
                self.sample_seconds += time.perf_counter() - start

        def draw(self, questions, latest) -> str:
            start = time.perf_counter()
            try:
                return super().draw(questions, latest)
            finally:
                self.sample_seconds += time.perf_counter() - start
                self.sampled_rows += questions * self.buffer.per_question  # drawn once can_draw holds

        def timings(self) -> dict:
            return {
                **self.stats(),
                "add_seconds": self.add_seconds,
                "sample_seconds": self.sample_seconds,
                "sampled_rows": self.sampled_rows,
            }

    return TimedTrajectoryStore


def reopenable_weights_class():
    """WeightStore whose stop can be lifted: the same searchers serve every sweep point."""

    class ReopenableWeightStore(WeightStore):
        def resume(self) -> None:
            self.stopped = False

        def pid(self) -> int:
            return os.getpid()

    return ReopenableWeightStore


# ----------------------------------------------------------------------------- publication (one entry)


def publisher_for(weights, *, bucket_mb: float = 256.0) -> WeightPublisher:
    """The asynchronous trainer's own publisher (pipeline.finetune.publication.WeightPublisher) with
    the object-store transport: bf16 buckets of ``bucket_mb`` MiB put in Ray's object store once,
    their references handed to the weights actor, from which every searcher fetches at the start of
    its next round. ``publish`` returns once the snapshot is packed and sends it in the background,
    as ``AsyncFinetuneTrainer.publish`` does; the next ``publish`` waits for the previous one."""
    return WeightPublisher(
        transport="object_store", weights=weights, dtype=torch.bfloat16, bucket_bytes=bucket_bytes(bucket_mb)
    )


def publish_weights(weights, searchers: list, state: dict, version: int, *, bucket_mb: float = 256.0) -> dict:
    """One publication waited for (the 1B-parameter measurement): {"seconds", "bytes", "buckets"},
    from the call until the references are handed out (packing included)."""

    publisher = publisher_for(weights, bucket_mb=bucket_mb)
    start = time.monotonic()
    publisher.publish(state, version, searchers)
    publisher.wait()
    seconds = time.monotonic() - start
    (publication,) = publisher.take_finished()
    publisher.close()
    return {"seconds": seconds, "bytes": publication.bytes, "buckets": publication.buckets}


def bf16_state(parameters: int, *, tensor_parameters: int = 64 * 2**20) -> dict:
    """A bf16 state dict of ``parameters`` values (tensors of at most ``tensor_parameters``, ones)."""
    state, left, index = {}, parameters, 0
    while left > 0:
        size = min(left, tensor_parameters)
        state[f"layer{index}.weight"] = torch.ones(size, dtype=torch.bfloat16)
        left, index = left - size, index + 1
    return state


def fetch_seconds(version: int, refs: list, layout: dict) -> dict:
    """One reader's fetch of a published version (a Ray task on this node, through the searchers'
    own WeightReceiver): seconds and bytes."""

    receiver = WeightReceiver("reader")
    start = time.monotonic()
    receiver.fetch(version, refs, layout)
    _, state = receiver.take()
    seconds = time.monotonic() - start
    return {"seconds": seconds, "bytes": sum(v.numel() * v.element_size() for v in state.values())}


VERSION_FIELD = re.compile(r'"policy_version": (\d+)')


def process_cpu_seconds() -> dict[int, tuple[str, float]]:
    """Every process's CPU seconds so far (user + system, all its threads), from /proc (Linux):
    pid -> (name, seconds)."""
    tick = os.sysconf("SC_CLK_TCK")
    seconds = {}
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        try:
            text = Path(entry.path, "stat").read_text()
        except OSError:  # ended meanwhile
            continue
        name, fields = text[text.index("(") + 1 : text.rindex(")")], text[text.rindex(")") + 2 :].split()
        seconds[int(entry.name)] = (name, (int(fields[11]) + int(fields[12])) / tick)
    return seconds


def machine_cpu_ticks() -> tuple[int, int]:
    """(busy, all) clock ticks of every core so far (/proc/stat; idle and iowait are not busy)."""
    values = [int(v) for v in Path("/proc/stat").read_text().splitlines()[0].split()[1:]]
    return sum(values) - values[3] - values[4], sum(values)


def cpu_split(before: dict, after: dict, roles: dict[str, set[int]]) -> dict:
    """CPU seconds spent between two ``process_cpu_seconds`` readings by the processes of each role
    (pids), the rest as "other", with the three busiest other process names."""
    spent = {role: 0.0 for role in roles} | {"other": 0.0}
    others: dict[str, float] = {}
    for pid, (name, seconds) in after.items():
        used = seconds - before.get(pid, (name, 0.0))[1]
        role = next((r for r, pids in roles.items() if pid in pids), "other")
        spent[role] += used
        if role == "other":
            others[name] = others.get(name, 0.0) + used
    spent["other_busiest"] = dict(sorted(others.items(), key=lambda item: -item[1])[:3])
    return spent


# ----------------------------------------------------------------------------- the sweep


def trajectory_identity(trajectory) -> tuple:
    return trajectory.problem_id, tuple(trajectory.steps)


def sampled_by(trajectory) -> int:
    """The searcher whose SleepingEngine wrote the trajectory (its steps begin "searcher i round ...")."""
    return int(trajectory.steps[0].split()[1])


def gfn_section(cfg, settings: SimSettings, searchers: int, policy: StorePolicy | None = None):
    """The gfn section the searchers' samplers and the placement read: the config's, with the
    sweep's round shape, searcher count and the policy's rounds per version (None: no limit)."""
    return dataclasses.replace(
        cfg.gfn,
        questions_per_step=settings.questions_per_round,
        samples_per_question=settings.samples_per_question,
        searchers=searchers,
        searcher_gpus=0.0,
        searcher_rounds_per_version=policy.searcher_rounds_per_version if policy else None,
        min_steps=1,
        placement_timeout=settings.placement_timeout,
    )


def problems_json(count: int) -> list[dict]:
    return [{"problem_id": f"q{i}", "question": f"question {i}", "answer": "1"} for i in range(count)]


def train_point(
    *,
    searchers: int,
    policy: StorePolicy,
    store,
    weights,
    actors: list,
    settings: SimSettings,
    calibration: Calibration,
    first_step: int,
    sweep_state: dict,
    pids: dict[str, set[int]] | None = None,
) -> dict:
    """One sweep point: ``searchers`` searchers run while the fake trainer trains warmup +
    measured updates under ``policy``. Returns the point's measurements and the next free step.
    pids: role -> process ids ("searchers" of all started searchers, "store", "weights"), for the
    CPU time each role spends in the measured window (this process is the trainer)."""
    import ray  # the optional extra (extra `distributed`)

    questions, used = searchers * settings.questions_per_round, settings.samples_per_question
    rows_per_update = questions * used
    capacity = policy.buffer_size or policy.buffer_batches * rows_per_update
    if capacity < rows_per_update:
        raise ValueError(
            f"async_cluster_sim: policy {policy.name}: buffer_size = {capacity} is below one batch "
            f"({questions} questions x {used}) at {searchers} searchers"
        )
    buffer = {
        "capacity": capacity,
        "per_question": used,
        "priority": policy.async_priority,
        "temperature": 1.0,
        "recency": policy.recency_fraction,
        "seed": searchers,
    }
    ray.get(store.restart.remote(buffer))
    ray.get(weights.resume.remote())
    step = published = first_step
    publisher = publisher_for(weights)
    publisher.publish(sweep_state, step, actors[:searchers])  # what the searchers start from
    runs = [actor.run.remote() for actor in actors[:searchers]]
    trained: set = set()
    window_rows, staleness, waits, window_publications = 0, [], [], []
    # the trainer's seconds per measured update (update, its part of publishing, reading its batch); version -> when published
    updating, publishing, parsing, publish_started = [], [], [], {}
    roles = {**(pids or {}), "trainer": {os.getpid()}}
    fresh_in_window = recent_groups = shared_groups = 0
    window_start = stats_start = None
    updates = settings.warmup_updates + settings.measured_updates
    request = None  # the store request for the next update's batch
    try:
        for update in range(updates):
            if update == settings.warmup_updates:
                window_start, stats_start = time.monotonic(), ray.get(store.timings.remote())
                cpu_start, ticks_start = process_cpu_seconds(), machine_cpu_ticks()
            measured = update >= settings.warmup_updates
            waited, deadline = time.monotonic(), time.monotonic() + settings.draw_timeout
            if request is None or request.conditions != (questions, published, step, policy.max_staleness, 0):
                request = BatchRequest(store, (questions, published, step, policy.max_staleness, 0))
            while True:
                # the real trainer's wait (AsyncFinetuneTrainer.draw_once): the batch as soon as the store
                # holds it, asked for as the previous update started
                answer = request.result(WAIT_SECONDS)
                if answer is not None:
                    break
                ready, _ = ray.wait(runs, num_returns=len(runs), timeout=0)
                for ref in ready:
                    ray.get(ref)  # a searcher's loop ends early only with an error: raised here
                if time.monotonic() > deadline:
                    raise RuntimeError(
                        f"async_cluster_sim: {searchers} searchers: step {step} got no batch of "
                        f"{questions} questions x {used} within {settings.draw_timeout:g} s; store: "
                        f"{ray.get(store.stats.remote())}"
                    )
            _, groups, recent = answer
            parsed = request.read_seconds  # the reading of the batch (json, records checked), in the request's thread
            request = None
            if update + 1 < updates:  # the next batch asked for as the update starts (AsyncFinetuneTrainer.prefetch)
                following = (questions, published_after(step, published, policy.sync_every), step + 1)
                request = BatchRequest(store, (*following, policy.max_staleness, 0))
            batch = [trajectory for group in groups for trajectory in group]
            # a question's group with completions of two searchers: their question cycles met
            shared_groups += sum(len({sampled_by(t) for t in group}) > 1 for group in groups)
            wait = time.monotonic() - waited
            started = time.monotonic()
            time.sleep(calibration.update_seconds)  # the update
            updated = time.monotonic() - started
            new = 0
            for trajectory in batch:
                identity = trajectory_identity(trajectory)
                new += identity not in trained
                trained.add(identity)
            if measured:
                window_rows += len(batch)
                fresh_in_window += new
                recent_groups += recent
                staleness += [step - t.policy_version for t in batch]
                waits.append(wait)
                parsing.append(parsed)
                updating.append(updated)
            step += 1
            if step % policy.sync_every == 0:
                # the real trainer's publication (AsyncFinetuneTrainer.publish): packed here, sent in the
                # background while the next update waits for its batch and trains
                started = time.monotonic()
                publisher.publish(sweep_state, step, actors[:searchers])
                publish_started[step] = started
                published = step
                if measured:
                    publishing.append(time.monotonic() - started)
            if measured:
                window_publications += publisher.take_finished()
        window_seconds = time.monotonic() - window_start
        stats_end = ray.get(store.timings.remote())
        cpu_end, ticks_end = process_cpu_seconds(), machine_cpu_ticks()
    finally:
        if request is not None:
            request.close()
        publisher.close()  # the running publication ends first
        ray.get(weights.stop.remote())
        rounds = ray.get(runs, timeout=settings.draw_timeout)
    # when each version measured reached the searchers (references handed out), and when its last round reached the store
    arrivals = ray.get(store.round_arrivals.remote())
    lags = [
        max(arrivals[p.version]) - (publish_started[p.version] + p.seconds)
        for p in window_publications
        if p.version in publish_started and len(arrivals.get(p.version, [])) >= searchers
    ]
    cpu = cpu_split(cpu_start, cpu_end, roles)
    measured_rounds = (stats_end["added"] - stats_start["added"]) / (
        settings.questions_per_round * settings.samples_per_question
    )
    final = ray.get(store.timings.remote())
    added = stats_end["added"] - stats_start["added"]
    sampled = stats_end["sampled_rows"] - stats_start["sampled_rows"]
    add_s = stats_end["add_seconds"] - stats_start["add_seconds"]
    sample_s = stats_end["sample_seconds"] - stats_start["sample_seconds"]
    ideal = ideal_rate(
        searchers,
        round_seconds=calibration.round_seconds,
        trajectories_per_round=calibration.trajectories_per_round,
        update_seconds=calibration.update_seconds,
        rows_per_update=rows_per_update,
    )
    trained_per_s = fresh_in_window / window_seconds
    point = {
        "policy": policy.name,
        "searchers": searchers,
        "rows_per_update": rows_per_update,
        "window_seconds": window_seconds,
        "trained_per_s": trained_per_s,
        "rows_trained_per_s": window_rows / window_seconds,
        "rows_trained_of_ideal": window_rows / window_seconds / ideal,
        # groups the store took from completions of the newest published weights (the recency share m)
        "recent_group_fraction": recent_groups / (settings.measured_updates * questions),
        "ideal_per_s": ideal,
        "fraction_of_ideal": trained_per_s / ideal,
        "generated_per_s": added / window_seconds,
        "staleness_p50": percentile(staleness, 50),
        "staleness_p90": percentile(staleness, 90),
        "staleness_max": max(staleness) if staleness else None,
        "staleness_histogram": {str(v): staleness.count(v) for v in sorted(set(staleness))},
        "trainer_wait_per_update_s": sum(waits) / max(len(waits), 1),
        "store_ingest_per_s": added / window_seconds,
        "store_ingest_capacity_per_s": added / add_s if add_s > 0 else None,
        "store_sample_per_s": sampled / window_seconds,
        "store_sample_capacity_per_s": sampled / sample_s if sample_s > 0 else None,
        "store_busy_fraction": (add_s + sample_s) / window_seconds,
        "publish_seconds": sum(p.seconds for p in window_publications) / max(len(window_publications), 1),
        "publish_bytes": window_publications[0].bytes if window_publications else None,
        # the trainer's wall time per measured update: waiting for its batch, the update, its own part
        # of a publication (packing; waiting for the previous one), the rest (the simulation's counting)
        "trainer_update_per_update_s": sum(updating) / max(len(updating), 1),
        # the batch's reading (JSON, records built and checked) in the request's thread, and the
        # store's own time checking and drawing (per update): both run while the previous update does,
        # the trainer waits only for what is left of them when it ends
        "trainer_parse_per_update_s": sum(parsing) / max(len(parsing), 1),
        "store_draw_per_update_s": sample_s / settings.measured_updates,
        "trainer_publish_per_update_s": sum(publishing) / max(len(updating), 1),
        "trainer_other_per_update_s": (window_seconds - sum(waits) - sum(updating) - sum(publishing))
        / max(len(updating), 1),
        # a version's last round at the store, seconds after its references were handed out (one
        # round of G with no overhead: G); p50 and max over the measured versions
        "last_round_after_publication_p50_s": percentile(lags, 50),
        "last_round_after_publication_max_s": max(lags) if lags else None,
        # CPU seconds per measured update of each role's processes (all their threads); other: Ray's
        # own processes (raylet, GCS, idle workers) and the rest of the machine; busy: the machine's
        # cores busy over the window (1.0: every core all the time)
        "cpu_per_update_s": {
            role: value / settings.measured_updates
            if isinstance(value, float)
            else {name: seconds / settings.measured_updates for name, seconds in value.items()}
            for role, value in cpu.items()
        },
        "cpu_per_searcher_round_s": cpu.get("searchers", 0.0) / measured_rounds if measured_rounds else None,
        "machine_busy_fraction": (ticks_end[0] - ticks_start[0]) / max(ticks_end[1] - ticks_start[1], 1),
        # the whole point (warm-up included): what the searchers sent, what the trainer trained
        "rounds": sum(rounds),
        "added": final["added"],
        "per_searcher": final["per_searcher"],
        "trained_distinct": len(trained),
        "trained_rows": updates * rows_per_update,
        "shared_question_groups": shared_groups,
        "searcher_rate_of_calibrated": (added / window_seconds)
        / (searchers * calibration.trajectories_per_round / calibration.round_seconds),
        "next_step": step,
    }
    return point


def full_publication(weights, searchers: list, state: dict, version: int) -> dict:
    """The 1B-parameter bf16 payload published with the searchers stopped (each would fetch a copy, and
    N copies of 2 GB do not fit one machine; the object-store transport puts it once whatever N),
    then fetched by one reader."""
    import ray  # the optional extra (extra `distributed`)

    publication = publish_weights(weights, searchers, state, version)
    published, refs, layout, _ = ray.get(weights.latest.remote(-1))
    fetched = ray.get(ray.remote(num_cpus=0)(fetch_seconds).remote(published, refs, layout))
    ray.get(weights.publish.remote(version, None, None))  # drop the 2 GB object before the next point
    return {
        "full_publish_seconds": publication["seconds"],
        "full_publish_bytes": publication["bytes"],
        "full_fetch_seconds": fetched["seconds"],
    }


def start_searchers(gfn, group, names: dict, calibration: Calibration) -> tuple[list, list, set[int]]:
    """gfn.searchers Searcher actors, searcher i in bundle 1 + i of the run's placement group, each
    sampling its share of the problems: (the actors, each one's bundles as Ray reports them, their process ids)."""
    import ray  # the optional extra (extra `distributed`)

    factory = functools.partial(make_sampler, gfn=gfn, calibration=calibration)
    searcher = ray.remote(num_cpus=1, max_restarts=0, max_concurrency=2)(Searcher)
    actors = [
        searcher.options(scheduling_strategy=ray_cluster.searcher_strategy(group, i)).remote(
            i, factory, names, None, searchers=gfn.searchers
        )
        for i in range(gfn.searchers)
    ]
    statuses = ray.get([actor.status.remote() for actor in actors], timeout=600)
    return actors, [status["placement"]["bundles"] for status in statuses], {status["pid"] for status in statuses}


def sweep(
    cfg, *, settings: SimSettings = SimSettings(), calibration: Calibration = CALIBRATION, full_payload: bool = True
) -> dict:
    """Start a local Ray instance, the run's actors and max(searcher_counts) searchers in the
    run's placement group, run every sweep point, shut Ray down."""
    import ray  # the optional extra (extra `distributed`)

    most = max(settings.searcher_counts)
    gfn = gfn_section(cfg, settings, most)
    started = time.monotonic()
    path = os.pathsep.join([str(REPO), *filter(None, [os.environ.get("PYTHONPATH")])])
    # Ray's CPU resource is logical: one per searcher bundle, as ray_cluster.bundles asks; the
    # searchers sleep, so more bundles than cores is what the simulation is for
    ray.init(
        num_cpus=most,
        include_dashboard=False,
        log_to_driver=False,
        namespace=f"{NAME}-{os.getpid()}",
        runtime_env={
            "env_vars": {
                "PYTHONPATH": path,
                "OMP_NUM_THREADS": "1",
                "MKL_NUM_THREADS": "1",
                "TOKENIZERS_PARALLELISM": "false",
            }
        },
    )
    try:
        names = {"store": "store", "weights": "weights"}
        store = (
            ray.remote(num_cpus=0)(timed_store_class())
            .options(name=names["store"])
            .remote(
                {"capacity": 1, "per_question": 1, "priority": "uniform", "temperature": 1.0, "recency": 0.0, "seed": 0}
            )
        )
        problems_ref = ray.put(problems_json(settings.problems))
        weights_actor = ray.remote(num_cpus=0)(reopenable_weights_class())
        weights = weights_actor.options(name=names["weights"]).remote([problems_ref])
        group, _ = ray_cluster.reserve(gfn, 0, settings.placement_timeout, "the local Ray instance")
        sweep_state = bf16_state(settings.sweep_payload_parameters)
        points, step, starts, bundles, actors, startup = [], 0, [], None, [], None
        for policy in settings.policies or (config_policy(cfg.gfn), NO_REPLAY):
            # each policy's own searchers: how many rounds they sample per version is their setting
            for actor in actors:
                ray.kill(actor)
            start = time.monotonic()
            actors, placed, searcher_pids = start_searchers(
                gfn_section(cfg, settings, most, policy), group, names, calibration
            )
            pids = {
                "searchers": searcher_pids,
                "store": {ray.get(store.pid.remote())},
                "weights": {ray.get(weights.pid.remote())},
            }
            bundles = bundles or placed
            starts.append(time.monotonic() - start)
            startup = startup or time.monotonic() - started  # Ray and the first searchers
            log.info("%s: %s: %d searchers started in %.1f s", NAME, policy.name, most, starts[-1])
            for count in settings.searcher_counts:
                point = train_point(
                    searchers=count,
                    policy=policy,
                    store=store,
                    weights=weights,
                    actors=actors,
                    settings=settings,
                    calibration=calibration,
                    first_step=step,
                    sweep_state=sweep_state,
                    pids=pids,
                )
                step = point["next_step"]
                points.append(point)
                log.info(
                    "%s: %s N=%d trained %.1f/s of ideal %.1f/s (%.2f); staleness p50 %.1f p90 %.1f; store busy %.3f",
                    NAME,
                    policy.name,
                    count,
                    point["trained_per_s"],
                    point["ideal_per_s"],
                    point["fraction_of_ideal"],
                    point["staleness_p50"],
                    point["staleness_p90"],
                    point["store_busy_fraction"],
                )
        full = None
        if full_payload:
            full = full_publication(weights, actors, bf16_state(settings.full_payload_parameters), step)
            log.info("%s: 1B-parameter bf16 publication %s", NAME, full)
        return {
            "points": points,
            "full_publication": full,
            "startup_seconds": startup,
            "searcher_start_seconds": starts,
            "searcher_bundles": bundles,
            "total_seconds": time.monotonic() - started,
        }
    finally:
        ray.shutdown()


def by_policy(points: list[dict]) -> dict[str, list[dict]]:
    groups: dict[str, list[dict]] = {}
    for point in points:
        groups.setdefault(point["policy"], []).append(point)
    return groups


def plot(result: dict, path: Path) -> Path:
    """Per store policy: trained trajectories per second and the ideal against N (log-log); the
    fraction of the ideal and the store's busy fraction beside it."""

    fig = Figure(figsize=(11, 4.2))
    left, right = fig.subplots(1, 2)
    groups = by_policy(result["points"])
    first = next(iter(groups.values()))
    n = [p["searchers"] for p in first]
    left.plot(n, [p["ideal_per_s"] for p in first], "k--", label="ideal min(N x 16 / G, 16 N / T)")
    left.plot(
        n, [p["store_ingest_per_s"] for p in first], "s:", color="grey", label=f"store ingest ({first[0]['policy']})"
    )
    for (name, points), marker, color in zip(groups.items(), "o^v", ("tab:blue", "tab:orange", "tab:green")):
        n = [p["searchers"] for p in points]
        left.plot(
            n,
            [p["trained_per_s"] for p in points],
            marker + "-",
            color=color,
            label=f"fresh trained (first time), {name}",
        )
        right.plot(
            n,
            [p["fraction_of_ideal"] for p in points],
            marker + "-",
            color=color,
            label=f"fresh trained / ideal, {name}",
        )
        right.plot(
            n,
            [p["rows_trained_of_ideal"] for p in points],
            marker + "--",
            color=color,
            alpha=0.6,
            label=f"rows trained (replays too) / ideal, {name}",
        )
        right.plot(
            n,
            [p["store_busy_fraction"] for p in points],
            marker + ":",
            color=color,
            alpha=0.6,
            label=f"store busy fraction, {name}",
        )
    left.set_xscale("log", base=2)
    left.set_yscale("log")
    left.set_xlabel("searchers N")
    left.set_ylabel("trajectories / s")
    left.legend(fontsize=7)
    left.set_title("async_cluster_sim (simulated engine and update)", fontsize=9)
    right.axhline(0.9, color="grey", linewidth=0.8, linestyle="--", label="goal 0.9")
    right.set_xscale("log", base=2)
    right.set_ylim(0, 1.1)
    right.set_xlabel("searchers N")
    right.legend(fontsize=7)
    right.set_title(result.get("machine", ""), fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    return path


def markdown_table(row: dict) -> str:
    """The docs/benchmarks.md table of a row: one line per store policy and N."""
    header = (
        "| policy | N | fresh trained traj/s | ideal | fresh trained / ideal | rows trained / ideal | "
        "searchers' rate / calibrated | staleness p50 / p90 (max) | trainer wait per update (s) | "
        "groups mixing searchers | store ingest /s (capacity) | "
        "store sample rows/s (capacity) | store busy | "
        "publication s (sweep payload) |"
    )
    lines = [header, "|" + "---|" * 14]
    for p in row["points"]:
        cells = [
            p["policy"],
            p["searchers"],
            f"{p['trained_per_s']:.1f}",
            f"{p['ideal_per_s']:.1f}",
            f"{p['fraction_of_ideal']:.2f}",
            f"{p['rows_trained_of_ideal']:.2f}",
            f"{p['searcher_rate_of_calibrated']:.2f}",
            f"{p['staleness_p50']:g} / {p['staleness_p90']:g} ({p['staleness_max']})",
            f"{p['trainer_wait_per_update_s']:.3f}",
            p["shared_question_groups"],
            f"{p['store_ingest_per_s']:.0f} ({p['store_ingest_capacity_per_s']:.0f})",
            f"{p['store_sample_per_s']:.0f} ({p['store_sample_capacity_per_s']:.0f})",
            f"{p['store_busy_fraction']:.3f}",
            f"{p['publish_seconds']:.3f}",
        ]
        lines.append("| " + " | ".join(str(cell) for cell in cells) + " |")
    return "\n".join(lines)


def breakdown_table(row: dict) -> str:
    """The docs/benchmarks.md table of where the time goes, per store policy and N: the trainer's
    wall seconds per update, each role's CPU seconds per update, the machine's busy share."""
    header = (
        "| policy | N | trainer wait (s) | store's check + draw (s) | reading the batch, request's thread (s) | "
        "update (s) | publishing, trainer's part (s) | last round after publication p50 / max (s) | "
        "CPU s per update: searchers / store / weights / trainer / other | machine busy |"
    )
    lines = [header, "|" + "---|" * 10]
    for p in row["points"]:
        cpu = p["cpu_per_update_s"]
        cells = [
            p["policy"],
            p["searchers"],
            f"{p['trainer_wait_per_update_s']:.3f}",
            f"{p['store_draw_per_update_s']:.3f}",
            f"{p['trainer_parse_per_update_s']:.3f}",
            f"{p['trainer_update_per_update_s']:.3f}",
            f"{p['trainer_publish_per_update_s']:.3f}",
            f"{p['last_round_after_publication_p50_s']:.3f} / {p['last_round_after_publication_max_s'] or math.nan:.3f}",
            " / ".join(f"{cpu[role]:.3f}" for role in ("searchers", "store", "weights", "trainer", "other")),
            f"{p['machine_busy_fraction']:.2f}",
        ]
        lines.append("| " + " | ".join(str(cell) for cell in cells) + " |")
    return "\n".join(lines)


def run(cfg, out_dir: Path) -> dict:
    """The benchmark row (make bench): the sweep at the default settings and calibration."""
    return measure(cfg, out_dir)


def measure(
    cfg,
    out_dir: Path,
    *,
    settings: SimSettings = SimSettings(),
    calibration: Calibration = CALIBRATION,
    full_payload: bool = True,
) -> dict:
    """The row at the given settings: writes out_dir/async_cluster_sim.json and .png; returns the row."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    result = sweep(cfg, settings=settings, calibration=calibration, full_payload=full_payload)
    groups = by_policy(result["points"])
    worst = {name: min(p["fraction_of_ideal"] for p in points) for name, points in groups.items()}
    worst_rows = {name: min(p["rows_trained_of_ideal"] for p in points) for name, points in groups.items()}
    # the headline: fresh trajectories trained / ideal at the worst N, without replay when that policy
    # ran (every row trained once: what the searchers generate reaches the trainer); with replay the
    # fresh share of a batch is bounded by design and rows trained / ideal says whether the trainer is fed
    headline = NO_REPLAY.name if NO_REPLAY.name in worst else next(iter(worst))
    row = {
        "name": NAME,
        "fraction_of_ideal": worst[headline],
        "headline_policy": headline,
        "fraction_of_ideal_by_policy": worst,
        "rows_trained_of_ideal_by_policy": worst_rows,
        "goal": ">= 0.9 of ideal at every N up to 32; the store never the bottleneck",
        "machine": machine_description(),
        "calibration": dataclasses.asdict(calibration),
        "settings": dataclasses.asdict(settings),
        **result,
    }
    (out_dir / f"{NAME}.json").write_text(json.dumps(row, indent=1) + "\n")
    plot(row, out_dir / f"{NAME}.png")
    return row


def main(argv: list[str] | None = None) -> dict:
    """``--config FILE key=value ...`` (stages.common.parse_args); ``--docs-image`` copies the plot
    to docs/img/async_cluster_sim.png."""

    argv = list(sys.argv[1:] if argv is None else argv)
    docs_image = "--docs-image" in argv
    config = parse_args("bench", [a for a in argv if a != "--docs-image"])
    out_dir = config.run_dir / "bench"
    row = run(config, out_dir)
    if docs_image:
        shutil.copyfile(out_dir / f"{NAME}.png", REPO / "docs" / "img" / f"{NAME}.png")
    print(markdown_table(row))
    print(breakdown_table(row))
    summary = ("name", "fraction_of_ideal", "headline_policy", "rows_trained_of_ideal_by_policy", "machine")
    print(json.dumps({key: row[key] for key in (*summary, "full_publication")}))
    return row


if __name__ == "__main__":
    main()
