"""The Process Reward Model: a transformers backbone plus a scalar step-score head (paper 3.3).

Input: the prompt (pipeline.prompts) followed by the solution's steps, tokenized segment by
segment (pipeline.steps.encode_trajectory, no end token). The head reads the hidden state at
the LAST token of every step (its separator), so one causal forward pass scores every step:

    U(s_k | s_{k-1}) = sigmoid(head(h_k)),   h_k = hidden state at the last token of step k.

A step's score sees only the prompt and the steps up to it (causal attention), so it equals the
score of that prefix scored on its own.

On disk (``save_pretrained``), a standard transformers token-classification model, so
``AutoModelForTokenClassification.from_pretrained(folder)`` loads it (TRL, search-and-learn, a
user's own code) and gives the same step scores, read at each step's last token::

    config.json        the backbone's config, architectures = [<Arch>ForTokenClassification], 2 labels
    model*.safetensors the backbone's weights under its base-model prefix, and the 2-class head
                       (float32): row 0 zero, row 1 our head, so softmax(logits)[1] = sigmoid(w.h + b)
    prm_config.json    format (separator, prompt template, ...), kind, base model and architecture
    README.md          the model card: how to score a solution with transformers alone
    tokenizer files    when a tokenizer is given

An architecture transformers has no token-classification class for (or remote code) is saved
in the first layout instead, which only this project reads: backbone/ (AutoModel) +
head.safetensors + prm_config.json. Both load with ``ProcessRewardModel.from_pretrained``.

LoRA adapters are merged into the saved backbone weights (merge_lora_state_dict), so a
saved PRM loads with plain transformers and needs no peft at scoring time.
"""

from __future__ import annotations

import copy
import json
import logging
import shutil
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
from huggingface_hub import save_torch_state_dict
from peft import LoraConfig, get_peft_model
from safetensors import safe_open
from safetensors.torch import load_file, save_file
from torch import Tensor, nn
from transformers import AutoModel, AutoModelForTokenClassification
from transformers.dynamic_module_utils import custom_object_save
from transformers.models.auto.modeling_auto import MODEL_FOR_TOKEN_CLASSIFICATION_MAPPING_NAMES

from pipeline.config.schema import FormatConfig
from pipeline.modeling import (
    hub_model_errors,
    lora_fan_in_fan_out,
    merge_lora_state_dict,
    model_kwargs,
    resolve_device,
    resolve_dtype,
)
from pipeline.storage.files import InputNotFound
from pipeline.storage.model_folders import check_model_folder
from prm.model_card import write_model_card

log = logging.getLogger("stepflow.prm")

PRM_CONFIG_NAME = "prm_config.json"
HEAD_NAME = "head.safetensors"
BACKBONE_DIR = "backbone"
FORMAT_VERSION = 2  # 1: backbone/ + head.safetensors only; 2: token-classification layout (or 1's, see layout)
LAYOUT_TOKEN_CLASSIFICATION = "token_classification"
LAYOUT_BACKBONE_AND_HEAD = "backbone_and_head"
ID2LABEL = {0: "wrong", 1: "correct"}


@dataclass
class PRMInfo:
    """What a saved PRM needs besides its weights: how its inputs were built.

    separator, prompt_template, use_chat_template, num_few_shot: the FormatConfig it was trained with
    kind:              the prompt kind (tiny | math | gsm8k | sat) of pipeline.prompts.build_prompt
    base_model:        hub id or path the backbone was initialised from
    base_architecture: the backbone's transformers class (e.g. Qwen2Model)
    """

    separator: str = "\n"
    prompt_template: str = "Question: {question}\nAnswer:\n"
    use_chat_template: bool = True
    num_few_shot: int = 0
    kind: str = "math"
    base_model: str = ""
    base_architecture: str = ""
    extra: dict[str, Any] = field(default_factory=dict)

    @classmethod
    def from_format(cls, format_config, kind: str, base_model: str = "", base_architecture: str = "") -> PRMInfo:
        return cls(
            separator=format_config.separator,
            prompt_template=format_config.prompt_template,
            use_chat_template=format_config.use_chat_template,
            num_few_shot=format_config.num_few_shot,
            kind=kind,
            base_model=base_model,
            base_architecture=base_architecture,
        )

    def format_config(self):
        """The FormatConfig this PRM was trained with (what its scorer must use)."""
        return FormatConfig(
            separator=self.separator,
            prompt_template=self.prompt_template,
            use_chat_template=self.use_chat_template,
            num_few_shot=self.num_few_shot,
        )


def base_transformer(module: nn.Module) -> nn.Module:
    """The transformers base model inside a causal LM, a base model, or a peft wrapper of either."""
    if hasattr(module, "get_base_model"):  # peft
        module = module.get_base_model()
    return getattr(module, "base_model", module)


class ProcessRewardModel(nn.Module):
    """Backbone + Linear(hidden, 1) step-score head, read at each step's last token.

    backbone: a transformers base model (e.g. LlamaModel; the ``base_model`` of a causal LM),
              optionally wrapped by peft
    info:     PRMInfo, how the inputs are built (saved beside the weights)
    """

    def __init__(self, backbone: nn.Module, info: PRMInfo, head: nn.Linear | None = None):
        super().__init__()
        backbone = base_transformer(backbone) if not hasattr(backbone, "get_base_model") else backbone
        self.backbone = backbone
        self.info = info
        hidden = self.config.hidden_size
        if head is None:
            head = nn.Linear(hidden, 1)
            std = float(getattr(self.config, "initializer_range", 0.02))
            nn.init.normal_(head.weight, std=std)
            nn.init.zeros_(head.bias)
        # The head stays float32 whatever the backbone's dtype: it is tiny, and the logits feed a BCE.
        self.head = head.float()

    @classmethod
    def from_backbone(cls, model: nn.Module, info: PRMInfo | None = None) -> ProcessRewardModel:
        """A PRM with a fresh head on an in-memory model: a causal LM (its base model is used,
        its lm_head ignored; the weights are SHARED with ``model``, not copied) or a base model.
        info defaults to PRMInfo() (plain prompt template, kind "math")."""
        head_device = next(model.parameters()).device
        return cls(base_transformer(model), info or PRMInfo()).to(head_device)

    @property
    def config(self):
        return base_transformer(self.backbone).config

    @property
    def _no_split_modules(self) -> list[str]:
        """The backbone's layer classes: what accelerate's FSDP wraps one by one when its config
        names no class (configs/accelerate/fsdp.yaml), whatever the backbone's family."""
        return list(getattr(base_transformer(self.backbone), "_no_split_modules", None) or [])

    @property
    def device(self) -> torch.device:
        return self.head.weight.device

    def forward(
        self, input_ids: Tensor, attention_mask: Tensor | None = None, score_positions: Tensor | None = None
    ) -> Tensor:
        """Step-score logits.

        input_ids:       (B, T) prompt + steps, right-padded
        attention_mask:  (B, T) 1 for real tokens
        score_positions: (B, S) index of each step's last token (padding: any valid index)
        returns:         (B, S) logits, or (B, T) logits at every token when score_positions is None
        """
        hidden = self.backbone(input_ids=input_ids, attention_mask=attention_mask, use_cache=False).last_hidden_state
        if score_positions is not None:
            index = score_positions.unsqueeze(-1).expand(-1, -1, hidden.shape[-1])
            hidden = torch.gather(hidden, 1, index)
        return self.head(hidden.to(self.head.weight.dtype)).squeeze(-1)

    # ------------------------------------------------------------------ LoRA

    def add_lora(self, r: int, alpha: int, dropout: float, target_modules: list[str]) -> None:
        """Wrap the backbone with peft LoRA adapters; the head stays fully trainable."""
        lora_config = LoraConfig(
            r=r, lora_alpha=alpha, lora_dropout=dropout, target_modules=list(target_modules), bias="none"
        )
        self.backbone = get_peft_model(self.backbone, lora_config)
        self.info.extra["lora_scaling"] = alpha / r
        self.info.extra["lora_fan_in_fan_out"] = lora_fan_in_fan_out(self.backbone)  # peft's, for Conv1D layers

    @property
    def has_lora(self) -> bool:
        return hasattr(self.backbone, "get_base_model")

    # ------------------------------------------------------------------ save / load

    def save_pretrained(
        self,
        directory: str | Path,
        tokenizer=None,
        state_dict: dict[str, Tensor] | None = None,
        dtype: torch.dtype | None = None,
    ) -> Path:
        """Write the PRM as a transformers token-classification model (config.json + safetensors,
        sharded at 5 GB), prm_config.json and the model card (+ tokenizer); the backbone/ +
        head.safetensors layout where transformers has no token-classification class for it.

        state_dict: this module's full state dict when it must come from elsewhere (a gathered
                    FSDP/DeepSpeed one: ``accelerator.get_state_dict(model)``); default: own.
        dtype:      cast the backbone's floating weights to it (the head stays float32).
        """
        directory = Path(directory)
        directory.mkdir(parents=True, exist_ok=True)
        remove_saved_weights(directory)  # a rerun into the same folder must not leave the other layout's files behind
        full = state_dict if state_dict is not None else self.state_dict()
        backbone_sd = {k[len("backbone.") :]: v for k, v in full.items() if k.startswith("backbone.")}
        head_sd = {
            k[len("head.") :]: v.detach().float().cpu().contiguous() for k, v in full.items() if k.startswith("head.")
        }
        if any(".lora_" in k for k in backbone_sd):
            backbone_sd = merge_lora_state_dict(
                backbone_sd, self.info.extra["lora_scaling"], self.info.extra.get("lora_fan_in_fan_out", False)
            )
        backbone_sd = {
            k: (v.to(dtype) if dtype is not None and v.is_floating_point() else v).detach().to("cpu").contiguous()
            for k, v in backbone_sd.items()
        }
        base = base_transformer(self.backbone)
        base_config = copy.deepcopy(base.config)
        if dtype is not None:
            base_config.dtype = dtype
        layout = token_classification_layout(base, set(backbone_sd))
        info = asdict(self.info)
        info["base_architecture"] = info["base_architecture"] or type(base).__name__
        if layout is not None:
            class_name, prefix, head_name = layout
            weights = {f"{prefix}.{k}": v for k, v in backbone_sd.items()}
            weights[f"{head_name}.weight"], weights[f"{head_name}.bias"] = two_class_head(
                head_sd["weight"], head_sd["bias"]
            )
            save_torch_state_dict(weights, directory, max_shard_size="5GB")
            base_config.architectures = [class_name]
            base_config.num_labels = len(ID2LABEL)
            base_config.id2label, base_config.label2id = dict(ID2LABEL), {v: k for k, v in ID2LABEL.items()}
            base_config.save_pretrained(directory)
            info.update(layout=LAYOUT_TOKEN_CLASSIFICATION, score_head=head_name, transformers_class=class_name)
        else:
            log.warning(
                "prm: %s has no transformers token-classification class matching its weights; saved as backbone/ + "
                "head.safetensors, which only stepflow loads",
                type(base).__name__,
            )
            (directory / BACKBONE_DIR).mkdir(exist_ok=True)
            save_torch_state_dict(backbone_sd, directory / BACKBONE_DIR, max_shard_size="5GB")
            base_config.architectures = [type(base).__name__]
            base_config.save_pretrained(directory / BACKBONE_DIR)
            if (
                getattr(base, "_auto_class", None) is not None
            ):  # trust_remote_code models need their code beside the weights
                custom_object_save(base, directory / BACKBONE_DIR, config=base_config)
            save_file(head_sd, str(directory / HEAD_NAME))
            info.update(layout=LAYOUT_BACKBONE_AND_HEAD)
        info["format_version"] = FORMAT_VERSION
        info["hidden_size"] = self.config.hidden_size
        info["lora_merged"] = self.has_lora
        (directory / PRM_CONFIG_NAME).write_text(
            json.dumps(info, indent=2, ensure_ascii=False) + "\n", encoding="utf-8"
        )
        if tokenizer is not None:
            tokenizer.save_pretrained(str(directory))
        write_model_card(directory, self.info, layout[0] if layout is not None else None, tokenizer)
        return directory

    @classmethod
    def from_pretrained(cls, directory: str | Path, model_config=None) -> ProcessRewardModel:
        """Reload a saved PRM (either layout) on model_config's device and dtype (ModelConfig;
        None: CPU float32). The head is read in float32 from the file, whatever the dtype."""
        directory = Path(directory)
        info_path = directory / PRM_CONFIG_NAME
        if not info_path.exists():
            raise InputNotFound(f"{directory} is not a saved PRM: {PRM_CONFIG_NAME} is missing")
        check_model_folder(directory)  # damaged files are named here (prm_config.json, head, backbone)
        raw = json.loads(info_path.read_text(encoding="utf-8"))
        known = {f for f in PRMInfo.__dataclass_fields__}
        info = PRMInfo(**{k: v for k, v in raw.items() if k in known})
        device, dtype = _device_and_dtype(model_config)
        kwargs: dict[str, Any] = {"dtype": dtype}
        if model_config is not None:
            kwargs["trust_remote_code"] = model_config.trust_remote_code
            if model_config.attn_implementation:
                kwargs["attn_implementation"] = model_config.attn_implementation
        if (directory / BACKBONE_DIR).is_dir():
            backbone = AutoModel.from_pretrained(str(directory / BACKBONE_DIR), **kwargs)
            head_sd = load_file(str(directory / HEAD_NAME))
        else:
            # the token-classification checkpoint loaded as what it is, so that transformers has no
            # unused weights to report on every load; its base model is the backbone, and the head
            # is read below from the file, in float32 whatever the dtype
            backbone = AutoModelForTokenClassification.from_pretrained(str(directory), **kwargs).base_model
            head_name = raw.get("score_head", "score")
            two_class = read_tensors(directory, [f"{head_name}.weight", f"{head_name}.bias"])
            weight, bias = two_class[f"{head_name}.weight"].float(), two_class[f"{head_name}.bias"].float()
            head_sd = {"weight": (weight[1] - weight[0]).unsqueeze(0), "bias": (bias[1] - bias[0]).unsqueeze(0)}
        head = nn.Linear(head_sd["weight"].shape[1], 1)
        head.load_state_dict(head_sd)
        model = cls(backbone, info, head=head)
        return model.to(device).eval()


def two_class_head(weight: Tensor, bias: Tensor) -> tuple[Tensor, Tensor]:
    """Our head (weight (1, H), bias (1,)) as a 2-class one whose softmax gives the same score:
    logits (0, z) -> softmax[1] = e^z / (1 + e^z) = sigmoid(z). Row 0 is zero; float32."""
    zeros = torch.zeros_like(weight, dtype=torch.float32)
    return torch.cat([zeros, weight.float()]).contiguous(), torch.cat([torch.zeros(1), bias.float()]).contiguous()


def token_classification_layout(base: nn.Module, backbone_keys: set[str]) -> tuple[str, str, str] | None:
    """(class name, base-model prefix, head name) of the transformers token-classification model
    of ``base``'s architecture whose weights are exactly the backbone's plus one Linear head with
    a bias; None when transformers has none (or the model is remote code)."""
    config = base.config
    if getattr(config, "auto_map", None) or config.model_type not in MODEL_FOR_TOKEN_CLASSIFICATION_MAPPING_NAMES:
        return None
    probe_config = copy.deepcopy(config)
    probe_config.num_labels = len(ID2LABEL)
    try:
        with torch.device("meta"):  # the structure only: no memory, no init cost
            probe = AutoModelForTokenClassification.from_config(probe_config)
    except Exception:  # an architecture whose classification class cannot be built from this config
        return None
    prefix = probe.base_model_prefix
    keys = set(probe.state_dict())
    inside = {k[len(prefix) + 1 :] for k in keys if k.startswith(prefix + ".")}
    outside = keys - {f"{prefix}.{k}" for k in inside}
    heads = {k.rsplit(".", 1)[0] for k in outside}
    if inside != backbone_keys or len(heads) != 1:
        return None
    head = heads.pop()
    if outside != {f"{head}.weight", f"{head}.bias"}:
        return None
    return type(probe).__name__, prefix, head


def remove_saved_weights(directory: Path) -> None:
    """Delete the weight files either layout writes (before a save into the same folder)."""
    shutil.rmtree(directory / BACKBONE_DIR, ignore_errors=True)
    for path in [
        directory / HEAD_NAME,
        directory / "config.json",
        *directory.glob("model*.safetensors"),
        directory / "model.safetensors.index.json",
    ]:
        path.unlink(missing_ok=True)


def read_tensors(directory: Path, names: list[str]) -> dict[str, Tensor]:
    """Named tensors of a (possibly sharded) safetensors checkpoint, as stored."""
    index = directory / "model.safetensors.index.json"
    if index.exists():
        weight_map = json.loads(index.read_text(encoding="utf-8"))["weight_map"]
        files = {name: directory / weight_map[name] for name in names}
    else:
        files = {name: directory / "model.safetensors" for name in names}
    tensors = {}
    for name, path in files.items():
        with safe_open(str(path), framework="pt") as handle:
            tensors[name] = handle.get_tensor(name)
    return tensors


def _device_and_dtype(model_config) -> tuple[torch.device, torch.dtype]:
    if model_config is None:
        return torch.device("cpu"), torch.float32

    device = torch.device(resolve_device(model_config.device))
    return device, resolve_dtype(model_config.dtype, device)


def load_backbone(path: str, model_config, device: torch.device | str | None = None) -> nn.Module:
    """The base model (AutoModel) of a hub id or local causal-LM checkpoint, in model_config's
    dtype, on ``device`` (default: model_config.device; under accelerate launch the trainer
    passes each process its own GPU).

    AutoModel rather than pipeline.modeling.load_causal_lm: it skips the lm_head, which for a
    7B model with a 152k vocabulary is half a gigabyte the PRM never uses.
    """
    check_model_folder(path)
    kwargs, device = model_kwargs(model_config, device)
    with hub_model_errors(path, model_config):
        return AutoModel.from_pretrained(path, **kwargs).to(device)


def new_prm(
    backbone_path: str, model_config, format_config, kind: str, device: torch.device | str | None = None
) -> ProcessRewardModel:
    """A PRM with a freshly initialised head on the backbone at ``backbone_path``."""
    backbone = load_backbone(backbone_path, model_config, device)
    info = PRMInfo.from_format(
        format_config, kind, base_model=str(backbone_path), base_architecture=type(backbone).__name__
    )
    model = ProcessRewardModel(backbone, info)
    return model.to(backbone.device)
