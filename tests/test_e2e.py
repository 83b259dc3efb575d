"""The whole pipeline on a reduced tiny-world config, checked against the DESIGN.md contracts."""

import json
import os
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]

REDUCED = [
    "run=e2e",
    "tinyworld.n_train=600",
    "tinyworld.n_val=20",
    "tinyworld.n_test=20",
    "bootstrap.train_seconds=20",
    "bootstrap.eval_problems=20",
    "generation.max_new_tokens=72",
    "mcts.k=4",
    "mcts.max_problems=8",
    "mcts.max_iterations=2",
    "mcts.max_rollouts=24",
    "mcts.search_trivial=true",
    "prm.epochs=1",
    "prm.batch_size=16",
    "prm.micro_batch_size=16",
    "prm.corrupt_examples=20",
    "gfn.num_train_steps=3",
    "gfn.questions_per_step=2",
    "gfn.samples_per_question=2",
    "gfn.save_every=2",
    "ppo.num_train_steps=2",
    "ppo.questions_per_step=2",
    "ppo.samples_per_question=2",
    "ppo.save_every=0",
    "eval.max_problems=4",
    "eval.k=2",
    "eval.bootstrap_resamples=200",
    "eval.target_samples=4",
    "search.ks=[1, 2]",
    "claims.search_ks=[2]",
    "search.max_problems=3",
    "search.max_depth=4",
    "search.strategies=[step_best_of_k, best_of_n, weighted_vote]",
    "prm_bench.policy_problems=8",
    "prm_bench.policy_samples=2",
    "prm_bench.bootstrap_resamples=200",
]


def jsonl(path):
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


@pytest.mark.slow
def test_demo_chain_on_a_reduced_config(tmp_path, monkeypatch):
    from pipeline.contracts import check_run
    from stages import demo

    monkeypatch.chdir(tmp_path)
    # the stages run as python -m stages.<module> processes (two at once; mcts, eval and search as
    # two shard workers each): they import this tree
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])))
    report = demo.main(["--config", str(REPO / "configs" / "tiny.yaml"), *REDUCED, "demo.jobs=2"])
    run_dir, reports = tmp_path / "runs" / "e2e", tmp_path / "reports" / "e2e"
    assert check_run(run_dir, reports) == []
    logs = run_dir / "demo" / "logs"
    assert {p.name for p in logs.glob("*.log")} == {
        "bootstrap.log",
        "augment.log",
        "prm.log",
        "gfn.log",
        "ppo.log",
        "prm_bench.log",
        *(f"{stage}-{i}of2.log" for stage in ("mcts", "eval", "search") for i in (0, 1)),
        "eval-merge.log",
        "search-merge.log",
    }
    assert len(list((run_dir / "mcts" / "shards").glob("part-*"))) >= 2
    text = report.read_text()
    assert "up to 2 at once (demo.jobs)" in text and "| total (wall clock) |" in text
    for section in (
        "Stage timings",
        "PRM validation",
        "GFlowNet and PPO training",
        "Accuracy and diversity",
        "Against `base` (paired)",
        "PRM-guided search",
        "corrupted steps (E.4",
        "MC-label AUC",
        "exact labels (",
        "slip pairs (",
        "Mean PRM reward",
    ):
        assert section in text
    assert (reports / "gfn_training_curves.png").exists()
    # every claim reported; the GFlowNet judged against its target from the base's draw at temperature 1
    from eval.claims import CLAIM_IDS

    results = json.loads((reports / "results.json").read_text())
    assert list(results["claims"]) == list(CLAIM_IDS)
    assert "not measured" not in results["claims"]["gfn_matches_target"]["comparison"]
    assert set(results["timings"]["stages"]) == {name for name, _, _ in demo.STAGES}
    # the PRM on ProcessBench's protocol: the base policy's samples of validation problems, which no
    # PRM example (training or validation) comes from, labelled exactly by the tiny world
    bench = json.loads((run_dir / "prm_bench" / "results.json").read_text())["tiny_policy"]
    cases = bench["cases"]
    assert 0 < len(cases) <= 16 and bench["n_held_out"] + bench["n_erroneous"] + bench["n_correct"] == len(cases)
    validation = {p["problem_id"]: p["question"] for p in jsonl(run_dir / "bootstrap" / "problems_val.jsonl")}
    prm_examples = jsonl(run_dir / "augment" / "prm_train.jsonl") + jsonl(run_dir / "augment" / "prm_val.jsonl")
    benched = {case["id"].rsplit("#", 1)[0] for case in cases}
    assert benched <= set(validation)
    assert not benched & {e["problem_id"] for e in prm_examples}
    assert not {validation[p] for p in benched} & {e["question"] for e in prm_examples}
    # ... reported in the demo's results.json (without the per-case predictions) and report.md
    assert json.loads((reports / "results.json").read_text())["prm_bench"] == {
        "tiny_policy": {k: v for k, v in bench.items() if k != "cases"}
    }
    assert "## PRM on ProcessBench's protocol (make prm-bench)" in text
    line = next(line for line in text.splitlines() if line.startswith("- tiny_policy: F1 "))
    figure = (
        "F1 n/a"
        if bench["f1"] is None
        else f"F1 {bench['f1']:.3f} [{bench['interval'][0]:.3f}, {bench['interval'][1]:.3f}]"
    )
    for part in (
        figure,
        f"({bench['n_erroneous']} with a wrong step, {bench['n_correct']} without)",
        f"threshold {bench['threshold']:.2f}",
        "problems_val.jsonl",
    ):
        assert part in line
    metrics = [json.loads(line) for line in (run_dir / "gfn" / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in metrics] == [1, 2, 3]
    assert not (run_dir / "gfn" / "checkpoints").exists()  # saved at step 2, gone once model/ is written
    # the trained policies load like any model
    from transformers import AutoModelForCausalLM

    for stage in ("gfn", "ppo"):
        AutoModelForCausalLM.from_pretrained(run_dir / stage / "model")


def test_the_demo_graph_follows_what_each_stage_reads_and_shards_with_the_jobs():
    from pipeline.config.loader import ConfigError, load_config
    from pipeline.launcher import check_graph
    from stages.demo import demo_graph, demo_jobs

    argv = ["--config", "c.yaml", "run=g"]
    config = load_config(REPO / "configs" / "tiny.yaml", ["run=g"])
    assert demo_jobs(config) == len(os.sched_getaffinity(0))  # demo.jobs: 0
    graph = {stage.name: stage for stage in demo_graph(config, argv, 2)}
    check_graph(list(graph.values()), 2)
    assert list(graph) == ["bootstrap", "mcts", "augment", "prm", "gfn", "ppo", "eval", "search", "prm_bench"]
    assert set(graph["eval"].after) == {"bootstrap", "prm", "gfn", "ppo"}  # it evaluates base, ppo and gfn
    assert set(graph["search"].after) == set(graph["prm_bench"].after) == {"bootstrap", "prm"}
    for name, module in (("mcts", "stages.mcts"), ("eval", "stages.evaluate"), ("search", "stages.search")):
        workers = graph[name].phases[0]
        assert [w.argv[2:] for w in workers] == [[module, *argv, f"{name}.shard={i}/2"] for i in (0, 1)]
    assert [len(phase) for phase in graph["eval"].phases] == [len(phase) for phase in graph["search"].phases] == [2, 1]
    assert graph["eval"].phases[1][0].argv[2:] == ["stages.evaluate", *argv]  # the merge run, no shard
    assert graph["mcts"].finish is not None  # stats.json over every shard
    assert [len(phase) for phase in graph["gfn"].phases] == [1]
    single = demo_graph(config, argv, 1)
    assert all(len(stage.phases) == 1 and len(stage.phases[0]) == 1 for stage in single)
    assert all(not any(".shard=" in arg for arg in stage.phases[0][0].argv) for stage in single)
    with pytest.raises(ConfigError, match="mcts.shard is set by make demo"):
        demo_graph(config, [*argv, "mcts.shard=0/2"], 2)


def test_a_new_demo_sets_the_previous_run_aside_without_deleting_it(tmp_path, monkeypatch):
    from pipeline.config.loader import load_config
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


def test_the_reports_processbench_line_gives_the_figure_counts_and_how_the_threshold_was_chosen():
    from stages.demo import processbench_lines

    result = {
        "source": "S",
        "threshold": 0.42,
        "threshold_from": "the best F1 (accuracy where one kind only) on 20 held-out cases",
        "f1": 0.61234,
        "interval": [0.5, 0.7],
        "accuracy_erroneous": 0.5,
        "accuracy_correct": 0.8,
        "n_erroneous": 4,
        "n_correct": 16,
        "n_held_out": 20,
        "held_out_f1": 0.65,
    }
    [line] = processbench_lines({"tiny_policy": result})
    assert line.startswith(
        "- tiny_policy: F1 0.612 [0.500, 0.700] on 20 scored cases (4 with a wrong step, 16 without); accuracy 0.500"
    )
    assert (
        "threshold 0.42, the best F1 on 20 other cases set aside to choose it (F1 there 0.650)" in line
        and line.endswith("Cases: S.")
    )
    [line] = processbench_lines(
        {"s": {**result, "f1": None, "n_correct": 0, "accuracy_correct": None, "held_out_f1": None}}
    )
    assert "F1 n/a (no solution without a wrong step) on 4 scored cases" in line
    assert "the best accuracy on 20 other cases set aside to choose it (of one kind only: no F1 there)" in line
    [line] = processbench_lines(
        {"s": {**result, "threshold": 0.5, "threshold_from": "given", "n_held_out": 0, "held_out_f1": None}}
    )
    assert "threshold 0.50 (given; no case set aside)" in line
