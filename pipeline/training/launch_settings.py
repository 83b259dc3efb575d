"""What the training base takes from an accelerate config file: refused or honoured, never ignored.

``accelerate launch --config_file F`` reads F and exports its settings to every process
(ACCELERATE_MIXED_PRECISION, ACCELERATE_DYNAMO_BACKEND, ACCELERATE_USE_FSDP, FSDP_OFFLOAD_PARAMS,
...). The launcher's keys (num_processes, machine_rank, gpu_ids, ...) and the DeepSpeed section
are accelerate's to read. The training base builds its Accelerator itself (mixed precision from
model.dtype, torch.compile from prm.compile) and applies FSDP2 itself (pipeline.training.sharding.
shard_model), so of the rest it honours only some values; any other value is refused when it
differs from accelerate's default, naming the key:

    check_launch_environment(config.model, os.environ)   # at the trainer's start
    check_accelerate_file("configs/accelerate/fsdp.yaml", config.model)   # make plan: also unknown keys

An fsdp_config key accelerate does not know (``fsdp_cpu_offload``: accelerate's is
``fsdp_offload_params``) is refused by make plan; ``accelerate launch`` would pass it on unread.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from accelerate.commands.config.config_args import ClusterConfig
from accelerate.commands.launch import launch_command_parser

from pipeline.config.loader import ConfigError, load_yaml_file

FSDP_SECTION = "fsdp_config"
DYNAMO_SECTION = "dynamo_config"

# fsdp_config keys the training base applies (pipeline.training.sharding.shard_model), with the values it
# applies (None: any); every other FSDP key accelerate knows is refused unless it keeps accelerate's default
HONOURED_FSDP = {
    "fsdp_version": None,  # 2 only: pipeline.finetune.setup.check_accelerate_launch and shard_model refuse another
    "fsdp_reshard_after_forward": None,
    "fsdp_activation_checkpointing": None,
    # the base wraps each decoder layer of the model's own _no_split_modules (make plan checks a named class)
    "fsdp_auto_wrap_policy": ("transformer_based_wrap",),
    "fsdp_transformer_layer_cls_to_wrap": None,
    # every process loads the model itself before fully_shard (true would leave the others' weights empty)
    "fsdp_cpu_ram_efficient_loading": ("false",),
}
FSDP_WHY = {
    "fsdp_offload_params": "the training base keeps the shards on the GPU (no CPU offload)",
    "fsdp_state_dict_type": "checkpoints are sharded (torch.distributed.checkpoint) and model/ holds the gathered "
    "weights, whatever the file says",
}
# dynamo_config keys and accelerate's defaults: the training base compiles only through prm.compile (inductor)
DYNAMO_DEFAULTS = {
    "dynamo_backend": "no",
    "dynamo_mode": "default",
    "dynamo_use_fullgraph": "false",
    "dynamo_use_dynamic": "false",
    "dynamo_use_regional_compilation": "false",
}


@dataclass(frozen=True)
class LaunchSetting:
    """One setting of an accelerate config file: its key there, the variable accelerate launch
    exports it as, accelerate's default (as exported, lower case) and the values the base applies."""

    key: str  # "fsdp_config.fsdp_offload_params"
    env: str  # "FSDP_OFFLOAD_PARAMS"
    default: str  # "false"
    honoured: tuple[str, ...] | None  # None: any value


def _text(value: Any) -> str:
    return "none" if value is None else str(value).lower()


@functools.cache
def accelerate_fsdp_defaults() -> dict[str, str]:
    """accelerate's own list of FSDP keys and their defaults: the "FSDP Arguments" of its launch
    command (what ``accelerate launch`` copies an fsdp_config key to)."""
    groups = [g for g in launch_command_parser()._action_groups if g.title == "FSDP Arguments"]
    return {action.dest: _text(action.default) for group in groups for action in group._group_actions}


def _fsdp_env(name: str) -> str:
    return "FSDP_TRANSFORMER_CLS_TO_WRAP" if name == "fsdp_transformer_layer_cls_to_wrap" else name.upper()


def fsdp_settings() -> list[LaunchSetting]:
    return [
        LaunchSetting(f"{FSDP_SECTION}.{name}", _fsdp_env(name), default, HONOURED_FSDP.get(name, ()))
        for name, default in accelerate_fsdp_defaults().items()
    ]


def dynamo_settings(compile: bool) -> list[LaunchSetting]:
    return [
        LaunchSetting(
            f"{DYNAMO_SECTION}.{name}",
            f"ACCELERATE_{name.upper()}",
            default,
            ("inductor",) if compile and name == "dynamo_backend" else (),
        )
        for name, default in DYNAMO_DEFAULTS.items()
    ]


def applied_mixed_precision(dtype: str, on_gpu: bool = True) -> str:
    """The mixed precision the training base gives accelerate (pipeline.training.accelerator.mixed_precision):
    bf16 autocast on a GPU unless model.dtype is float32, none on CPU."""
    return "bf16" if on_gpu and dtype != "float32" else "no"


def check_launch_environment(
    model_config, environ, compile: bool = False, applied: str | None = None, where: str = "the accelerate config"
) -> None:
    """The settings ``accelerate launch`` exported into ``environ`` (none: not launched by it, nothing
    to check) against what the training base applies: a ConfigError naming the key and the value
    otherwise. ``applied``: the base's mixed precision (default: applied_mixed_precision on a GPU)."""
    applied = applied_mixed_precision(model_config.dtype) if applied is None else applied
    precision = environ.get("ACCELERATE_MIXED_PRECISION")
    if precision is not None and precision.lower() not in ("no", applied):
        raise ConfigError(
            f"{where}: mixed_precision: {precision}, but the training base trains with {applied} for "
            f"model.dtype={model_config.dtype} (bf16 autocast over float32 weights on a GPU unless model.dtype is "
            f"float32): set mixed_precision: {applied} or leave it out"
        )
    settings = dynamo_settings(compile)
    if str(environ.get("ACCELERATE_USE_FSDP", "")).lower() == "true":
        settings += fsdp_settings()
    for setting in settings:
        value = environ.get(setting.env)
        if value is None or value.lower() == setting.default:
            continue
        if setting.honoured is None or value.lower() in setting.honoured:
            continue
        name = setting.key.split(".", 1)[1]
        why = FSDP_WHY.get(name) or (
            "the training base compiles only with prm.compile=true (inductor)"
            if setting.key.startswith(DYNAMO_SECTION)
            else "the training base applies FSDP2 itself and does not apply it"
        )
        allowed = f" or {', '.join(setting.honoured)}" if setting.honoured else ""
        raise ConfigError(
            f"{where}: {setting.key}: {value.lower()} is not applied ({why}); leave it out (accelerate's default: "
            f"{setting.default}{allowed})"
        )


def file_environment(settings: dict) -> dict[str, str]:
    """What ``accelerate launch`` exports for an accelerate config file's settings (the variables the
    training base and pipeline.finetune.setup.check_accelerate_launch read)."""
    environ: dict[str, str] = {}
    kind = str(settings.get("distributed_type", "NO")).upper()
    if settings.get("mixed_precision") is not None:
        environ["ACCELERATE_MIXED_PRECISION"] = str(settings["mixed_precision"])
    for name, value in (settings.get(DYNAMO_SECTION) or {}).items():
        name = name if name.startswith("dynamo_") else f"dynamo_{name}"
        environ[f"ACCELERATE_{name.upper()}"] = _text(value)
    if kind == "FSDP":
        environ["ACCELERATE_USE_FSDP"] = "true"
        fsdp = {_fsdp_name(name): value for name, value in (settings.get(FSDP_SECTION) or {}).items()}
        environ["FSDP_VERSION"] = str(fsdp.get("fsdp_version", accelerate_fsdp_defaults()["fsdp_version"]))
        for name, value in fsdp.items():
            environ[_fsdp_env(name)] = _text(value)
    if kind == "DEEPSPEED":
        environ["ACCELERATE_USE_DEEPSPEED"] = "true"
        environ["ACCELERATE_DEEPSPEED_ZERO_STAGE"] = str((settings.get("deepspeed_config") or {}).get("zero_stage", 2))
    return environ


def _fsdp_name(name: str) -> str:
    """An fsdp_config key as accelerate launch reads it (``offload_params`` is ``fsdp_offload_params``)."""
    return name if name.startswith("fsdp") else f"fsdp_{name}"


def accelerate_file_keys() -> set[str]:
    """The top-level keys accelerate's config file reader knows (its ClusterConfig's fields)."""
    return set(ClusterConfig.__dataclass_fields__)


def read_accelerate_file(path: str | Path) -> dict:
    """An accelerate config file, read by the project's YAML rules (pipeline.config.loader.load_yaml_file),
    with every key accelerate knows: a top-level key its config reader refuses, or an fsdp_config key
    its launch command does not know (passed on unread), is a ConfigError naming the file and the key."""
    settings = load_yaml_file(path) or {}
    if not isinstance(settings, dict):
        raise ConfigError(f"{path}: expected a mapping at the top level")
    unknown = sorted(set(settings) - accelerate_file_keys())
    if unknown:
        raise ConfigError(f"{path}: {unknown[0]} is not a key of accelerate's config files")
    fsdp = settings.get(FSDP_SECTION) or {}
    known = accelerate_fsdp_defaults()
    for name in fsdp:
        if _fsdp_name(name) not in known:
            hint = " (accelerate's is fsdp_offload_params)" if "offload" in name else ""
            raise ConfigError(
                f"{path}: {FSDP_SECTION}.{name} is not an FSDP key accelerate knows{hint}; its keys: "
                f"{', '.join(sorted(known))}"
            )
    for name in settings.get(DYNAMO_SECTION) or {}:
        if (name if name.startswith("dynamo_") else f"dynamo_{name}") not in DYNAMO_DEFAULTS:
            raise ConfigError(f"{path}: {DYNAMO_SECTION}.{name} is not a dynamo key accelerate knows")
    return settings


def check_accelerate_file(path: str | Path, model_config, compile: bool = False) -> dict:
    """read_accelerate_file, then what it would export checked as the trainer checks it at its start
    (check_accelerate_launch's rules are the fine-tuning stages' own); returns the file's settings."""
    settings = read_accelerate_file(path)
    applied = applied_mixed_precision(model_config.dtype, on_gpu=model_config.device != "cpu")
    check_launch_environment(model_config, file_environment(settings), compile, applied, where=str(path))
    return settings
