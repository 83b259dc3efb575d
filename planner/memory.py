"""The memory of one GPU: training state, activation settings, sampling (a vLLM engine's share of
the device or HF's KV cache), and the check of a stage's items against the device, whose errors name
the setting that reduces them."""

from __future__ import annotations

from pipeline.config.schema import Config
from pipeline.generation.vllm_settings import default_max_model_len, engine_memory_share
from pipeline.sizing.activation_memory import dropout_mask_bytes
from pipeline.sizing.shapes import ModelShape
from planner.plan import GIB, Finding, Launch, Plan, StageCost


def half_bytes(config: Config) -> int:
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


def activation_settings(config: Config, cfg) -> dict:
    """pipeline.sizing.activation_memory.activation_terms' settings of a training section: the model's dtype, LoRA
    (frozen base, float32 adapters with or without dropout) or full fine-tuning, padded
    micro-batches (trajectories differ in length), dropout's mask on a GPU."""
    return {
        "bytes_per_value": half_bytes(config),
        "lora_modules": list(cfg.lora_target_modules) if cfg.lora else None,
        "lora_rank": cfg.lora_r,
        "lora_dropout": cfg.lora_dropout > 0,
        "padded": True,
        "mask_bytes": dropout_mask_bytes("cuda"),
    }


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


def check_memory(plan: Plan, cost: StageCost, key: str) -> None:
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
    (pipeline.generation.vllm_settings.engine_memory_share: derived when the key is unset, else checked); an error
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


def sampler_memory(
    plan: Plan, cost: StageCost, policy: ModelShape, sequences: int, tokens: int, with_weights: bool, engines: int = 1
) -> None:
    """The memory of sampling: vLLM's share of the device (its weights and KV cache: derived from
    or checked against the stage's other items in check_memory), or HF's KV cache (+ the weights
    when the sampler is not the model being trained, ``with_weights``). For a colocated engine
    (``not with_weights``) a share too small for a step's samples at once is a warning (vLLM
    queues them)."""
    config = plan.config
    kv_per_token = policy.kv_cache_bytes_per_token(half_bytes(config))
    kv = sequences * tokens * kv_per_token
    if config.generation.backend == "vllm":
        max_model_len = config.generation.vllm_max_model_len or default_max_model_len(
            config.generation.max_new_tokens, None
        )
        weights = half_bytes(config) * policy.parameters()
        cost.engine_needs = {
            "weights": weights,
            f"KV cache of one {max_model_len}-token sequence": max_model_len * kv_per_token,
        }
        cost.engines = engines
        cost.memory[VLLM_SHARE_ITEM] = 0.0  # sized in check_memory, beside everything else the stage holds
        cost.colocated_kv = None if with_weights else (kv, sequences, tokens)
    else:
        if with_weights:
            cost.memory["policy weights"] = half_bytes(config) * policy.parameters()
        cost.memory[f"KV cache ({sequences} x {tokens} tokens)"] = kv


def warn_queued(plan: Plan, cost: StageCost) -> None:
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
