"""Experiment trackers (report_to): TensorBoard event files and W&B runs carry exactly what
metrics.jsonl does, through the training base every trainer uses."""

from __future__ import annotations

import importlib.machinery
import json
import os
import sys
import types
from pathlib import Path

import pytest
from test_prm import arithmetic_records, make_prm, make_tokenizer, tiny_config

from pipeline.config.loader import ConfigError, load_config
from pipeline.finetune.setup import preflight
from pipeline.tinyworld.bootstrap import build_base_policy
from pipeline.training import tracking as tracking_module
from pipeline.training.tracking import Tracking, flat_config, tracker_names
from prm.model import ProcessRewardModel
from prm.train import train_prm
from stages import train_gfn

REPO = Path(__file__).resolve().parents[1]

event_accumulator = pytest.importorskip(
    "tensorboard.backend.event_processing.event_accumulator",
    reason="tensorboard is in the dev extra: pip install -e '.[dev]'",
)


pytestmark = pytest.mark.usefixtures("one_torch_thread")


def read_metrics(directory) -> list[dict]:
    return [json.loads(line) for line in (directory / "metrics.jsonl").read_text().splitlines() if line.strip()]


def read_tensorboard(directory) -> dict[str, list[tuple[int, float]]]:
    """{tag: [(step, value), ...]} of the event files in ``directory`` (tensorboard's own reader)."""
    accumulator = event_accumulator.EventAccumulator(str(directory), size_guidance={event_accumulator.SCALARS: 0})
    accumulator.Reload()
    return {
        tag: [(event.step, event.value) for event in accumulator.Scalars(tag)] for tag in accumulator.Tags()["scalars"]
    }


def assert_tracked_equals_metrics(tracked: dict[str, list[tuple[int, float]]], records: list[dict]) -> None:
    """Every number of every metrics.jsonl record is in the tracker at its step (float32, as
    TensorBoard stores it), and the tracker holds nothing else."""
    expected: dict[str, list[tuple[int, float]]] = {}
    for record in records:
        for key, value in record.items():
            if key != "step" and isinstance(value, (bool, int, float)):
                expected.setdefault(key, []).append((record["step"], float(value)))
    assert sorted(tracked) == sorted(expected)
    for key, points in expected.items():
        assert [step for step, _ in tracked[key]] == [step for step, _ in points], key
        for (_, got), (_, want) in zip(tracked[key], points):
            assert got == pytest.approx(want, rel=1e-6, abs=1e-12), key


def prm_run(tmp_path, name, report_to, tokenizer, **prm):
    config = tiny_config(lr=1e-2, batch_size=8, micro_batch_size=4, epochs=1.0, log_every=1, **prm)
    config.report_to = report_to
    config.run = "trackers"
    out = tmp_path / name
    train_prm(
        config,
        arithmetic_records(40, seed=3),
        None,
        out,
        model=make_prm(tokenizer),
        tokenizer=tokenizer,
        progress=False,
    )
    return out


def test_tensorboard_scalars_equal_metrics_jsonl(tmp_path):
    tokenizer = make_tokenizer()
    out = prm_run(tmp_path, "prm", "tensorboard", tokenizer)
    records = read_metrics(out)
    assert [r["step"] for r in records] == [1, 2, 3, 4, 5]
    assert_tracked_equals_metrics(read_tensorboard(out / "tensorboard"), records)
    # the resolved config, flattened, is stored beside the scalars (accelerate writes it as hparams)
    hparams = list((out / "tensorboard").glob("*/hparams.yml"))
    assert len(hparams) == 1 and "prm.lr: 0.01" in hparams[0].read_text()


def test_a_resumed_run_hides_the_interrupted_attempts_later_events(tmp_path, monkeypatch):
    """Killed after its step-4 checkpoint, having logged step 5: the rerun logs step 5 again, and
    TensorBoard shows it once (purge_step), as metrics.jsonl does."""
    tokenizer = make_tokenizer()

    def crash(*args, **kwargs):
        raise KeyboardInterrupt

    with monkeypatch.context() as patch:
        patch.setattr(ProcessRewardModel, "save_pretrained", crash)
        with pytest.raises(KeyboardInterrupt):
            prm_run(tmp_path, "resumed", "tensorboard", tokenizer, save_every=2)
    out = prm_run(tmp_path, "resumed", "tensorboard", tokenizer, save_every=2)
    assert len(list((out / "tensorboard").glob("events.out.tfevents.*"))) == 2  # one file per attempt
    records = read_metrics(out)
    assert [r["step"] for r in records] == [1, 2, 3, 4, 5]
    assert_tracked_equals_metrics(read_tensorboard(out / "tensorboard"), records)


class FakeWandb(types.ModuleType):
    """The part of wandb accelerate's WandBTracker calls: init -> run.log / run.finish, config.update."""

    def __init__(self):
        super().__init__("wandb")
        self.__spec__ = importlib.machinery.ModuleSpec("wandb", None)
        self.inits, self.logged, self.configs, self.finished = [], [], [], 0
        fake = self

        class Run:
            def log(self, values, step=None, **kwargs):
                fake.logged.append((step, dict(values)))

            def finish(self):
                fake.finished += 1

        class Config:
            def update(self, values, allow_val_change=False):
                fake.configs.append(dict(values))

        self.run_class, self.config = Run, Config()

    def init(self, **kwargs):
        self.inits.append(kwargs)
        return self.run_class()


def test_wandb_gets_the_same_records_and_the_resolved_config(tmp_path, monkeypatch):
    """A stub of the wandb module (the real one is a 20 MB wheel with a service process; it is not
    in the dev extra, and the test below runs it offline where it is installed): what our wiring
    hands wandb through accelerate's tracker."""
    fake = FakeWandb()
    monkeypatch.setitem(sys.modules, "wandb", fake)
    monkeypatch.setenv("WANDB_PROJECT", "interop-test")
    out = prm_run(tmp_path, "prm", "wandb", make_tokenizer())
    assert len(fake.inits) == 1
    init = fake.inits[0]
    assert (init["project"], init["name"], init["group"], init["job_type"], init["dir"]) == (
        "interop-test",
        "trackers/prm",
        "trackers",
        "prm",
        str(out),
    )
    tracked: dict[str, list[tuple[int, float]]] = {}
    for step, values in fake.logged:
        for key, value in values.items():
            tracked.setdefault(key, []).append((step, value))
    assert_tracked_equals_metrics(tracked, read_metrics(out))
    assert fake.configs[0]["prm.lr"] == 0.01 and fake.configs[0]["report_to"] == "wandb" and fake.finished == 1


def test_wandb_offline_run_needs_no_account(tmp_path, monkeypatch):
    pytest.importorskip(
        "wandb", reason="wandb is in the optional extra 'tracking', not in dev (see the stub test above)"
    )
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    out = prm_run(tmp_path, "prm", "wandb", make_tokenizer())
    runs = list((out / "wandb").glob("offline-run-*/run-*.wandb"))
    assert len(runs) == 1
    # wandb 0.31 has no public reader of an offline run file; its records hold the logged names in the clear
    written = runs[0].read_bytes()
    assert all(name.encode() in written for name in read_metrics(out)[-1] if name != "step")


def test_report_to_is_checked_and_a_missing_tracker_names_the_extra(monkeypatch, tmp_path):
    with pytest.raises(ConfigError, match="report_to must be one of none, tensorboard, wandb, all"):
        load_config(None, ["report_to=mlflow"])
    assert tracker_names("none") == []
    assert load_config(None, []).report_to == "none"
    monkeypatch.setattr(tracking_module.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(
        ImportError, match=r"report_to=all needs tensorboard and wandb.*pip install -e '\.\[tracking\]'"
    ):
        Tracking("all", tmp_path)
    with pytest.raises(
        ConfigError, match="report_to=wandb needs wandb"
    ):  # gfn / ppo: before the PRM or the policy loads
        preflight(load_config(None, ["report_to=wandb", "model.device=cpu"]), "gfn")


def test_flat_config_gives_scalars_for_hparams():
    flat = flat_config(
        {"prm": {"lr": 0.1, "lora_target_modules": ["q", "v"], "kind": None}, "run": "demo", "eval": {"models": {}}}
    )
    assert flat == {
        "prm.lr": 0.1,
        "prm.lora_target_modules": '["q", "v"]',
        "prm.kind": "null",
        "run": "demo",
        "eval.models": "{}",
    }
    assert all(isinstance(value, (bool, int, float, str)) for value in flat.values())


def test_no_tracker_by_default_writes_nothing_more(tmp_path):
    out = prm_run(tmp_path, "prm", "none", make_tokenizer())
    assert not (out / "tensorboard").exists() and not (out / "wandb").exists()
    assert os.path.exists(out / "metrics.jsonl")


# ----------------------------------------------------------------------------- every trainer


@pytest.mark.parametrize("stage", ["gfn", "ppo"])
def test_fine_tuning_reports_to_tensorboard(random_tiny_world, tmp_path, stage):
    world = random_tiny_world
    args = {
        "runs_root": tmp_path,
        "run": "tb",
        "report_to": "tensorboard",
        "model.policy": world / "policy",
        "model.prm": world / "prm",
        "data.train_path": world / "problems_train.jsonl",
        "data.disjoint_from": "[]",
        "generation.max_new_tokens": 16,
        "generation.batch_size": 8,
        f"{stage}.num_train_steps": 2,
        f"{stage}.questions_per_step": 2,
        f"{stage}.samples_per_question": 2,
        f"{stage}.save_every": 0,
        f"{stage}.warmup_steps": 0,
    }
    train_gfn.main(
        ["--config", str(REPO / "configs" / "tiny.yaml"), *(f"{k}={v}" for k, v in args.items())], stage=stage
    )
    out = tmp_path / "tb" / stage
    records = read_metrics(out)
    assert [r["step"] for r in records] == [1, 2] and "avg_reward" in records[0]
    assert_tracked_equals_metrics(read_tensorboard(out / "tensorboard"), records)


def test_bootstrap_reports_to_tensorboard(tmp_path):
    config = load_config(
        REPO / "configs" / "tiny.yaml",
        [
            f"runs_root={tmp_path}",
            "run=tb",
            "report_to=tensorboard",
            "tinyworld.n_train=40",
            "tinyworld.n_val=4",
            "tinyworld.n_test=4",
            "bootstrap.hidden_size=32",
            "bootstrap.intermediate_size=64",
            "bootstrap.num_layers=1",
            "bootstrap.num_heads=2",
            "bootstrap.max_train_steps=40",
            "bootstrap.warmup_steps=2",
            "bootstrap.batch_size=8",
        ],
    )
    out = config.stage_dir("bootstrap")
    out.mkdir(parents=True)
    build_base_policy(config, out, progress=False)
    records = read_metrics(out)
    assert [r["step"] for r in records] == [20, 40]
    assert_tracked_equals_metrics(read_tensorboard(out / "tensorboard"), records)
