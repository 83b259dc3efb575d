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

import copy
import importlib.util
import inspect
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import NamedTuple

from huggingface_hub.utils import HFValidationError, validate_repo_id

from eval.benchmark_sources import resolve_benchmark
from eval.model_specs import parse_model_spec
from pipeline.batches import gradient_accumulation
from pipeline.config import Config, GPUType
from pipeline.config_loader import ConfigError, check_choice, load_yaml_file
from pipeline.finetune.objectives import needs_reference
from pipeline.finetune.setup import FinetuneLaunch, SetupError, resolve
from pipeline.generation import VLLM_INSTALL
from pipeline.generation.vllm_backend import default_max_model_len
from pipeline.problems import BENCHMARK_LOADERS, NeedsHub, hub_forbidden, load_benchmark
from pipeline.shapes import (
    ModelShape,
    activation_bytes,
    dropout_mask_bytes,
    engine_memory_share,
    logits_bytes,
    lora_parameters,
    model_shape,
)
from pipeline.shards import parse_shard
from pipeline.training.launch_settings import check_accelerate_file, file_environment, read_accelerate_file
from prm.formats import is_hub_id

GIB = 1024**3


class GPU(NamedTuple):
    memory_gib: float  # per device
    peak_tflops: float  # dense bf16 tensor-core peak (the vendor's datasheet)


GPUS: dict[str, GPU] = {  # plan.gpu's choices (pipeline.config.GPUType) in the same order
    "A100-40GB": GPU(40, 312),
    "A100-80GB": GPU(80, 312),
    "H100-80GB": GPU(80, 989),
    "H200": GPU(140, 989),
    "L40S": GPU(45, 362),
}

# transformers' _no_split_modules of the families pipeline.shapes sizes: the layer FSDP should wrap
WRAP_CLASSES = {"llama": "LlamaDecoderLayer", "qwen2": "Qwen2DecoderLayer"}
STAGES = ("mcts", "augment", "prm", "gfn", "ppo", "eval", "search")


@dataclass
class Finding:
    level: str  # error | warning
    key: str
    message: str

    def __str__(self) -> str:
        return f"{self.level.upper()}: {self.key}: {self.message}"


@dataclass
class Model:
    """One model the config names: where it is and its shape."""

    key: str
    value: str
    status: str  # "local" | "hub" | "made by make <stage>"
    shape: ModelShape | None
    source: str


@dataclass
class Data:
    key: str
    name: str
    status: str  # "local <path>" | "needs the hub (<id>)" | "made by make <stage>"
    problems: int | None  # after the configured limit; None: unknown


@dataclass
class Launch:
    """How a training stage runs: its accelerate config's strategy."""

    strategy: str  # single | ddp | zero2 | zero3 | fsdp
    activation_checkpointing: bool
    file: str | None
    environ: dict | None = None  # what `accelerate launch` exports for the file (None: no file, or the running launch)


@dataclass
class StageCost:
    name: str
    processes: int
    work: list[str] = field(default_factory=list)
    memory: dict[str, float] = field(default_factory=dict)  # item -> bytes on one GPU
    gpu_seconds: tuple[float, float] | None = None  # (low, high); None: unknown
    notes: list[str] = field(default_factory=list)
    # a vLLM sampler: what one engine needs to start, engines per device, the share it gets
    engine_needs: dict[str, float] = field(default_factory=dict)
    engines: int = 1
    engine_share: float | None = None
    share_key: str = (
        "generation.vllm_gpu_memory_utilization"  # the config key of that share (VLLM_SHARE_KEY, SEARCHER_SHARE_KEY)
    )
    colocated_kv: tuple[int, int, int] | None = None  # (bytes, sequences, tokens) of a colocated engine's step
    memory_errors: list[Finding] = field(
        default_factory=list
    )  # the device cannot hold the stage (or its engines' share)


@dataclass
class Plan:
    config_path: str
    config: Config
    gpu_name: str
    gpu: GPU
    models: list[Model] = field(default_factory=list)
    data: list[Data] = field(default_factory=list)
    stages: list[StageCost] = field(default_factory=list)
    findings: list[Finding] = field(default_factory=list)
    launch: Launch | None = None  # the running launch (stage_memory), instead of plan.accelerate's files

    @property
    def errors(self) -> list[Finding]:
        return [f for f in self.findings if f.level == "error"]

    def error(self, key: str, message: str) -> None:
        self._add(Finding("error", key, message))

    def warn(self, key: str, message: str) -> None:
        self._add(Finding("warning", key, message))

    def _add(self, finding: Finding) -> None:
        if finding not in self.findings:  # a check shared by two stages (gfn, ppo) is said once
            self.findings.append(finding)


# ----------------------------------------------------------------------------- resolving


def _made_by(config: Config, raw: str) -> str | None:
    """The stage whose output a ``{run_dir}/<stage>/...`` path names, when it does not exist yet."""
    if "{run_dir}" not in raw or Path(config.resolve(raw)).exists():
        return None
    rest = raw.split("{run_dir}", 1)[1].strip("/").split("/")
    return rest[0] if rest and rest[0] else "?"


def _bootstrap_shape(config: Config) -> ModelShape:
    b = config.bootstrap
    return ModelShape(
        "llama",
        b.hidden_size,
        b.num_layers,
        b.num_heads,
        b.num_heads,
        b.hidden_size // b.num_heads,
        b.intermediate_size,
        b.vocab_size,
        True,
        False,
    )


def resolve_model(config: Config, key: str, raw: str, derived_from: Model | None = None) -> Model:
    """A model path or hub id: local folder, hub id, or the output of a stage (its shape is that of
    ``derived_from``: the policy a fine-tuned model starts from, the PRM's backbone)."""
    value = config.resolve(raw)
    stage = _made_by(config, raw)
    if stage is not None:
        if stage == "bootstrap":
            return Model(key, value, "made by make bootstrap", _bootstrap_shape(config), "the bootstrap section")
        if derived_from is not None:
            return Model(key, value, f"made by make {stage}", derived_from.shape, f"that of {derived_from.key}")
        return Model(key, value, f"made by make {stage}", None, "unknown until it is made")
    spec = parse_model_spec(config, key, raw)
    if spec.path_is_local and not Path(spec.path).exists():
        return Model(key, spec.path, "local", None, "missing")
    shape, source = model_shape(spec.path)
    return Model(key, spec.path, "local" if spec.path_is_local else "hub", shape, source)


def unresolvable_model(config: Config, key: str, raw: str, missing_ok: bool = False) -> str | None:
    """Why the model ``raw`` names (config key ``key``) cannot be loaded, in one line naming the
    key, or None: a local path (eval.model_specs.parse_model_spec's rule) that is not a folder, or a
    hub id that is not of the hub's form owner/name (huggingface_hub's validate_repo_id). A hub id
    of that form passes unlooked-up (nothing is downloaded); a path a stage of this run makes
    ({run_dir}/<stage>/...) is left to the stage that reads it (stages.common.require names the
    target that makes it). ``missing_ok``: a local path that does not exist at all passes too (make
    eval skips such a model with a note)."""
    if _made_by(config, raw) is not None:
        return None
    spec = parse_model_spec(config, key, raw)
    path = Path(spec.path).expanduser()
    if spec.path_is_local:
        if path.is_dir() or (missing_ok and not path.exists()):
            return None
    elif is_hub_id(spec.path):
        try:
            validate_repo_id(spec.path)
            return None
        except HFValidationError:
            pass
    return f"{key}: {spec.path} is neither a local folder nor a hub id (owner/name)"


def _check_model(plan: Plan, model: Model) -> None:
    problem = (
        unresolvable_model(plan.config, model.key, model.value) if not model.status.startswith("made by") else None
    )
    if problem is not None:
        plan.error(model.key, problem.split(": ", 1)[1])
    elif model.shape is None and not model.status.startswith("made by"):
        plan.warn(model.key, f"shape unknown ({model.source}): its memory and cost are not estimated")


def resolve_models(plan: Plan) -> dict[str, Model]:
    config = plan.config
    policy = resolve_model(config, "model.policy", config.model.policy)
    backbone = resolve_model(config, "model.prm_backbone", config.model.prm_backbone)
    models = {
        "policy": policy,
        "prm_backbone": backbone,
        "prm": resolve_model(config, "model.prm", config.model.prm, backbone),
    }
    for name, raw in config.eval.models.items():
        derived = policy if _made_by(config, raw) in ("gfn", "ppo") else None
        models[f"eval.{name}"] = resolve_model(config, f"eval.models.{name}", raw.split("::")[0], derived)
    if config.eval.prm:
        models["eval.prm"] = resolve_model(config, "eval.prm", config.eval.prm, backbone)
    for model in models.values():
        _check_model(plan, model)
    plan.models = list(models.values())
    return models


KNOWN_SIZES = {
    "math500": 500,
    "gsm8k": 1319,
    "math": 5000,
    "math_level5": 1324,
    "agieval_sat_math": 220,
    "sat_math_32": 32,
}


def resolve_data(plan: Plan, key: str, loader: str, raw_path: str | None, limit: int | None, **kwargs) -> Data:
    """A benchmark or problems file: loaded when local (checked, counted), else which stage makes
    it or which hub dataset it needs (counted from its published size and the limit)."""
    config = plan.config
    path = config.resolve(raw_path) if raw_path is not None else None
    stage = _made_by(config, raw_path) if raw_path is not None else None
    if stage is not None:
        return Data(key, loader, f"made by make {stage}", limit)
    if path is not None and not Path(path).exists():
        plan.error(key, f"{loader}: file {path} not found")
        return Data(key, loader, f"missing {path}", None)
    try:
        with hub_forbidden():
            problems = load_benchmark(loader, path=path, limit=limit, lenient=config.data.lenient, **kwargs)
    except NeedsHub as hub:
        known = KNOWN_SIZES.get(loader)
        count = min(x for x in (known, limit) if x is not None) if (known or limit) else None
        return Data(key, loader, f"needs the hub ({hub.hub_id})", count)
    except (OSError, ValueError) as error:  # RecordError is a ValueError
        plan.error(key, f"{loader}: {error}")
        return Data(key, loader, "unresolvable", None)
    return Data(key, loader, f"local {path}" if path else "local (the repository's copy)", len(problems))


def resolve_all_data(plan: Plan) -> dict[str, Data]:
    config = plan.config
    data = {}
    for split in ("train", "validation"):
        loader = getattr(config.data, split)
        sources = {}
        if config.data.problem_sources:
            if "problem_sources" in inspect.signature(BENCHMARK_LOADERS.get(loader, load_benchmark)).parameters:
                sources = {"problem_sources": config.data.problem_sources}
            else:
                plan.warn(
                    "data.problem_sources",
                    f"filters OpenMathInstruct-2 problems only: not applied to data.{split} ({loader})",
                )
        data[split] = resolve_data(
            plan,
            f"data.{split}",
            loader,
            getattr(config.data, f"{split}_path"),
            getattr(config.data, f"{split}_limit"),
            **sources,
        )
    for index, name in enumerate(config.eval.benchmarks):
        source = resolve_benchmark(config, name)
        raw = config.eval.benchmark_paths.get(name) or (
            source.path and source.path.replace(str(config.run_dir), "{run_dir}")
        )
        data[f"eval.{name}"] = resolve_data(
            plan, f"eval.benchmarks[{index}] ({name})", source.loader, raw, config.eval.max_problems
        )
    name = config.search.benchmark
    if config.search.benchmark_path is not None:
        loader, raw = ("problems" if name == "tiny_test" else name), config.search.benchmark_path
    else:
        source = resolve_benchmark(config, name)
        loader = source.loader
        raw = config.eval.benchmark_paths.get(name) or (
            source.path and source.path.replace(str(config.run_dir), "{run_dir}")
        )
    data["search"] = resolve_data(plan, "search.benchmark", loader, raw, config.search.max_problems)
    plan.data = list(data.values())
    return data


# ----------------------------------------------------------------------------- launches


def read_launch(plan: Plan, stage: str) -> Launch:
    """The strategy of the accelerate config plan.accelerate[stage]; its num_processes must be plan.processes."""
    if plan.launch is not None:
        return plan.launch
    config = plan.config
    file = config.plan.accelerate.get(stage)
    processes = config.plan.processes
    if file is None:
        return Launch("single" if processes == 1 else "ddp", False, None)
    key = f"plan.accelerate.{stage}"
    try:
        settings = read_accelerate_file(file)
    except ConfigError as error:
        plan.error(key, str(error))
        try:  # a key accelerate does not know, in a file that parses: its strategy still counts
            settings = load_yaml_file(file) or {}
        except ConfigError:
            return Launch("ddp", False, file)
    else:  # what the training base would not apply, as the trainer refuses it at its start
        compile = config.prm.compile if stage == "prm" else False
        try:
            check_accelerate_file(file, config.model, compile)
        except ConfigError as error:
            plan.error(key, str(error))
    if settings.get("num_processes") not in (None, processes):
        plan.error(
            key,
            f"{file} launches num_processes: {settings['num_processes']} but plan.processes = {processes} "
            f"(accelerate launch --num_processes {processes} overrides the file)",
        )
    environ = file_environment(settings)
    kind = str(settings.get("distributed_type", "NO")).upper()
    if kind == "FSDP":
        fsdp = settings.get("fsdp_config") or {}
        return Launch("fsdp", bool(fsdp.get("fsdp_activation_checkpointing")), file, environ)
    if kind == "DEEPSPEED":
        stage_number = int((settings.get("deepspeed_config") or {}).get("zero_stage", 0))
        return Launch({3: "zero3", 2: "zero2"}.get(stage_number, "ddp"), False, file, environ)
    return Launch("ddp" if processes > 1 else "single", False, file, environ)


def launch_from_environment(environ: dict) -> Launch:
    """The strategy of the launch this process runs under, from the variables ``accelerate launch``
    sets (ACCELERATE_USE_FSDP, FSDP_ACTIVATION_CHECKPOINTING, ACCELERATE_USE_DEEPSPEED,
    ACCELERATE_DEEPSPEED_ZERO_STAGE, WORLD_SIZE)."""
    processes = int(environ.get("WORLD_SIZE", "1"))
    if environ.get("ACCELERATE_USE_FSDP", "").lower() == "true":
        return Launch("fsdp", environ.get("FSDP_ACTIVATION_CHECKPOINTING", "").lower() == "true", "the running launch")
    if environ.get("ACCELERATE_USE_DEEPSPEED", "").lower() == "true":
        zero = environ.get("ACCELERATE_DEEPSPEED_ZERO_STAGE", "")
        return Launch({"3": "zero3", "2": "zero2"}.get(zero, "ddp"), False, "the running launch")
    return Launch("ddp" if processes > 1 else "single", False, None)


def check_wrap_class(plan: Plan, stage: str, model: Model) -> None:
    """An FSDP config that names a layer class must name the model's (else accelerate stops at
    prepare, or, for a class the model lacks in another family, nothing is wrapped per layer)."""
    file = plan.config.plan.accelerate.get(stage)
    if file is None or model.shape is None or not Path(file).is_file():
        return
    try:
        fsdp = (load_yaml_file(file) or {}).get("fsdp_config") or {}
    except ConfigError:  # read_launch said why
        return
    named = fsdp.get("fsdp_transformer_layer_cls_to_wrap")
    wanted = WRAP_CLASSES.get(model.shape.model_type)
    if named and wanted and named != wanted:
        plan.error(
            f"plan.accelerate.{stage}",
            f"{file} wraps {named} but {model.key} is a {model.shape.model_type} model "
            f"({wanted}); leave fsdp_transformer_layer_cls_to_wrap out to wrap the model's "
            "own _no_split_modules",
        )


# ----------------------------------------------------------------------------- memory and time


def _half_bytes(config: Config) -> int:
    return 4 if config.model.dtype == "float32" else 2


def training_state(
    shape: ModelShape, trainable: int, launch: Launch, processes: int, lm_head: bool
) -> dict[str, float]:
    """Weights, gradients and AdamW state on one GPU: float32 master weights (4 bytes), gradients
    (4) and two moments (8) of the trainable parameters; a LoRA base stays frozen in bf16 (2).
    ZeRO-2 shards gradients and optimizer state; ZeRO-3 and FSDP also the weights (plus one layer
    gathered for its forward)."""
    params = shape.parameters(lm_head=lm_head)
    full = trainable >= params
    n = processes
    sharded = launch.strategy in ("zero3", "fsdp")
    if full:
        weights = 4 * params / n + 4 * shape.layer_parameters() if sharded else 4 * params
        state_share = n if launch.strategy in ("zero2", "zero3", "fsdp") else 1
        return {
            "weights (fp32 master)": weights,
            "gradients": 4 * params / state_share,
            "AdamW state": 8 * params / state_share,
        }
    base = 2 * params / n + 2 * shape.layer_parameters() if sharded else 2 * params
    return {
        "weights (bf16 base + fp32 LoRA)": base + 4 * trainable,
        "gradients (LoRA)": 4 * trainable,
        "AdamW state (LoRA)": 8 * trainable,
    }


def _activation_settings(config: Config, cfg) -> dict:
    """pipeline.shapes.activation_terms' settings of a training section: the model's dtype, LoRA
    (frozen base, float32 adapters with or without dropout) or full fine-tuning, padded
    micro-batches (trajectories differ in length), dropout's mask on a GPU."""
    return {
        "bytes_per_value": _half_bytes(config),
        "lora_modules": list(cfg.lora_target_modules) if cfg.lora else None,
        "lora_rank": cfg.lora_r,
        "lora_dropout": cfg.lora_dropout > 0,
        "padded": True,
        "mask_bytes": dropout_mask_bytes("cuda"),
    }


def _tokens_per_second(plan: Plan, parameters: int, mfu: float, flops_per_parameter: int) -> float:
    return mfu * plan.gpu.peak_tflops * 1e12 / (flops_per_parameter * parameters)


RUNTIME_RESERVE = 2 * GIB  # CUDA context, NCCL buffers, allocator slack: an assumption, said in the output


VLLM_SHARE_KEY = "generation.vllm_gpu_memory_utilization"
SEARCHER_SHARE_KEY = "gfn.searcher_vllm_memory_share"  # an asynchronous searcher's engine's share (its own key)
VLLM_SHARE_ITEM = "vLLM share (weights + KV cache)"


def setting(config: Config, key: str):
    """The value of a dotted config key ("gfn.searcher_vllm_memory_share")."""
    value = config
    for name in key.split("."):
        value = getattr(value, name)
    return value


def share_key(config: Config, stage: str) -> str:
    """The key of the vLLM share a stage (stages.<name>) derives or checks at its start: the
    asynchronous searchers' own (SEARCHER_SHARE_KEY) for make gfn in mode async, else VLLM_SHARE_KEY."""
    name = MEMORY_STAGES.get(stage)
    if name in ("gfn", "ppo") and getattr(config, name).mode == "async":
        return SEARCHER_SHARE_KEY
    return VLLM_SHARE_KEY


def training_memory_key(cost: StageCost, stage: str, launch: Launch, lora: bool) -> str:
    """The key that reduces a training stage's memory the most: its largest item's. The weights,
    gradients and AdamW state shrink with sharding over several processes (plan.accelerate.<stage>: an
    FSDP or ZeRO config), else with LoRA (<stage>.lora); activations and logits with <stage>.micro_batch_size."""
    items = {name: value for name, value in cost.memory.items() if not name.startswith(("CUDA", VLLM_SHARE_ITEM))}
    largest = max(items, key=items.get, default="")
    if largest.startswith(("weights", "gradients", "AdamW")):
        unsharded = launch.strategy in ("single", "ddp") or (
            launch.strategy == "zero2" and largest.startswith("weights")
        )
        if unsharded and cost.processes > 1:
            return f"plan.accelerate.{stage}"
        if not lora:
            return f"{stage}.lora"
    return f"{stage}.micro_batch_size"


def _check_memory(plan: Plan, cost: StageCost, key: str) -> None:
    """``key``: the setting that reduces the stage's memory (named by an error when it exceeds the
    device, or when the vLLM share derived beside it is too small)."""
    if plan.config.model.device == "cpu":
        cost.notes.append("model.device is cpu: memory not checked against a GPU")
        return
    cost.memory["CUDA context and buffers (assumed)"] = RUNTIME_RESERVE
    device = plan.gpu.memory_gib * GIB
    if cost.engine_needs:
        if not _engine_share(plan, cost, device, key):
            return
    total = sum(cost.memory.values())
    if total > device:
        items = " + ".join(f"{v / GIB:.1f}" for v in cost.memory.values())
        _memory_error(
            plan,
            cost,
            key,
            f"make {cost.name}: estimated {items} = {total / GIB:.1f} GiB per GPU exceeds the "
            f"{plan.gpu_name}'s {plan.gpu.memory_gib:g} GiB",
        )


def _memory_error(plan: Plan, cost: StageCost, key: str, message: str) -> None:
    plan.error(key, message)
    cost.memory_errors.append(Finding("error", key, message))


def _engine_share(plan: Plan, cost: StageCost, device: float, reducer: str) -> bool:
    """The vLLM engines' share of the device beside the stage's other items
    (pipeline.shapes.engine_memory_share: derived when the key is unset, else checked); an error
    naming the share's key when a share set does not fit, or ``reducer`` (what shrinks the items
    beside the engine) when the share derived is too small. Sets cost.engine_share; False after an error."""
    requested = setting(plan.config, cost.share_key)
    beside = {name: value for name, value in cost.memory.items() if name != VLLM_SHARE_ITEM}
    try:
        share = engine_memory_share(
            device, beside, cost.engine_needs, cost.engines, requested, cost.share_key, f"make {cost.name}"
        )
    except ValueError as error:
        key = cost.share_key if requested is not None or reducer in (VLLM_SHARE_KEY, SEARCHER_SHARE_KEY) else reducer
        _memory_error(plan, cost, key, str(error))
        return False
    cost.engine_share = share
    cost.memory = {**beside, VLLM_SHARE_ITEM: share * device * cost.engines}
    if requested is None:
        cost.notes.append(
            f"{cost.share_key} unset: derived {share:.2f} per engine ({cost.engines} on a device) from what shares it"
        )
    return True


def _sampler_memory(
    plan: Plan, cost: StageCost, policy: ModelShape, sequences: int, tokens: int, with_weights: bool, engines: int = 1
) -> None:
    """The memory of sampling: vLLM's share of the device (its weights and KV cache: derived from
    or checked against the stage's other items in _check_memory), or HF's KV cache (+ the weights
    when the sampler is not the model being trained, ``with_weights``). For a colocated engine
    (``not with_weights``) a share too small for a step's samples at once is a warning (vLLM
    queues them)."""
    config = plan.config
    kv_per_token = policy.kv_cache_bytes_per_token(_half_bytes(config))
    kv = sequences * tokens * kv_per_token
    if config.generation.backend == "vllm":
        max_model_len = config.generation.vllm_max_model_len or default_max_model_len(
            config.generation.max_new_tokens, None
        )
        weights = _half_bytes(config) * policy.parameters()
        cost.engine_needs = {
            "weights": weights,
            f"KV cache of one {max_model_len}-token sequence": max_model_len * kv_per_token,
        }
        cost.engines = engines
        cost.memory[VLLM_SHARE_ITEM] = 0.0  # sized in _check_memory, beside everything else the stage holds
        cost.colocated_kv = None if with_weights else (kv, sequences, tokens)
    else:
        if with_weights:
            cost.memory["policy weights"] = _half_bytes(config) * policy.parameters()
        cost.memory[f"KV cache ({sequences} x {tokens} tokens)"] = kv


def _warn_queued(plan: Plan, cost: StageCost) -> None:
    """A colocated engine whose share holds fewer than a step's samples at once: a warning."""
    if cost.engine_share is None or cost.colocated_kv is None:
        return
    kv, sequences, tokens = cost.colocated_kv
    share = cost.engine_share * plan.gpu.memory_gib * GIB
    weights = cost.engine_needs["weights"]
    if share < weights + kv:
        plan.warn(
            VLLM_SHARE_KEY,
            f"make {cost.name}: {cost.engine_share:g} x {plan.gpu.memory_gib:g} GiB = {share / GIB:.1f} GiB for "
            f"vLLM, which needs {weights / GIB:.1f} GiB of weights + {kv / GIB:.1f} GiB of KV cache for "
            f"{sequences} sequences of {tokens} tokens at once (it will queue them)",
        )


def _fmt(n: float) -> str:
    return f"{n:,.0f}" if n < 1e6 else f"{n:.3g}".replace("e+0", "e").replace("e+", "e")


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
        f"{_fmt(problems)} problems; {what}: {_fmt(low)}"
        + (f" to {_fmt(high)}" if high != low else "")
        + f"; generated tokens at most {_fmt(tokens)}"
    )
    if policy.shape is None:
        return cost
    concurrent = min(config.generation.batch_size, max(1, int(samples_high)))
    _sampler_memory(
        plan, cost, policy.shape, concurrent, config.plan.prompt_tokens + tokens_per_sample, with_weights=True
    )
    seconds = [
        n * tokens_per_sample / _tokens_per_second(plan, policy.shape.parameters(), config.plan.generation_mfu, 2)
        for n in (low, high)
    ]
    if prm is not None and prm.shape is not None:
        cost.memory["frozen PRM"] = _half_bytes(config) * prm.shape.parameters(lm_head=False)
        scoring = [
            n
            * scored_tokens_per_sample
            / _tokens_per_second(plan, prm.shape.parameters(False), config.plan.training_mfu, 2)
            for n in (low, high)
        ]
        seconds = [s + t for s, t in zip(seconds, scoring)]
    cost.gpu_seconds = (seconds[0], seconds[1])
    _check_memory(plan, cost, VLLM_SHARE_KEY if cost.engine_needs else "generation.batch_size")
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
    cost.work.append(
        f"{f'{_fmt(examples)} training records' if examples is not None else 'training records unknown until make augment: per 10,000'}"
        f"; training tokens at most {_fmt(tokens)} ({cfg.epochs:g} epochs x {cfg.max_length} tokens)"
    )
    if backbone.shape is None:
        return cost
    shape = backbone.shape
    checkpointing = cfg.gradient_checkpointing or launch.activation_checkpointing
    trainable = lora_parameters(shape, cfg.lora_r, cfg.lora_target_modules)[0] if cfg.lora else shape.parameters(False)
    cost.memory.update(training_state(shape, trainable, launch, processes, lm_head=False))
    cost.memory[
        f"activations ({cfg.micro_batch_size} x {cfg.max_length} tokens{', checkpointed' if checkpointing else ''})"
    ] = activation_bytes(
        shape, cfg.micro_batch_size, cfg.max_length, checkpointing, **_activation_settings(config, cfg)
    )
    flops = (4 if cfg.lora else 6) + (2 if checkpointing else 0)
    cost.gpu_seconds = (
        tokens / _tokens_per_second(plan, shape.parameters(False), config.plan.training_mfu, flops),
    ) * 2
    cost.notes.append(f"launch: {launch.strategy}" + (f" ({launch.file})" if launch.file else ""))
    _check_memory(plan, cost, training_memory_key(cost, "prm", launch, cfg.lora))
    return cost


def finetune_stage(plan: Plan, stage: str, policy: Model, prm: Model) -> StageCost:
    config = plan.config
    cfg = getattr(config, stage)
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
        f"{_fmt(fresh)} trajectories ({cfg.questions_per_step // max(1, processes)} questions per process a step); "
        f"generated tokens at most {_fmt(fresh * config.generation.max_new_tokens)}; trained on at most "
        f"{_fmt(trained * tokens)} tokens ({_fmt(trained)} trajectories x {tokens})"
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
    ] = activation_bytes(shape, cfg.micro_batch_size, tokens, checkpointing, **_activation_settings(config, cfg))
    positions = config.generation.max_new_tokens + 1  # logits from the prompt's last token on
    cost.memory[f"logits ({cfg.micro_batch_size} x {positions} x {shape.vocab_size}: fp32 log-softmax backward)"] = (
        logits_bytes(shape, cfg.micro_batch_size, positions)
    )
    cost.memory["frozen PRM"] = _half_bytes(config) * prm.shape.parameters(lm_head=False)
    if reference:
        cost.memory["frozen reference"] = _half_bytes(config) * shape.parameters()
    per_process = cfg.questions_per_step // max(1, processes) * cfg.samples_per_question
    if cfg.mode != "async":  # asynchronous: the searchers sample (searcher_stage), this process only trains
        _sampler_memory(plan, cost, shape, per_process, tokens, with_weights=False)
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
    _check_memory(plan, cost, training_memory_key(cost, stage, launch, cfg.lora))
    _warn_queued(plan, cost)
    return cost


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
    config, cfg = plan.config, getattr(plan.config, stage)
    cost = StageCost(f"{stage} searchers", cfg.searchers)
    cost.share_key = SEARCHER_SHARE_KEY
    tokens = config.plan.prompt_tokens + config.generation.max_new_tokens
    prm_bytes = _half_bytes(config) * prm.parameters(lm_head=False) if prm is not None else 0
    if not cfg.scorer_actors:
        cost.memory[f"frozen PRM x {searchers}"] = searchers * prm_bytes
    if scorers:
        cost.memory[f"frozen PRM of {scorers} scorer actor{'s' if scorers > 1 else ''} packed beside them"] = (
            scorers * prm_bytes
        )
    if searchers + scorers > 1:  # each actor is a process of its own; _check_memory counts one
        cost.memory[f"CUDA contexts of {searchers + scorers - 1} more processes (assumed)"] = (
            searchers + scorers - 1
        ) * RUNTIME_RESERVE
    sequences = cfg.questions_per_step * cfg.samples_per_question
    if config.generation.backend == "vllm":  # the engine holds the weights: no transformers copy
        _sampler_memory(plan, cost, policy, sequences, tokens, with_weights=True, engines=searchers)
    else:  # HF generate on each searcher's copy of the policy
        cost.memory[f"policy copies x {searchers}"] = searchers * _half_bytes(config) * policy.parameters()
        cost.memory[f"KV caches ({sequences} x {tokens} tokens) x {searchers}"] = (
            searchers * sequences * tokens * policy.kv_cache_bytes_per_token(_half_bytes(config))
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
    cfg = getattr(plan.config, stage)
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
    _check_memory(plan, cost, SEARCHER_SHARE_KEY if cost.engine_needs else "gfn.searcher_gpus")
    return cost


def scorer_stage(plan: Plan, stage: str, prm: Model) -> StageCost:
    """The PRM scorer actors' memory on their GPU (gfn.scorer_actors > 0): 1 / gfn.scorer_gpus of
    them share a device, each holding the PRM (a GPU shared with searchers: searcher_stage)."""
    config, cfg = plan.config, getattr(plan.config, stage)
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
    cost.memory[f"frozen PRM x {per_device}"] = per_device * _half_bytes(config) * prm.shape.parameters(lm_head=False)
    if per_device > 1:
        cost.memory[f"CUDA contexts of {per_device - 1} more scorer actors (assumed)"] = (
            per_device - 1
        ) * RUNTIME_RESERVE
    _check_memory(plan, cost, "gfn.scorer_gpus")
    return cost


# ----------------------------------------------------------------------------- the plan


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
    for stage in ("gfn", "ppo"):
        plan.stages.append(finetune_stage(plan, stage, policy, prm))
        if getattr(config, stage).mode == "async":
            plan.stages.append(searcher_stage(plan, stage, policy, prm))
            if getattr(config, stage).scorer_actors:
                plan.stages.append(scorer_stage(plan, stage, prm))
    eval_cost = _eval_stage(plan, models, data)
    plan.stages.append(eval_cost)
    plan.stages.append(_search_stage(plan, policy, prm, data["search"].problems))
    return plan


def generation_workers(config: Config, shard: str) -> int:
    """The processes of mcts / eval / search: the n of a shard the config sets by hand (i/n with
    n > 1), else plan.processes (``python -m stages.launch <stage>`` starts one worker per GPU)."""
    _, shards = parse_shard(shard)
    return shards if shards > 1 else config.plan.processes


def _eval_stage(plan: Plan, models: dict[str, Model], data: dict[str, Data]) -> StageCost:
    config = plan.config
    benchmarks = [data[f"eval.{name}"] for name in config.eval.benchmarks]
    counts = [d.problems for d in benchmarks]
    problems = None if any(c is None for c in counts) else sum(counts)
    evaluated = [models[f"eval.{name}"] for name in config.eval.models]
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
    if workers > 1:
        cost.notes.append(
            f"python -m stages.launch eval: {workers} workers sample; the PRM reward and the embeddings are "
            "computed after them in one process on one GPU"
        )
    return cost


def _search_stage(plan: Plan, policy: Model, prm: Model, problems: int | None) -> StageCost:
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


# ----------------------------------------------------------------------------- a stage's memory at its start


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


def stage_memory(config: Config, stage: str, device_bytes: float, environ: dict) -> float | None:
    """make plan's memory estimate of ``stage`` (a stages.<name> module) on a GPU of
    ``device_bytes`` under the running launch (``environ``: accelerate's variables): a ConfigError
    naming the key, with the arithmetic, when the device cannot hold it. With
    generation.backend=vllm, returns generation.vllm_gpu_memory_utilization for the stage's
    engines, derived when the key is unset, else checked (pipeline.shapes.engine_memory_share; an
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
    if name in ("gfn", "ppo"):
        prm = resolve_model(
            config,
            "model.prm",
            config.model.prm,
            resolve_model(config, "model.prm_backbone", config.model.prm_backbone),
        )
        cfg = getattr(config, name)
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
        costs.append(_eval_stage(plan, models, data))
    elif name == "search":
        prm = resolve_model(
            config,
            "model.prm",
            config.model.prm,
            resolve_model(config, "model.prm_backbone", config.model.prm_backbone),
        )
        costs.append(_search_stage(plan, policy, prm, 1))
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


# ----------------------------------------------------------------------------- output


def render(plan: Plan) -> str:
    config = plan.config
    p = config.plan
    lines = [
        f"make plan: {plan.config_path or 'defaults'} (run {config.run}): {p.processes} process(es) on {plan.gpu_name} "
        f"({plan.gpu.memory_gib:g} GiB each)",
        f"Assumed throughput per {plan.gpu_name} ({plan.gpu.peak_tflops:g} TFLOP/s bf16 peak): sampling at "
        f"plan.generation_mfu={p.generation_mfu:g} of peak (2 x parameters FLOPs a token), training and scoring at "
        f"plan.training_mfu={p.training_mfu:g} (6 x parameters a token, 4 with LoRA, +2 with activation checkpointing; "
        f"2 to score); prompts of plan.prompt_tokens={p.prompt_tokens}. Token counts are upper bounds.",
        "",
        "Models",
    ]
    for m in plan.models:
        size = f"{m.shape.model_type}, {_fmt(m.shape.parameters())} parameters" if m.shape else "shape unknown"
        lines.append(
            f"  {m.key:22} {m.value}  [{'needs the hub' if m.status == 'hub' else m.status}; {size}; shape from {m.source}]"
        )
    lines += ["", "Data"]
    for d in plan.data:
        lines.append(f"  {d.key:32} {d.name}: {d.status}; problems: {'unknown' if d.problems is None else d.problems}")
    lines += ["", "Stages (GPU-hours: at the assumed throughput; wall-clock = GPU-hours / processes)"]
    for cost in plan.stages:
        lines.append(f"  {cost.name} ({cost.processes} process{'es' if cost.processes > 1 else ''})")
        lines += [f"    work: {w}" for w in cost.work]
        if cost.memory:
            total = sum(cost.memory.values())
            items = ", ".join(f"{k} {v / GIB:.2f}" for k, v in cost.memory.items())
            lines.append(f"    memory per GPU: {total / GIB:.1f} GiB of {plan.gpu.memory_gib:g} ({items})")
        if cost.gpu_seconds is not None:
            low, high = (x / 3600 for x in cost.gpu_seconds)
            span = f"{low:.3g}" if math.isclose(low, high) else f"{low:.3g} to {high:.3g}"
            lines.append(f"    GPU-hours: {span}")
        lines += [f"    note: {n}" for n in cost.notes]
    lines.append("")
    if plan.findings:
        lines += [str(f) for f in plan.findings]
    else:
        lines.append("No errors or warnings.")
    return "\n".join(lines)
