"""Policy fine-tuning with a step-level objective: the library behind `make gfn` and `make ppo`.

``finetune_policy`` loads the policy (hub id or path, full fine-tuning or LoRA through peft), the
frozen reference when the objective needs one, builds the training problems' prompts, the
objective from the registry and the training base, and runs the fine-tuning loop with the PRM
scorer it is given. The final model is saved with save_pretrained (LoRA merged), so the
evaluation stage loads it like any other model.
"""

from __future__ import annotations

import copy
import dataclasses
import functools
import json
import logging
import shutil
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch
from accelerate import PartialState
from matplotlib.figure import Figure
from peft import LoraConfig, get_peft_model
from safetensors.torch import save_file

from pipeline.config.schema import Config, GFNConfig, PPOConfig
from pipeline.finetune.ceiling import ceiling_verdict, measure_ceiling
from pipeline.finetune.objectives import build_objective, regularized_target
from pipeline.finetune.policy import LMPolicy
from pipeline.finetune.sampling import TrainProblem, TrajectorySampler
from pipeline.finetune.setup import FinetuneSetup, preflight
from pipeline.finetune.tba import ray_cluster
from pipeline.finetune.tba.cores import pin_process
from pipeline.finetune.tba.publication import published_weights
from pipeline.finetune.tba.scorers import PooledScorer
from pipeline.finetune.tba.settings import check_async_problems, searcher_config
from pipeline.finetune.tba.trainer import AsyncFinetuneTrainer
from pipeline.finetune.trainer import FinetuneTrainer
from pipeline.generation import build_generator
from pipeline.generation.vllm_servable import lora_scaling
from pipeline.modeling import load_causal_lm, load_tokenizer, lora_fan_in_fan_out, resolve_device, upcast_trainable
from pipeline.prompts import prompt_from_config
from pipeline.records import Problem
from pipeline.storage.files import write_json_atomic
from pipeline.storage.model_folders import (
    commit_folder,
    snapshot_folder,
    snapshot_folders,
    snapshot_step,
    staging_folder,
)
from pipeline.training import OptimizerSettings, Tracking, TrainingBase, make_accelerator
from pipeline.training.distributed import Collective

CEILING = "ceiling.json"  # <out_dir>/ceiling.json: the GFlowNet stage's reweighting ceiling, before training

log = logging.getLogger("stepflow")


def add_lora(model, cfg):
    """peft LoRA adapters on cfg.lora_target_modules (peft keeps them float32 over a half base)."""
    lora = LoraConfig(
        r=cfg.lora_r,
        lora_alpha=cfg.lora_alpha,
        lora_dropout=cfg.lora_dropout,
        target_modules=list(cfg.lora_target_modules),
        task_type="CAUSAL_LM",
    )
    return get_peft_model(model, lora)


VALUE_HEAD = "value_head"  # PPO's value head: <out_dir>/value_head/value_head.safetensors, beside model/


@dataclasses.dataclass
class PolicySnapshots:
    """The policy along training: ``snapshot(step)`` writes <out_dir>/snapshots/step-<step>/, a model
    folder as model/ is (LoRA merged, in the saved dtype), committed by one rename; every process
    calls it (sharded weights are gathered), the main one writes. ``discard_after(step)`` removes the
    snapshots of later steps, which an earlier run of the same folder left."""

    base: Any
    tokenizer: Any
    out_dir: Path
    dtype: torch.dtype | None = None
    settings: dict | None = None  # the stage's config section, in each manifest as model/'s (eval.curves matches them)

    def folder(self, step: int) -> Path:
        return snapshot_folder(self.out_dir, step)

    def __call__(self, step: int) -> None:
        state_dict = self.base.final_state_dict()
        if self.base.is_main:
            staging = staging_folder(self.folder(step))
            save_policy(self.base.unwrapped, self.tokenizer, staging, dtype=self.dtype, state_dict=state_dict)
            commit_folder(staging, self.folder(step), steps=self.base.step, training_steps=step, settings=self.settings)

    def discard_after(self, step: int) -> None:
        if not self.base.is_main:
            return
        for folder in snapshot_folders(self.out_dir):
            if snapshot_step(folder) > step:
                shutil.rmtree(folder)


def save_policy(model, tokenizer, path: Path, dtype: torch.dtype | None = None, state_dict: dict | None = None) -> None:
    """save_pretrained with LoRA merged; ``dtype``: floating weights cast to it on the way out
    (float32 master weights saved in the configured half dtype); ``state_dict``: the weights
    when they must come from elsewhere (gathered from FSDP / DeepSpeed shards)."""
    path.mkdir(parents=True, exist_ok=True)
    to_save = model
    if hasattr(model, "merge_and_unload"):
        to_save = copy.deepcopy(model)
        if state_dict is not None:
            to_save.load_state_dict(state_dict)
            state_dict = None
        to_save = to_save.merge_and_unload()
    if state_dict is None:
        state_dict = to_save.state_dict()
    if dtype is not None:
        state_dict = {k: v.to(dtype) if v.is_floating_point() else v for k, v in state_dict.items()}
    to_save.save_pretrained(path, state_dict=state_dict)
    tokenizer.save_pretrained(path)


def plot_training_curves(metrics_path: Path, out_png: Path, title: str) -> None:
    """The paper's three training curves (Fig. 4): loss, average reward, proportionality gap."""
    rows = [json.loads(line) for line in metrics_path.read_text().splitlines() if line.strip()]
    names = [n for n in ("loss", "avg_reward", "proportionality_gap") if any(n in r for r in rows)]
    fig = Figure(figsize=(4 * len(names), 3.2))
    for index, name in enumerate(names, start=1):
        ax = fig.add_subplot(1, len(names), index)
        ax.plot([r["step"] for r in rows if name in r], [r[name] for r in rows if name in r])
        ax.set_xlabel("training step")
        ax.set_title(name.replace("_", " "))
        ax.grid(alpha=0.3)
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(out_png, dpi=120)


def optimizer_settings(cfg: GFNConfig | PPOConfig, updates_per_step: int) -> OptimizerSettings:
    """The training base's settings: the schedule runs over num_train_steps training steps of
    ``updates_per_step`` optimizer steps each (PPO: ppo_epochs)."""
    return OptimizerSettings(
        lr=cfg.lr,
        total_steps=cfg.num_train_steps * updates_per_step,
        weight_decay=cfg.weight_decay,
        schedule=cfg.scheduler,
        warmup_steps=cfg.warmup_steps * updates_per_step,
        max_grad_norm=cfg.grad_clip,
    )


def train_problems(config: Config, problems: Sequence[Problem], tokenizer) -> tuple[list[TrainProblem], str]:
    """The problems with the policy's prompts, and their one grading kind."""
    kinds = {p.kind for p in problems}
    if len(kinds) != 1:
        raise ValueError(f"training problems mix answer kinds {sorted(kinds)}")
    kind = kinds.pop()
    prompts = [
        TrainProblem(
            p.problem_id,
            p.question,
            prompt_from_config(p.question, kind, tokenizer, config.format, p.meta.get("options")),
            p.answer,
        )
        for p in problems
    ]
    return prompts, kind


def trained_lora_scaling(model) -> float | None:
    """alpha / r of the trained model's LoRA adapters (added from the section's lora_* settings,
    or a model.policy_adapter loaded to train on), merged into the weights a vLLM sampler is
    given; None without adapters."""
    settings = getattr(model, "peft_config", {}).get("default")
    return None if settings is None else lora_scaling(settings.to_dict())


def load_reference(config: Config, tokenizer) -> LMPolicy:
    """The frozen reference policy (the appendix-F prior, KL terms): the starting policy."""
    frozen = load_causal_lm(config.resolve(config.model.policy), config.model)
    frozen.requires_grad_(False)
    return LMPolicy(
        frozen, tokenizer, config.format.separator, config.generation.max_new_tokens, config.generation.batch_size
    )


def searcher_sampler(
    config: Config, stage: str, make_scorer: Callable, index: int, problems: list[dict]
) -> TrajectorySampler:
    """What an asynchronous searcher samples with, built inside its actor: a plain copy of the
    policy (the trainer publishes plain weights, LoRA merged) for HF generate, or its own vLLM engine
    (gfn.searcher_vllm_memory_share of its GPU) and no transformers copy unless gfn.importance_correction
    needs one to score what it sampled (beside the engine, in model.dtype); the PRM (``make_scorer``),
    or with gfn.scorer_actors > 0 the scorer actors (PooledScorer) and no PRM; its own question
    cycle. No reference: the trainer scores the reference itself.

    problems: the training problems as JSON (Problem.to_json; read from Ray's object store by the
              searcher), rebuilt and validated here
    """
    cfg = searcher_config(config.finetune_section(stage), index)
    policy_path = config.resolve(config.model.policy)
    tokenizer = load_tokenizer(policy_path, config.model.trust_remote_code)
    if config.generation.backend == "vllm":  # the engine samples and takes the published weights: no transformers copy
        engine_config = copy.copy(config)  # the searchers' own share of their GPU
        engine_config.generation = dataclasses.replace(
            config.generation, vllm_gpu_memory_utilization=cfg.searcher_vllm_memory_share
        )
        model, sampler = None, build_generator(engine_config, policy_path, weight_updates=True)
        if cfg.importance_correction:  # log pi(tau) of what it sampled, teacher-forced as the trainer scores it
            model = load_causal_lm(policy_path, config.model).requires_grad_(False)
    else:
        model, sampler = load_causal_lm(policy_path, config.model), None
        model.requires_grad_(False)
    policy = LMPolicy(
        model,
        tokenizer,
        config.format.separator,
        config.generation.max_new_tokens,
        config.generation.batch_size,
        sampler=sampler,
    )
    problems_with_prompts, kind = train_problems(
        config, [Problem.from_json(p, "training problems") for p in problems], tokenizer
    )
    scorer = PooledScorer(cfg.scorer_actors, index) if cfg.scorer_actors else make_scorer()
    return TrajectorySampler(policy, scorer, problems_with_prompts, kind, cfg)


def check_cluster(config: Config, setup: FinetuneSetup, problems: Sequence[Problem]) -> list[str]:
    """The asynchronous searchers against the Ray cluster this process has joined: refused when
    the cluster lacks the CPUs or GPUs to run them all at once beside the trainer's GPUs (one per
    trainer process on CUDA), a warning (returned and logged) when their estimated memory exceeds
    what Ray offers. Each searcher's estimate: a worker process (ray_cluster.WORKER_BYTES), its
    policy weights, the PRM's unless scorer actors hold it (no reference: the trainer holds it), the
    training problems; each scorer actor's: a worker process and the PRM's weights."""
    import ray  # the optional extra (extra `distributed`)

    cfg = config.finetune_section(setup.stage)
    policy, prm = (ray_cluster.folder_bytes(config.resolve(m)) for m in (config.model.policy, config.model.prm))
    searcher_bytes = (
        ray_cluster.WORKER_BYTES
        + policy
        + (0 if cfg.scorer_actors else prm)
        + len(json.dumps([p.to_json() for p in problems]))
    )
    trainer_gpus = setup.processes if resolve_device(config.model.device).type == "cuda" else 0
    return ray_cluster.check_searchers_fit(
        cfg,
        ray.cluster_resources(),
        searcher_bytes,
        ray_cluster.cluster_name(cfg),
        trainer_gpus=trainer_gpus,
        scorer_bytes=ray_cluster.WORKER_BYTES + prm,
    )


def log_reweighting_ceiling(
    cfg: GFNConfig,
    policy,
    scorer,
    problems: list[TrainProblem],
    kind: str,
    reward,
    collective: Collective,
    out_dir: Path,
    is_main: bool,
    records: Sequence[Problem] = (),
) -> dict | None:
    """Measure the reweighting ceiling of the base policy's samples (pipeline.finetune.ceiling),
    log it in one line with its verdict, and write it to <out_dir>/ceiling.json (main process).
    records: the problems' records (their strategies, where they know them)."""
    start = time.monotonic()
    ceiling = measure_ceiling(policy, scorer, problems, kind, cfg, reward, collective, records)
    if ceiling is None:
        return None
    ceiling["seconds"] = time.monotonic() - start
    if is_main:
        write_json_atomic(out_dir / CEILING, ceiling)
        log.info(
            "gfn: %s (%.1f s; %s)",
            ceiling_verdict(ceiling, cfg.reward_temperature),
            ceiling["seconds"],
            out_dir / CEILING,
        )
    return ceiling


def finetune_policy(
    config: Config, stage: str, problems: Sequence[Problem], make_scorer: Callable, out_dir: Path, progress: bool = True
) -> list[dict]:
    """Fine-tune config.model.policy with the objective of config.<stage> ("gfn" or "ppo"),
    in this process or across the processes of ``accelerate launch``; with gfn.mode=async,
    searcher actors on Ray sample while this process trains (docs/async.md). Every choice is the
    setup's (pipeline.finetune.setup.resolve, checked by ``preflight``); this builds it.

    make_scorer: builds the PRM (``log_scores_many([(question, steps), ...])``, e.g.
                 functools.partial(prm.scorer.PRMScorer.from_pretrained, path, config)); called
                 here, or in every searcher actor in asynchronous mode, or in every scorer actor
                 with gfn.scorer_actors > 0 (so it must pickle)
    Writes <out_dir>/model/ (+ <out_dir>/value_head/ for PPO), metrics.jsonl and
    training_curves.png (main process); checkpoints/ while training. Returns the metrics
    records of this run.
    """
    setup = preflight(config, stage)
    cfg = config.finetune_section(stage)
    asynchronous = setup.mode == "async"
    if asynchronous:
        check_async_problems(cfg, len(problems))  # before Ray starts
    # the main process alone talks to Ray (AsyncFinetuneTrainer); the others never connect
    drives_ray = asynchronous and PartialState().is_main_process
    if drives_ray and not ray_cluster.connected():
        # Ray first (joined within gfn.ray_connect_timeout), shut down however the run ends; the
        # call below finds it connected and goes on
        with ray_cluster.session(cfg, f"stepflow-{config.run}"):
            return finetune_policy(config, stage, problems, make_scorer, out_dir, progress)
    if drives_ray:
        check_cluster(config, setup, problems)  # before any model is loaded
    if cfg.trainer_cores:  # after Ray has started: its processes keep the cores this one was started on
        pin_process(set(cfg.trainer_cores), key=f"{stage}.trainer_cores")
    torch.manual_seed(cfg.seed)
    out_dir = Path(out_dir)
    policy_path = config.resolve(config.model.policy)
    tracking = Tracking.from_config(config, stage, out_dir)  # the trackers of report_to
    accelerator = make_accelerator(config.model, tracking=tracking)
    collective = Collective(accelerator)
    tokenizer = load_tokenizer(policy_path, config.model.trust_remote_code)
    model = load_causal_lm(
        policy_path, config.model, adapter=config.resolve(config.model.policy_adapter), is_trainable=True
    )
    reference = load_reference(config, tokenizer) if setup.reference != "none" else None
    if cfg.lora and not hasattr(model, "peft_config"):
        model = add_lora(model, cfg)
    # Full fine-tuning of a bf16/fp16 model: float32 master weights, the forward autocast to the
    # half dtype (and the saved model cast back to it).
    half_dtype = upcast_trainable(model)
    model.train()
    # the colocated engine loads model.policy alone: with a model.policy_adapter it is given the trained weights below
    engine = build_generator(config, policy_path, colocate=True) if setup.sampler == "vllm" else None
    policy = LMPolicy(
        model,
        tokenizer,
        config.format.separator,
        config.generation.max_new_tokens,
        config.generation.batch_size,
        autocast_dtype=half_dtype,
        sampler=engine,
        lora_scaling=trained_lora_scaling(model),
        lora_fan_in_fan_out=lora_fan_in_fan_out(model),
    )
    objective = build_objective(
        cfg,
        policy,
        hidden_size=model.config.get_text_config().hidden_size,
        collective=collective,
        reference=reference if setup.reference == "objective" else None,
    )
    updates = objective.updates_per_rollout
    base = TrainingBase(
        accelerator,
        model,
        optimizer_settings(cfg, updates),
        out_dir,
        objective=objective,
        objective_lr=objective.lr,
        save_every=cfg.save_every,
        updates_per_record=updates,
        progress=False,
        desc=stage,
        tracking=tracking,
    )
    policy.prepared(base.model, base.unwrapped)
    if setup.sampler == "hf_copy":
        # FSDP2: no process holds the whole policy between forwards, and HF generation would need
        # every process in lockstep at every token: sample from a plain copy in model.dtype (what
        # a vLLM engine holds), given the gathered weights now and after every update
        policy.sampler = build_generator(config, policy_path)
    if setup.start_weights:  # its copy holds model.policy alone: it samples the trained policy from the first step
        policy.after_update(0, base.iter_full_state)
    problems_with_prompts, kind = train_problems(config, problems, tokenizer)
    if asynchronous:
        trainer = AsyncFinetuneTrainer(
            base,
            TrajectorySampler(policy, None, problems_with_prompts, kind, cfg, collective=collective),
            objective,
            cfg,
            functools.partial(searcher_sampler, config, stage, make_scorer),
            export=functools.partial(published_weights, policy, base, setup.publish_dtype),
            problems=[p.to_json() for p in problems],
            run_name=config.run,
            progress=progress,
            publish_dtype=setup.publish_dtype,
            make_scorer=make_scorer,
        )
    else:
        trajectory_sampler = TrajectorySampler(
            policy,
            make_scorer(),
            problems_with_prompts,
            kind,
            cfg,
            reference=reference if setup.reference == "sampler" else None,
            collective=collective,
        )
        trainer = FinetuneTrainer(base, trajectory_sampler, objective, cfg, progress=progress)
    # always: with snapshot_every 0 it writes none, but a new training still removes an earlier run's later ones
    trainer.snapshot = PolicySnapshots(base, tokenizer, out_dir, half_dtype, settings=dataclasses.asdict(cfg))
    log.info("%s: %s", stage, regularized_target(cfg).describe())
    if setup.ceiling:
        # the base policy's own samples: before train() resumes any checkpoint
        scorer = make_scorer() if asynchronous else trajectory_sampler.scorer
        log_reweighting_ceiling(
            cfg,
            policy,
            scorer,
            problems_with_prompts,
            kind,
            objective.reward,
            collective,
            out_dir,
            base.is_main,
            records=problems,
        )
    history = trainer.train()
    state_dict = base.final_state_dict()  # gathered under FSDP / DeepSpeed: every process takes part
    if base.is_main:  # written aside, committed by one rename: model/ is either absent or whole
        if setup.value_head:  # beside the model, never in it: vLLM loads every *.safetensors of a folder
            head = staging_folder(out_dir / VALUE_HEAD)
            save_file(
                {k: v.contiguous() for k, v in objective.value_head.state_dict().items()},
                str(head / "value_head.safetensors"),
            )
            commit_folder(head, out_dir / VALUE_HEAD, steps=base.step)
        staging = staging_folder(out_dir / "model")
        save_policy(base.unwrapped, tokenizer, staging, dtype=half_dtype, state_dict=state_dict)
        commit_folder(
            staging, out_dir / "model", steps=base.step, training_steps=trainer.step, settings=dataclasses.asdict(cfg)
        )
        plot_training_curves(out_dir / "metrics.jsonl", out_dir / "training_curves.png", f"{stage} training")
    # The checkpoints only serve an interrupted run; left behind, a later `make gfn` in the same
    # run folder would resume from them (a policy trained against an older PRM) instead of training afresh.
    base.finish()
    return history
