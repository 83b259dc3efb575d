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
    source: (
        str  # "local config.json <path>" | "hub cache" | "published config (pipeline/sizing/shapes.py)" | why unknown
    )


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
        return ShapeSource(PUBLISHED[path_or_hub_id], "published config (table in pipeline/sizing/shapes.py)")
    return ShapeSource(None, "not local, not in the hub cache, not in pipeline/sizing/shapes.py's table")


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
