"""The policy along training (gfn.snapshot_every, ppo.snapshot_every): model folders the evaluation reads."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from pipeline.storage.model_folders import snapshot_folders

REPO = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.usefixtures("one_torch_thread")


def stage_args(world: Path, tmp_path: Path, stage: str, *extra: str) -> list[str]:
    return [
        "--config",
        str(REPO / "configs" / "tiny.yaml"),
        f"runs_root={tmp_path}",
        "run=s",
        f"model.policy={world / 'policy'}",
        f"model.prm={world / 'prm'}",
        f"data.train_path={world / 'problems_train.jsonl'}",
        "data.disjoint_from=[]",
        "generation.max_new_tokens=16",
        "generation.batch_size=32",
        f"{stage}.num_train_steps=3",
        f"{stage}.questions_per_step=2",
        f"{stage}.samples_per_question=2",
        f"{stage}.save_every=0",
        f"{stage}.warmup_steps=0",
        f"{stage}.lr=0.01",
        *(["gfn.ceiling_questions=0"] if stage == "gfn" else []),
        *extra,
    ]


@pytest.mark.parametrize("stage", ["gfn", "ppo"])
def test_snapshots_are_the_policy_at_their_steps_and_an_earlier_runs_later_ones_are_removed(
    random_tiny_world, tmp_path, stage
):
    from safetensors.torch import load_file

    from stages import train_gfn, train_ppo

    main = train_gfn.main if stage == "gfn" else train_ppo.main
    main(stage_args(random_tiny_world, tmp_path, stage, f"{stage}.snapshot_every=1"))
    out = tmp_path / "s" / stage
    folders = snapshot_folders(out)
    assert [f.name for f in folders] == ["step-1", "step-2"]  # the last step is model/
    weights = [load_file(str(f / "model.safetensors")) for f in (*folders, out / "model")]
    assert all((f / "config.json").is_file() and (f / "tokenizer.json").is_file() for f in folders)
    name = next(k for k in weights[0] if weights[0][k].is_floating_point() and weights[0][k].dim() == 2)
    # each snapshot holds the policy of its own step: they differ from each other and from the final model
    assert not weights[0][name].equal(weights[1][name]) and not weights[1][name].equal(weights[2][name])
    manifests = [json.loads((f / "manifest.json").read_text()) for f in (*folders, out / "model")]
    assert [m["training_steps"] for m in manifests] == [1, 2, 3]  # training steps, whatever PPO's epochs
    assert manifests[0]["settings"] == manifests[2]["settings"]  # eval.curves pairs them by it
    # a new training in the same folder keeps no snapshot of a step it has not reached again
    main(stage_args(random_tiny_world, tmp_path, stage, f"{stage}.snapshot_every=2", f"{stage}.retrain=true"))
    assert [f.name for f in snapshot_folders(out)] == ["step-2"]
    # nor does one that writes none
    main(stage_args(random_tiny_world, tmp_path, stage, f"{stage}.snapshot_every=0", f"{stage}.retrain=true"))
    assert snapshot_folders(out) == []
