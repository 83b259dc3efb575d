"""A model's architecture numbers, read without loading it: what `make plan` sizes memory and work with.

``model_shape`` reads a local folder's config.json, else a hub id's config.json from the local
hub cache (nothing is downloaded), else the published config of the models the configs in
configs/paper/ name (``PUBLISHED``), and says which source it used.

Parameter counts follow the decoder-only layout of Llama and Qwen2 (the families transformers'
``_no_split_modules`` wrap as ``LlamaDecoderLayer`` / ``Qwen2DecoderLayer``): embeddings, per
layer q/k/v/o projections (Qwen2: with q/k/v biases), a gated MLP (gate, up, down) and two
RMSNorms, a final norm, and an lm_head unless the embeddings are tied.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import NamedTuple

from huggingface_hub import try_to_load_from_cache

from pipeline.storage.files import read_json


@dataclass(frozen=True)
class ModelShape:
    """The numbers of a decoder-only transformer that memory and FLOPs depend on."""

    model_type: str  # transformers' model_type: llama | qwen2 | ...
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    tied_embeddings: bool
    qkv_bias: bool  # Qwen2: q/k/v projections carry biases

    def parameters(self, lm_head: bool = True) -> int:
        """Distinct parameters; ``lm_head=False``: the base model only (a PRM's backbone, whose
        head is a Linear(hidden, 1) on the hidden states, never loads the lm_head)."""
        h, q, kv = self.hidden_size, self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        attention = h * q + 2 * h * kv + q * h + ((q + 2 * kv) if self.qkv_bias else 0)
        layer = attention + 3 * h * self.intermediate_size + 2 * h
        total = self.vocab_size * h + self.num_layers * layer + h
        return total + (self.vocab_size * h if lm_head and not self.tied_embeddings else 0)

    def kv_cache_bytes_per_token(self, bytes_per_value: int = 2) -> int:
        """Keys and values of one token in every layer (bf16: 2 bytes a value)."""
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * bytes_per_value

    def layer_parameters(self) -> int:
        """One decoder layer's parameters (what FSDP gathers at a time)."""
        return (
            self.parameters(lm_head=False) - self.vocab_size * self.hidden_size - self.hidden_size
        ) // self.num_layers


def shape_from_config(config: dict, where: str) -> ModelShape:
    """A ModelShape from a transformers config.json mapping; a missing key is an error naming ``where``."""
    try:
        heads = int(config["num_attention_heads"])
        hidden = int(config["hidden_size"])
        return ModelShape(
            model_type=str(config.get("model_type", "?")),
            hidden_size=hidden,
            num_layers=int(config["num_hidden_layers"]),
            num_heads=heads,
            num_kv_heads=int(config.get("num_key_value_heads") or heads),
            head_dim=int(config.get("head_dim") or hidden // heads),
            intermediate_size=int(config["intermediate_size"]),
            vocab_size=int(config["vocab_size"]),
            tied_embeddings=bool(config.get("tie_word_embeddings", False)),
            qkv_bias=bool(config.get("attention_bias", config.get("model_type") == "qwen2")),
        )
    except (KeyError, TypeError, ValueError) as error:
        raise ValueError(
            f"{where}: not a decoder config this plan can size ({type(error).__name__}: {error})"
        ) from None


# The published config.json values of the models configs/paper/ names (hub "config.json" of each
# repository): used only when neither a local folder nor the hub cache has the file.
PUBLISHED: dict[str, ModelShape] = {
    "meta-llama/Llama-3.2-3B-Instruct": ModelShape("llama", 3072, 28, 24, 8, 128, 8192, 128256, True, False),
    "meta-llama/Llama-3.1-8B-Instruct": ModelShape("llama", 4096, 32, 32, 8, 128, 14336, 128256, False, False),
    "Qwen/Qwen2.5-Math-7B": ModelShape("qwen2", 3584, 28, 28, 4, 128, 18944, 152064, False, True),
    "Qwen/Qwen2.5-Math-1.5B-Instruct": ModelShape("qwen2", 1536, 28, 12, 2, 128, 8960, 151936, True, True),
}


class ShapeSource(NamedTuple):
    """A model's shape (None: unknown) and where it came from."""

    shape: ModelShape | None
    source: str  # "local config.json <path>" | "hub cache" | "published config (pipeline/shapes.py)" | why unknown


def cached_hub_config(hub_id: str) -> Path | None:
    """The hub id's config.json in the local hub cache, or None; never downloads."""
    try:
        found = try_to_load_from_cache(hub_id, "config.json")
    except ValueError:  # not of the form org/name
        return None
    return Path(found) if isinstance(found, str) else None


def model_shape(path_or_hub_id: str) -> ShapeSource:
    """The shape of a local model folder (its config.json) or of a hub id (the hub cache's
    config.json, else ``PUBLISHED``), without loading or downloading anything."""
    folder = Path(path_or_hub_id).expanduser()
    if folder.is_dir():
        config_file = folder / "config.json"
        if not config_file.is_file():
            return ShapeSource(None, f"{folder} has no config.json")
        return ShapeSource(
            shape_from_config(read_json(config_file, "model config"), str(config_file)), f"local {config_file}"
        )
    cached = cached_hub_config(path_or_hub_id)
    if cached is not None:
        return ShapeSource(shape_from_config(read_json(cached, "model config"), str(cached)), f"hub cache {cached}")
    if path_or_hub_id in PUBLISHED:
        return ShapeSource(PUBLISHED[path_or_hub_id], "published config (table in pipeline/shapes.py)")
    return ShapeSource(None, "not local, not in the hub cache, not in pipeline/shapes.py's table")


LORA_INPUTS = {  # a projection's input width, by its transformers name
    "q_proj": "h",
    "k_proj": "h",
    "v_proj": "h",
    "o_proj": "q",
    "gate_proj": "h",
    "up_proj": "h",
    "down_proj": "i",
}
LOGITS_BYTES_PER_VALUE = 20  # see logits_bytes


def dropout_mask_bytes(device_type: str) -> int:
    """Bytes a value of what dropout keeps for its backward: on CUDA ``native_dropout``'s boolean
    mask (1); on CPU torch's composite dropout multiplies by a float32 noise tensor and keeps it (4)."""
    return 1 if device_type == "cuda" else 4


def activation_terms(
    shape: ModelShape,
    sequences: int,
    tokens: int,
    checkpointing: bool = False,
    bytes_per_value: int = 2,
    lora_modules: tuple[str, ...] | list[str] | None = None,
    lora_rank: int = 0,
    lora_dropout: bool = False,
    padded: bool = True,
    mask_bytes: int = 1,
) -> dict[str, int]:
    """What autograd keeps for the backward pass of ``sequences`` x ``tokens`` through the decoder
    layers, term by term (bytes): transformers' Llama / Qwen2 layers with sdpa attention, weights
    in ``bytes_per_value`` (bf16: 2).

    lora_modules: None = full fine-tuning; else the projections peft wraps over a frozen base
    (each adapter float32, rank ``lora_rank``, ``lora_dropout`` > 0 or not); ``padded``: the
    micro-batch has padding, so sdpa gets a mask (transformers then repeats k and v to every
    head and sdpa keeps an additive mask per layer) instead of ``is_causal`` with grouped k/v;
    ``mask_bytes``: dropout_mask_bytes of the device.

    Per layer and token (h hidden, q = heads x head_dim, kv = kv heads x head_dim, i intermediate,
    b = bytes_per_value):
    - RMSNorm x 2: its float32 copy of the input (4h) and the reciprocal RMS (4);
    - attention: q, k and v as sdpa receives them and its output (b(2q + 2kv), kv = q when
      padded), the float32 log-sum-exp per head (4 x heads), plus b x tokens when padded (the mask);
    - MLP with a frozen base: the gate output (kept by SiLU), SiLU's output and the up output
      (kept by their product): 3bi;
    - each LoRA projection of input width d: peft's float32 copy of its input after dropout (4d,
      kept by lora_A), dropout's mask (mask_bytes x d) and lora_A's output (4r); a frozen base
      linear keeps no input (its weight needs no gradient);
    - full fine-tuning instead: every projection's input in b bytes (q/k/v share one, gate/up
      another): b(2h + q + i).
    The first layer's input norm keeps nothing when the embeddings are frozen (its input needs
    no gradient); the final norm keeps 4h + 4. With activation checkpointing only each layer's
    input (bh) is kept, plus one layer's whole set while it is recomputed.
    """
    h, q, kv, i = (
        shape.hidden_size,
        shape.num_heads * shape.head_dim,
        shape.num_kv_heads * shape.head_dim,
        shape.intermediate_size,
    )
    b, n, layers = bytes_per_value, sequences * tokens, shape.num_layers
    norm = 4 * h + 4
    kv_seen = q if padded else kv
    attention = b * (2 * q + 2 * kv_seen) + 4 * shape.num_heads
    mask = b * sequences * tokens * tokens if padded else 0  # sdpa's additive mask, one per layer
    lora = lora_modules is not None
    if lora:
        width = {"h": h, "q": q, "i": i}
        adapters = sum(
            4 * width[LORA_INPUTS[m]] + (mask_bytes * width[LORA_INPUTS[m]] if lora_dropout else 0) + 4 * lora_rank
            for m in lora_modules
            if m in LORA_INPUTS
        )
        mlp_inputs = 0
    else:
        adapters = 0
        mlp_inputs = b * (2 * h + q + i)
    per_layer = {
        "RMSNorm float32 inputs": 2 * norm * n,
        "attention (sdpa q, k, v, output, log-sum-exp; mask when padded)": attention * n + mask,
        "MLP (gate, SiLU, up)": 3 * b * i * n,
        "LoRA inputs (float32, dropout mask, lora_A output)": adapters * n,
        "projection inputs (full fine-tuning)": mlp_inputs * n,
    }
    if checkpointing:
        terms = {"layer inputs (checkpointed)": layers * b * h * n}
        terms.update({f"one layer recomputed: {k}": v for k, v in per_layer.items() if v})
        return terms
    terms = {k: layers * v for k, v in per_layer.items() if v}
    if not lora:  # the final norm; with LoRA it equals layer 0's input norm, which keeps nothing
        terms["RMSNorm float32 inputs"] += norm * n
    return terms


def activation_bytes(shape: ModelShape, sequences: int, tokens: int, checkpointing: bool, **settings) -> int:
    """The sum of activation_terms (bytes kept for the backward pass of the decoder layers)."""
    return sum(activation_terms(shape, sequences, tokens, checkpointing, **settings).values())


def logits_bytes(shape: ModelShape, sequences: int, positions: int) -> int:
    """The peak the log-probabilities over the vocabulary add, per value of the (sequences x
    positions x vocabulary) logits (pipeline.generation.step_logprobs.trajectory_logprobs; positions:
    from the shortest prompt's last token on): the backward of the float32 logsumexp, the first
    backward step, while every layer's activations are still kept, holds the float32 logits kept
    for it (4), the gradient already accumulated from the token and end-token gathers (4) and the
    three float32 temporaries of logsumexp's backward, ``grad * (logits - lse).exp()`` (12):
    20 bytes. (The forward holds at most 10: bf16 logits 2, their float32 cast 4, logsumexp's own
    temporary 4; the entropy PPO adds reuses these buffers in its backward and peaks at 20 too.)"""
    return LOGITS_BYTES_PER_VALUE * sequences * positions * shape.vocab_size


def lora_parameters(shape: ModelShape, rank: int, target_modules: list[str]) -> tuple[int, list[str]]:
    """LoRA's trainable parameters, r x (in + out) per targeted projection and layer, and the
    target names this layout does not know (their adapters are not counted)."""
    h, q, kv, i = (
        shape.hidden_size,
        shape.num_heads * shape.head_dim,
        shape.num_kv_heads * shape.head_dim,
        shape.intermediate_size,
    )
    sizes = {
        "q_proj": (h, q),
        "k_proj": (h, kv),
        "v_proj": (h, kv),
        "o_proj": (q, h),
        "gate_proj": (h, i),
        "up_proj": (h, i),
        "down_proj": (i, h),
    }
    known = [name for name in target_modules if name in sizes]
    per_layer = sum(rank * sum(sizes[name]) for name in known)
    return shape.num_layers * per_layer, [name for name in target_modules if name not in sizes]


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
