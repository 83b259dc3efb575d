"""The whole pipeline on a reduced tiny-world config, checked against the DESIGN.md contracts."""

import json
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]

REDUCED = [
    "run=e2e",
    "tinyworld.n_train=600", "tinyworld.n_val=20", "tinyworld.n_test=20",
    "bootstrap.train_seconds=20", "bootstrap.eval_problems=20",
    "generation.max_new_tokens=72",
    "mcts.k=4", "mcts.max_problems=8", "mcts.max_iterations=2", "mcts.max_rollouts=24", "mcts.search_trivial=true",
    "prm.epochs=1", "prm.batch_size=16", "prm.micro_batch_size=16", "prm.corrupt_examples=20",
    "gfn.num_train_steps=3", "gfn.questions_per_step=2", "gfn.samples_per_question=2", "gfn.save_every=2",
    "ppo.num_train_steps=2", "ppo.questions_per_step=2", "ppo.samples_per_question=2", "ppo.save_every=0",
    "eval.max_problems=4", "eval.k=2", "eval.bootstrap_resamples=200",
    "search.ks=[1, 2]", "search.max_problems=3", "search.max_depth=4", "search.strategies=[step_best_of_k, best_of_n, weighted_vote]",
]


@pytest.mark.slow
def test_demo_chain_on_a_reduced_config(tmp_path, monkeypatch):
    from pipeline.contracts import check_run
    from stages import demo

    monkeypatch.chdir(tmp_path)
    report = demo.main(["--config", str(REPO / "configs" / "tiny.yaml"), *REDUCED])
    run_dir, reports = tmp_path / "runs" / "e2e", tmp_path / "reports" / "e2e"
    assert check_run(run_dir, reports) == []
    text = report.read_text()
    for section in ("Stage timings", "PRM validation", "GFlowNet and PPO training", "Accuracy and diversity", "Against `base` (paired)",
                    "PRM-guided search", "corrupted steps (E.4", "natural slips (", "Mean PRM reward"):
        assert section in text
    assert (reports / "gfn_training_curves.png").exists()
    metrics = [json.loads(line) for line in (run_dir / "gfn" / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in metrics] == [1, 2, 3]
    assert not (run_dir / "gfn" / "checkpoints").exists()  # saved at step 2, gone once model/ is written
    # the trained policies load like any model
    from transformers import AutoModelForCausalLM

    for stage in ("gfn", "ppo"):
        AutoModelForCausalLM.from_pretrained(run_dir / stage / "model")


def test_a_new_demo_sets_the_previous_run_aside_without_deleting_it(tmp_path, monkeypatch):
    from pipeline.config import load_config
    from stages.demo import set_aside_previous_run

    monkeypatch.chdir(tmp_path)
    config = load_config(REPO / "configs" / "tiny.yaml", ["run=d"])
    (config.run_dir / "mcts" / "shards").mkdir(parents=True)
    (config.run_dir / "mcts" / "shards" / "settings.json").write_text("{}")
    (tmp_path / "reports" / "d").mkdir(parents=True)  # empty: left where it is
    moved = set_aside_previous_run(config)
    assert len(moved) == 1 and (moved[0] / "mcts" / "shards" / "settings.json").exists()
    assert not config.run_dir.exists() and (tmp_path / "reports" / "d").exists()
    assert set_aside_previous_run(config) == []
