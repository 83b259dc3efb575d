"""Each stage's cost: its work (problems, rollouts, generated and training tokens), the memory of
one GPU and GPU-hours at the assumed throughput, for sampling (mcts, eval, search), PRM training and
policy fine-tuning (the asynchronous mode's searchers and scorer actors: planner.searchers)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

from pipeline.batches import gradient_accumulation
from pipeline.config.schema import Config
from pipeline.finetune.objectives import needs_reference
from pipeline.finetune.setup import FinetuneLaunch, SetupError, resolve
from pipeline.generation import VLLM_INSTALL
from pipeline.sizing.activation_memory import activation_bytes, logits_bytes
from pipeline.sizing.shapes import lora_parameters
from pipeline.storage.shards import parse_shard
from planner.launch import check_wrap_class, read_launch
from planner.memory import (
    VLLM_SHARE_KEY,
    activation_settings,
    check_memory,
    half_bytes,
    sampler_memory,
    training_memory_key,
    training_state,
    warn_queued,
)
from planner.plan import Data, Model, Plan, StageCost
from planner.render import format_count


def _tokens_per_second(plan: Plan, parameters: int, mfu: float, flops_per_parameter: int) -> float:
    return mfu * plan.gpu.peak_tflops * 1e12 / (flops_per_parameter * parameters)


def generation_stage(
    plan: Plan,
    name: str,
    policy: Model,
    prm: Model | None,
    problems: int | None,
    samples_low: float,
    samples_high: float,
    tokens_per_sample: int,
    scored_tokens_per_sample: int,
    workers: int,
    what: str,
) -> StageCost:
    """mcts / eval / search: ``samples_*`` per problem, each at most ``tokens_per_sample`` tokens."""
    config = plan.config
    cost = StageCost(name, workers)
    if problems is None:
        cost.work.append(f"problems: unknown until the input is made; {what}")
        return cost
    low, high = problems * samples_low, problems * samples_high
    tokens = high * tokens_per_sample
    cost.work.append(
        f"{format_count(problems)} problems; {what}: {format_count(low)}"
        + (f" to {format_count(high)}" if high != low else "")
        + f"; generated tokens at most {format_count(tokens)}"
    )
    if policy.shape is None:
        return cost
    concurrent = min(config.generation.batch_size, max(1, int(samples_high)))
    sampler_memory(
        plan, cost, policy.shape, concurrent, config.plan.prompt_tokens + tokens_per_sample, with_weights=True
    )
    seconds = [
        n * tokens_per_sample / _tokens_per_second(plan, policy.shape.parameters(), config.plan.generation_mfu, 2)
        for n in (low, high)
    ]
    if prm is not None and prm.shape is not None:
        cost.memory["frozen PRM"] = half_bytes(config) * prm.shape.parameters(lm_head=False)
        scoring = [
            n
            * scored_tokens_per_sample
            / _tokens_per_second(plan, prm.shape.parameters(False), config.plan.training_mfu, 2)
            for n in (low, high)
        ]
        seconds = [s + t for s, t in zip(seconds, scoring)]
    cost.gpu_seconds = (seconds[0], seconds[1])
    check_memory(plan, cost, VLLM_SHARE_KEY if cost.engine_needs else "generation.batch_size")
    return cost


def prm_stage(plan: Plan, backbone: Model) -> StageCost:
    config, cfg = plan.config, plan.config.prm
    processes = config.plan.processes
    launch = read_launch(plan, "prm")
    check_wrap_class(plan, "prm", backbone)
    cost = StageCost("prm", processes)
    try:
        accumulation = gradient_accumulation(cfg.batch_size, cfg.micro_batch_size, processes)
        cost.work.append(
            f"{cfg.batch_size} sequences a step = micro-batch {cfg.micro_batch_size} x {processes} processes x "
            f"{accumulation} accumulation"
        )
    except ValueError as error:
        plan.error("prm.batch_size", str(error))
    train_path = Path(config.resolve(cfg.train_path))
    examples = sum(1 for line in train_path.open(encoding="utf-8") if line.strip()) if train_path.is_file() else None
    counted = examples if examples is not None else 10_000
    tokens = counted * cfg.epochs * cfg.max_length
    records = (
        f"{format_count(examples)} training records"
        if examples is not None
        else "training records unknown until make augment: per 10,000"
    )
    cost.work.append(
        f"{records}; training tokens at most {format_count(tokens)} ({cfg.epochs:g} epochs x {cfg.max_length} tokens)"
    )
    if backbone.shape is None:
        return cost
    shape = backbone.shape
    checkpointing = cfg.gradient_checkpointing or launch.activation_checkpointing
    trainable = lora_parameters(shape, cfg.lora_r, cfg.lora_target_modules)[0] if cfg.lora else shape.parameters(False)
    cost.memory.update(training_state(shape, trainable, launch, processes, lm_head=False))
    cost.memory[
        f"activations ({cfg.micro_batch_size} x {cfg.max_length} tokens{', checkpointed' if checkpointing else ''})"
    ] = activation_bytes(shape, cfg.micro_batch_size, cfg.max_length, checkpointing, **activation_settings(config, cfg))
    flops = (4 if cfg.lora else 6) + (2 if checkpointing else 0)
    cost.gpu_seconds = (
        tokens / _tokens_per_second(plan, shape.parameters(False), config.plan.training_mfu, flops),
    ) * 2
    cost.notes.append(f"launch: {launch.strategy}" + (f" ({launch.file})" if launch.file else ""))
    check_memory(plan, cost, training_memory_key(cost, "prm", launch, cfg.lora))
    return cost


def finetune_stage(plan: Plan, stage: str, policy: Model, prm: Model) -> StageCost:
    config = plan.config
    cfg = config.finetune_section(stage)
    processes = config.plan.processes
    launch = read_launch(plan, stage)
    check_wrap_class(plan, stage, policy)
    cost = StageCost(stage, processes)
    try:  # the trainer's own choices and refusals under the launch it runs under (pipeline.finetune.setup)
        resolve(config, stage, FinetuneLaunch(processes, launch.environ or {}))
    except SetupError as error:
        if error.key is None:  # the launch itself: its accelerate file
            plan.error(f"plan.accelerate.{stage}", f"{launch.file}: {error}")
        else:
            plan.error(error.key, str(error))
    if config.generation.backend == "vllm" and importlib.util.find_spec("vllm") is None:
        plan.warn("generation.backend", f"vllm is not installed here: {VLLM_INSTALL}")
    fresh = cfg.num_train_steps * cfg.questions_per_step * cfg.samples_per_question
    trained = fresh * (cfg.ppo_epochs if stage == "ppo" else (1 + cfg.replay_fraction if cfg.buffer_size > 0 else 1))
    tokens = config.plan.prompt_tokens + config.generation.max_new_tokens
    reference = needs_reference(cfg)
    cost.work.append(
        f"{cfg.num_train_steps} steps x {cfg.questions_per_step} questions x {cfg.samples_per_question} samples = "
        f"{format_count(fresh)} trajectories ({cfg.questions_per_step // max(1, processes)} questions per process a step); "
        f"generated tokens at most {format_count(fresh * config.generation.max_new_tokens)}; trained on at most "
        f"{format_count(trained * tokens)} tokens ({format_count(trained)} trajectories x {tokens})"
    )
    if cfg.mode == "async":
        cost.notes.append(
            "mode=async: this process trains; the searchers' memory is the next entry, their time is not estimated"
        )
    if policy.shape is None or prm.shape is None:
        return cost
    shape = policy.shape
    checkpointing = launch.activation_checkpointing
    trainable = lora_parameters(shape, cfg.lora_r, cfg.lora_target_modules)[0] if cfg.lora else shape.parameters()
    cost.memory.update(training_state(shape, trainable, launch, processes, lm_head=True))
    cost.memory[
        f"activations ({cfg.micro_batch_size} x {tokens} tokens{', checkpointed' if checkpointing else ''})"
    ] = activation_bytes(shape, cfg.micro_batch_size, tokens, checkpointing, **activation_settings(config, cfg))
    positions = config.generation.max_new_tokens + 1  # logits from the prompt's last token on
    cost.memory[f"logits ({cfg.micro_batch_size} x {positions} x {shape.vocab_size}: fp32 log-softmax backward)"] = (
        logits_bytes(shape, cfg.micro_batch_size, positions)
    )
    cost.memory["frozen PRM"] = half_bytes(config) * prm.shape.parameters(lm_head=False)
    if reference:
        cost.memory["frozen reference"] = half_bytes(config) * shape.parameters()
    per_process = cfg.questions_per_step // max(1, processes) * cfg.samples_per_question
    if cfg.mode != "async":  # asynchronous: the searchers sample (planner.searchers), this process only trains
        sampler_memory(plan, cost, shape, per_process, tokens, with_weights=False)
    flops = (4 if cfg.lora else 6) + (2 if checkpointing else 0)
    seconds = (
        fresh
        * config.generation.max_new_tokens
        / _tokens_per_second(plan, shape.parameters(), config.plan.generation_mfu, 2)
        + trained * tokens / _tokens_per_second(plan, shape.parameters(), config.plan.training_mfu, flops)
        + fresh * tokens / _tokens_per_second(plan, prm.shape.parameters(False), config.plan.training_mfu, 2)
        + (
            fresh * tokens / _tokens_per_second(plan, shape.parameters(), config.plan.training_mfu, 2)
            if reference
            else 0
        )
    )
    cost.gpu_seconds = (seconds, seconds)
    cost.notes.append(f"launch: {launch.strategy}" + (f" ({launch.file})" if launch.file else ""))
    check_memory(plan, cost, training_memory_key(cost, stage, launch, cfg.lora))
    warn_queued(plan, cost)
    return cost


def generation_workers(config: Config, shard: str) -> int:
    """The processes of mcts / eval / search: the n of a shard the config sets by hand (i/n with
    n > 1), else plan.processes (``python -m stages.launch <stage>`` starts one worker per GPU)."""
    _, shards = parse_shard(shard)
    return shards if shards > 1 else config.plan.processes


def expected_snapshots(config: Config) -> dict[str, int]:
    """{eval model name: the snapshots its training stage will write} for the models of eval.curves
    that are a fine-tuning stage's own model folder (gfn or ppo with snapshot_every > 0): one every
    snapshot_every steps before the last (pipeline.finetune.run.PolicySnapshots)."""
    out = {}
    for name in config.eval.curves:
        if name not in config.eval.models:
            continue
        path = config.resolve(config.eval.models[name].split("::")[0])
        for stage in ("gfn", "ppo"):
            section = config.finetune_section(stage)
            if section.snapshot_every and path == str(config.stage_dir(stage) / "model"):
                out[name] = (section.num_train_steps - 1) // section.snapshot_every
    return out


def eval_stage(plan: Plan, models: dict[str, Model], data: dict[str, Data]) -> StageCost:
    config = plan.config
    benchmarks = [data[f"eval.{name}"] for name in config.eval.benchmarks]
    counts = [d.problems for d in benchmarks]
    problems = None if any(c is None for c in counts) else sum(counts)
    evaluated = [models[f"eval.{name}"] for name in config.eval.models]
    snapshots = expected_snapshots(config)
    evaluated += [models[f"eval.{name}"] for name, count in snapshots.items() for _ in range(count)]
    samples = config.eval.k + (1 if config.eval.greedy else 0)
    largest = max(
        (m for m in evaluated if m.shape is not None), key=lambda m: m.shape.parameters(), default=evaluated[0]
    )
    workers = generation_workers(config, config.eval.shard)
    cost = generation_stage(
        plan,
        "eval",
        largest,
        models.get("eval.prm"),
        problems,
        samples * len(evaluated),
        samples * len(evaluated),
        config.generation.max_new_tokens,
        config.generation.max_new_tokens,
        workers,
        f"samples ({len(evaluated)} models x (eval.k={config.eval.k}{' + greedy' if config.eval.greedy else ''}))",
    )
    cost.notes.append("one model at a time: memory is that of the largest")
    if snapshots:
        cost.notes.append(
            "eval.curves: "
            + ", ".join(f"{count} snapshots of {name}" for name, count in snapshots.items())
            + " evaluated beside the models (counted above)"
        )
    if config.eval.target_samples:
        cost.notes.append(
            f"eval.target_samples={config.eval.target_samples}: every model also draws that many samples per problem "
            f"at temperature 1 on up to eval.target_problems={config.eval.target_problems} problems per benchmark, "
            "and the PRM scores them; not counted in the figures above"
        )
    if workers > 1:
        cost.notes.append(
            f"python -m stages.launch eval: {workers} workers sample; the PRM reward and the embeddings are "
            "computed after them in one process on one GPU"
        )
    return cost


def search_stage(plan: Plan, policy: Model, prm: Model, problems: int | None) -> StageCost:
    config, s = plan.config, plan.config.search
    step_level = {"step_best_of_k", "beam"}
    per_problem = 0
    for k in s.ks:
        for strategy in [*s.strategies, "majority"]:
            per_problem += k * (
                s.max_depth * config.generation.max_step_tokens
                if strategy in step_level
                else config.generation.max_new_tokens
            )
    samples = per_problem / config.generation.max_new_tokens
    workers = generation_workers(config, s.shard)
    cost = generation_stage(
        plan,
        "search",
        policy,
        prm,
        problems,
        samples,
        samples,
        config.generation.max_new_tokens,
        config.generation.max_new_tokens,
        workers,
        f"sample-equivalents of max_new_tokens ({len(s.strategies)} strategies + majority, ks {s.ks})",
    )
    if workers > 1:
        cost.notes.append(
            f"python -m stages.launch search: {workers} workers, each with the policy and the PRM on its GPU"
        )
    return cost
