"""The config schema: one dataclass per stage, every field typed, documented and bounded.

A config file is a YAML mapping with top-level fields (run, seed, runs_root) and one section
per stage (``mcts:``, ``prm:``, ...). Command-line overrides use dotted keys:
``python -m stages.mcts --config configs/tiny.yaml run=demo mcts.k=8``. Reading them is
pipeline.config.loader's job (``load_config``), which checks every value against the
annotations here: unknown keys, values of the wrong type, out of range (``bounded``) or outside a
``Literal`` are errors naming the key and the file (or "command line"). How a field declares its
range is pipeline.config.rules', which names it may take pipeline.config.choices'; the gfn
section's asynchronous-mode fields are pipeline.config.asynchronous's ``AsyncSettings``.

String fields may contain ``{run_dir}``, replaced by ``<runs_root>/<run>`` when resolved, so
a stage finds the artifacts of the stages before it without hard-coded paths.
Paper defaults are in configs/paper/*.yaml; the defaults here are the tiny world's.
"""

from __future__ import annotations

import dataclasses
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pipeline.config.asynchronous import AsyncSettings
from pipeline.config.choices import (
    Aggregation,
    BufferKey,
    BufferPriority,
    BufferScope,
    GenerationBackend,
    GFlowNetLoss,
    GPUType,
    LogFlow,
    ModelDtype,
    PRMFormat,
    PRMLabels,
    ReportTo,
    Schedule,
    SearchStrategy,
    TinyFamily,
    TinyStrategy,
    TrainingMode,
)
from pipeline.config.claims import ClaimsConfig, ExperimentConfig
from pipeline.config.rules import bounded, seed_field

MAX_TEMPERATURE = (
    2.0  # vLLM's SamplingParams refuses more; both backends follow vLLM's rules (pipeline.generation.base)
)


# The data.train loaders (pipeline.datasets.loaders) that take data.problem_sources: the other sources
# carry no problem_source to filter on
SOURCE_FILTERED_DATA = ("openmathinstruct2",)


@dataclass
class ModelConfig:
    """Which models the stages load, and how (any hub id or local path)."""

    policy: str = "{run_dir}/bootstrap/model"  # paper: meta-llama/Llama-3.2-3B-Instruct (or 3.1-8B)
    policy_adapter: str | None = None  # optional peft adapter on top of `policy`
    prm_backbone: str = "{run_dir}/bootstrap/model"  # paper: Qwen/Qwen2.5-Math-7B
    prm: str = (
        "{run_dir}/prm/model"  # the trained PRM the later stages score with (or a third-party PRM: hub id or path)
    )
    # how to read the PRM a stage loads (model.prm; eval.prm in make eval): auto (sniffed from its folder) | stepflow |
    # token_classification (TRL's PRMTrainer) | math_shepherd | qwen_prm (docs/prm.md, "Other PRMs")
    prm_format: PRMFormat = "auto"
    trust_remote_code: bool = False  # never on unless you trust the repository
    device: str = "auto"  # auto | cpu | cuda | cuda:N (DEVICE_PATTERN)
    dtype: ModelDtype = "auto"  # auto (float32 on CPU, bfloat16 on GPU) | float32 | bfloat16 | float16
    attn_implementation: str | None = None  # None = transformers' default; "eager" is faster for tiny CPU models
    torch_threads: int = bounded(0, ge=0)  # 0 = leave torch's default


@dataclass
class GenerationConfig:
    """The generation backend shared by every stage that samples."""

    backend: GenerationBackend = "hf"  # hf | vllm
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
    # vLLM's batch-invariant mode (VLLM_BATCH_INVARIANT=1, set before every engine starts): a prompt's samples do not depend
    # on the rest of the engine's batch; vLLM 0.32: CUDA GPUs of compute capability 8-10, ROCm, XPU; slower (pipeline/generation/base.py)
    vllm_batch_invariant: bool = False


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

    train: str = "problems"  # a pipeline.datasets.loaders benchmark name (paper: openmathinstruct2)
    # a *_path: a file; null: the repository's copy (data/benchmarks/), else the hub's; "hub": the hub's
    # (the tiny world: the reinforcement-learning split, problems the bootstrap never trained on)
    train_path: str | None = "{run_dir}/bootstrap/problems_rl.jsonl"
    # problems-contract files (JSONL or a JSON array) that may share no question with data.train's
    # problems, e.g. the base policy's own training problems: a shared question is an error naming
    # both files and the first such problem (stages.inputs.training_problems)
    disjoint_from: list[str] = field(default_factory=list)
    train_limit: int | None = bounded(None, ge=1)  # paper: 10000
    validation: str = "problems"
    validation_path: str | None = "{run_dir}/bootstrap/problems_val.jsonl"
    validation_limit: int | None = bounded(None, ge=1)
    problem_sources: list[str] = field(
        default_factory=list
    )  # data.train's OpenMathInstruct-2 filter, e.g. [augmented_math]
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
    train_seconds: float = bounded(
        3600.0, gt=0
    )  # wall-clock safety net: a run still training then stops, with a loud warning
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
    # also the temperature of the Monte Carlo rollouts: > 0 when mc_problems and mc_rollouts are (check_ranges)
    sample_temperature: float = bounded(0.6, ge=0, le=MAX_TEMPERATURE)
    mc_problems: int = bounded(8, ge=0)  # problems whose sampled step prefixes get Monte Carlo values
    mc_rollouts: int = bounded(16, ge=0)  # continuations per prefix
    retrain: bool = False  # train again even when bootstrap/ holds a model made with this config


@dataclass
class MCTSConfig:
    """OmegaPRM-style rollout data generation (paper 3.1, appendix E.1)."""

    k: int = bounded(16, ge=1)  # rollouts per MC estimate (paper: 96)
    # the rollouts of every Monte Carlo value (the labels) and the ones augmentation reuses (paper: 0.6);
    # > 0, since at 0 the k rollouts are one greedy continuation and every MC value is 0 or 1
    temperature: float = bounded(0.6, gt=0, le=MAX_TEMPERATURE)
    # the root's k rollouts only: which problems are searched (0 < MC(root) < 1) and the first wrong
    # paths the binary search starts from; null: temperature (docs/mcts.md, "Rollout temperature")
    root_temperature: float | None = bounded(None, gt=0, le=MAX_TEMPERATURE)
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
    k: int | None = bounded(
        None, ge=1
    )  # samples per problem (null: mcts.k, the rollouts of an MC estimate at the root)
    seed: int = seed_field()


@dataclass
class MCAuditConfig:
    """make mc-audit: what the Monte Carlo path can teach a PRM about slips: the MC values of the exact
    check's slip pairs by rollout temperature, and the PRM data's slip-holding prefixes and clean
    slip/counterpart pairs (stages.mc_audit, prm.mc_audit, docs/prm.md)."""

    temperatures: list[float] = bounded(default_factory=lambda: [0.6, 1.2], gt=0, le=MAX_TEMPERATURE)
    k: int | None = bounded(None, ge=1)  # rollouts per MC estimate (null: mcts.k)
    max_pairs: int = bounded(200, ge=0)  # slip pairs whose MC values are estimated, the first ones (0: none)
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
    micro_batch_size: int = bounded(
        32, ge=1
    )  # sequences per forward and process; accumulation = batch_size / (micro x processes)
    weight_decay: float = bounded(0.01, ge=0)  # AdamW; never on biases and norm weights
    epochs: float = bounded(2.0, gt=0)  # paper: 1; fractions allowed
    torch_threads: int = bounded(0, ge=0)  # threads while training (0 = model.torch_threads / torch's default)
    warmup_ratio: float = bounded(0.05, ge=0, le=1)  # share of optimizer steps with linear warmup
    scheduler: Schedule = "cosine"  # cosine | linear | constant (after warmup)
    max_grad_norm: float = bounded(1.0, ge=0)  # gradient clipping (0: none)
    max_length: int = bounded(512, ge=2)  # tokens; labels of steps ending beyond it are dropped (and counted)
    group_by_length: bool = (
        False  # length-bucketed micro-batches: less padding, but label-homogeneous batches (docs/prm.md)
    )
    merge_prefixes: bool = True  # records whose path is a prefix of another share one sequence
    kind: str | None = None  # prompt kind (tiny | math | gsm8k | sat); None = the training problems' kind
    lora: bool = False  # LoRA on the backbone; the saved model has the adapters merged
    lora_r: int = bounded(16, ge=1)
    lora_alpha: int = bounded(32, ge=1)
    lora_dropout: float = bounded(0.05, ge=0, lt=1)
    lora_target_modules: list[str] = field(default_factory=lambda: ["q_proj", "k_proj", "v_proj", "o_proj"])
    gradient_checkpointing: bool = False
    compile: bool = (
        False  # torch.compile through accelerate (GPU: 1.6x training throughput on Qwen2-0.5B shapes, docs/prm.md)
    )
    seed: int = seed_field()
    log_every: int = bounded(10, ge=1)  # optimizer steps between metrics lines
    save_every: int = bounded(0, ge=0)  # optimizer steps between resumable checkpoints (0: only the final model)
    resume: bool = True  # continue from the newest good checkpoint under <output>/checkpoints when there is one
    retrain: bool = (
        False  # train again even when prm/model/ holds a finished model (it is replaced once the new one is done)
    )
    eval_only: bool = False  # stages.train_prm: validate the model at model.prm, train nothing
    corrupt_examples: int = bounded(200, ge=0)  # E.4 check: correct steps whose result is altered (+1..9 and +-1)
    # held-out problems (data.validation) the policy samples for the exact check and the slip pairs (0: off); only kinds
    # with an exact labeller (prm.exact_check.FIRST_ERROR_LABELLERS) are sampled
    exact_check_problems: int = bounded(200, ge=0)
    exact_check_samples: int = bounded(4, ge=1)  # samples per problem
    # > 0 when more than one sample per problem is labelled (check_ranges): at 0 they would be copies of one greedy sample
    exact_check_temperature: float = bounded(0.6, ge=0, le=MAX_TEMPERATURE)
    prm800k_path: str | None = None  # PRM800K-format file for first-error accuracy
    score_batch_size: int = bounded(64, ge=1)  # sequences per scorer forward
    calibration_bins: int = bounded(10, ge=1)  # equal-width bins of the expected calibration error


@dataclass
class StepTrainingConfig:
    """What every fine-tuning objective's section has: the loop, sampling, optimiser and LoRA.
    Each objective reads only its own section (gfn or ppo)."""

    lr: float = bounded(5e-4, gt=0)  # paper: 5e-6
    scheduler: Schedule = "cosine"  # cosine | linear | constant, after warmup
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
    # every this many training steps the policy is also saved to <stage>/snapshots/step-<n>/, a model folder kept after
    # training, for the evaluation along training (eval.curves: diversity against reward); 0: none
    snapshot_every: int = bounded(0, ge=0)
    seed: int = seed_field()
    retrain: bool = (
        False  # train again even when <stage>/model/ holds a finished model (it is replaced once the new one is done)
    )
    # sync | async (gfn only: searcher actors on Ray fill a replay buffer the trainer draws from; docs/async.md)
    mode: TrainingMode = "sync"
    # CPU cores every trainer process pins itself to (os.sched_setaffinity) when training starts, after it has started or
    # joined Ray in async mode (so Ray's own processes keep the cores the stage was started on); None: left as started
    trainer_cores: list[int] | None = bounded(None, ge=0)


@dataclass
class GFlowNetObjectiveConfig(StepTrainingConfig):
    """The gfn section's fields of the GFlowNet objective: its loss, reward, reference, off-policy
    correction and replay buffer (GFNConfig adds the asynchronous mode's)."""

    loss: GFlowNetLoss = "subtb"  # subtb | tb | tb_vargrad
    lam: float = bounded(1.0, ge=0)  # SubTB lambda
    # SubTB's log-flow at the states that state no answer, but a trajectory's last: stop (paper eq. 1, log R(s) -
    # log pi(s_f|s), which ties every such state's stop probability to the unfinished-state penalty) | learned (a linear
    # head on the policy's hidden state there, trained at log_z_lr; docs/gflownet.md, "SubTB's log-flow")
    log_flow: LogFlow = "stop"
    reward_temperature: float = bounded(1.0, gt=0)  # log R is multiplied by 1/this
    reference_prior_coef: float = bounded(
        0.0, ge=0
    )  # appendix F: + coef * log pi_ref(trajectory); off in the paper config
    outcome_coef: float = bounded(0.0, ge=0)  # + coef * log(correct ? 1 : outcome_floor); off in the paper config
    outcome_floor: float = bounded(0.01, gt=0, le=1)
    unfinished_log_reward: float = bounded(
        -10.0, le=0
    )  # added to log R(s) when s's last step states no final answer (s_0 too)
    # before training: the base policy's samples of this many training questions (samples_per_question each), reweighted by
    # R^(1/reward_temperature): the reward a GFlowNet could gain on them, logged and written to gfn/ceiling.json (0: skipped)
    ceiling_questions: int = bounded(32, ge=0)
    kl_coef: float = bounded(0.0, ge=0)  # TB-VarGrad: beta, the KL to the reference (at step 0 when annealed)
    kl_coef_final: float | None = bounded(
        None, ge=0
    )  # beta annealed linearly from kl_coef to this over kl_anneal_steps (None: constant)
    kl_anneal_steps: int = bounded(0, ge=0)  # trainer steps of the linear beta anneal (then kl_coef_final)
    reference_reset_every: int = bounded(
        0, ge=0
    )  # rho: every rho updates the reference becomes the current policy (0: never; TBA': 50)
    # TBA's off-policy correction (appendix D; docs/async.md, "The off-policy correction"): each trajectory's loss times
    # sg(clip(pi_theta(tau) / pi_sampled(tau), importance_clip_low, importance_clip_high)), pi_sampled the weights that
    # sampled it (the sampler records log pi(tau) teacher-forced, one more forward per trajectory); off: every weight is 1
    importance_correction: bool = False
    importance_clip_low: float = bounded(0.0, ge=0, le=1)  # TBA, Table 4 (MATH): 0 (CISPO-style: no lower clip)
    importance_clip_high: float = bounded(8.0, ge=1)  # TBA, Table 4 (MATH): 8
    learn_log_z: bool = True  # TB: a learned log Z per run; ignored by subtb / tb_vargrad
    log_z_lr: float = bounded(1e-2, gt=0)
    buffer_size: int = bounded(1000, ge=0)  # paper: 1000
    buffer_priority: BufferPriority = "softmax"  # softmax | proportional
    buffer_temperature: float = bounded(1.0, gt=0)
    # which stored trajectories an update replays (sync mode): global (any question's) | per_question (each question of the
    # update its own earlier ones, which join its TB-VarGrad group; a question recurs when data.train_limit < the questions
    # drawn in all; docs/gflownet.md, "The replay buffer")
    buffer_scope: BufferScope = "global"
    # what the buffer ranks, evicts and draws by: log_reward (log R of the last state as trained, without the appendix-F prior)
    # | log_u (the sum of the PRM log-scores: no unfinished-state penalty, outcome term or reward temperature)
    buffer_key: BufferKey = "log_reward"
    buffer_replacement: bool = True  # sync mode: draws with replacement (true) or distinct within one update (false)
    recency_fraction: float = bounded(0.5, ge=0, le=1)  # TBA's m
    replay_fraction: float = bounded(0.5, ge=0)  # replayed trajectories per fresh one in each batch (sync mode)


# A dataclass lays out its bases' fields in reverse method-resolution order: this order of the bases puts the
# objective's fields first and the asynchronous mode's after them, the order of the saved config.yaml and --help.
@dataclass
class GFNConfig(AsyncSettings, GFlowNetObjectiveConfig):
    """Step-level GFlowNet fine-tuning (paper 4, appendices F-H)."""


@dataclass
class PPOConfig(StepTrainingConfig):
    """PPO baseline with step-level PRM rewards (paper 5, appendix D)."""

    clip: float = bounded(0.2, gt=0)
    value_coef: float = bounded(0.5, ge=0)
    entropy_coef: float = bounded(0.01, ge=0)
    gamma: float = bounded(1.0, ge=0, le=1)
    gae_lambda: float = bounded(0.95, ge=0, le=1)
    kl_coef: float = bounded(0.0, ge=0)  # KL penalty to the frozen reference, folded into step rewards
    step_reward: str = (
        "score"  # score: r_k = U (paper) | log_score: r_k = log U, return log R (no gain from extra steps)
    )
    unfinished_reward: float = bounded(-1.0, le=0)  # added to the last step's reward when it states no final answer
    ppo_epochs: int = bounded(2, ge=1)


@dataclass
class EvalConfig:
    """Accuracy and diversity evaluation (paper 5, Tables 2 and 4)."""

    benchmarks: list[str] = field(default_factory=lambda: ["tiny_test"])  # names in pipeline.datasets.loaders / tiny
    benchmark_paths: dict[str, str] = field(
        default_factory=dict
    )  # name -> local file (or "hub"); absent: the repository's copy
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
    prm: str | None = (
        None  # a trained PRM: report each model's mean PRM reward R = prod U on its samples (skipped if absent)
    )
    pairs: list[list[str]] = field(
        default_factory=lambda: [["gfn", "ppo"]]
    )  # [a, b]: also report a minus b, paired (Table 4)
    # models of eval.models whose training snapshots (<model folder's parent>/snapshots/step-<n>/, written with
    # gfn/ppo.snapshot_every) are evaluated too, as <name>@<n>: results.json "curves", each checkpoint's held-out
    # mean log L and strategy entropy, and for each pair of eval.pairs with both here the first's entropy minus the
    # second's at the log L both reach (eval/matched.py; needs eval.prm). A name eval.models lacks: no curve
    curves: list[str] = field(default_factory=list)
    bootstrap_resamples: int = bounded(2000, ge=1)
    seed: int = seed_field()
    # i/n: this process samples the problems with index % n == i of every (model, benchmark) into
    # reports/<run>/samples/shards/ and stops; 0/1 samples whatever is missing, merges and scores
    # (python -m stages.launch eval sets it, one worker per GPU)
    shard: str = "0/1"
    problems_per_commit: int = bounded(64, ge=1)  # problems sampled per generate call and committed together
    # right samples per problem at which strategy entropy is also scored for every model alike
    # (eval.diversity.equal_count_strategy_entropy; a problem with fewer is left out and counted)
    entropy_samples: int = bounded(4, ge=1, le=1024)
    pass_at_k_max: int = bounded(64, ge=1, le=4096)  # pass@k is reported for every k = 1..this (and <= the samples)
    # the GFlowNet's target, measured (eval.target; docs/evaluation.md): every model also draws this
    # many samples per problem at temperature 1 on the first eval.target_problems problems, and the
    # base's (the model named "base", else the first), weighted by R^(1/T) of the gfn section, estimate
    # the target each model is compared with (needs eval.prm). 0: off (the demo's default: the issue's
    # 64 samples x 50 problems x 3 models would about double its evaluation)
    target_samples: int = bounded(0, ge=0, le=4096)
    target_problems: int = bounded(50, ge=1)


@dataclass
class SearchConfig:
    """PRM-guided search at inference (paper 3.4, Figure 2)."""

    strategies: list[SearchStrategy] = field(
        default_factory=lambda: ["step_best_of_k", "beam", "best_of_n", "weighted_vote"]
    )
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
    problems_per_commit: int = bounded(
        32, ge=1
    )  # problems searched together (every strategy and k) and committed together


@dataclass
class PRMBenchConfig:
    """The ProcessBench protocol for the PRM at model.prm (stages.prm_bench, docs/prm.md "ProcessBench")."""

    processbench_paths: list[str] = field(
        default_factory=list
    )  # ProcessBench-format JSON/JSONL files, or hub splits hf://owner/name/split
    prm800k_path: str | None = None  # PRM800K phase-2 ratings: the first step rated -1 is the label
    policy_problems: int = bounded(
        100, ge=0
    )  # held-out problems (data.validation) the policy samples, labelled exactly where the kind can be (0: off)
    policy_samples: int = bounded(4, ge=1)  # samples per problem
    # > 0 when more than one sample per problem is labelled (check_ranges): at 0 they would be copies of one greedy sample
    temperature: float = bounded(0.6, ge=0, le=MAX_TEMPERATURE)
    held_out_fraction: float = bounded(0.5, gt=0, lt=1)  # share of each set's cases the threshold is chosen on
    threshold: float | None = bounded(None, gt=0, lt=1)  # a fixed threshold instead (every case is then scored)
    bootstrap_resamples: int = bounded(1000, ge=1)
    seed: int = seed_field()


@dataclass
class DemoConfig:
    """How make demo runs the stages (stages/demo.py, docs/demo.md "How the demo uses the cores")."""

    # processes at once: stages on their dependency graph, the sharded ones (mcts, eval, search)
    # as this many workers; 0 = the CPUs this process may use (os.sched_getaffinity)
    jobs: int = bounded(0, ge=0)


@dataclass
class PlanConfig:
    """The machine `make plan` checks the config against (stages/plan.py, docs/real-model.md)."""

    processes: int = bounded(1, ge=1)  # processes of make prm / gfn / ppo (accelerate launch); one GPU each
    gpu: GPUType = "A100-80GB"  # a GPU type of planner.plan.GPUS: its memory and peak bf16 FLOP/s
    gpu_memory_gb: float | None = bounded(None, gt=0)  # GiB per GPU; None: the GPU type's
    # stage (prm, gfn, ppo) -> the accelerate config file it is launched with; a stage not named
    # runs as DDP (one whole copy per process), or as one plain process when processes is 1
    accelerate: dict[str, str] = field(default_factory=dict)
    generation_mfu: float = bounded(
        0.10, gt=0, le=1
    )  # assumed share of peak FLOP/s when sampling (2 x parameters a token)
    training_mfu: float = bounded(0.35, gt=0, le=1)  # assumed share when training (6 x parameters a token) or scoring
    prompt_tokens: int = bounded(256, ge=1)  # assumed prompt length (chat template + question) in tokens


FINETUNE_STAGES = ("gfn", "ppo")  # the fine-tuning stages, each named for its config section


@dataclass
class Config:
    """The whole pipeline's configuration."""

    run: str = "demo"
    runs_root: str = "runs"  # relative: below the working folder; absolute: anywhere (explicit)
    seed: int = (
        seed_field()
    )  # every section's seed unless the section sets its own (tiny world, training, sampling, evaluation)
    report_to: ReportTo = (
        "none"  # experiment trackers of every trainer: none | tensorboard | wandb | all (extra `tracking`)
    )
    model: ModelConfig = field(default_factory=ModelConfig)
    generation: GenerationConfig = field(default_factory=GenerationConfig)
    format: FormatConfig = field(default_factory=FormatConfig)
    data: DataConfig = field(default_factory=DataConfig)
    tinyworld: TinyWorldConfig = field(default_factory=TinyWorldConfig)
    bootstrap: BootstrapConfig = field(default_factory=BootstrapConfig)
    mcts: MCTSConfig = field(default_factory=MCTSConfig)
    rollout_temperature: RolloutTemperatureConfig = field(default_factory=RolloutTemperatureConfig)
    mc_audit: MCAuditConfig = field(default_factory=MCAuditConfig)
    augment: AugmentConfig = field(default_factory=AugmentConfig)
    prm: PRMConfig = field(default_factory=PRMConfig)
    gfn: GFNConfig = field(default_factory=GFNConfig)
    ppo: PPOConfig = field(default_factory=PPOConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    search: SearchConfig = field(default_factory=SearchConfig)
    prm_bench: PRMBenchConfig = field(default_factory=PRMBenchConfig)
    demo: DemoConfig = field(default_factory=DemoConfig)
    claims: ClaimsConfig = field(default_factory=ClaimsConfig)
    experiment: ExperimentConfig = field(default_factory=ExperimentConfig)
    plan: PlanConfig = field(default_factory=PlanConfig)

    @property
    def run_dir(self) -> Path:
        return Path(self.runs_root) / self.run

    def stage_dir(self, stage: str) -> Path:
        return self.run_dir / stage

    def finetune_section(self, stage: str) -> GFNConfig | PPOConfig:
        """The section of fine-tuning stage ``stage`` (FINETUNE_STAGES: each is named for its section)."""
        match stage:
            case "gfn":
                return self.gfn
            case "ppo":
                return self.ppo
        raise ValueError(f"fine-tuning stage must be one of {FINETUNE_STAGES}, got {stage!r}")

    def resolve(self, value: str | None) -> str | None:
        """Substitute ``{run_dir}`` in a path-like string field."""
        if value is None:
            return None
        return value.replace("{run_dir}", str(self.run_dir))

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)
