"""The asynchronous mode's GPUs: the searchers' (1 / gfn.searcher_gpus of them a device, each with
its own vLLM engine or HF copy of the policy) and the PRM scorer actors', with the tightest mix Ray
could pack checked."""

from __future__ import annotations

import math

from pipeline.sizing.shapes import ModelShape
from planner.memory import (
    RUNTIME_RESERVE,
    SEARCHER_SHARE_KEY,
    VLLM_SHARE_ITEM,
    check_memory,
    half_bytes,
    sampler_memory,
)
from planner.plan import GIB, Model, Plan, StageCost


def searchers_per_device(cfg) -> int:
    """Asynchronous searchers that share one GPU: 1 / gfn.searcher_gpus of them (Ray packs
    fractional GPUs onto one device)."""
    return max(1, math.floor(1 / cfg.searcher_gpus + 1e-9)) if cfg.searcher_gpus else 1


def scorers_beside(cfg, searchers: int) -> int:
    """Scorer actors Ray could pack on a GPU beside ``searchers`` searchers: as many as the GPU's
    fraction left by the searchers' gfn.searcher_gpus holds at gfn.scorer_gpus each (at most gfn.scorer_actors)."""
    if not (cfg.scorer_actors and cfg.scorer_gpus):
        return 0
    left = 1 - searchers * cfg.searcher_gpus
    return max(0, min(cfg.scorer_actors, math.floor(left / cfg.scorer_gpus + 1e-9)))


def _searcher_device(
    plan: Plan, stage: str, policy: ModelShape, prm: ModelShape | None, searchers: int, scorers: int
) -> StageCost:
    """One GPU holding ``searchers`` searchers and ``scorers`` scorer actors: its memory items."""
    config, cfg = plan.config, plan.config.finetune_section(stage)
    cost = StageCost(f"{stage} searchers", cfg.searchers)
    cost.share_key = SEARCHER_SHARE_KEY
    tokens = config.plan.prompt_tokens + config.generation.max_new_tokens
    prm_bytes = half_bytes(config) * prm.parameters(lm_head=False) if prm is not None else 0
    if not cfg.scorer_actors:
        cost.memory[f"frozen PRM x {searchers}"] = searchers * prm_bytes
    if scorers:
        cost.memory[f"frozen PRM of {scorers} scorer actor{'s' if scorers > 1 else ''} packed beside them"] = (
            scorers * prm_bytes
        )
    if searchers + scorers > 1:  # each actor is a process of its own; check_memory counts one
        cost.memory[f"CUDA contexts of {searchers + scorers - 1} more processes (assumed)"] = (
            searchers + scorers - 1
        ) * RUNTIME_RESERVE
    sequences = cfg.questions_per_step * cfg.samples_per_question
    if config.generation.backend == "vllm":  # the engine holds the weights: no transformers copy
        sampler_memory(plan, cost, policy, sequences, tokens, with_weights=True, engines=searchers)
    else:  # HF generate on each searcher's copy of the policy
        cost.memory[f"policy copies x {searchers}"] = searchers * half_bytes(config) * policy.parameters()
        cost.memory[f"KV caches ({sequences} x {tokens} tokens) x {searchers}"] = (
            searchers * sequences * tokens * policy.kv_cache_bytes_per_token(half_bytes(config))
        )
    return cost


def searcher_stage(plan: Plan, stage: str, policy: Model, prm: Model) -> StageCost:
    """The asynchronous searchers' memory on their GPU: each samples with its own vLLM engine
    (gfn.searcher_vllm_memory_share of the device, derived when unset; no transformers copy) or HF
    generate on a copy of the policy, and holds the PRM unless scorer actors do (gfn.scorer_actors);
    no reference (the trainer holds it). 1 / gfn.searcher_gpus of them share a device, and scorer
    actors with a fractional gfn.scorer_gpus may be packed beside them: of every mix Ray could make
    (1 to 1 / searcher_gpus searchers, as many scorer actors as the rest holds) the tightest is
    checked and shown. The trainer's own GPU is the stage's entry before this one."""
    cfg = plan.config.finetune_section(stage)
    engines = searchers_per_device(cfg)
    work = (
        f"gfn.searchers={cfg.searchers}, {engines} per GPU (gfn.searcher_gpus={cfg.searcher_gpus:g}), each sampling "
        f"{cfg.questions_per_step} questions x {cfg.samples_per_question} a round"
    )
    notes = (
        [f"gfn.scorer_actors={cfg.scorer_actors}: the PRM is in the scorer actors, not in the searchers"]
        if cfg.scorer_actors
        else []
    )
    if not cfg.searcher_gpus:
        return StageCost(
            f"{stage} searchers",
            cfg.searchers,
            work=[work],
            share_key=SEARCHER_SHARE_KEY,
            notes=notes + ["gfn.searcher_gpus=0: the searchers run on CPUs; no GPU memory"],
        )
    if policy.shape is None or (prm.shape is None and not cfg.scorer_actors):
        return StageCost(f"{stage} searchers", cfg.searchers, work=[work], notes=notes, share_key=SEARCHER_SHARE_KEY)
    device = plan.gpu.memory_gib * GIB
    mixes = [
        _searcher_device(plan, stage, policy.shape, prm.shape, n, scorers_beside(cfg, n)) for n in range(engines, 0, -1)
    ]

    def room(
        mix: StageCost,
    ) -> float:  # what each engine (or, with HF, the device) has left beside the mix's other items
        held = sum(v for k, v in mix.memory.items() if k != VLLM_SHARE_ITEM)
        return (device - held) / (mix.engines if mix.engine_needs else 1)

    cost = min(mixes, key=room)  # the first of equals: the most searchers
    cost.work.append(work)
    cost.notes += notes
    if len(mixes) > 1 and cost is not mixes[0]:
        cost.notes.append(f"the tightest GPU Ray could pack: {cost.engines} searcher(s) beside scorer actors")
    check_memory(plan, cost, SEARCHER_SHARE_KEY if cost.engine_needs else "gfn.searcher_gpus")
    return cost


def scorer_stage(plan: Plan, stage: str, prm: Model) -> StageCost:
    """The PRM scorer actors' memory on their GPU (gfn.scorer_actors > 0): 1 / gfn.scorer_gpus of
    them share a device, each holding the PRM (a GPU shared with searchers: searcher_stage)."""
    config, cfg = plan.config, plan.config.finetune_section(stage)
    per_device = min(cfg.scorer_actors, max(1, math.floor(1 / cfg.scorer_gpus + 1e-9))) if cfg.scorer_gpus else 1
    cost = StageCost(f"{stage} scorers", cfg.scorer_actors)
    cost.work.append(
        f"gfn.scorer_actors={cfg.scorer_actors}, {per_device} per GPU (gfn.scorer_gpus={cfg.scorer_gpus:g}), each "
        "scoring the rounds searchers send it"
    )
    if not cfg.scorer_gpus:
        cost.notes.append("gfn.scorer_gpus=0: the scorer actors run on CPUs; no GPU memory")
        return cost
    if prm.shape is None:
        return cost
    cost.memory[f"frozen PRM x {per_device}"] = per_device * half_bytes(config) * prm.shape.parameters(lm_head=False)
    if per_device > 1:
        cost.memory[f"CUDA contexts of {per_device - 1} more scorer actors (assumed)"] = (
            per_device - 1
        ) * RUNTIME_RESERVE
    check_memory(plan, cost, "gfn.scorer_gpus")
    return cost
