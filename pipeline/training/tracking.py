"""Experiment trackers for every trainer: TensorBoard and Weights & Biases, through accelerate.

``report_to`` (the config's top-level field, as in every Hugging Face trainer): ``none`` |
``tensorboard`` | ``wandb`` | ``all`` (both). A trainer builds ``Tracking.from_config(config,
stage, out_dir)`` and hands it to ``make_accelerator`` (its trackers become the Accelerator's
``log_with``) and to ``TrainingBase``, which starts them at its first metrics record
(``accelerator.init_trackers``, with the resolved config as hyper-parameters) and sends every
record to them (``accelerator.log``) beside metrics.jsonl: the same numbers, at the same steps.

- TensorBoard: event files under ``<stage dir>/tensorboard/``. A resumed run hides the events an
  interrupted attempt wrote at or after the first step it logs again (SummaryWriter's
  ``purge_step``), as metrics.jsonl is trimmed.
- W&B: project ``$WANDB_PROJECT`` (default "stepflow"), run name ``<run>/<stage>``, group
  ``<run>``, files under ``<stage dir>/wandb/``. ``WANDB_MODE=offline`` logs with no account
  (``wandb sync`` uploads later). A resumed run is a new W&B run starting at its checkpoint's step.

The packages are the optional extra ``tracking`` (``pip install -e '.[tracking]'``); choosing one
that is not installed is an error naming the extra, raised before any model is loaded.
"""

from __future__ import annotations

import importlib.util
import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from accelerate import Accelerator
from accelerate.tracking import GeneralTracker, TensorBoardTracker, WandBTracker

from pipeline.config.loader import check_choice
from pipeline.config.schema import ReportTo

# tracker name -> the package it needs
PACKAGES = {"tensorboard": "tensorboard", "wandb": "wandb"}
EXTRA_HINT = "pip install -e '.[tracking]'"
DEFAULT_WANDB_PROJECT = "stepflow"


def tracker_names(report_to: str) -> list[str]:
    """The trackers of a ``report_to`` value; an unknown value, or a tracker whose package is not
    installed, is an error that says what to do."""
    check_choice(report_to, ReportTo, "report_to")
    names = {"none": [], "all": list(PACKAGES)}.get(report_to, [report_to])
    missing = [PACKAGES[name] for name in names if importlib.util.find_spec(PACKAGES[name]) is None]
    if missing:
        raise ImportError(
            f"report_to={report_to} needs {' and '.join(missing)}, which is not installed: {EXTRA_HINT} "
            f"(the optional extra 'tracking'), or set report_to=none"
        )
    return names


def flat_config(values: dict[str, Any], prefix: str = "") -> dict[str, bool | int | float | str]:
    """A nested config as {dotted.key: scalar}: what TensorBoard's hparams accept (lists, mappings
    and None become their JSON text)."""
    flat: dict[str, bool | int | float | str] = {}
    for key, value in values.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict) and value:
            flat.update(flat_config(value, f"{name}."))
        elif isinstance(value, (bool, int, float, str)):
            flat[name] = value
        else:
            flat[name] = json.dumps(value)
    return flat


def scalars(record: dict[str, Any]) -> dict[str, float]:
    """The numbers of a metrics record (its step aside): what the trackers plot. Booleans become
    0/1; None, text and lists are left to metrics.jsonl."""
    return {
        key: float(value) for key, value in record.items() if key != "step" and isinstance(value, (bool, int, float))
    }


@dataclass
class Tracking:
    """The trackers of one trainer's run.

    report_to: none | tensorboard | wandb | all
    out_dir:   the stage's output folder (tensorboard/ and wandb/ go there)
    run:       the pipeline run's name (W&B group)
    stage:     bootstrap | prm | gfn | ppo (W&B run name <run>/<stage>, job type <stage>)
    config:    the resolved config, stored as hyper-parameters (flattened to dotted keys)
    """

    report_to: str
    out_dir: Path
    run: str = ""
    stage: str = "train"
    config: dict[str, Any] = field(default_factory=dict)
    names: list[str] = field(init=False)
    trackers: list[GeneralTracker] = field(init=False)
    started: bool = field(default=False, init=False)

    def __post_init__(self):
        self.out_dir = Path(self.out_dir)
        self.names = tracker_names(self.report_to)
        self.trackers = [self._make(name) for name in self.names]

    @classmethod
    def from_config(cls, config, stage: str, out_dir: str | Path) -> Tracking:
        """The trackers ``config.report_to`` asks for, for ``stage`` writing to ``out_dir``."""
        return cls(config.report_to, Path(out_dir), run=config.run, stage=stage, config=config.to_dict())

    @property
    def project(self) -> str:
        return os.environ.get("WANDB_PROJECT") or DEFAULT_WANDB_PROJECT

    def _make(self, name: str) -> GeneralTracker:
        if name == "tensorboard":
            return TensorBoardTracker("tensorboard", str(self.out_dir))  # events in <out_dir>/tensorboard
        return WandBTracker(
            self.project,
            name=f"{self.run}/{self.stage}" if self.run else self.stage,
            group=self.run or None,
            job_type=self.stage,
            dir=str(self.out_dir),
        )

    def log(self, accelerator: Accelerator, record: dict[str, Any]) -> None:
        """Send one metrics record to every tracker (accelerate logs on the main process only);
        the first one starts them."""
        if not self.trackers:
            return
        step = int(record["step"])
        if not self.started:
            self.start(accelerator, step)
        accelerator.log(scalars(record), step=step)

    def start(self, accelerator: Accelerator, first_step: int) -> None:
        """accelerate's init_trackers with the resolved config. ``first_step``: the first step this
        attempt logs; TensorBoard hides what an interrupted attempt wrote from there on."""
        for tracker in self.trackers:
            if isinstance(tracker, TensorBoardTracker):
                tracker.init_kwargs["purge_step"] = first_step  # passed on to SummaryWriter by tracker.start()
        if accelerator.is_main_process:
            self.out_dir.mkdir(parents=True, exist_ok=True)
        accelerator.init_trackers(self.project, config=flat_config(self.config))
        self.started = True

    def finish(self, accelerator: Accelerator) -> None:
        """Close the trackers (flush the event files, end the W&B run) once, whoever calls
        accelerator.end_training afterwards."""
        if self.started:
            for tracker in accelerator.trackers:
                tracker.finish()
            accelerator.trackers = []
            self.started = False
