"""A plan and its parts: the GPU types, the models and data the config names, each stage's
launch and cost, and the findings (errors and warnings) every check adds."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import NamedTuple

from pipeline.config.schema import Config
from pipeline.sizing.shapes import ModelShape

GIB = 1024**3


class GPU(NamedTuple):
    memory_gib: float  # per device
    peak_tflops: float  # dense bf16 tensor-core peak (the vendor's datasheet)


GPUS: dict[str, GPU] = {  # plan.gpu's choices (pipeline.config.schema.GPUType) in the same order
    "A100-40GB": GPU(40, 312),
    "A100-80GB": GPU(80, 312),
    "H100-80GB": GPU(80, 989),
    "H200": GPU(140, 989),
    "L40S": GPU(45, 362),
}


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
