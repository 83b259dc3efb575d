"""The gfn section's settings of the asynchronous mode (gfn.mode=async; TBA, Bartoldson et al.;
docs/async.md): the searcher actors on Ray, the trajectory buffer they fill, the weights the
trainer publishes to them, their cores, GPUs and PRM scorer actors.

``GFNConfig`` (pipeline.config.schema) takes these fields by inheritance, so they stay keys of the
gfn section (``gfn.searchers``, ``gfn.ray_address``, ...). The checks of the ones that only make
sense together run before Ray starts (pipeline.finetune.tba.settings).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from pipeline.config.rules import bounded

WeightTransport = Literal["object_store", "collective"]  # gfn.weight_transport (finetune/tba/weight_transport.py)
AsyncPriority = Literal["softmax", "uniform"]  # gfn.async_priority (pipeline/finetune/tba/grouped_replay.py)


@dataclass
class AsyncSettings:
    """The asynchronous mode's fields of the gfn section (docs/async.md)."""

    # asynchronous mode (mode=async; TBA, Bartoldson et al.; docs/async.md): searcher actors sample questions_per_step
    # questions x samples_per_question (S) completions each round with the newest published weights, into one buffer
    # (buffer_per_question completions per question, its newest, and buffer_size in all, FIFO); each trainer step draws
    # async_questions (B) questions x async_samples_used (K) distinct completions, a question's group from the newest
    # weights' completions with probability recency_fraction (m). Refused before Ray starts unless the buffer can hold a
    # batch: buffer_size >= (B - 1) x buffer_per_question + K, and B distinct training problems (docs/async.md, "The buffer")
    searchers: int = bounded(2, ge=1)  # searcher actors
    sync_every: int = bounded(1, ge=1)  # trainer steps between weight publications (TBA's k)
    async_questions: int | None = bounded(None, ge=1)  # B, questions per trainer step (None: questions_per_step)
    async_samples_used: int | None = bounded(
        None, ge=1
    )  # K <= S, distinct completions per question in a batch (None: S)
    async_initial_completions: int = bounded(
        0, ge=0
    )  # the first step waits until the buffer holds this many (paper: 500)
    # how a question's K completions are drawn: uniform (TBA's Table 2; inverse temperature 0 in its code) | softmax
    # (p ~ exp(priority / buffer_temperature), priority = the trained reward without the prior; docs/async.md says why not)
    async_priority: AsyncPriority = "uniform"
    # most completions the buffer keeps per question, its newest (TBA: max_capacity_per_query = 100); None: S, the
    # completions of the question's newest round, so that buffer_size >= (B - 1) x S + K holds a batch (docs/async.md)
    buffer_per_question: int | None = bounded(None, ge=1)
    searcher_rounds_per_version: int | None = bounded(
        None, ge=1
    )  # rounds a searcher samples per published version (None: no limit)
    max_staleness: int | None = bounded(
        16, ge=0
    )  # completions sampled by weights more than this many trainer steps old are dropped (None: kept)
    ray_address: str | None = None  # None: start a local Ray instance; "auto" or host:port: join that cluster
    ray_connect_timeout: float = bounded(30.0, gt=0)  # seconds to wait for the cluster at ray_address to answer
    searcher_max_restarts: int = bounded(
        10, ge=0
    )  # Ray restarts a dead searcher this many times; one more death stops the run
    searcher_gpus: float = bounded(0.0, ge=0)  # GPUs per searcher actor (0 on CPU; e.g. 1 with one GPU per searcher)
    # each searcher's vLLM engine's share of its GPU (vLLM's gpu_memory_utilization; generation.vllm_gpu_memory_utilization is
    # the other stages' engines'); None: derived at the stage's start from what shares a searcher's GPU (the PRM unless scorer
    # actors hold it, other searchers' engines with searcher_gpus < 1), or a set share checked against it: refused with the arithmetic
    searcher_vllm_memory_share: float | None = bounded(None, gt=0, le=1)
    # PRM scorer actors: 0: every searcher holds the PRM and scores its own rounds; N > 0: N Ray actors hold it, each in its own
    # placement-group bundle (1 CPU, scorer_gpus GPUs), searchers send each round's steps to them in turn and load no PRM
    scorer_actors: int = bounded(0, ge=0)
    scorer_gpus: float = bounded(0.0, ge=0)  # GPUs per scorer actor (0: on CPU)
    placement_timeout: float = bounded(
        60.0, gt=0
    )  # seconds to wait for Ray to place the trainer's and searchers' bundles
    # CPU cores searcher i pins its process to (os.sched_setaffinity): searcher_cores[i % len]; None: wherever the OS runs it
    searcher_cores: list[int] | None = bounded(None, ge=0)
    # how the trainer publishes its weights (docs/async.md, "Weight publication"): object_store (one Ray object per bucket, read
    # by every searcher) | collective (one NCCL group of the trainer and every GPU searcher, gloo on CPU; one broadcast per bucket)
    weight_transport: WeightTransport = "object_store"
    publish_bucket_mb: float = bounded(
        256.0, gt=0
    )  # MiB per bucket of published weights (flattened, in the sampler's dtype)
