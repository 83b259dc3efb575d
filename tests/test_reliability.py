"""Stages against damaged, inconsistent or concurrent run folders (docs/reliability.md).

Each test builds the run folder a stage reads (synthetic MCTS shards, a tiny problems file), damages
it as the issue's campaign did, and checks that the stage stops with an error naming what is wrong,
before it loads a model and without touching its earlier outputs.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from pipeline.config.loader import load_config
from pipeline.records import MCTSRecord, MCTSRollout, MCTSSummary, Problem
from pipeline.storage.locks import LockError, release_stage_locks
from pipeline.storage.model_folders import commit_folder, staging_folder, verify_manifest
from pipeline.storage.shards import SettingsMismatch, ShardError, ShardWriter, check_settings
from pipeline.training import checkpoint_io
from stages import augment, mcts, train_gfn, train_prm
from stages.cli import cli
from stages.run_folders import finished_model

REPO = Path(__file__).resolve().parents[1]
PROBLEMS = [f"tiny-train-{i:05d}" for i in range(24)]  # 1 of them in the validation split (augment.val_fraction 0.1)


def args(tmp_path: Path, *extra: str) -> list[str]:
    """A stage's command line whose policy is an empty folder: it passes the stage's model check
    (a local folder) and fails only if a model were loaded from it."""
    (tmp_path / "no-policy").mkdir(exist_ok=True)
    return [
        "--config",
        str(REPO / "configs" / "tiny.yaml"),
        f"runs_root={tmp_path / 'runs'}",
        "run=r",
        f"data.train_path={tmp_path / 'train.jsonl'}",
        "data.disjoint_from=[]",
        f"model.policy={tmp_path / 'no-policy'}",
        *extra,
    ]


def mcts_record(pid: str, depth: int) -> MCTSRecord:
    rollouts = [
        MCTSRollout(["3 + 4 = 7", "The answer is 7"], "7", True),
        MCTSRollout(["3 + 4 = 8", "The answer is 8"], "8", False),
    ]
    return MCTSRecord(
        pid, f"question {pid}", [f"step {i}" for i in range(depth)], f"step {depth}", 0.5, 1, 2, rollouts, depth + 1
    )


@pytest.fixture
def run(tmp_path):
    """A run folder holding committed MCTS shards (6 shards of 4 problems) and their settings."""
    with (tmp_path / "train.jsonl").open("w") as handle:
        for pid in PROBLEMS:
            handle.write(json.dumps(Problem(pid, f"question {pid}", "7", "tiny").to_json()) + "\n")
    config = load_config(REPO / "configs" / "tiny.yaml", args(tmp_path)[2:])
    shards = config.stage_dir("mcts") / "shards"
    check_settings(shards, mcts.mcts_settings(config), "the MCTS run")
    with ShardWriter(shards, tag="0of1", commit_every=4) as writer:
        for pid in PROBLEMS:
            records = [mcts_record(pid, depth) for depth in range(2)]
            summary = MCTSSummary(pid, 0.5, 1, records[0].rollouts, True, 1, len(records), 4, 2)
            writer.add(pid, records=records, summaries=[summary])
    return tmp_path, config, shards


def outputs(directory: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(directory.glob("prm_*.jsonl"))}


@pytest.mark.parametrize(
    "damage,match",
    [
        ("delete problems.json", r"part-0of1-00001: problems\.json: missing"),
        ("delete records.jsonl", r"part-0of1-00001: records\.jsonl is missing"),
        ("empty records.jsonl", r"part-0of1-00001: records\.jsonl holds 0 records in 0 bytes; the manifest says 8"),
        ("copy a shard folder", r"part-0of1-00009 and .*part-0of1-00001 both hold problem 'tiny-train-00004'"),
        ("truncate records.jsonl", r"part-0of1-00001: records\.jsonl holds 4 records"),
    ],
)
def test_augment_refuses_damaged_shards_and_keeps_its_outputs(run, damage, match):
    tmp_path, config, shards = run
    first = augment.main(args(tmp_path))
    assert first["train_examples"] > 0 and first["val_examples"] > 0
    before = outputs(config.stage_dir("augment"))
    shard = shards / "part-0of1-00001"
    if damage == "delete problems.json":
        (shard / "problems.json").unlink()
    elif damage == "delete records.jsonl":
        (shard / "records.jsonl").unlink()
    elif damage == "empty records.jsonl":
        (shard / "records.jsonl").write_text("")
    elif damage == "copy a shard folder":
        shutil.copytree(shard, shards / "part-0of1-00009")
    else:
        lines = (shard / "records.jsonl").read_text().splitlines(keepends=True)
        (shard / "records.jsonl").write_text("".join(lines[:4]))
    with pytest.raises(ShardError, match=match):
        augment.main(args(tmp_path))
    assert outputs(config.stage_dir("augment")) == before  # prm_train.jsonl was overwritten with 0 examples before


def test_mcts_refuses_a_damaged_shard_instead_of_searching_its_problems_again(run):
    tmp_path, _, shards = run
    (shards / "part-0of1-00002" / "problems.json").unlink()
    # the policy does not exist: the error must come before any model is loaded
    with pytest.raises(ShardError, match=r"part-0of1-00002: problems\.json: missing .*searched again"):
        mcts.main(args(tmp_path))


def test_a_resume_with_other_settings_stops_with_one_line_and_exit_status_2(run, monkeypatch, capsys):
    tmp_path, _, shards = run
    monkeypatch.setattr(sys, "argv", ["stages/mcts.py"])
    with pytest.raises(SystemExit) as exit_info:
        cli(lambda argv: mcts.main(args(tmp_path, "mcts.k=5")))  # the shards were made with the config's k
    assert exit_info.value.code == 2
    error = capsys.readouterr().err.splitlines()
    assert error == [
        f"error: {shards / 'settings.json'}: the MCTS run already holds records made with other settings "
        f"(mcts differ). Resuming would mix the two. Move or delete {shards}, or use another run name."
    ]


def test_augment_refuses_empty_inputs_and_empty_splits(run):
    tmp_path, config, shards = run
    augment.main(args(tmp_path))
    before = outputs(config.stage_dir("augment"))
    with pytest.raises(SystemExit, match=r"the validation split is empty .*augment\.val_fraction=0\.01"):
        augment.main(args(tmp_path, "augment.val_fraction=0.01"))
    for shard in sorted(shards.glob("part-*")):  # shards that hold no records at all
        shutil.rmtree(shard)
    with ShardWriter(shards, tag="0of1") as writer:
        writer.add(
            "tiny-train-00000", records=[], summaries=[MCTSSummary("tiny-train-00000", 0.0, 0, [], False, 0, 0, 4, 1)]
        )
    with pytest.raises(SystemExit, match="the MCTS shards hold no records"):
        augment.main(args(tmp_path))
    assert outputs(config.stage_dir("augment")) == before


HOLDER = """
import sys, time
from pipeline.storage.locks import StageLock
StageLock(sys.argv[1], "test").acquire()
print("locked", flush=True)
time.sleep(120)
"""


def hold(lock: Path) -> subprocess.Popen:
    """Another process holding ``lock`` (a user's first `make`), until killed."""
    process = subprocess.Popen(
        [sys.executable, "-c", HOLDER, str(lock)],
        env={**os.environ, "PYTHONPATH": str(REPO)},
        stdout=subprocess.PIPE,
        text=True,
    )
    assert process.stdout.readline().strip() == "locked"
    return process


def test_a_second_process_on_a_stage_stops_at_once_and_writes_nothing(run):
    tmp_path, config, _ = run
    for stage, module, lock in (
        ("augment", augment, ".lock"),
        ("mcts", mcts, ".lock-shard-0of1"),
        ("prm", train_prm, ".lock"),
    ):
        if stage == "prm":
            augment.main(args(tmp_path))  # its inputs: a stage whose inputs are missing stops before its lock
        folder = config.stage_dir(stage)
        folder.mkdir(parents=True, exist_ok=True)
        (folder / "config.yaml").unlink(missing_ok=True)
        holder = hold(folder / lock)
        try:
            with pytest.raises(
                LockError, match=rf"another process is writing this stage of this run: .*held by process {holder.pid}"
            ):
                module.main(args(tmp_path))
            assert not (folder / "config.yaml").exists()
            if stage == "mcts":  # shard=i/n processes share the folder by design, but not with another split
                with pytest.raises(SystemExit, match="split another way than 2 shards"):
                    mcts.main(args(tmp_path, "mcts.shard=1/2"))
        finally:
            holder.kill()
            holder.wait(timeout=30)


def test_a_stage_does_not_read_what_the_stage_before_is_still_writing(run):
    tmp_path, config, _ = run
    holder = hold(config.stage_dir("mcts") / ".lock-shard-0of1")
    try:
        with pytest.raises(SystemExit, match=rf"make mcts is still running in .* \(process {holder.pid} "):
            augment.main(args(tmp_path))
    finally:
        holder.kill()
        holder.wait(timeout=30)


def fake_model(out: Path, steps: int = 3, settings: dict | None = None) -> Path:
    staging = staging_folder(out / "model")
    (staging / "config.json").write_text("{}")
    return commit_folder(staging, out / "model", steps=steps, settings=settings or {"lr": 1.0})


def test_a_finished_stage_is_recognised_and_retrains_only_when_asked(tmp_path, caplog):
    import logging

    out = tmp_path / "gfn"
    assert finished_model(out, "gfn", False, {"lr": 1.0}) is None  # nothing there: train
    fake_model(out)
    (out / "checkpoints" / "step-00000002").mkdir(parents=True)  # killed after the commit, before the cleanup
    with caplog.at_level(logging.INFO):
        assert finished_model(out, "gfn", False, {"lr": 2.0})["steps"] == 3
    assert (
        "gfn: finished" in caplog.text
        and "settings changed since: lr" in caplog.text
        and "gfn.retrain=true" in caplog.text
    )
    assert not (out / "checkpoints").exists()
    (out / "model" / "config.json").write_text('{"x": 1}')  # damaged: set aside, never deleted, and trained again
    assert finished_model(out, "gfn", False, {"lr": 1.0}) is None
    assert not (out / "model").exists() and len(list(out.glob("model.set-aside-*"))) == 1
    fake_model(out)
    (out / "metrics.jsonl").write_text('{"step": 1}\n')
    checkpoint_io.commit(checkpoint_io.staging_dir(out / "checkpoints", 2), 2)
    assert finished_model(out, "gfn", True, {"lr": 1.0}) is None  # retrain: afresh, without the old checkpoints
    assert not (out / "checkpoints").exists()
    assert (
        finished_model(out, "gfn", False, {"lr": 1.0})["steps"] == 3
    )  # the old model stays until a new one replaces it


@pytest.mark.slow
def test_a_killed_retrain_leaves_the_model_it_was_replacing(random_tiny_world, tmp_path):
    world = random_tiny_world
    base = [
        "--config",
        str(REPO / "configs" / "tiny.yaml"),
        f"runs_root={tmp_path}",
        "run=r",
        f"model.policy={world / 'policy'}",
        f"model.prm={world / 'prm'}",
        f"data.train_path={world / 'problems_train.jsonl'}",
        "data.disjoint_from=[]",
        "model.torch_threads=1",
        "generation.max_new_tokens=16",
        "gfn.questions_per_step=2",
        "gfn.samples_per_question=2",
        "gfn.save_every=1",
    ]
    train_gfn.main([*base, "gfn.num_train_steps=2"])
    release_stage_locks()  # as the process ending would: the retrain below runs in another one
    model = tmp_path / "r" / "gfn" / "model"
    before = verify_manifest(model)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}
    log = tmp_path / "retrain.log"
    process = subprocess.Popen(
        [sys.executable, "-m", "stages.train_gfn", *base, "gfn.num_train_steps=500", "gfn.retrain=true"],
        cwd=REPO,
        env=env,
        stdout=log.open("w"),
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    try:
        deadline = time.monotonic() + 240
        while (
            not checkpoint_io.committed(model.parent / "checkpoints")
            and process.poll() is None
            and time.monotonic() < deadline
        ):
            time.sleep(0.05)
        assert process.poll() is None, f"the retrain ended before it was killed: {log.read_text()[-3000:]}"
        assert checkpoint_io.committed(model.parent / "checkpoints"), "the retrain made no checkpoint in time"
    finally:
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGKILL)
        process.wait(timeout=30)
    assert verify_manifest(model) == before  # killed while retraining: the old model, whole
    assert finished_model(model.parent, "gfn", False, {})["steps"] == 2


def test_a_start_that_committed_no_record_never_blocks_a_rerun_with_other_settings(tmp_path):
    with (tmp_path / "train.jsonl").open("w") as handle:
        for pid in PROBLEMS[:2]:
            handle.write(json.dumps(Problem(pid, f"question {pid}", "7", "tiny").to_json()) + "\n")
    shards = tmp_path / "runs" / "r" / "mcts" / "shards"
    for policy in (
        "typo-policy",
        "no-policy",
    ):  # a folder named wrongly, corrected: both hold no model, so both fail to load here
        (tmp_path / policy).mkdir(exist_ok=True)
        with pytest.raises(Exception) as failure:
            mcts.main(args(tmp_path, f"model.policy={tmp_path / policy}"))
        assert "other settings" not in str(failure.value)
        assert json.loads((shards / "settings.json").read_text())["policy"] == str(tmp_path / policy)
        release_stage_locks()
    check_settings(shards, {"policy": "a"}, "the MCTS run", others_running=False)  # nothing committed: replaced
    with pytest.raises(SettingsMismatch, match="other settings"):  # another shard's process may commit under them
        check_settings(shards, {"policy": "b"}, "the MCTS run", others_running=True)
