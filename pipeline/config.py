"""Typed configuration: one dataclass per stage, loaded from YAML with `key=value` overrides.

A config file is a YAML mapping with top-level fields (run, seed, runs_root) and one section
per stage (``mcts:``, ``prm:``, ...). Command-line overrides use dotted keys:
``python -m stages.mcts --config configs/tiny.yaml run=demo mcts.k=8``. Unknown keys and
values of the wrong type are errors naming the key and the file (or "command line").

String fields may contain ``{run_dir}``, replaced by ``<runs_root>/<run>`` when resolved, so
a stage finds the artifacts of the stages before it without hard-coded paths.
Paper defaults are in configs/paper/*.yaml; the defaults here are the tiny world's.
"""

from __future__ import annotations

import dataclasses
import re
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml


class ConfigError(ValueError):
    """A config file or override that does not match the typed schema."""


# Fields that take one of a few names (checked where they are set, naming the file or the command line).
REPORT_TO = ("none", "tensorboard", "wandb", "all")  # experiment trackers (pipeline/training/tracking.py)
PRM_FORMATS = ("auto", "stepflow", "token_classification", "math_shepherd", "qwen_prm")  # docs/prm.md, "Other PRMs"
CHOICES = {"report_to": REPORT_TO, "model.prm_format": PRM_FORMATS}


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
    prm_format: str = "auto"
    trust_remote_code: bool = False  # never on unless you trust the repository
    device: str = "auto"  # auto | cpu | cuda | cuda:N
    dtype: str = "auto"  # auto (float32 on CPU, bfloat16 on GPU) | float32 | bfloat16 | float16
    attn_implementation: str | None = None  # None = transformers' default; "eager" is faster for tiny CPU models
    torch_threads: int = 0  # 0 = leave torch's default


@dataclass
class GenerationConfig:
    """The generation backend shared by every stage that samples."""

    backend: str = "hf"  # hf | vllm
    batch_size: int = 256  # HF backend: sequences decoded together (prompts x n)
    max_new_tokens: int = 160  # a whole solution
    max_step_tokens: int = 48  # one step (step-level search)
    top_p: float = 1.0
    vllm_tensor_parallel_size: int = 1
    vllm_gpu_memory_utilization: float = 0.85
    vllm_max_model_len: int | None = None
    vllm_enable_prefix_caching: bool = True


@dataclass
class FormatConfig:
    """The one step format and prompt builder."""

    separator: str = "\n"  # paper E.1.1: "\n", empty lines dropped
    prompt_template: str = "Question: {question}\nAnswer:\n"  # used when the tokenizer has no chat template
    use_chat_template: bool = True  # use the tokenizer's chat template when it has one
    num_few_shot: int = 0  # few-shot exemplars prepended to plain-text prompts


@dataclass
class DataConfig:
    """Problems the training stages (mcts, gfn, ppo) draw from."""

    train: str = "problems"  # a pipeline.problems benchmark name (paper: openmathinstruct2)
    train_path: str | None = "{run_dir}/bootstrap/problems_train.jsonl"
    train_limit: int | None = None  # paper: 10000
    validation: str = "problems"
    validation_path: str | None = "{run_dir}/bootstrap/problems_val.jsonl"
    validation_limit: int | None = None
    problem_sources: list[str] = field(default_factory=list)  # OpenMathInstruct-2 filter, e.g. [augmented_math]


@dataclass
class TinyWorldConfig:
    """Synthetic multi-step arithmetic word problems (pipeline.tinyworld)."""

    seed: int = 0
    n_train: int = 6000
    n_val: int = 200
    n_test: int = 200
    max_operand: int = 15
    max_result: int = 75
    min_ops: int = 2
    max_ops: int = 4
    swap_fraction: float = 0.5  # problems whose gold solution uses the other valid step order


@dataclass
class BootstrapConfig:
    """The from-scratch base policy of the tiny world (stages.bootstrap, docs/tinyworld.md)."""

    architecture: str = "llama"  # a transformers config family (Llama-style keeps the tokenizer as trained)
    vocab_size: int = 512  # BPE vocabulary cap (the tiny world's text needs about 420)
    hidden_size: int = 192
    num_layers: int = 4
    num_heads: int = 4
    intermediate_size: int = 512
    max_position_embeddings: int = 256
    train_seconds: float = 240.0  # wall-clock safety net: a run still training then stops, with a loud warning
    max_train_steps: int = 100000  # optimizer steps: what bounds the run
    batch_size: int = 32
    lr: float = 3e-3
    min_lr_ratio: float = 0.1  # the cosine ends at lr * min_lr_ratio
    warmup_steps: int = 50
    weight_decay: float = 0.01
    grad_clip: float = 1.0
    save_every: int = 0  # optimizer steps between resumable checkpoints (0: only the final model)
    torch_threads: int = 0  # threads while training (0 = model.torch_threads / torch's default)
    seed: int = 0
    eval_problems: int = 200  # held-out test problems for the greedy-accuracy report
    eval_samples: int = 4  # samples per problem at sample_temperature (sampled accuracy, pass@k, maj@k)
    sample_temperature: float = 0.6
    mc_problems: int = 8  # problems whose sampled step prefixes get Monte Carlo values
    mc_rollouts: int = 16  # continuations per prefix


@dataclass
class MCTSConfig:
    """OmegaPRM-style rollout data generation (paper 3.1, appendix E.1)."""

    k: int = 16  # rollouts per MC estimate (paper: 96)
    temperature: float = 0.6
    top_p: float = 1.0
    alpha: float = 0.5  # Q = alpha^(1-MC) * beta^(len/L)
    beta: float = 0.9
    length_scale: float = 500.0  # L, in tokens
    c_puct: float = 0.125
    max_iterations: int = 4  # selections per problem
    max_rollouts: int = 160  # rollout budget per problem
    search_trivial: bool = False  # also search problems with MC(root) of 0 or 1
    max_problems: int | None = 60
    shard: str = "0/1"  # i/n: this process handles problems with index % n == i
    problems_per_commit: int = 8
    # problems in flight at once: bounds one round's generator call to max_active x k rollouts
    # (memory) and lets finished problems be committed while later ones start
    max_active: int | None = 256


@dataclass
class AugmentConfig:
    """Similarity-grouped augmentation (paper 3.2)."""

    similarity_threshold: float = 0.85
    include_mcts: bool = True
    val_fraction: float = 0.1
    seed: int = 0


@dataclass
class PRMConfig:
    """PRM training and validation (paper 3.3, appendix E.2-E.5; docs/prm.md)."""

    # training and held-out records: ours (make augment) or PRM800K-format human labels (docs/prm.md)
    train_path: str = "{run_dir}/augment/prm_train.jsonl"
    val_path: str = "{run_dir}/augment/prm_val.jsonl"
    prm800k_neutral_label: float = 1.0  # the label of a PRM800K rating 0 (1 -> 1.0, -1 -> 0.0)
    lr: float = 1e-3  # paper: 8e-6
    batch_size: int = 32  # sequences per optimizer step, all processes together (paper: 144 examples)
    micro_batch_size: int = 32  # sequences per forward and process; accumulation = batch_size / (micro x processes)
    weight_decay: float = 0.01  # AdamW; never on biases and norm weights
    epochs: float = 2.0  # paper: 1; fractions allowed
    warmup_ratio: float = 0.05  # share of optimizer steps with linear warmup
    scheduler: str = "cosine"  # cosine | linear | constant (after warmup)
    max_grad_norm: float = 1.0  # gradient clipping
    max_length: int = 512  # tokens; labels of steps ending beyond it are dropped (and counted)
    group_by_length: bool = False  # length-bucketed micro-batches: less padding, but label-homogeneous batches (docs/prm.md)
    merge_prefixes: bool = True  # records whose path is a prefix of another share one sequence
    kind: str | None = None  # prompt kind (tiny | math | gsm8k | sat); None = the training problems' kind
    lora: bool = False  # LoRA on the backbone; the saved model has the adapters merged
    lora_r: int = 16
    lora_alpha: int = 32
    lora_dropout: float = 0.05
    lora_target_modules: list[str] = field(default_factory=lambda: ["q_proj", "k_proj", "v_proj", "o_proj"])
    gradient_checkpointing: bool = False
    compile: bool = False  # torch.compile through accelerate (GPU: 1.6x training throughput on Qwen2-0.5B shapes, docs/prm.md)
    seed: int = 0
    log_every: int = 10  # optimizer steps between metrics lines
    save_every: int = 0  # optimizer steps between resumable checkpoints (0: only the final model)
    resume: bool = True  # continue from <output>/checkpoints/last when it exists
    eval_only: bool = False  # stages.train_prm: validate the model at model.prm, train nothing
    corrupt_examples: int = 200  # E.4 check: correct steps whose result is altered (+1..9 and +-1)
    natural_slip_problems: int = 200  # held-out problems (data.validation) the policy samples for the natural-slip AUC (0: off)
    natural_slip_samples: int = 4  # samples per problem
    natural_slip_temperature: float = 0.6
    prm800k_path: str | None = None  # PRM800K-format file for first-error accuracy
    score_batch_size: int = 64  # sequences per scorer forward
    calibration_bins: int = 10  # equal-width bins of the expected calibration error


@dataclass
class StepTrainingConfig:
    """What every fine-tuning objective's section has: the loop, sampling, optimiser and LoRA.
    Each objective reads only its own section (gfn or ppo)."""

    lr: float = 5e-4  # paper: 5e-6
    scheduler: str = "cosine"  # cosine | linear | constant, after warmup
    warmup_steps: int = 5
    weight_decay: float = 0.0
    grad_clip: float = 1.0  # paper: 1.0
    num_train_steps: int = 40
    questions_per_step: int = 8
    samples_per_question: int = 4  # K; questions_per_step x K = the paper's batch of 144
    micro_batch_size: int = 32  # trajectories per teacher-forced forward
    temperature: float = 0.6  # sampling temperature (paper 0.6)
    min_steps: int = 1  # samples with fewer steps are dropped (stopping at s_0 is not an action)
    lora: bool = False
    lora_r: int = 16
    lora_alpha: int = 32
    lora_dropout: float = 0.05
    lora_target_modules: list[str] = field(default_factory=lambda: ["q_proj", "k_proj", "v_proj", "o_proj"])
    save_every: int = 20  # steps between resumable checkpoints
    seed: int = 0


@dataclass
class GFNConfig(StepTrainingConfig):
    """Step-level GFlowNet fine-tuning (paper 4, appendices F-H)."""

    loss: str = "subtb"  # subtb | tb | tb_vargrad
    lam: float = 1.0  # SubTB lambda
    reward_temperature: float = 1.0  # log R is multiplied by 1/this
    reference_prior_coef: float = 0.0  # appendix F: + coef * log pi_ref(trajectory); off in the paper config
    outcome_coef: float = 0.0  # + coef * log(correct ? 1 : outcome_floor); off in the paper config
    outcome_floor: float = 0.01
    unfinished_log_reward: float = -10.0  # added to log R(s) when s's last step states no final answer (s_0 too)
    kl_coef: float = 0.0  # TB-VarGrad: KL to the frozen reference
    learn_log_z: bool = True  # TB: a learned log Z per run; ignored by subtb / tb_vargrad
    log_z_lr: float = 1e-2
    buffer_size: int = 1000  # paper: 1000
    buffer_priority: str = "softmax"  # softmax | proportional
    buffer_temperature: float = 1.0
    recency_fraction: float = 0.5  # TBA's m
    replay_fraction: float = 0.5  # replayed trajectories per fresh one in each batch


@dataclass
class PPOConfig(StepTrainingConfig):
    """PPO baseline with step-level PRM rewards (paper 5, appendix D)."""

    clip: float = 0.2
    value_coef: float = 0.5
    entropy_coef: float = 0.01
    gamma: float = 1.0
    gae_lambda: float = 0.95
    kl_coef: float = 0.0  # KL penalty to the frozen reference, folded into step rewards
    step_reward: str = "score"  # score: r_k = U (paper) | log_score: r_k = log U, return log R (no gain from extra steps)
    unfinished_reward: float = -1.0  # added to the last step's reward when it states no final answer
    ppo_epochs: int = 2


@dataclass
class EvalConfig:
    """Accuracy and diversity evaluation (paper 5, Tables 2 and 4)."""

    benchmarks: list[str] = field(default_factory=lambda: ["tiny_test"])  # names in pipeline.problems / tiny
    benchmark_paths: dict[str, str] = field(default_factory=dict)  # name -> local file
    max_problems: int | None = 100
    models: dict[str, str] = field(
        default_factory=lambda: {
            "base": "{run_dir}/bootstrap/model",
            "ppo": "{run_dir}/ppo/model",
            "gfn": "{run_dir}/gfn/model",
        }
    )
    k: int = 8  # samples per problem
    temperature: float = 0.6
    greedy: bool = True
    embedder: str | None = None  # None = offline all-MiniLM-L6-v2; paper: sentence-transformers/paraphrase-MiniLM-L6-v2
    prm: str | None = None  # a trained PRM: report each model's mean PRM reward R = prod U on its samples (skipped if absent)
    bootstrap_resamples: int = 2000
    seed: int = 0


@dataclass
class SearchConfig:
    """PRM-guided search at inference (paper 3.4, Figure 2)."""

    strategies: list[str] = field(default_factory=lambda: ["step_best_of_k", "beam", "best_of_n", "weighted_vote"])
    ks: list[int] = field(default_factory=lambda: [1, 2, 4, 8, 16])
    temperature: float = 0.8
    max_depth: int = 12
    beam_width: int = 4
    # last | mean | min | prod: a partial or whole solution's score from its step scores. last: the
    # PRM is trained on Monte Carlo values, so U of the last step estimates P(correct) of the whole
    # prefix (of the answer, for a finished one) and compares solutions of any length; min and
    # prod can only fall as steps are added and prefer short solutions (docs/search.md)
    aggregation: str = "last"
    benchmark: str = "tiny_test"
    benchmark_path: str | None = None
    max_problems: int | None = 100
    seed: int = 0


@dataclass
class Config:
    """The whole pipeline's configuration."""

    run: str = "demo"
    runs_root: str = "runs"
    seed: int = 0
    report_to: str = "none"  # experiment trackers of every trainer: none | tensorboard | wandb | all (extra `tracking`)
    model: ModelConfig = field(default_factory=ModelConfig)
    generation: GenerationConfig = field(default_factory=GenerationConfig)
    format: FormatConfig = field(default_factory=FormatConfig)
    data: DataConfig = field(default_factory=DataConfig)
    tinyworld: TinyWorldConfig = field(default_factory=TinyWorldConfig)
    bootstrap: BootstrapConfig = field(default_factory=BootstrapConfig)
    mcts: MCTSConfig = field(default_factory=MCTSConfig)
    augment: AugmentConfig = field(default_factory=AugmentConfig)
    prm: PRMConfig = field(default_factory=PRMConfig)
    gfn: GFNConfig = field(default_factory=GFNConfig)
    ppo: PPOConfig = field(default_factory=PPOConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    search: SearchConfig = field(default_factory=SearchConfig)

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


def _type_name(tp: Any) -> str:
    return getattr(tp, "__name__", None) or str(tp).replace("typing.", "")


def _coerce(value: Any, tp: Any, key: str, where: str) -> Any:
    """Check ``value`` against the annotation ``tp``; return it (ints widen to floats)."""
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        args = typing.get_args(tp)
        if value is None and type(None) in args:
            return None
        errors = []
        for arg in args:
            if arg is type(None):
                continue
            try:
                return _coerce(value, arg, key, where)
            except ConfigError as exc:
                errors.append(str(exc))
        raise ConfigError(f"{where}: {key} expects {_type_name(tp)}, got {value!r}")
    if origin is list:
        (item_tp,) = typing.get_args(tp)
        if not isinstance(value, list):
            raise ConfigError(f"{where}: {key} expects a list, got {value!r}")
        return [_coerce(v, item_tp, f"{key}[{i}]", where) for i, v in enumerate(value)]
    if origin is dict:
        key_tp, val_tp = typing.get_args(tp)
        if not isinstance(value, dict):
            raise ConfigError(f"{where}: {key} expects a mapping, got {value!r}")
        return {
            _coerce(k, key_tp, f"{key}.<key>", where): _coerce(v, val_tp, f"{key}.{k}", where)
            for k, v in value.items()
        }
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
    raise ConfigError(f"{where}: {key} expects {_type_name(tp)}, got {value!r} ({type(value).__name__})")


def _apply(obj: Any, updates: dict[str, Any], prefix: str, where: str) -> None:
    hints = typing.get_type_hints(type(obj))
    names = {f.name for f in dataclasses.fields(obj)}
    for name, value in updates.items():
        key = f"{prefix}{name}"
        if name not in names:
            raise ConfigError(f"{where}: unknown key '{key}' (known: {', '.join(sorted(names))})")
        tp = hints[name]
        current = getattr(obj, name)
        if dataclasses.is_dataclass(current):
            if not isinstance(value, dict):
                raise ConfigError(f"{where}: {key} expects a mapping of its fields, got {value!r}")
            _apply(current, value, f"{key}.", where)
        else:
            value = _coerce(value, tp, key, where)
            if key in CHOICES and value not in CHOICES[key]:
                raise ConfigError(f"{where}: {key} must be one of {', '.join(CHOICES[key])}, got {value!r}")
            setattr(obj, name, value)


def parse_override(text: str) -> tuple[list[str], Any]:
    """``a.b=value`` -> (["a", "b"], value parsed as a YAML scalar/list)."""
    if "=" not in text:
        raise ConfigError(f"command line: override {text!r} is not of the form key=value")
    key, raw = text.split("=", 1)
    key = key.strip()
    if not key:
        raise ConfigError(f"command line: override {text!r} has an empty key")
    try:
        value = yaml.safe_load(raw) if raw.strip() != "" else ""
    except yaml.YAMLError:
        value = raw
    return key.split("."), value


def load_config(path: str | Path | None = None, overrides: list[str] | None = None) -> Config:
    """Defaults, then the YAML file, then ``key=value`` overrides, all type-checked."""
    config = Config()
    if path is not None:
        path = Path(path)
        if not path.exists():
            raise ConfigError(f"{path}: config file not found")
        try:
            data = yaml.safe_load(path.read_text(encoding="utf-8")) or {}
        except yaml.YAMLError as exc:
            raise ConfigError(f"{path}: not valid YAML: {exc}") from exc
        if not isinstance(data, dict):
            raise ConfigError(f"{path}: expected a mapping at the top level")
        _apply(config, data, "", str(path))
    for text in overrides or []:
        keys, value = parse_override(text)
        nested: Any = value
        for name in reversed(keys):
            nested = {name: nested}
        _apply(config, nested, "", "command line")
    return config


def save_config(config: Config, path: str | Path) -> None:
    """Write the resolved config beside a stage's outputs."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(yaml.safe_dump(config.to_dict(), sort_keys=False, allow_unicode=True), encoding="utf-8")
