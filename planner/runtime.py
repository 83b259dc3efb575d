"""A stage's memory at its start: make plan's estimate of the stage on the GPU it runs on, under the
running launch, refused when the device cannot hold it, and the vLLM share it derives or checks."""

from __future__ import annotations

import copy

from pipeline.config.loader import ConfigError
from pipeline.config.schema import FINETUNE_STAGES, Config
from planner.costs import eval_stage, finetune_stage, generation_stage, prm_stage, search_stage
from planner.launch import launch_from_environment
from planner.memory import SEARCHER_SHARE_KEY, VLLM_SHARE_KEY
from planner.plan import GIB, GPU, Data, Plan
from planner.resolve import resolve_model, resolve_models
from planner.searchers import scorer_stage, searcher_stage

# stages.<name> -> the plan's stage whose memory estimate the stage checks on its GPU before any model
# loads (None: a vLLM engine of its own only, sized alone on the device)
MEMORY_STAGES = {
    "mcts": "mcts",
    "evaluate": "eval",
    "search": "search",
    "train_gfn": "gfn",
    "train_ppo": "ppo",
    "train_prm": "prm",
    "bootstrap": None,
    "prm_bench": None,
}


def share_key(config: Config, stage: str) -> str:
    """The key of the vLLM share a stage (stages.<name>) derives or checks at its start: the
    asynchronous searchers' own (SEARCHER_SHARE_KEY) for make gfn in mode async, else VLLM_SHARE_KEY."""
    name = MEMORY_STAGES.get(stage)
    if name in FINETUNE_STAGES and config.finetune_section(name).mode == "async":
        return SEARCHER_SHARE_KEY
    return VLLM_SHARE_KEY


def stage_memory(config: Config, stage: str, device_bytes: float, environ: dict) -> float | None:
    """make plan's memory estimate of ``stage`` (a stages.<name> module) on a GPU of
    ``device_bytes`` under the running launch (``environ``: accelerate's variables): a ConfigError
    naming the key, with the arithmetic, when the device cannot hold it. With
    generation.backend=vllm, returns generation.vllm_gpu_memory_utilization for the stage's
    engines, derived when the key is unset, else checked (pipeline.generation.vllm_settings.engine_memory_share; an
    asynchronous fine-tuning run: the searchers' own share, gfn.searcher_vllm_memory_share
    (share_key), each searcher's GPU taken to be the size of this one; its scorer actors' GPUs are
    checked too); else None. A model whose shape is unknown (no local config.json, hub cache entry or
    published shape) is not estimated, except that a vLLM share cannot be derived without it.
    Reads config.json files only."""
    if stage not in MEMORY_STAGES:
        raise ValueError(f"{stage}: not a stage whose memory is checked at its start ({', '.join(MEMORY_STAGES)})")
    vllm = config.generation.backend == "vllm"
    config = copy.deepcopy(config)
    launch = launch_from_environment(environ)
    config.plan.processes = int(environ.get("WORLD_SIZE", "1"))
    plan = Plan("", config, "GPU", GPU(device_bytes / GIB, 1.0), launch=launch)
    policy = resolve_model(config, "model.policy", config.model.policy)
    name = MEMORY_STAGES[stage]
    costs = []
    if name == "prm":  # PRM training; the tiny world's exact-check sampling runs before it, its engine alone
        costs.append(prm_stage(plan, resolve_model(config, "model.prm_backbone", config.model.prm_backbone)))
        name = None
    if name in FINETUNE_STAGES:
        prm = resolve_model(
            config,
            "model.prm",
            config.model.prm,
            resolve_model(config, "model.prm_backbone", config.model.prm_backbone),
        )
        cfg = config.finetune_section(name)
        if vllm and cfg.mode == "async" and not cfg.searcher_gpus:
            raise ConfigError(
                "gfn.searcher_gpus=0 with generation.backend=vllm on a machine with a GPU: Ray hides the GPUs from a "
                "searcher that asks for none, and vLLM's GPU build cannot start without one; set gfn.searcher_gpus "
                "(1: a GPU each; 0.5: two searchers a GPU)"
            )
        if cfg.mode == "async" and cfg.scorer_actors:
            costs.append(scorer_stage(plan, name, prm))
        costs.append(
            searcher_stage(plan, name, policy, prm) if cfg.mode == "async" else finetune_stage(plan, name, policy, prm)
        )
    elif name == "eval":
        models = resolve_models(plan)
        data = {
            f"eval.{benchmark}": Data(benchmark, benchmark, "counted at the stage", 1)
            for benchmark in config.eval.benchmarks
        }
        costs.append(eval_stage(plan, models, data))
    elif name == "search":
        prm = resolve_model(
            config,
            "model.prm",
            config.model.prm,
            resolve_model(config, "model.prm_backbone", config.model.prm_backbone),
        )
        costs.append(search_stage(plan, policy, prm, 1))
    elif name == "mcts" or vllm:
        samples = (config.mcts.k, config.mcts.max_rollouts) if name == "mcts" else (1, config.generation.batch_size)
        costs.append(
            generation_stage(
                plan,
                name or stage,
                policy,
                None,
                1,
                samples[0],
                samples[1],
                config.generation.max_new_tokens,
                0,
                1,
                "samples",
            )
        )
    errors = [
        f.message if f.key in f.message else f"{f.key}: {f.message}" for cost in costs for f in cost.memory_errors
    ]
    if errors:
        raise ConfigError("; ".join(errors))
    if not vllm:
        return None
    cost = costs[-1]
    if cost.engine_share is None:
        unknown = [m.key for m in (policy,) if m.shape is None]
        raise ConfigError(
            f"{cost.share_key}: make {name or stage}'s memory cannot be estimated "
            f"({', '.join(unknown) or 'a model'}'s shape is unknown: no local config.json, hub cache entry or "
            f"published shape); set {cost.share_key}"
        )
    return cost.engine_share
