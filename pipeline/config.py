"""Typed configuration: one dataclass per stage, loaded from YAML with `key=value` overrides.

A config file is a YAML mapping with top-level fields (run, seed, runs_root) and one section
per stage (``mcts:``, ``prm:``, ...). Command-line overrides use dotted keys:
``python -m stages.mcts --config configs/tiny.yaml run=demo mcts.k=8``. Unknown keys and
values of the wrong type are errors naming the key and the file (or "command line").

String fields may contain ``{run_dir}``, replaced by ``<runs_root>/<run>`` when resolved, so
a stage finds the artifacts of the stages before it without hard-coded paths.
Paper defaults are in configs/paper/*.yaml; the defaults here are the tiny world's.

Loading is bounded and checked before anything is written (docs/reliability.md):
- YAML aliases (``*name``) are refused where they are read, before any expansion (a few hundred
  bytes of nested aliases expand to gigabytes); files over 64 KiB, overrides over 16 KiB and
  nesting deeper than the parser's stack are refused too (parsing stays under about a second);
  values quoted in errors are cut to a few dozen characters;
- every numeric field declares its range (``bounded(default, ge=..., gt=..., le=..., lt=...)``,
  finite unless declared otherwise); a value outside it is an error naming the key, the value,
  the range and the file (or "command line") that set it;
- ``run`` is one plain folder name and ``runs_root`` a relative path that stays below the
  working folder, unless it is given as an absolute path (the user's explicit choice).
"""

from __future__ import annotations

import dataclasses
import functools
import json
import math
import re
import reprlib
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Literal

import yaml

from pipeline.io import parse_shard, write_text_atomic


class ConfigError(ValueError):
    """A config file or override that does not match the typed schema, or settings a check
    before the work refuses (``config_checks``)."""


def config_checks(check: Callable) -> Callable:
    """Marks a function that checks a config before any work starts: what it refuses (ValueError,
    ImportError: a bad setting, a missing optional package) is the user's to fix, so it is raised
    as ConfigError, which a stage's command line prints as one line (stages.common.cli)."""

    @functools.wraps(check)
    def checked(*args, **kwargs):
        try:
            return check(*args, **kwargs)
        except ConfigError:
            raise
        except (ValueError, ImportError) as error:
            raise ConfigError(str(error)) from None

    return checked


# ----------------------------------------------------------------------------- ranges


@dataclass(frozen=True)
class Range:
    """The values a numeric field accepts: finite numbers within the bounds (None: unbounded)."""

    ge: float | None = None
    gt: float | None = None
    le: float | None = None
    lt: float | None = None

    def contains(self, value: float) -> bool:
        return (math.isfinite(value) and (self.ge is None or value >= self.ge) and (self.gt is None or value > self.gt)
                and (self.le is None or value <= self.le) and (self.lt is None or value < self.lt))

    def __str__(self) -> str:
        parts = [f"{op} {bound:.12g}" for op, bound in ((">=", self.ge), (">", self.gt), ("<=", self.le), ("<", self.lt))
                 if bound is not None]
        return " and ".join(parts) if parts else "any finite number"


_RANGE_KEY = "range"
SEED_MAX = 2**32 - 1  # numpy's seeds (accelerate's set_seed seeds numpy too)
MAX_TEMPERATURE = 2.0  # vLLM's SamplingParams refuses more; both backends follow vLLM's rules (pipeline.generation.base)


def bounded(default: Any = dataclasses.MISSING, *, ge: float | None = None, gt: float | None = None, le: float | None = None,
            lt: float | None = None, default_factory: Any = dataclasses.MISSING) -> Any:
    """A numeric config field with its declared range, e.g. ``k: int = bounded(16, ge=1)``;
    None (for an optional field) is always accepted, a list's items are checked one by one."""
    return field(default=default, default_factory=default_factory, metadata={_RANGE_KEY: Range(ge, gt, le, lt)})


def seed_field(default: int = 0) -> Any:
    return bounded(default, ge=0, le=SEED_MAX)


# Fields that take one of a few names are typed Literal[...], the one list of those names: the loader
# checks any such field (or list of them) where it is set, naming the file or the command line, with
# ``check_choice``, which library calls taking such a name use too; typing.get_args lists them
# (PRM_FORMATS, gflownet.LOSSES, prm.search.STRATEGIES).
ReportTo = Literal["none", "tensorboard", "wandb", "all"]  # experiment trackers (pipeline/training/tracking.py)
PRMFormat = Literal["auto", "stepflow", "token_classification", "math_shepherd", "qwen_prm"]  # docs/prm.md, "Other PRMs"
TrainingMode = Literal["sync", "async"]  # gfn.mode / ppo.mode (async: docs/async.md; PPO refuses it)
WeightTransport = Literal["object_store", "collective"]  # gfn.weight_transport (pipeline/finetune/weight_transport.py)
AsyncPriority = Literal["softmax", "uniform"]  # gfn.async_priority (pipeline/finetune/grouped_replay.py)
GFlowNetLoss = Literal["subtb", "tb", "tb_vargrad"]  # gfn.loss (pipeline/finetune/gflownet.py)
SearchStrategy = Literal["step_best_of_k", "beam", "best_of_n", "weighted_vote", "majority"]  # prm/search.py
Aggregation = Literal["last", "mean", "min", "prod"]  # search.aggregation (prm/search.py, docs/search.md)
TinyFamily = Literal["gains_losses", "shared_containers", "mixed"]  # tinyworld.families (pipeline/tinyworld/problems.py FAMILIES)
TinyStrategy = Literal["running_total", "gains_losses", "containers_first"]  # tinyworld.strategies (docs/tinyworld.md)
PRMLabels = Literal["soft", "hard"]  # prm.labels: the BCE targets, the MC value or MC > prm.hard_label_threshold (prm/train.py)
PRM_FORMATS = typing.get_args(PRMFormat)
# The data.train loaders (pipeline.problems) that take data.problem_sources: the other sources
# carry no problem_source to filter on
SOURCE_FILTERED_DATA = ("openmathinstruct2",)


def choices_of(tp: Any) -> tuple | None:
    """The values a Literal annotation allows (None: ``tp`` is no Literal)."""
    return typing.get_args(tp) if typing.get_origin(tp) is Literal else None


def check_choice(value: Any, tp: Any, key: str, where: str | None = None) -> Any:
    """``value`` when the Literal ``tp`` allows it; else ConfigError "<where>: <key> must be one of
    <choices>, got <value>". The loader's check of every Literal field, and the check of library
    calls that take such a name without a config file (``where`` None)."""
    allowed = typing.get_args(tp)
    if value not in allowed:
        prefix = f"{where}: " if where else ""
        raise ConfigError(f"{prefix}{key} must be one of {', '.join(map(str, allowed))}, got {_show(value)}")
    return value


# ----------------------------------------------------------------------------- sections


@dataclass
class ModelConfig:
    """Which models the stages load, and how (any hub id or local path)."""

    policy: str = "{run_dir}/bootstrap/model"  # paper: meta-llama/Llama-3.2-3B-Instruct (or 3.1-8B)
    policy_adapter: str | None = None  # optional peft adapter on top of `policy`
    prm_backbone: str = "{run_dir}/bootstrap/model"  # paper: Qwen/Qwen2.5-Math-7B
    prm: str = "{run_dir}/prm/model"  # the trained PRM the later stages score with (or a third-party PRM: hub id or path)
    # how to read the PRM a stage loads (model.prm; eval.prm in make eval): auto (sniffed from its folder) | stepflow |
    # token_classification (TRL's PRMTrainer) | math_shepherd | qwen_prm (docs/prm.md, "Other PRMs")
    prm_format: PRMFormat = "auto"
    trust_remote_code: bool = False  # never on unless you trust the repository
    device: str = "auto"  # auto | cpu | cuda | cuda:N
    dtype: str = "auto"  # auto (float32 on CPU, bfloat16 on GPU) | float32 | bfloat16 | float16
    attn_implementation: str | None = None  # None = transformers' default; "eager" is faster for tiny CPU models
    torch_threads: int = bounded(0, ge=0)  # 0 = leave torch's default


@dataclass
class GenerationConfig:
    """The generation backend shared by every stage that samples."""

    backend: str = "hf"  # hf | vllm
    batch_size: int = bounded(256, ge=1)  # HF backend: sequences decoded together (prompts x n)
    max_new_tokens: int = bounded(160, ge=1)  # a whole solution
    max_step_tokens: int = bounded(48, ge=1)  # one step (step-level search)
    top_p: float = bounded(1.0, gt=0, le=1)
    vllm_tensor_parallel_size: int = bounded(1, ge=1)
    # each engine's share of its whole GPU (vLLM's gpu_memory_utilization); null: derived at the stage's start from what
    # shares the device (make plan's estimate: a colocated trainer, a PRM, several searchers), or refused with the arithmetic
    vllm_gpu_memory_utilization: float | None = bounded(None, gt=0, le=1)
    vllm_max_model_len: int | None = bounded(None, ge=1)
    vllm_enable_prefix_caching: bool = True
    vllm_enforce_eager: bool = False  # true: no torch.compile at engine start (~35 s on 2 CPU cores for the tiny model)


@dataclass
class FormatConfig:
    """The one step format and prompt builder."""

    separator: str = "\n"  # paper E.1.1: "\n", empty lines dropped
    prompt_template: str = "Question: {question}\nAnswer:\n"  # used when the tokenizer has no chat template
    use_chat_template: bool = True  # use the tokenizer's chat template when it has one
    num_few_shot: int = bounded(0, ge=0)  # few-shot exemplars prepended to plain-text prompts


@dataclass
class DataConfig:
    """Problems the training stages (mcts, gfn, ppo) draw from."""

    train: str = "problems"  # a pipeline.problems benchmark name (paper: openmathinstruct2)
    # a *_path: a file; null: the repository's copy (data/benchmarks/), else the hub's; "hub": the hub's
    # (the tiny world: the reinforcement-learning split, problems the bootstrap never trained on)
    train_path: str | None = "{run_dir}/bootstrap/problems_rl.jsonl"
    # problems-contract files (JSONL or a JSON array) that may share no question with data.train's
    # problems, e.g. the base policy's own training problems: a shared question is an error naming
    # both files and the first such problem (stages.common.training_problems)
    disjoint_from: list[str] = field(default_factory=list)
    train_limit: int | None = bounded(None, ge=1)  # paper: 10000
    validation: str = "problems"
    validation_path: str | None = "{run_dir}/bootstrap/problems_val.jsonl"
    validation_limit: int | None = bounded(None, ge=1)
    problem_sources: list[str] = field(default_factory=list)  # data.train's OpenMathInstruct-2 filter, e.g. [augmented_math]
    # skip malformed problem records (counted, and reported once loading ends) instead of
    # stopping at the first one with its file, line and field; every stage that loads problems
    # or benchmarks (mcts, prm, gfn, ppo, eval, search) follows it
    lenient: bool = False


@dataclass
class TinyWorldConfig:
    """Synthetic multi-step arithmetic word problems (pipeline.tinyworld)."""

    seed: int = seed_field()
    n_train: int = bounded(6000, ge=1)
    n_val: int = bounded(200, ge=1)
    n_test: int = bounded(200, ge=1)
    # problems the bootstrap never trains on, for the stages after it (data.train_path): MCTS reads
    # up to mcts.max_problems of them, the GFlowNet and PPO draw their questions from them
    n_rl: int = bounded(1000, ge=1)
    max_operand: int = bounded(15, ge=1)
    max_result: int = bounded(75, ge=1)
    min_ops: int = bounded(2, ge=1)
    max_ops: int = bounded(4, ge=1)  # >= min_ops
    # problem families drawn uniformly per problem (a name listed twice is drawn twice as often); docs/tinyworld.md
    families: list[TinyFamily] = field(default_factory=lambda: ["gains_losses", "shared_containers"])
    # the strategies a gold solution may use, drawn uniformly per problem among those that solve its family
    strategies: list[TinyStrategy] = field(default_factory=lambda: list(typing.get_args(TinyStrategy)))


@dataclass
class BootstrapConfig:
    """The from-scratch base policy of the tiny world (stages.bootstrap, docs/tinyworld.md)."""

    architecture: str = "llama"  # a transformers config family (Llama-style keeps the tokenizer as trained)
    vocab_size: int = bounded(512, ge=1)  # BPE vocabulary cap (the tiny world's text needs about 420)
    hidden_size: int = bounded(192, ge=1)
    num_layers: int = bounded(4, ge=1)
    num_heads: int = bounded(4, ge=1)
    intermediate_size: int = bounded(512, ge=1)
    max_position_embeddings: int = bounded(256, ge=1)
    # train on every strategy's template of each problem (false: on its gold solution only); docs/tinyworld.md
    every_strategy: bool = True
    train_seconds: float = bounded(3600.0, gt=0)  # wall-clock safety net: a run still training then stops, with a loud warning
    max_train_steps: int = bounded(100000, ge=1)  # optimizer steps: what bounds the run
    batch_size: int = bounded(32, ge=1)
    lr: float = bounded(3e-3, gt=0)
    min_lr_ratio: float = bounded(0.1, ge=0, le=1)  # the cosine ends at lr * min_lr_ratio
    warmup_steps: int = bounded(50, ge=0)
    weight_decay: float = bounded(0.01, ge=0)
    grad_clip: float = bounded(1.0, ge=0)  # 0: no clipping
    save_every: int = bounded(0, ge=0)  # optimizer steps between resumable checkpoints (0: only the final model)
    torch_threads: int = bounded(0, ge=0)  # threads while training (0 = model.torch_threads / torch's default)
    seed: int = seed_field()
    eval_problems: int = bounded(200, ge=0)  # held-out test problems for the greedy-accuracy report
    eval_samples: int = bounded(4, ge=1)  # samples per problem at sample_temperature (sampled accuracy, pass@k, maj@k)
    sample_temperature: float = bounded(0.6, ge=0, le=MAX_TEMPERATURE)
    mc_problems: int = bounded(8, ge=0)  # problems whose sampled step prefixes get Monte Carlo values
    mc_rollouts: int = bounded(16, ge=0)  # continuations per prefix
    retrain: bool = False  # train again even when bootstrap/ holds a model made with this config


@dataclass
class MCTSConfig:
    """OmegaPRM-style rollout data generation (paper 3.1, appendix E.1)."""

    k: int = bounded(16, ge=1)  # rollouts per MC estimate (paper: 96)
    temperature: float = bounded(0.6, ge=0, le=MAX_TEMPERATURE)
    top_p: float = bounded(1.0, gt=0, le=1)
    alpha: float = bounded(0.5, gt=0, le=1)  # Q = alpha^(1-MC) * beta^(len/L)
    beta: float = bounded(0.9, gt=0, le=1)
    length_scale: float = bounded(500.0, gt=0)  # L, in tokens
    c_puct: float = bounded(0.125, ge=0)
    max_iterations: int = bounded(4, ge=0)  # selections per problem
    max_rollouts: int = bounded(160, ge=1)  # rollout budget per problem
    search_trivial: bool = False  # also search problems with MC(root) of 0 or 1
    max_problems: int | None = bounded(60, ge=1)
    shard: str = "0/1"  # i/n: this process handles problems with index % n == i
    problems_per_commit: int = bounded(8, ge=1)
    # problems in flight at once: bounds one round's generator call to max_active x k rollouts
    # (memory) and lets finished problems be committed while later ones start
    max_active: int | None = bounded(256, ge=1)


@dataclass
class RolloutTemperatureConfig:
    """make rollout-temperature: the policy's per-step slip rate, sampled accuracy and share of
    problems MCTS would search, by rollout temperature (stages.rollout_temperature, docs/mcts.md)."""

    temperatures: list[float] = bounded(default_factory=lambda: [0.6, 0.8, 1.0, 1.2, 1.4], gt=0, le=MAX_TEMPERATURE)
    problems: int = bounded(200, ge=1)  # held-out problems (data.validation) sampled at each temperature
    k: int | None = bounded(None, ge=1)  # samples per problem (null: mcts.k, the rollouts of an MC estimate at the root)
    seed: int = seed_field()


@dataclass
class AugmentConfig:
    """Similarity-grouped augmentation (paper 3.2)."""

    similarity_threshold: float = bounded(0.85, ge=0, le=1)
    include_mcts: bool = True
    val_fraction: float = bounded(0.1, gt=0, lt=1)  # both splits must hold problems
    seed: int = seed_field()


@dataclass
class PRMConfig:
    """PRM training and validation (paper 3.3, appendix E.2-E.5; docs/prm.md)."""

    # training and held-out records: ours (make augment) or PRM800K-format human labels (docs/prm.md)
    train_path: str = "{run_dir}/augment/prm_train.jsonl"
    val_path: str = "{run_dir}/augment/prm_val.jsonl"
    prm800k_neutral_label: float = bounded(1.0, ge=0, le=1)  # the label of a PRM800K rating 0 (1 -> 1.0, -1 -> 0.0)
    # the training targets: soft = the stored label (the MC value, paper 3.3); hard = 1 where it exceeds
    # hard_label_threshold, else 0 (Zhang et al. 2025, "The Lessons of Developing PRMs": threshold 0; docs/prm.md)
    labels: PRMLabels = "soft"
    hard_label_threshold: float = bounded(0.0, ge=0, lt=1)
    # weight of the Bradley-Terry ranking loss over sibling steps (same prefix, different labels), added to the BCE;
    # 0: BCE alone (the paper). > 0 also keeps siblings in one micro-batch (docs/prm.md, "Sibling ranking loss")
    pair_loss_weight: float = bounded(0.0, ge=0)
    lr: float = bounded(1e-3, gt=0)  # paper: 8e-6
    batch_size: int = bounded(32, ge=1)  # sequences per optimizer step, all processes together (paper: 144 examples)
    micro_batch_size: int = bounded(32, ge=1)  # sequences per forward and process; accumulation = batch_size / (micro x processes)
    weight_decay: float = bounded(0.01, ge=0)  # AdamW; never on biases and norm weights
    epochs: float = bounded(2.0, gt=0)  # paper: 1; fractions allowed
    warmup_ratio: float = bounded(0.05, ge=0, le=1)  # share of optimizer steps with linear warmup
    scheduler: str = "cosine"  # cosine | linear | constant (after warmup)
    max_grad_norm: float = bounded(1.0, ge=0)  # gradient clipping (0: none)
    max_length: int = bounded(512, ge=2)  # tokens; labels of steps ending beyond it are dropped (and counted)
    group_by_length: bool = False  # length-bucketed micro-batches: less padding, but label-homogeneous batches (docs/prm.md)
    merge_prefixes: bool = True  # records whose path is a prefix of another share one sequence
    kind: str | None = None  # prompt kind (tiny | math | gsm8k | sat); None = the training problems' kind
    lora: bool = False  # LoRA on the backbone; the saved model has the adapters merged
    lora_r: int = bounded(16, ge=1)
    lora_alpha: int = bounded(32, ge=1)
    lora_dropout: float = bounded(0.05, ge=0, lt=1)
    lora_target_modules: list[str] = field(default_factory=lambda: ["q_proj", "k_proj", "v_proj", "o_proj"])
    gradient_checkpointing: bool = False
    compile: bool = False  # torch.compile through accelerate (GPU: 1.6x training throughput on Qwen2-0.5B shapes, docs/prm.md)
    seed: int = seed_field()
    log_every: int = bounded(10, ge=1)  # optimizer steps between metrics lines
    save_every: int = bounded(0, ge=0)  # optimizer steps between resumable checkpoints (0: only the final model)
    resume: bool = True  # continue from the newest good checkpoint under <output>/checkpoints when there is one
    retrain: bool = False  # train again even when prm/model/ holds a finished model (it is replaced once the new one is done)
    eval_only: bool = False  # stages.train_prm: validate the model at model.prm, train nothing
    corrupt_examples: int = bounded(200, ge=0)  # E.4 check: correct steps whose result is altered (+1..9 and +-1)
    # held-out problems (data.validation) the policy samples for the exact check and the slip pairs (0: off); only kinds
    # with an exact labeller (prm.validation.FIRST_ERROR_LABELLERS) are sampled
    exact_check_problems: int = bounded(200, ge=0)
    exact_check_samples: int = bounded(4, ge=1)  # samples per problem
    exact_check_temperature: float = bounded(0.6, ge=0, le=MAX_TEMPERATURE)
    prm800k_path: str | None = None  # PRM800K-format file for first-error accuracy
    score_batch_size: int = bounded(64, ge=1)  # sequences per scorer forward
    calibration_bins: int = bounded(10, ge=1)  # equal-width bins of the expected calibration error


@dataclass
class StepTrainingConfig:
    """What every fine-tuning objective's section has: the loop, sampling, optimiser and LoRA.
    Each objective reads only its own section (gfn or ppo)."""

    lr: float = bounded(5e-4, gt=0)  # paper: 5e-6
    scheduler: str = "cosine"  # cosine | linear | constant, after warmup
    warmup_steps: int = bounded(5, ge=0)
    weight_decay: float = bounded(0.0, ge=0)
    grad_clip: float = bounded(1.0, ge=0)  # paper: 1.0 (0: no clipping)
    num_train_steps: int = bounded(40, ge=1)
    questions_per_step: int = bounded(8, ge=1)
    samples_per_question: int = bounded(4, ge=1)  # K; questions_per_step x K = the paper's batch of 144
    micro_batch_size: int = bounded(32, ge=1)  # trajectories per teacher-forced forward
    temperature: float = bounded(0.6, gt=0, le=MAX_TEMPERATURE)  # sampling temperature (paper 0.6)
    min_steps: int = bounded(1, ge=0)  # samples with fewer steps are dropped (stopping at s_0 is not an action)
    lora: bool = False
    lora_r: int = bounded(16, ge=1)
    lora_alpha: int = bounded(32, ge=1)
    lora_dropout: float = bounded(0.05, ge=0, lt=1)
    lora_target_modules: list[str] = field(default_factory=lambda: ["q_proj", "k_proj", "v_proj", "o_proj"])
    save_every: int = bounded(20, ge=0)  # steps between resumable checkpoints (0: none)
    seed: int = seed_field()
    retrain: bool = False  # train again even when <stage>/model/ holds a finished model (it is replaced once the new one is done)
    mode: TrainingMode = "sync"  # sync | async (gfn only: searcher actors on Ray fill a replay buffer the trainer draws from; docs/async.md)
    # CPU cores every trainer process pins itself to (os.sched_setaffinity) when training starts, after it has started or
    # joined Ray in async mode (so Ray's own processes keep the cores the stage was started on); None: left as started
    trainer_cores: list[int] | None = bounded(None, ge=0)


@dataclass
class GFNConfig(StepTrainingConfig):
    """Step-level GFlowNet fine-tuning (paper 4, appendices F-H)."""

    loss: GFlowNetLoss = "subtb"  # subtb | tb | tb_vargrad
    lam: float = bounded(1.0, ge=0)  # SubTB lambda
    reward_temperature: float = bounded(1.0, gt=0)  # log R is multiplied by 1/this
    reference_prior_coef: float = bounded(0.0, ge=0)  # appendix F: + coef * log pi_ref(trajectory); off in the paper config
    outcome_coef: float = bounded(0.0, ge=0)  # + coef * log(correct ? 1 : outcome_floor); off in the paper config
    outcome_floor: float = bounded(0.01, gt=0, le=1)
    unfinished_log_reward: float = bounded(-10.0, le=0)  # added to log R(s) when s's last step states no final answer (s_0 too)
    # before training: the base policy's samples of this many training questions (samples_per_question each), reweighted by
    # R^(1/reward_temperature): the reward a GFlowNet could gain on them, logged and written to gfn/ceiling.json (0: skipped)
    ceiling_questions: int = bounded(32, ge=0)
    kl_coef: float = bounded(0.0, ge=0)  # TB-VarGrad: beta, the KL to the reference (at step 0 when annealed)
    kl_coef_final: float | None = bounded(None, ge=0)  # beta annealed linearly from kl_coef to this over kl_anneal_steps (None: constant)
    kl_anneal_steps: int = bounded(0, ge=0)  # trainer steps of the linear beta anneal (then kl_coef_final)
    reference_reset_every: int = bounded(0, ge=0)  # rho: every rho updates the reference becomes the current policy (0: never; TBA': 50)
    learn_log_z: bool = True  # TB: a learned log Z per run; ignored by subtb / tb_vargrad
    log_z_lr: float = bounded(1e-2, gt=0)
    buffer_size: int = bounded(1000, ge=0)  # paper: 1000
    buffer_priority: str = "softmax"  # softmax | proportional
    buffer_temperature: float = bounded(1.0, gt=0)
    recency_fraction: float = bounded(0.5, ge=0, le=1)  # TBA's m
    replay_fraction: float = bounded(0.5, ge=0)  # replayed trajectories per fresh one in each batch (sync mode)
    # asynchronous mode (mode=async; TBA, Bartoldson et al.; docs/async.md): searcher actors sample questions_per_step
    # questions x samples_per_question (S) completions each round with the newest published weights, into one buffer
    # (buffer_size completions, FIFO); each trainer step draws async_questions (B) questions x async_samples_used (K)
    # distinct completions, a question's group from the newest weights' completions with probability recency_fraction (m)
    searchers: int = bounded(2, ge=1)  # searcher actors
    sync_every: int = bounded(1, ge=1)  # trainer steps between weight publications (TBA's k)
    async_questions: int | None = bounded(None, ge=1)  # B, questions per trainer step (None: questions_per_step)
    async_samples_used: int | None = bounded(None, ge=1)  # K <= S, distinct completions per question in a batch (None: S)
    async_initial_completions: int = bounded(0, ge=0)  # the first step waits until the buffer holds this many (paper: 500)
    async_priority: AsyncPriority = "softmax"  # softmax (p ~ exp(log_reward / buffer_temperature)) | uniform: a question's K completions
    searcher_rounds_per_version: int | None = bounded(None, ge=1)  # rounds a searcher samples per published version (None: no limit)
    max_staleness: int | None = bounded(16, ge=0)  # completions sampled by weights more than this many trainer steps old are dropped (None: kept)
    ray_address: str | None = None  # None: start a local Ray instance; "auto" or host:port: join that cluster
    ray_connect_timeout: float = bounded(30.0, gt=0)  # seconds to wait for the cluster at ray_address to answer
    searcher_max_restarts: int = bounded(10, ge=0)  # Ray restarts a dead searcher this many times; one more death stops the run
    searcher_gpus: float = bounded(0.0, ge=0)  # GPUs per searcher actor (0 on CPU; e.g. 1 with one GPU per searcher)
    placement_timeout: float = bounded(60.0, gt=0)  # seconds to wait for Ray to place the trainer's and searchers' bundles
    # CPU cores searcher i pins its process to (os.sched_setaffinity): searcher_cores[i % len]; None: wherever the OS runs it
    searcher_cores: list[int] | None = bounded(None, ge=0)
    weight_transport: WeightTransport = "object_store"  # object_store (Ray, any cluster) | collective (a NCCL group per GPU searcher, gloo on CPU)


@dataclass
class PPOConfig(StepTrainingConfig):
    """PPO baseline with step-level PRM rewards (paper 5, appendix D)."""

    clip: float = bounded(0.2, gt=0)
    value_coef: float = bounded(0.5, ge=0)
    entropy_coef: float = bounded(0.01, ge=0)
    gamma: float = bounded(1.0, ge=0, le=1)
    gae_lambda: float = bounded(0.95, ge=0, le=1)
    kl_coef: float = bounded(0.0, ge=0)  # KL penalty to the frozen reference, folded into step rewards
    step_reward: str = "score"  # score: r_k = U (paper) | log_score: r_k = log U, return log R (no gain from extra steps)
    unfinished_reward: float = bounded(-1.0, le=0)  # added to the last step's reward when it states no final answer
    ppo_epochs: int = bounded(2, ge=1)


@dataclass
class EvalConfig:
    """Accuracy and diversity evaluation (paper 5, Tables 2 and 4)."""

    benchmarks: list[str] = field(default_factory=lambda: ["tiny_test"])  # names in pipeline.problems / tiny
    benchmark_paths: dict[str, str] = field(default_factory=dict)  # name -> local file (or "hub"); absent: the repository's copy
    max_problems: int | None = bounded(100, ge=1)
    models: dict[str, str] = field(
        default_factory=lambda: {
            "base": "{run_dir}/bootstrap/model",
            "ppo": "{run_dir}/ppo/model",
            "gfn": "{run_dir}/gfn/model",
        }
    )
    k: int = bounded(8, ge=1)  # samples per problem
    temperature: float = bounded(0.6, ge=0, le=MAX_TEMPERATURE)
    greedy: bool = True
    embedder: str | None = None  # None = offline all-MiniLM-L6-v2; paper: sentence-transformers/paraphrase-MiniLM-L6-v2
    prm: str | None = None  # a trained PRM: report each model's mean PRM reward R = prod U on its samples (skipped if absent)
    pairs: list[list[str]] = field(default_factory=lambda: [["gfn", "ppo"]])  # [a, b]: also report a minus b, paired (Table 4)
    bootstrap_resamples: int = bounded(2000, ge=1)
    seed: int = seed_field()
    # i/n: this process samples the problems with index % n == i of every (model, benchmark) into
    # reports/<run>/samples/shards/ and stops; 0/1 samples whatever is missing, merges and scores
    # (python -m stages.launch eval sets it, one worker per GPU)
    shard: str = "0/1"
    problems_per_commit: int = bounded(64, ge=1)  # problems sampled per generate call and committed together


@dataclass
class SearchConfig:
    """PRM-guided search at inference (paper 3.4, Figure 2)."""

    strategies: list[SearchStrategy] = field(default_factory=lambda: ["step_best_of_k", "beam", "best_of_n", "weighted_vote"])
    ks: list[int] = bounded(default_factory=lambda: [1, 2, 4, 8, 16], ge=1)
    temperature: float = bounded(0.8, ge=0, le=MAX_TEMPERATURE)
    max_depth: int = bounded(12, ge=1)
    beam_width: int = bounded(4, ge=1)
    # last | mean | min | prod: a partial or whole solution's score from its step scores. last: the
    # PRM is trained on Monte Carlo values, so U of the last step estimates P(correct) of the whole
    # prefix (of the answer, for a finished one) and compares solutions of any length; min and
    # prod can only fall as steps are added and prefer short solutions (docs/search.md)
    aggregation: Aggregation = "last"
    benchmark: str = "tiny_test"
    benchmark_path: str | None = None
    max_problems: int | None = bounded(100, ge=1)
    seed: int = seed_field()
    # i/n: this process searches the problems with index % n == i into runs/<run>/search/shards/
    # and stops; 0/1 searches whatever is missing and writes the results over every problem
    # (python -m stages.launch search sets it, one worker per GPU)
    shard: str = "0/1"
    problems_per_commit: int = bounded(32, ge=1)  # problems searched together (every strategy and k) and committed together


@dataclass
class PRMBenchConfig:
    """The ProcessBench protocol for the PRM at model.prm (stages.prm_bench, docs/prm.md "ProcessBench")."""

    processbench_paths: list[str] = field(default_factory=list)  # ProcessBench-format JSON/JSONL files, or hub splits hf://owner/name/split
    prm800k_path: str | None = None  # PRM800K phase-2 ratings: the first step rated -1 is the label
    policy_problems: int = bounded(100, ge=0)  # held-out problems (data.validation) the policy samples, labelled exactly where the kind can be (0: off)
    policy_samples: int = bounded(4, ge=1)  # samples per problem
    temperature: float = bounded(0.6, ge=0)
    held_out_fraction: float = bounded(0.5, gt=0, lt=1)  # share of each set's cases the threshold is chosen on
    threshold: float | None = bounded(None, gt=0, lt=1)  # a fixed threshold instead (every case is then scored)
    bootstrap_resamples: int = bounded(1000, ge=1)
    seed: int = seed_field()


@dataclass
class PlanConfig:
    """The machine `make plan` checks the config against (stages/plan.py, docs/real-model.md)."""

    processes: int = bounded(1, ge=1)  # processes of make prm / gfn / ppo (accelerate launch); one GPU each
    gpu: str = "A100-80GB"  # a GPU type of eval.plan.GPUS: its memory and peak bf16 FLOP/s
    gpu_memory_gb: float | None = bounded(None, gt=0)  # GiB per GPU; None: the GPU type's
    # stage (prm, gfn, ppo) -> the accelerate config file it is launched with; a stage not named
    # runs as DDP (one whole copy per process), or as one plain process when processes is 1
    accelerate: dict[str, str] = field(default_factory=dict)
    generation_mfu: float = bounded(0.10, gt=0, le=1)  # assumed share of peak FLOP/s when sampling (2 x parameters a token)
    training_mfu: float = bounded(0.35, gt=0, le=1)  # assumed share when training (6 x parameters a token) or scoring
    prompt_tokens: int = bounded(256, ge=1)  # assumed prompt length (chat template + question) in tokens


@dataclass
class Config:
    """The whole pipeline's configuration."""

    run: str = "demo"
    runs_root: str = "runs"  # relative: below the working folder; absolute: anywhere (explicit)
    seed: int = seed_field()  # every section's seed unless the section sets its own (tiny world, training, sampling, evaluation)
    report_to: ReportTo = "none"  # experiment trackers of every trainer: none | tensorboard | wandb | all (extra `tracking`)
    model: ModelConfig = field(default_factory=ModelConfig)
    generation: GenerationConfig = field(default_factory=GenerationConfig)
    format: FormatConfig = field(default_factory=FormatConfig)
    data: DataConfig = field(default_factory=DataConfig)
    tinyworld: TinyWorldConfig = field(default_factory=TinyWorldConfig)
    bootstrap: BootstrapConfig = field(default_factory=BootstrapConfig)
    mcts: MCTSConfig = field(default_factory=MCTSConfig)
    rollout_temperature: RolloutTemperatureConfig = field(default_factory=RolloutTemperatureConfig)
    augment: AugmentConfig = field(default_factory=AugmentConfig)
    prm: PRMConfig = field(default_factory=PRMConfig)
    gfn: GFNConfig = field(default_factory=GFNConfig)
    ppo: PPOConfig = field(default_factory=PPOConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    search: SearchConfig = field(default_factory=SearchConfig)
    prm_bench: PRMBenchConfig = field(default_factory=PRMBenchConfig)
    plan: PlanConfig = field(default_factory=PlanConfig)

    @property
    def run_dir(self) -> Path:
        return Path(self.runs_root) / self.run

    def stage_dir(self, stage: str) -> Path:
        return self.run_dir / stage

    def resolve(self, value: str | None) -> str | None:
        """Substitute ``{run_dir}`` in a path-like string field."""
        if value is None:
            return None
        return value.replace("{run_dir}", str(self.run_dir))

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


# ----------------------------------------------------------------------------- loading


_EXPONENT_FLOAT = re.compile(r"[-+]?(\d+\.?\d*|\.\d+)[eE][-+]?\d+")
MAX_CONFIG_BYTES = 64 << 10  # a config is a few kilobytes (configs/: 2-3 KB); PyYAML parses ~70 KB/s of nested flow lists
MAX_OVERRIDE_CHARS = 16 << 10
_RUN_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*")
_SHOW = reprlib.Repr()  # (3.11's Repr takes no keyword arguments)
_SHOW.maxlevel, _SHOW.maxtuple, _SHOW.maxlist, _SHOW.maxdict, _SHOW.maxset = 2, 4, 4, 4, 4
_SHOW.maxstring, _SHOW.maxlong, _SHOW.maxother = 60, 40, 60


def _show(value: Any) -> str:
    """A value for an error message, at most a few dozen characters whatever its size (reprlib
    stops early: it never formats the whole of a huge nested value)."""
    return _SHOW.repr(value)


class _NoAliasLoader(yaml.SafeLoader):
    """yaml.SafeLoader that refuses aliases when it meets one, before anything is expanded: a
    409-byte file of nested aliases ("billion laughs") would otherwise expand to 10^9 values in
    every consumer that walks them (the type check, repr, save_config). A config never needs one."""

    def compose_node(self, parent, index):
        if self.check_event(yaml.AliasEvent):
            event = self.peek_event()
            raise yaml.composer.ComposerError(None, None, f"the alias *{event.anchor} is not allowed: configs do not use YAML "
                                              "anchors and aliases (write the value out)", event.start_mark)
        return super().compose_node(parent, index)


def _yaml_load(text: str) -> Any:
    """yaml.safe_load without aliases; RecursionError (nesting deeper than the parser's stack)
    becomes a YAMLError."""
    try:
        return yaml.load(text, Loader=_NoAliasLoader)  # a SafeLoader subclass
    except RecursionError:
        raise yaml.YAMLError("nested too deeply") from None


def _type_name(tp: Any) -> str:
    if choices_of(tp) is not None:  # a choice reads as its values' type; describe_fields lists the choices
        return type(typing.get_args(tp)[0]).__name__
    return getattr(tp, "__name__", None) or str(tp).replace("typing.", "")


def _coerce(value: Any, tp: Any, key: str, where: str) -> Any:
    """Check ``value`` against the annotation ``tp``; return it (ints widen to floats)."""
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        args = typing.get_args(tp)
        if value is None and type(None) in args:
            return None
        for arg in args:
            if arg is type(None):
                continue
            try:
                return _coerce(value, arg, key, where)
            except ConfigError:
                pass
        raise ConfigError(f"{where}: {key} expects {_type_name(tp)}, got {_show(value)}")
    if origin is list:
        (item_tp,) = typing.get_args(tp)
        if not isinstance(value, list):
            raise ConfigError(f"{where}: {key} expects a list, got {_show(value)}")
        return [_coerce(v, item_tp, f"{key}[{i}]", where) for i, v in enumerate(value)]
    if origin is dict:
        key_tp, val_tp = typing.get_args(tp)
        if not isinstance(value, dict):
            raise ConfigError(f"{where}: {key} expects a mapping, got {_show(value)}")
        return {
            _coerce(k, key_tp, f"{key}.<key>", where): _coerce(v, val_tp, f"{key}.{k}", where)
            for k, v in value.items()
        }
    if origin is Literal:
        return check_choice(value, tp, key, where)
    if tp is bool:
        if isinstance(value, bool):
            return value
    elif tp is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
    elif tp is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
        # PyYAML follows YAML 1.1, which reads 1e-4 (no dot) as a string; accept such literals.
        if isinstance(value, str) and _EXPONENT_FLOAT.fullmatch(value.strip()):
            return float(value)
    elif tp is str:
        if isinstance(value, str):
            return value
    elif tp is Any:
        return value
    raise ConfigError(f"{where}: {key} expects {_type_name(tp)}, got {_show(value)} ({type(value).__name__})")


def _apply(obj: Any, updates: dict[str, Any], prefix: str, where: str, sources: dict[str, str]) -> None:
    hints = typing.get_type_hints(type(obj))
    names = {f.name for f in dataclasses.fields(obj)}
    for name, value in updates.items():
        key = f"{prefix}{name}"
        if name not in names:
            raise ConfigError(f"{where}: unknown key '{_show(key)}' (known: {', '.join(sorted(names))})")
        tp = hints[name]
        current = getattr(obj, name)
        if dataclasses.is_dataclass(current):
            if not isinstance(value, dict):
                raise ConfigError(f"{where}: {key} expects a mapping of its fields, got {_show(value)}")
            _apply(current, value, f"{key}.", where, sources)
        else:
            value = _coerce(value, tp, key, where)
            setattr(obj, name, value)
            sources[key] = where


def _apply_override(config: Config, keys: list[str], value: Any, sources: dict[str, str]) -> None:
    """One ``a.b.c=value`` override. A key inside a mapping field changes that entry only
    (``eval.models.base=X`` keeps the other models; a new name adds one); the field itself
    (``eval.models={base: X}``) is replaced whole, as a YAML file replaces it."""
    where = "command line"
    obj, prefix = config, ""
    for depth, name in enumerate(keys):
        names = {f.name for f in dataclasses.fields(obj)}
        if name not in names:
            raise ConfigError(f"{where}: unknown key {_show(prefix + name)} (known: {', '.join(sorted(names))})")
        current = getattr(obj, name)
        rest = keys[depth + 1:]
        if dataclasses.is_dataclass(current) and rest:
            obj, prefix = current, f"{prefix}{name}."
            continue
        if rest and isinstance(current, dict):
            if len(rest) > 1:
                raise ConfigError(f"{where}: {prefix}{name}.{'.'.join(rest)}: {prefix}{name} maps names to values; "
                                  f"expected {prefix}{name}.<name>=value")
            _, value_type = typing.get_args(typing.get_type_hints(type(obj))[name])
            key = f"{prefix}{name}.{rest[0]}"
            setattr(obj, name, {**current, rest[0]: _coerce(value, value_type, key, where)})
            sources[key] = where
            return
        if rest:
            raise ConfigError(f"{where}: unknown key {_show('.'.join(keys))} ({prefix}{name} has no fields)")
        _apply(obj, {name: value}, prefix, where, sources)
        return


def parse_override(text: str) -> tuple[list[str], Any]:
    """``a.b=value`` -> (["a", "b"], value parsed as a YAML scalar/list)."""
    if "=" not in text:
        raise ConfigError(f"command line: override {_show(text)} is not of the form key=value")
    if len(text) > MAX_OVERRIDE_CHARS:
        raise ConfigError(f"command line: override {_show(text)} has {len(text)} characters; at most {MAX_OVERRIDE_CHARS}")
    key, raw = text.split("=", 1)
    key = key.strip()
    if not key:
        raise ConfigError(f"command line: override {_show(text)} has an empty key")
    try:
        value = _yaml_load(raw) if raw.strip() != "" else ""
    except yaml.composer.ComposerError as exc:  # an alias: refused, not read as a string
        raise ConfigError(f"command line: {key}: {exc.problem}") from None
    except yaml.YAMLError:
        value = raw
    return key.split("."), value


def check_ranges(config: Config, sources: dict[str, str] | None = None) -> None:
    """Every numeric field within its declared range (``bounded``), and the few rules that span
    fields; raises ConfigError "<file>: <key> = <value> is out of range: expected <range>"."""
    sources = sources or {}

    def fail(key: str, message: str) -> None:
        raise ConfigError(f"{sources.get(key, 'default')}: {key} {message}")

    def walk(obj: Any, prefix: str) -> None:
        for spec in dataclasses.fields(obj):
            value, key = getattr(obj, spec.name), f"{prefix}{spec.name}"
            if dataclasses.is_dataclass(value):
                walk(value, f"{key}.")
                continue
            allowed = spec.metadata.get(_RANGE_KEY)
            if allowed is None or value is None:
                continue
            for index, item in enumerate(value if isinstance(value, list) else [value]):
                if isinstance(item, (int, float)) and not isinstance(item, bool) and not allowed.contains(item):
                    shown = f"[{index}] = {_show(item)}" if isinstance(value, list) else f"= {_show(item)}"
                    fail(key, f"{shown} is out of range: expected {allowed}")

    walk(config, "")
    if config.tinyworld.min_ops > config.tinyworld.max_ops:
        fail("tinyworld.max_ops", f"= {config.tinyworld.max_ops} is below tinyworld.min_ops = {config.tinyworld.min_ops}")
    if config.data.problem_sources and config.data.train not in SOURCE_FILTERED_DATA:
        fail("data.problem_sources", f"= {_show(config.data.problem_sources)} filters {', '.join(SOURCE_FILTERED_DATA)} problems "
             f"only, but data.train is {_show(config.data.train)}: set data.problem_sources=[]")
    for key, shard in (("mcts.shard", config.mcts.shard), ("eval.shard", config.eval.shard), ("search.shard", config.search.shard)):
        try:
            parse_shard(shard)  # what the stage reads it with
        except ValueError:
            fail(key, f"= {_show(shard)}: expected i/n with 0 <= i < n (e.g. 0/4)")


def check_run_location(config: Config, sources: dict[str, str] | None = None) -> None:
    """``run`` is one plain folder name; ``runs_root`` is absolute (the user's explicit choice) or
    a relative path without '..' (it stays below the working folder). Checked at load time, so a
    stage writes nothing (not even config.yaml) outside the runs folder."""
    sources = sources or {}
    if not _RUN_NAME.fullmatch(config.run):
        raise ConfigError(f"{sources.get('run', 'default')}: run = {_show(config.run)}: expected one folder name "
                          "(letters, digits, '.', '_', '-'; not starting with '.'), so the run stays inside runs_root")
    root = Path(config.runs_root)
    if not config.runs_root.strip() or (not root.is_absolute() and ".." in root.parts):
        raise ConfigError(f"{sources.get('runs_root', 'default')}: runs_root = {_show(config.runs_root)}: a relative runs_root "
                          "may not leave the working folder ('..'); give an absolute path to put runs elsewhere")


def load_config(path: str | Path | None = None, overrides: list[str] | None = None) -> Config:
    """Defaults, then the YAML file, then ``key=value`` overrides, all type- and range-checked. A
    section's ``seed`` that neither sets is the top-level ``seed``: ``seed=3`` reseeds the whole pipeline."""
    config = Config()
    sources: dict[str, str] = {}
    if path is not None:
        path = Path(path)
        if not path.is_file():
            raise ConfigError(f"{path}: config file not found")
        size = path.stat().st_size
        if size > MAX_CONFIG_BYTES:
            raise ConfigError(f"{path}: {size} bytes; a config file may hold at most {MAX_CONFIG_BYTES}")
        try:
            data = _yaml_load(path.read_text(encoding="utf-8")) or {}
        except UnicodeDecodeError as exc:
            raise ConfigError(f"{path}: not UTF-8 text (byte {exc.start})") from None
        except yaml.YAMLError as exc:
            raise ConfigError(f"{path}: not valid YAML: {str(exc)[:500]}") from None
        if not isinstance(data, dict):
            raise ConfigError(f"{path}: expected a mapping at the top level")
        _apply(config, data, "", str(path), sources)
    for text in overrides or []:
        keys, value = parse_override(text)
        _apply_override(config, keys, value, sources)
    for section in dataclasses.fields(config):
        value = getattr(config, section.name)
        if dataclasses.is_dataclass(value) and hasattr(value, "seed") and f"{section.name}.seed" not in sources:
            value.seed = config.seed
            if "seed" in sources:
                sources[f"{section.name}.seed"] = sources["seed"]
    check_ranges(config, sources)
    check_run_location(config, sources)
    return config


def save_config(config: Config, path: str | Path) -> None:
    """Write the resolved config beside a stage's outputs (atomically: processes of a sharded
    stage write the same folder)."""
    write_text_atomic(path, config_text(config))


def config_text(config: Config) -> str:
    """The resolved config as YAML: what save_config writes and ``print_config=true`` prints."""
    return yaml.safe_dump(config.to_dict(), sort_keys=False, allow_unicode=True)


def describe_fields(config: Any = None, prefix: str = "") -> list[str]:
    """One line per config field, from the dataclasses above: ``section.key: type = default``,
    with the declared range or choices. What a stage's ``--help`` lists."""
    config = Config() if config is None else config
    hints = typing.get_type_hints(type(config))
    lines = []
    for item in dataclasses.fields(config):
        key, value = prefix + item.name, getattr(config, item.name)
        if dataclasses.is_dataclass(value):
            lines.append(f"{key}:")
            lines.extend("  " + line for line in describe_fields(value, key + "."))
            continue
        extra = [str(item.metadata[_RANGE_KEY])] if _RANGE_KEY in item.metadata else []
        tp = hints[item.name]
        choices = choices_of(typing.get_args(tp)[0] if typing.get_origin(tp) is list else tp)
        extra += [f"one of {', '.join(map(str, choices))}"] if choices is not None else []
        shown = json.dumps(value, ensure_ascii=False)  # JSON is YAML: a default reads as it would be written
        lines.append(f"{key}: {_type_name(hints[item.name])} = {shown}" + (f"  ({'; '.join(extra)})" if extra else ""))
    return lines
