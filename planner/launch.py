"""How a training stage is launched: the strategy of the accelerate config plan.accelerate.<stage>
names (checked as the trainer checks it), or of the launch this process runs under, and the FSDP
layer class it wraps."""

from __future__ import annotations

from pathlib import Path

from pipeline.config.loader import ConfigError, load_yaml_file
from pipeline.finetune.setup import FinetuneLaunch
from pipeline.training.launch_settings import check_accelerate_file, file_environment, read_accelerate_file
from planner.plan import Launch, Model, Plan

# transformers' _no_split_modules of the families pipeline.sizing.shapes sizes: the layer FSDP should wrap
WRAP_CLASSES = {"llama": "LlamaDecoderLayer", "qwen2": "Qwen2DecoderLayer"}


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
    checkpointing = bool((settings.get("fsdp_config") or {}).get("fsdp_activation_checkpointing"))
    strategy = launch_strategy(processes, environ)
    return Launch(strategy, checkpointing and strategy == "fsdp", file, environ)


def launch_strategy(processes: int, environ: dict) -> str:
    """single | ddp | zero2 | zero3 | fsdp: the strategy of a launch of ``processes`` that exports
    ``environ``, read as the fine-tuning setup reads it (pipeline.finetune.setup.FinetuneLaunch:
    accelerate's defaults where a variable is unsaid, e.g. ZeRO stage 2)."""
    launch = FinetuneLaunch(processes, environ)
    if launch.fsdp_version is not None:
        return "fsdp"
    if launch.zero_stage is not None:
        return {"3": "zero3", "2": "zero2"}.get(launch.zero_stage, "ddp")
    return "ddp" if processes > 1 else "single"


def launch_from_environment(environ: dict) -> Launch:
    """The strategy of the launch this process runs under, from the variables ``accelerate launch``
    sets (ACCELERATE_USE_FSDP, FSDP_ACTIVATION_CHECKPOINTING, ACCELERATE_USE_DEEPSPEED,
    ACCELERATE_DEEPSPEED_ZERO_STAGE, WORLD_SIZE; ``launch_strategy``)."""
    strategy = launch_strategy(int(environ.get("WORLD_SIZE", "1")), environ)
    if strategy in ("single", "ddp"):
        return Launch(strategy, False, None)
    checkpointing = environ.get("FSDP_ACTIVATION_CHECKPOINTING", "").lower() == "true"
    return Launch(strategy, checkpointing and strategy == "fsdp", "the running launch")


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
