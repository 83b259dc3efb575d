"""Loading models and tokenizers the same way in every stage.

Device and dtype come from ModelConfig ("auto": CUDA when present, float32 on CPU and bfloat16
on GPU). Tokenizers: a tokenizer trained locally with the `tokenizers` library and saved as a generic
PreTrainedTokenizerFast (tokenizer_class "TokenizersBackend" in transformers 5) is reloaded as
exactly that class, because AutoTokenizer with a Qwen2 config builds a Qwen2Tokenizer with Qwen's
pre-tokenizer instead (DESIGN.md; checked with transformers 5.23) and the ids would change.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable, Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path

import torch
from peft import PeftModel
from torch import Tensor
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedTokenizerFast

from pipeline.config.schema import ModelConfig
from pipeline.storage.files import InputNotFound
from pipeline.storage.model_folders import check_model_folder

# What save_pretrained writes as tokenizer_class for a tokenizer built from a `tokenizers`
# object: "PreTrainedTokenizerFast" before transformers 5, "TokenizersBackend" (its v5 name) now.
GENERIC_TOKENIZER_CLASSES = ("PreTrainedTokenizerFast", "TokenizersBackend")

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def resolve_device(name: str = "auto") -> torch.device:
    """``auto`` -> cuda when available, else cpu; otherwise the named device (cpu, cuda, cuda:N)."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name.startswith("cuda") and not torch.cuda.is_available():
        raise ValueError(f"model.device is {name!r} but CUDA is not available on this machine; use 'cpu' or 'auto'")
    return torch.device(name)


def resolve_dtype(name: str, device: torch.device | str) -> torch.dtype:
    """``auto`` -> float32 on CPU, bfloat16 on GPU (float16 where bfloat16 is unsupported)."""
    device = torch.device(device)
    if name == "auto":
        if device.type == "cuda":
            return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
        return torch.float32
    if name not in DTYPES:
        raise ValueError(f"model.dtype is {name!r}; expected one of auto, {', '.join(DTYPES)}")
    return DTYPES[name]


def model_kwargs(model_config: ModelConfig, device: torch.device | str | None = None) -> tuple[dict, torch.device]:
    """from_pretrained keyword arguments of a ModelConfig (dtype, trust_remote_code,
    attn_implementation) and the device to load on (``device``, else model_config.device)."""
    device = torch.device(device) if device is not None else resolve_device(model_config.device)
    kwargs = {"dtype": resolve_dtype(model_config.dtype, device), "trust_remote_code": model_config.trust_remote_code}
    if model_config.attn_implementation:
        kwargs["attn_implementation"] = model_config.attn_implementation
    return kwargs, device


class HubModelUnreachable(InputNotFound):
    """A model named by hub id that cannot be loaded (offline mode and not in the cache, no network,
    no such repository, gated): one line naming it, the config key and what to do."""


MODEL_KEYS = ("policy", "prm_backbone", "prm", "policy_adapter")  # ModelConfig's models, for an error's key


@contextmanager
def hub_model_errors(path: str | Path, model_config: ModelConfig | None = None):
    """Inside: transformers', peft's and huggingface_hub's error for a model ``path`` that is no
    local folder (a hub id they could not fetch) becomes HubModelUnreachable; a local folder's
    errors pass unchanged. The key is the ModelConfig field naming ``path`` when there is one."""
    try:
        yield
    except OSError as error:
        if isinstance(error, InputNotFound) or Path(path).exists():
            raise
        key = next(
            (
                f"model.{name}"
                for name in MODEL_KEYS
                if model_config is not None and getattr(model_config, name) == path
            ),
            "the config key naming it",
        )
        reason = next((line.strip() for line in str(error).splitlines() if line.strip()), type(error).__name__)
        raise HubModelUnreachable(
            f"{key}: hub model {path} cannot be loaded ({type(error).__name__}: {reason[:200]}). Run where the hub "
            f"is reachable (with HF_HUB_OFFLINE=1 only a model already in the cache loads; `hf download {path}` "
            f"fetches it), check the name, or set {key} to a local folder"
        ) from None


def _saved_tokenizer_class(path: str) -> str | None:
    config_file = Path(path) / "tokenizer_config.json"
    if not config_file.is_file():
        return None
    try:
        return json.loads(config_file.read_text(encoding="utf-8")).get("tokenizer_class")
    except (json.JSONDecodeError, OSError):
        return None


def load_tokenizer(
    path: str, trust_remote_code: bool = False, check: bool = True, model_config: ModelConfig | None = None
):
    """The tokenizer saved at ``path`` (hub id or folder), with a pad token (eos when it has none).
    ``check=False`` when the model loaded beside it has checked the folder already; ``model_config``:
    the config whose key an error for a hub id that cannot be fetched names (hub_model_errors)."""
    if check:
        check_model_folder(path)  # a damaged local file is named here, not deep inside transformers
    with hub_model_errors(path, model_config):
        if _saved_tokenizer_class(path) in GENERIC_TOKENIZER_CLASSES:
            tokenizer = PreTrainedTokenizerFast.from_pretrained(path)
        else:
            tokenizer = AutoTokenizer.from_pretrained(path, trust_remote_code=trust_remote_code)
    if tokenizer.pad_token_id is None:
        if tokenizer.eos_token is None:
            raise ValueError(
                f"{path}: the tokenizer has neither a pad token nor an eos token; the step format needs an end token"
            )
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


def load_causal_lm(path: str, model_config: ModelConfig, adapter: str | None = None, is_trainable: bool = False):
    """A causal LM on the configured device and dtype, optionally with a peft adapter on top.

    Honours model_config.device, dtype, attn_implementation and trust_remote_code. The model is
    returned in eval mode; with an adapter it is a peft model (trainable when ``is_trainable``).
    """
    check_model_folder(path)  # a damaged local file is named here, not deep inside transformers
    kwargs, device = model_kwargs(model_config)
    with hub_model_errors(path, model_config):
        model = AutoModelForCausalLM.from_pretrained(path, **kwargs).to(device)
    if adapter:
        with hub_model_errors(adapter, model_config):
            model = PeftModel.from_pretrained(model, adapter, is_trainable=is_trainable).to(device)
    model.eval()
    return model


def upcast_trainable(model: torch.nn.Module) -> torch.dtype | None:
    """Trainable floating weights to float32 (master weights), in place; returns the half dtype
    they had (the dtype to autocast the forward to), or None when none was half.

    At the paper's learning rates (5e-6, 8e-6) an AdamW update of a bf16 weight of magnitude
    ~0.02 is below half an ulp (2^-7 relative): rounded away, the weight never moves.
    """
    half = None
    for param in model.parameters():
        if param.requires_grad and param.is_floating_point() and param.dtype != torch.float32:
            half = param.dtype
            param.data = param.data.float()
    return half


_LORA_BASE_SUFFIX = re.compile(r"\.base_layer\.(weight|bias)$")


def iter_merged_lora(
    weights: Iterable[tuple[str, Tensor]], scaling: float, fan_in_fan_out: bool = False
) -> Iterator[tuple[str, Tensor]]:
    """A peft-LoRA backbone's (name, tensor) stream -> the plain backbone's, adapters merged as
    they come.

    Keys ``base_model.model.<m>.base_layer.weight`` + ``<m>.lora_A.<name>.weight`` (r, in) +
    ``<m>.lora_B.<name>.weight`` (out, r) become ``<m>.weight = W + scaling * B @ A``
    (scaling = lora_alpha / r); with ``fan_in_fan_out`` (peft's setting for GPT-2's Conv1D layers,
    whose weight is stored (in, out)) ``W + scaling * (B @ A)^T``. A merged weight of another shape
    than its base weight is refused naming the module (a Conv1D adapter merged as a Linear one). The
    merged weight is yielded once the module's three have come; every other tensor is
    yielded at once under its plain name. A module's tensors come together in a state dict (its
    base layer, then lora_A, then lora_B), so what is held at a time is one module's W, A and B.
    Works on a gathered FSDP/DeepSpeed stream as well as a local state dict's items, and never
    touches the live model.
    """
    pending: dict[str, dict[str, Tensor]] = {}  # module -> the parts of it come so far ("W", "A", "B")
    for key, value in weights:
        name = key[len("base_model.model.") :] if key.startswith("base_model.model.") else key
        if ".lora_A." in name or ".lora_B." in name:
            module, which = (name.split(".lora_A.")[0], "A") if ".lora_A." in name else (name.split(".lora_B.")[0], "B")
        elif ".lora_" in name:  # lora_embedding_*, lora_magnitude_*: not produced by our LoraConfig
            raise ValueError(f"cannot merge LoRA parameter {key!r}: only Linear lora_A/lora_B adapters are supported")
        elif name.endswith(".base_layer.weight"):
            module, which = name[: -len(".base_layer.weight")], "W"
        else:
            yield _LORA_BASE_SUFFIX.sub(r".\1", name), value
            del value  # not held while the next tensor is gathered
            continue
        parts = pending.setdefault(module, {})
        if which in parts:
            raise ValueError(
                f"LoRA module {module!r} has more than one {'base weight' if which == 'W' else 'lora_' + which}"
            )
        parts[which] = value
        del value
        if len(parts) == 3:
            del pending[module]
            weight = parts["W"]
            delta = (parts["B"].float() @ parts["A"].float()) * scaling
            if fan_in_fan_out:
                delta = delta.t()
            if delta.shape != weight.shape:
                raise ValueError(
                    f"LoRA module {module!r}: B @ A is {tuple(delta.shape)} but its base weight {tuple(weight.shape)}"
                    f"{' (fan_in_fan_out: the base weight is stored (in, out))' if not fan_in_fan_out else ''}"
                )
            merged = (weight.float() + delta.to(weight.device)).to(weight.dtype)
            del parts, weight, delta
            yield f"{module}.weight", merged
            del merged
    for module, parts in pending.items():
        if set(parts) == {"W"}:  # a wrapped layer without an adapter: its weight as it is
            yield f"{module}.weight", parts["W"]
        elif "W" not in parts:
            raise ValueError(f"LoRA module {module!r} has adapters but no base_layer.weight")
        else:
            raise ValueError(
                f"LoRA module {module!r} has {sorted(set(parts) - {'W'})} but needs both lora_A and lora_B"
            )


def merge_lora_state_dict(
    state_dict: dict[str, Tensor], scaling: float, fan_in_fan_out: bool = False
) -> dict[str, Tensor]:
    """``iter_merged_lora`` of a whole state dict, kept whole: the plain backbone's state dict."""
    return dict(iter_merged_lora(state_dict.items(), scaling, fan_in_fan_out))


def lora_fan_in_fan_out(model) -> bool:
    """Whether a peft model's LoRA adapters sit on layers whose weight is stored (in, out) (GPT-2's
    Conv1D: peft sets fan_in_fan_out on its config when it wraps one), so a merge transposes B A."""
    settings = getattr(model, "peft_config", {}).get("default")
    return bool(getattr(settings, "fan_in_fan_out", False))


def copy_weights(
    module: torch.nn.Module,
    weights: Mapping[str, Tensor] | Iterable[tuple[str, Tensor]],
    *,
    strict: bool,
    who: str,
) -> None:
    """Copy ``weights`` (a state dict, or a stream of (name, tensor) read one at a time) into
    ``module``'s own tensors in place, each cast to its dtype and device, without a second copy of
    the model. A name the module does not hold is refused (a state dict's before anything is
    copied; a stream's when it comes); ``strict``: so is a name of the module's left out, named
    once the stream has ended (a tied name counts as given when its twin was: they share storage)."""
    own = module.state_dict()
    if isinstance(weights, Mapping):
        unknown = sorted(set(weights) - set(own))
        if unknown:
            raise ValueError(f"{who}: weights this model does not have: {unknown[:3]}")
        weights = weights.items()
    loaded: set[str] = set()
    with torch.no_grad():
        for name, value in weights:
            target = own.get(name)
            if target is None:
                raise ValueError(f"{who}: weights this model does not have: [{name!r}]")
            target.copy_(value)
            loaded.add(name)
            del value
    written = {own[name].data_ptr() for name in loaded}
    missing = [name for name in own if name not in loaded and own[name].data_ptr() not in written]
    if strict and missing:
        raise ValueError(f"{who}: weights missing for this model: {missing[:3]}")
