"""What a vLLM engine can serve, checked before anything loads: a local model folder's weight
files (``check_servable``), a LoRA adapter's rank (``adapter_rank``) and the scaling its merged
weights take (``lora_scaling``). No vllm import: the stages and the fine-tuning setup check
their keys' folders with it.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

from pipeline.storage.model_folders import FolderError, check_model_folder

VLLM_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)


def adapter_config(adapter: str, key: str = "model.policy_adapter") -> dict:
    """A local peft adapter folder's adapter_config.json (FileNotFoundError naming ``key`` without one)."""
    config_file = Path(adapter) / "adapter_config.json"
    if not config_file.is_file():
        raise FileNotFoundError(f"{config_file}: not found; {key} must be a peft adapter folder")
    return json.loads(config_file.read_text(encoding="utf-8"))


def adapter_rank(adapter: str, key: str = "model.policy_adapter") -> int:
    """The served adapter's rank, checked against VLLM_LORA_RANKS before the engine loads anything."""
    rank = int(adapter_config(adapter, key).get("r", 16))
    if rank not in VLLM_LORA_RANKS:
        raise ValueError(
            f"{Path(adapter) / 'adapter_config.json'}: {key} has LoRA rank r={rank}; vLLM serves ranks "
            f"{', '.join(map(str, VLLM_LORA_RANKS))} (merge the adapter into the model, or use generation.backend=hf)"
        )
    return rank


SAFETENSORS_INDEX = "model.safetensors.index.json"


def check_servable(path: str | Path, key: str | None = None) -> None:
    """Refuse a local model folder a vLLM engine cannot serve, before anything loads; raises
    FolderError in one line naming the folder, the file(s), ``key`` (the config key that names the
    folder) and what to do. A hub id (no such folder) is left to vLLM.

    vLLM's loader reads, of a folder's top level, the *.safetensors files that its
    model.safetensors.index.json names, and without an index EVERY *.safetensors file as weights of
    the model: a second file beside the model's (a value head, an adapter, an optimizer dump) makes
    the engine fail after loading for minutes ("There is no module or parameter named ...").
    from_pretrained reads only model.safetensors or the index's files, so the HF backend is not
    affected. Refused here: several *.safetensors without an index (all but model.safetensors named
    as stray; every one when none is named so), an index that is not a JSON object with a
    "weight_map", an index naming a file the folder lacks. Damaged files: check_model_folder."""
    folder = Path(path)
    if not folder.is_dir():
        return
    check_model_folder(folder)
    where = f" ({key})" if key else ""
    index = folder / SAFETENSORS_INDEX
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text(encoding="utf-8")).get("weight_map")
        except (UnicodeDecodeError, ValueError, AttributeError):
            weight_map = None
        if not isinstance(weight_map, dict):
            raise FolderError(
                f'{index}{where}: not a safetensors index (a JSON object with a "weight_map"): damaged; '
                "restore the model folder"
            )
        missing = sorted(name for name in {str(v) for v in weight_map.values()} if not (folder / name).is_file())
        if missing:
            raise FolderError(
                f"{folder}{where}: {SAFETENSORS_INDEX} names {', '.join(missing)}, which the folder lacks: "
                "the model cannot load; restore the missing weight files (or the whole folder)"
            )
        return
    weights = sorted(p.name for p in folder.glob("*.safetensors"))
    if len(weights) <= 1:
        return
    stray = [name for name in weights if name != "model.safetensors"]
    raise FolderError(
        f"{folder}{where}: holds {len(weights)} *.safetensors files and no {SAFETENSORS_INDEX}, and vLLM loads "
        f"every one as weights of the model, so {', '.join(stray)} would make the engine fail: move "
        f"{'it' if len(stray) == 1 else 'them'} out of the folder (a model's weights are model.safetensors, or "
        "the files an index names), or use generation.backend=hf"
    )


def lora_scaling(settings: dict, key: str = "model.policy_adapter") -> float:
    """alpha / r of a peft LoRA config (alpha / sqrt(r) with rsLoRA): what merging its adapters into
    the plain weights a vLLM sampler is given multiplies B A by. Refused (naming ``key``) when the
    adapters do not merge that way: per-module ranks or alphas, DoRA, or other than LoRA."""
    peft_type = settings.get("peft_type", "LORA")
    peft_type = str(getattr(peft_type, "value", peft_type))  # peft's PeftType in a live config, a string in the file
    if peft_type.upper() != "LORA":
        raise ValueError(
            f"{key}: a {peft_type} adapter; a vLLM sampler is given the weights with the adapter "
            "merged, which is done for LoRA only (use generation.backend=hf)"
        )
    if settings.get("rank_pattern") or settings.get("alpha_pattern") or settings.get("use_dora"):
        raise ValueError(
            f"{key}: the adapter has per-module ranks or alphas (rank_pattern, alpha_pattern) or DoRA; a vLLM "
            "sampler is given the weights with one alpha / r merged (use generation.backend=hf)"
        )
    rank, alpha = int(settings.get("r", 8)), float(settings.get("lora_alpha", 8))
    return alpha / math.sqrt(rank) if settings.get("use_rslora") else alpha / rank
