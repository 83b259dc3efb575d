"""`make plan`: check a config and estimate its cost before anything loads (docs/real-model.md).

``make_plan(config)`` resolves every model and data file the config names (local, made by an
earlier stage, or needing the hub: nothing is downloaded and no model is loaded), checks the
batches against the number of processes with the trainers' own checks (pipeline.batches), and
estimates per stage the work (problems, rollouts, generated and training tokens), the memory of
one GPU under the accelerate config each training stage is launched with, and GPU-hours at the
throughput ``plan.generation_mfu`` / ``plan.training_mfu`` of the GPU type's peak bf16 FLOP/s.
Every problem found is a Finding: an error (the stage would fail, or memory exceeds the device)
or a warning. Token counts are upper bounds (every sample runs to max_new_tokens).
"""

from __future__ import annotations

from pipeline.config.loader import check_choice
from pipeline.config.schema import FINETUNE_STAGES, Config, GPUType
from planner.costs import eval_stage, finetune_stage, generation_stage, generation_workers, prm_stage, search_stage
from planner.plan import GPU, GPUS, Plan, StageCost
from planner.resolve import resolve_all_data, resolve_models
from planner.searchers import scorer_stage, searcher_stage


def make_plan(config: Config, config_path: str = "") -> Plan:
    """Resolve, check and estimate every stage of ``config`` (module docstring); loads no model."""
    gpu_name = config.plan.gpu
    check_choice(gpu_name, GPUType, "plan.gpu")  # the loader checked it; a Config built in code may not be
    gpu = GPUS[gpu_name]
    if config.plan.gpu_memory_gb is not None:
        gpu = GPU(config.plan.gpu_memory_gb, gpu.peak_tflops)
    plan = Plan(config_path, config, gpu_name, gpu)
    models = resolve_models(plan)
    data = resolve_all_data(plan)
    policy, backbone, prm = models["policy"], models["prm_backbone"], models["prm"]
    train = data["train"].problems
    mcts = config.mcts
    problems = (
        None
        if train is None and mcts.max_problems is None
        else min(x for x in (train, mcts.max_problems) if x is not None)
    )
    plan.stages.append(
        generation_stage(
            plan,
            "mcts",
            policy,
            None,
            problems,
            mcts.k,
            mcts.max_rollouts,
            config.generation.max_new_tokens,
            0,
            generation_workers(config, mcts.shard),
            f"rollouts (mcts.k={mcts.k} to mcts.max_rollouts={mcts.max_rollouts} a problem)",
        )
    )
    if plan.stages[-1].processes > 1:
        plan.stages[-1].notes.append(
            f"python -m stages.launch mcts: {plan.stages[-1].processes} workers, one shard each"
        )
    plan.stages.append(StageCost("augment", 1, work=["CPU: groups and splits the MCTS records (no GPU)"]))
    plan.stages.append(prm_stage(plan, backbone))
    for stage in FINETUNE_STAGES:
        plan.stages.append(finetune_stage(plan, stage, policy, prm))
        cfg = config.finetune_section(stage)
        if cfg.mode == "async":
            plan.stages.append(searcher_stage(plan, stage, policy, prm))
            if cfg.scorer_actors:
                plan.stages.append(scorer_stage(plan, stage, prm))
    eval_cost = eval_stage(plan, models, data)
    plan.stages.append(eval_cost)
    plan.stages.append(search_stage(plan, policy, prm, data["search"].problems))
    return plan
