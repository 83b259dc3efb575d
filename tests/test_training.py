"""The training base (pipeline.training): schedule, crash-safe checkpoints, resume, accumulation,
the wall-clock safety net."""

from __future__ import annotations

import json
import logging
import math
import random

import numpy as np
import pytest
import torch

from pipeline.config.schema import ModelConfig
from pipeline.training import (
    OptimizerSettings,
    TrainingBase,
    checkpoint_io,
    checkpoint_state,
    learning_rate,
    make_accelerator,
)

CPU = ModelConfig(device="cpu", dtype="float32")


pytestmark = pytest.mark.usefixtures("one_torch_thread")


# ----------------------------------------------------------------------------- schedule


def test_schedule_warms_up_then_decays_to_the_floor():
    assert learning_rate(0, 1e-3, 100, warmup_steps=10, min_lr_ratio=0.1) == pytest.approx(1e-4)
    assert learning_rate(9, 1e-3, 100, warmup_steps=10, min_lr_ratio=0.1) == pytest.approx(1e-3)
    assert learning_rate(50, 1e-3, 100, warmup_steps=10, min_lr_ratio=0.1) == pytest.approx(1e-3 * (0.1 + 0.9 * 0.5))
    assert learning_rate(100, 1e-3, 100, warmup_steps=10, min_lr_ratio=0.1) == pytest.approx(1e-4)
    assert learning_rate(75, 1.0, 100, schedule="linear") == pytest.approx(0.25)
    assert learning_rate(75, 1.0, 100, warmup_steps=5, schedule="constant") == 1.0
    for step in range(0, 120, 7):  # cosine written out
        expected = 0.5 * (1 + math.cos(math.pi * min(step / 100, 1.0)))
        assert learning_rate(step, 1.0, 100) == pytest.approx(expected)
    with pytest.raises(ValueError, match="one of cosine"):
        learning_rate(0, 1.0, 10, schedule="exponential")


# ----------------------------------------------------------------------------- checkpoint files


def test_nested_state_round_trips_without_pickle(tmp_path):
    model = torch.nn.Linear(3, 2)
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.1, betas=(0.9, 0.95))
    model(torch.randn(4, 3)).sum().backward()
    optimizer.step()
    state = {
        "optimizer": optimizer.state_dict(),
        "rng": checkpoint_state.rng_state(),
        "python": random.Random(3).getstate(),
        "mixed": {1: [1.5, None, "x", True], "t": (1, 2)},
    }
    checkpoint_io.write_state(tmp_path, "state", state)
    back = checkpoint_io.read_state(tmp_path, "state")
    assert back["python"] == state["python"] and back["mixed"] == state["mixed"]
    assert back["optimizer"]["param_groups"] == [dict(g, betas=(0.9, 0.95)) for g in state["optimizer"]["param_groups"]]
    for key, value in state["optimizer"]["state"][0].items():
        assert torch.equal(back["optimizer"]["state"][0][key], value)
    assert np.array_equal(back["rng"]["numpy"]["state"]["key"], state["rng"]["numpy"]["state"]["key"])
    assert b"pickle" not in (tmp_path / "state.json").read_bytes()
    with pytest.raises(TypeError, match="without pickling"):
        checkpoint_io.flatten_state({"fn": print})


def test_a_damaged_newest_checkpoint_is_reported_and_the_previous_one_used(tmp_path, caplog):
    root = tmp_path / "checkpoints"
    for step in (2, 4, 6):
        staging = checkpoint_io.staging_dir(root, step)
        checkpoint_io.write_state(staging, "trainer", {"step": step})
        checkpoint_io.commit(staging, step, keep=3)
    assert [p.name for p in checkpoint_io.committed(root)] == ["step-00000002", "step-00000004", "step-00000006"]
    (root / "step-00000006" / "trainer.safetensors").write_bytes(b"")  # truncated by a kill or a full disk
    (root / "step-00000004" / "manifest.json").unlink()
    checkpoint_io.staging_dir(root, 8)  # a commit that never happened
    with caplog.at_level(logging.WARNING):
        assert checkpoint_io.latest(root).name == "step-00000002"
    assert (
        "step-00000006: trainer.safetensors has 0 bytes" in caplog.text
        and "step-00000004: no readable manifest.json" in caplog.text
    )
    # keep=2 prunes the oldest
    staging = checkpoint_io.staging_dir(root, 10)
    checkpoint_io.write_state(staging, "trainer", {"step": 10})
    checkpoint_io.commit(staging, 10, keep=2)
    assert [p.name for p in checkpoint_io.committed(root)] == ["step-00000006", "step-00000010"]


def test_whole_tensor_checkpoints_are_written_in_buckets_by_one_process_and_read_back_one_at_a_time(tmp_path):
    """The DeepSpeed layout (checkpoint_io.write_full / read_full_index / iter_full), without DeepSpeed:
    every process drives the gathering to its end, only the writer keeps and writes the tensors."""
    from pipeline.training import zero_state

    names = ["embed.weight", "layer.bias"]
    shapes = {"embed.weight": (6, 4), "layer.bias": (4,)}
    tensors = {key: torch.randn(shapes[zero_state.split_key(key)[1]]) for key in zero_state.keys(names)}
    assert list(tensors) == [
        "model.embed.weight",
        "exp_avg.embed.weight",
        "exp_avg_sq.embed.weight",
        "model.layer.bias",
        "exp_avg.layer.bias",
        "exp_avg_sq.layer.bias",
    ]
    driven = []

    def gathered():  # stands for the collectives: counts how far each process drove it
        for key, value in tensors.items():
            driven.append(key)
            yield key, value

    meta = {"processes": 2, "written_under": "DeepSpeed ZeRO-2, 2 process(es)", "optimizer_step": 7}
    checkpoint_io.write_full(tmp_path / "other_rank", gathered(), meta, write=False, bucket_bytes=100)
    assert driven == list(tensors) and not (tmp_path / "other_rank").exists()
    checkpoint_io.write_full(tmp_path, gathered(), meta, write=True, bucket_bytes=100)  # 96 bytes a matrix
    parts = sorted(p.name for p in (tmp_path / checkpoint_io.FULL).iterdir())
    assert parts == ["index.json", "part-00001.safetensors", "part-00002.safetensors", "part-00003.safetensors"]
    assert checkpoint_io.is_full(tmp_path)
    expected = {key: tuple(value.shape) for key, value in tensors.items()}
    index = checkpoint_io.read_full_index(tmp_path, expected, "DeepSpeed ZeRO-3, 1 process(es)")
    assert index["optimizer_step"] == 7 and index["tensors"]["model.layer.bias"]["dtype"] == "float32"
    order = list(reversed(tensors))  # any order the reader asks for
    back = list(checkpoint_io.iter_full(tmp_path, index, order))
    assert [key for key, _ in back] == order
    assert all(torch.equal(value, tensors[key]) for key, value in back)


def test_a_whole_tensor_checkpoint_of_another_model_is_refused_naming_both(tmp_path):
    meta = {"processes": 2, "written_under": "DeepSpeed ZeRO-2, 2 process(es)"}
    checkpoint_io.write_full(tmp_path, iter([("model.w", torch.zeros(3, 2))]), meta, write=True)
    here = "DeepSpeed ZeRO-3, 1 process(es)"
    with pytest.raises(
        checkpoint_io.CheckpointMismatch,
        match=r"model\.w has shape \[3, 2\] in the checkpoint \(written by 2 process\(es\) under DeepSpeed ZeRO-2, "
        r"2 process\(es\)\) and \[2, 3\] in this run \(DeepSpeed ZeRO-3, 1 process\(es\)\)",
    ):
        checkpoint_io.read_full_index(tmp_path, {"model.w": (2, 3)}, here)
    with pytest.raises(checkpoint_io.CheckpointMismatch, match=r"missing \['model\.v'\], unexpected \['model\.w'\]"):
        checkpoint_io.read_full_index(tmp_path, {"model.v": (3, 2)}, here)
    (tmp_path / checkpoint_io.FULL / checkpoint_io.FULL_INDEX).write_text("{")
    with pytest.raises(checkpoint_io.CheckpointError, match=r"cannot read full/index\.json"):
        checkpoint_io.read_full_index(tmp_path, {"model.w": (3, 2)}, here)


def test_a_deepspeed_checkpoint_is_refused_not_skipped_by_a_run_without_deepspeed(tmp_path):
    """Skipping it as damaged would restart from step 0 and let the new run's checkpoints replace it."""
    base = make_base(tmp_path)
    staging = checkpoint_io.staging_dir(base.checkpoint_root, 4)
    names = [n for n, p in base.unwrapped.named_parameters()]
    params = dict(base.unwrapped.named_parameters())
    from pipeline.training import zero_state

    items = ((key, params[zero_state.split_key(key)[1]].detach()) for key in zero_state.keys(names))
    checkpoint_io.write_full(staging, items, {"processes": 2, "written_under": "DeepSpeed ZeRO-2, 2 process(es)"}, True)
    checkpoint_io.write_state(staging, "trainer", {"step": 4, "processes": 2, "loop": None})
    checkpoint_io.commit(staging, 4)
    with pytest.raises(
        checkpoint_io.CheckpointMismatch, match=r"written under DeepSpeed ZeRO.*this run is unsharded, 1 process"
    ):
        make_base(tmp_path).resume()
    assert [p.name for p in checkpoint_io.committed(base.checkpoint_root)] == ["step-00000004"]


def test_a_deepspeed_run_refuses_a_checkpoint_written_without_deepspeed_naming_both(tmp_path, monkeypatch):
    """Its whole copy (model.safetensors + optimizer) holds no ZeRO master weights to set: refused."""
    x, y = regression_data()
    make_base(tmp_path, save_every=2, total_steps=4).fit(batches(x, y, 16, stop=3), mse)
    monkeypatch.setattr(TrainingBase, "_zero", property(lambda self: True))  # the DeepSpeed branch, on CPU
    monkeypatch.setattr(TrainingBase, "_layout", lambda self: "DeepSpeed ZeRO-2, 2 process(es)")
    with pytest.raises(
        checkpoint_io.CheckpointMismatch,
        match=r"step-00000002: written by a run without DeepSpeed \(1 process\(es\); one whole copy\), and this run "
        r"is DeepSpeed ZeRO-2, 2 process\(es\)",
    ):
        make_base(tmp_path, save_every=2, total_steps=4).resume()


# ----------------------------------------------------------------------------- the loop


def regression_data(n=64, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 5, generator=g)
    return x, x @ torch.tensor([1.0, -2.0, 0.5, 3.0, 0.0]) + 0.1


def make_base(tmp_path, total_steps=12, accumulation=1, save_every=0, max_seconds=None, objective=None):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(5, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1))
    accelerator = make_accelerator(CPU, accumulation=accumulation)
    settings = OptimizerSettings(lr=0.05, total_steps=total_steps, weight_decay=0.01, warmup_steps=2, max_grad_norm=1.0)
    return TrainingBase(
        accelerator,
        model,
        settings,
        tmp_path,
        save_every=save_every,
        max_seconds=max_seconds,
        progress=False,
        objective=objective,
        objective_lr=0.1,
    )


def batches(x, y, size, start=0, stop=None):
    """Micro-batches of a fixed stream from micro-batch ``start`` on (what a resumed loop feeds)."""
    index = start
    while stop is None or index < stop:
        rows = [(index * size + i) % len(x) for i in range(size)]
        yield x[rows], y[rows]
        index += 1


def mse(model, batch):
    x, y = batch
    return ((model(x).squeeze(-1) - y) ** 2).mean(), {"examples": len(x)}


def test_accumulated_micro_batches_equal_one_full_batch(tmp_path):
    x, y = regression_data()
    whole = make_base(tmp_path / "a", accumulation=1)
    whole.fit(batches(x, y, 16), mse)
    halves = make_base(tmp_path / "b", accumulation=2)
    halves.fit(batches(x, y, 8), mse)
    for p, q in zip(whole.unwrapped.parameters(), halves.unwrapped.parameters()):
        assert torch.allclose(p, q, atol=1e-6)
    records = [json.loads(line) for line in (tmp_path / "b" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == list(range(1, 13)) and "examples_per_s" in records[0]


def test_a_run_killed_after_a_checkpoint_resumes_to_the_same_weights(tmp_path):
    x, y = regression_data()
    straight = make_base(tmp_path / "straight", save_every=4)
    straight.fit(batches(x, y, 16), mse)

    killed = make_base(tmp_path / "killed", save_every=4)

    def dies_at_step_10(model, batch):
        if killed.step == 9:
            raise KeyboardInterrupt
        return mse(model, batch)

    with pytest.raises(KeyboardInterrupt):
        killed.fit(batches(x, y, 16), dies_at_step_10)
    resumed = make_base(tmp_path / "killed", save_every=4)
    for p in resumed.unwrapped.parameters():  # the resume, not the seed, must bring the weights back
        torch.nn.init.zeros_(p)
    assert resumed.resume() == {} and resumed.step == 8
    result = resumed.fit(batches(x, y, 16, start=resumed.step), mse)
    assert result["resumed_from"] == 8 and result["steps"] == 12
    for p, q in zip(straight.unwrapped.parameters(), resumed.unwrapped.parameters()):
        assert torch.equal(p, q)
    logged = [json.loads(line) for line in (tmp_path / "killed" / "metrics.jsonl").read_text().splitlines()]
    expected = [json.loads(line) for line in (tmp_path / "straight" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in logged] == list(range(1, 13))
    assert [r["loss"] for r in logged] == [r["loss"] for r in expected]
    resumed.finish()
    assert not (tmp_path / "killed" / "checkpoints").exists()


def log_z_module() -> torch.nn.Module:
    module = torch.nn.Module()
    module.log_z = torch.nn.Parameter(torch.zeros(()))
    return module


def test_objective_parameters_train_at_their_own_rate_and_are_checkpointed(tmp_path):
    base = make_base(tmp_path, objective=log_z_module())
    assert [g["initial_lr"] for g in base.optimizer.param_groups] == [0.05, 0.05]
    # an AdamW of their own: sharded wrappers (FSDP2, ZeRO) accept only the model's parameters in theirs
    assert [g["initial_lr"] for g in base.objective_optimizer.param_groups] == [0.1]
    assert all(p is not base.objective.log_z for g in base.optimizer.param_groups for p in g["params"])
    base.objective.log_z.grad = torch.tensor(1.0)
    base.optimizer_step()
    assert base.objective.log_z.item() < 0
    base.save_checkpoint({"order": [3, 1]})
    again = make_base(tmp_path, objective=log_z_module())
    assert again.resume() == {"order": [3, 1]}
    assert again.objective.log_z.item() == base.objective.log_z.item() and again.step == 1


def test_the_wall_clock_safety_net_stops_loudly(tmp_path, caplog):
    x, y = regression_data()
    base = make_base(tmp_path, max_seconds=0.0)
    with caplog.at_level(logging.WARNING):
        result = base.fit(batches(x, y, 16), mse)
    assert result["stopped_by_time"] and result["steps"] == 0
    assert "STOPPED BY THE WALL-CLOCK SAFETY NET after 0 of 12 steps" in caplog.text


def test_a_checkpoint_of_another_model_is_refused_with_a_clear_error(tmp_path):
    x, y = regression_data()
    base = make_base(tmp_path, save_every=2, total_steps=4)
    base.fit(batches(x, y, 16, stop=3), mse)
    other = TrainingBase(
        make_accelerator(CPU), torch.nn.Linear(5, 1), OptimizerSettings(lr=0.1, total_steps=4), tmp_path, progress=False
    )
    with pytest.raises(checkpoint_io.CheckpointError, match="written by another model or config"):
        other.resume()


# ----------------------------------------------------------------------------- hostile run folders


def test_when_no_checkpoint_is_usable_training_restarts_from_step_0_and_says_so(tmp_path, caplog):
    x, y = regression_data()
    straight = make_base(tmp_path / "straight")
    straight.fit(batches(x, y, 16), mse)
    killed = make_base(tmp_path / "killed", save_every=4)
    with pytest.raises(KeyboardInterrupt):
        killed.fit(
            batches(x, y, 16),
            lambda model, batch: (_ for _ in ()).throw(KeyboardInterrupt) if killed.step == 9 else mse(model, batch),
        )
    root = tmp_path / "killed" / "checkpoints"
    for directory in checkpoint_io.committed(root):  # every checkpoint damaged (a full disk, a bad copy)
        (directory / "optimizer.safetensors").write_bytes(b"\0" * 8)
    resumed = make_base(tmp_path / "killed", save_every=4)
    with caplog.at_level(logging.WARNING):
        assert resumed.resume() is None and resumed.step == 0
    assert caplog.text.count("checkpoint skipped") == 2 and "training restarts from step 0" in caplog.text
    resumed.fit(batches(x, y, 16), mse)  # no crash loop: the run completes, and as an uninterrupted one does
    for p, q in zip(straight.unwrapped.parameters(), resumed.unwrapped.parameters()):
        assert torch.equal(p, q)


def test_a_checkpoint_whose_manifest_checks_out_but_cannot_be_read_falls_back(tmp_path, caplog, monkeypatch):
    x, y = regression_data()
    base = make_base(tmp_path, save_every=4)
    base.fit(batches(x, y, 16, stop=9), mse)
    assert [p.name for p in checkpoint_io.committed(tmp_path / "checkpoints")] == ["step-00000004", "step-00000008"]
    real = checkpoint_io.read_state

    def unreadable_newest(directory, name):
        if directory.name == "step-00000008" and name == "optimizer":
            raise checkpoint_io.CheckpointError(f"{directory}: cannot read {name} (simulated)")
        return real(directory, name)

    monkeypatch.setattr(checkpoint_io, "read_state", unreadable_newest)
    resumed = make_base(tmp_path, save_every=4)
    with caplog.at_level(logging.WARNING):
        assert resumed.resume() == {} and resumed.step == 4
    assert "step-00000008: cannot read optimizer (simulated)" in caplog.text


PAYLOAD = """
import os, pickle
class Bomb:
    def __reduce__(self):
        return (os.system, ("touch {marker}",))
"""


def test_nothing_in_a_run_folder_is_ever_unpickled(tmp_path):
    import pickle

    x, y = regression_data()
    base = make_base(tmp_path, save_every=4)
    base.fit(batches(x, y, 16, stop=5), mse)
    marker = tmp_path / "PWNED"
    namespace: dict = {}
    exec(PAYLOAD.format(marker=marker), namespace)
    bomb = pickle.dumps(namespace["Bomb"]())
    newest = checkpoint_io.committed(tmp_path / "checkpoints")[-1]
    for name in ("optimizer.pkl", "trainer.pkl", "rng_state.pth", "pytorch_model.bin"):  # planted beside the real files
        (newest / name).write_bytes(bomb)
    planted = tmp_path / "checkpoints" / "step-99999999"  # and a whole fake newer checkpoint
    planted.mkdir()
    (planted / "optimizer.pkl").write_bytes(bomb)
    resumed = make_base(tmp_path, save_every=4)
    assert (
        resumed.resume() == {} and resumed.step == 4
    )  # the planted files are not in the manifest: ignored, or the folder skipped
    assert not marker.exists()


def test_the_code_never_unpickles():
    """No module of ours imports pickle, calls torch.load without weights_only=True, or loads numpy
    arrays with allow_pickle: run folders hold safetensors and JSON only."""
    import re
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    offenders = []
    for path in sorted(p for folder in ("pipeline", "prm", "eval", "stages") for p in (root / folder).rglob("*.py")):
        text = path.read_text(encoding="utf-8")
        for pattern in (
            r"^\s*(import|from)\s+(c?pickle|dill|joblib|cloudpickle)\b",
            r"allow_pickle\s*=\s*True",
            r"weights_only\s*=\s*False",
            r"torch\.load\((?![^)]*weights_only\s*=\s*True)",
        ):
            offenders += [
                f"{path.relative_to(root)}: {m.group(0).strip()}" for m in re.finditer(pattern, text, re.MULTILINE)
            ]
    assert offenders == []


def test_trimming_metrics_is_atomic_and_drops_a_line_a_kill_cut_short(tmp_path, monkeypatch):
    import os

    from pipeline.training.metrics import MetricsLog

    log_file = MetricsLog(tmp_path / "metrics.jsonl")
    for step in (1, 2, 3):
        log_file.write({"step": step, "loss": 1.0 / step})
    with (tmp_path / "metrics.jsonl").open("a") as handle:
        handle.write('{"step": 4, "lo')  # SIGKILL mid-append
    log_file.trim(2)
    assert [r["step"] for r in log_file.read()] == [1, 2]
    log_file.write({"step": 3, "loss": 0.3})

    def killed(*args, **kwargs):  # SIGKILL inside the trim's write: the old file must survive whole
        raise KeyboardInterrupt

    monkeypatch.setattr(os, "replace", killed)
    with pytest.raises(KeyboardInterrupt):
        log_file.trim(1)
    assert [r["step"] for r in log_file.read()] == [1, 2, 3]
