"""The ProcessBench protocol: first-error predictions at a threshold chosen on a held-out part, F1
of the accuracies on erroneous and correct solutions with a bootstrap interval; cases from
ProcessBench files (bad ones name file, line and field), PRM800K's ratings and the tiny world's
exact step labels; `make prm-bench` on the PRM800K sample and on a tiny-world policy's samples."""

from __future__ import annotations

import json
import random
import sys
import types

import numpy as np
import pytest
import torch
from test_prm_data_interop import english_tokenizer
from transformers import LlamaConfig, LlamaForCausalLM

from pipeline.config.schema import TinyWorldConfig
from pipeline.records import RecordError
from pipeline.tinyworld.checker import first_wrong_step, step_equations
from pipeline.tinyworld.problems import generate_splits
from prm.formats import detect_format
from prm.model import ProcessRewardModel
from prm.prm800k import load_prm800k
from prm.processbench import (
    FirstErrorCase,
    choose_threshold,
    first_error_f1,
    predicted_first_error,
    prm800k_cases,
    processbench,
    processbench_source,
    read_processbench,
    read_processbench_hub,
)
from prm.validation import corrupt_step

REPO_CONFIG = "configs/tiny.yaml"

pytestmark = pytest.mark.usefixtures("one_torch_thread")


class FixedScorer:
    """Scores looked up by question: the protocol, without a model."""

    def __init__(self, scores: dict[str, list[float]]):
        self.scores = scores

    def score_many(self, solutions):
        return [self.scores[question] for question, _ in solutions]


def test_prediction_is_the_first_step_below_the_threshold():
    assert predicted_first_error([0.9, 0.4, 0.2], 0.5) == 1
    assert predicted_first_error([0.9, 0.6], 0.5) == -1
    assert predicted_first_error([], 0.5) == -1


def test_f1_is_the_harmonic_mean_of_the_two_accuracies():
    # erroneous: labels 0, 2, 1 predicted 0, 1, 1 -> 2/3; correct: 2 cases, one predicted -1 -> 1/2
    result = first_error_f1([0, 1, 1, -1, 0], [0, 2, 1, -1, -1])
    assert result["accuracy_erroneous"] == pytest.approx(2 / 3) and result["accuracy_correct"] == 0.5
    assert result["f1"] == pytest.approx(2 * (2 / 3) * 0.5 / (2 / 3 + 0.5))
    assert (result["n_erroneous"], result["n_correct"]) == (3, 2)
    assert first_error_f1([1], [0])["f1"] is None  # no correct solution: no F1
    assert first_error_f1([1, 0], [0, -1])["f1"] == 0.0


def test_the_threshold_is_chosen_on_the_held_out_part_and_f1_reported_on_the_rest():
    rng = random.Random(0)
    cases, scores = [], {}
    for i in range(60):  # a wrong step scores 0.25, a right one 0.7-0.8: a threshold in (0.25, 0.7] separates them
        n = rng.randint(1, 4)
        label = rng.choice([-1, rng.randrange(n)])
        row = [0.75 + rng.uniform(-0.05, 0.05) if label == -1 or k < label else 0.25 for k in range(n)]
        cases.append(FirstErrorCase(f"c{i}", f"q{i}", [f"s{k}" for k in range(n)], label))
        scores[f"q{i}"] = row
    wrong = [scores[c.problem][c.label] for c in cases if c.label >= 0]
    right = [u for c in cases for u in (scores[c.problem] if c.label == -1 else scores[c.problem][: c.label])]
    assert (
        max(wrong) < choose_threshold(list(scores.values()), [c.label for c in cases]) <= min(right)
    )  # the first that separates
    result = processbench(FixedScorer(scores), cases, held_out_fraction=0.5, n_resamples=200)
    held = [c["held_out"] for c in result["cases"]]
    assert 0 < sum(held) == result["n_held_out"] < len(cases)
    assert result["n_erroneous"] + result["n_correct"] == len(cases) - result["n_held_out"]
    assert max(wrong) < result["threshold"] <= min(right) and result["f1"] == 1.0 and result["interval"] == [1.0, 1.0]
    # a given threshold scores every case; at 0.2 nothing is flagged: every erroneous case is missed
    given = processbench(FixedScorer(scores), cases, threshold=0.2, n_resamples=200)
    assert given["n_held_out"] == 0 and given["accuracy_erroneous"] == 0.0 and given["accuracy_correct"] == 1.0


def test_the_bootstrap_interval_brackets_a_noisy_f1():
    rng = random.Random(1)
    cases = [FirstErrorCase(f"c{i}", f"q{i}", ["a", "b"], rng.choice([-1, 0, 1])) for i in range(80)]
    scores = {c.problem: [rng.random(), rng.random()] for c in cases}
    result = processbench(FixedScorer(scores), cases, threshold=0.5, n_resamples=300)
    lo, hi = result["interval"]
    assert lo < result["f1"] < hi


def test_tiny_world_labels_are_the_first_step_off_every_valid_strategy():
    problems = generate_splits(TinyWorldConfig(n_train=30, n_val=1, n_test=1, max_operand=10, max_result=50))["train"]
    for problem in problems:
        for steps in problem.meta["solutions"]:  # every valid order is right
            assert first_wrong_step(problem, steps) == -1
        gold = problem.meta["solutions"][0]
        for k in range(len(gold) - 1):  # a slipped calculation is the first error
            slipped = corrupt_step(gold[k], seed=k)
            assert first_wrong_step(problem, [*gold[:k], slipped, *gold[k + 1 :]]) == k
        assert first_wrong_step(problem, [*gold[:-1], f"The answer is {int(problem.answer) + 1}"]) == len(gold) - 1
        assert first_wrong_step(problem, ["I like apples.", *gold]) == 0
    # a right calculation with an operand the problem does not have is an error too
    problem = problems[0]
    gold = problem.meta["solutions"][0]
    a, op, b, _ = step_equations(gold[:1])[0]
    assert first_wrong_step(problem, [f"x = {a + 1} {op} {b} = {eval_op(a + 1, op, b)}", *gold[1:]]) == 0


def eval_op(a: int, op: str, b: int) -> int:
    return {"+": a + b, "-": a - b, "*": a * b}[op]


def test_prm800k_ratings_become_first_error_labels(benchmarks_dir):
    sample = benchmarks_dir / "prm800k_phase2_sample.jsonl"
    cases = prm800k_cases(sample)
    solutions = [s for s in load_prm800k(sample) if s.steps]
    assert len(cases) == len(solutions) == 9
    assert [c.label for c in cases] == [-1 if s.first_error is None else s.first_error for s in solutions]
    assert all(
        c.label >= 0 for c in cases
    )  # every solution of the sample has a step rated -1: F1 needs correct ones too
    result = processbench(FixedScorer({c.problem: [0.9] * len(c.steps) for c in cases}), cases, threshold=0.5)
    assert result["f1"] is None and result["accuracy_erroneous"] == 0.0 and result["accuracy_correct"] is None


def test_processbench_files_read_as_json_arrays_and_jsonl(tmp_path):
    records = [
        {"id": "a", "problem": "Q", "steps": ["s1", "s2"], "label": 1, "final_answer_correct": False},
        {"id": "b", "problem": "R", "steps": ["t"], "label": -1, "final_answer_correct": True},
    ]
    (tmp_path / "set.json").write_text(json.dumps(records, indent=2))
    (tmp_path / "set.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    for name in ("set.json", "set.jsonl"):
        cases = read_processbench(tmp_path / name)
        assert [(c.id, c.steps, c.label, c.final_answer_correct) for c in cases] == [
            ("a", ["s1", "s2"], 1, False),
            ("b", ["t"], -1, True),
        ]


@pytest.mark.parametrize(
    "change, field",
    [
        ({"label": 2}, "label"),
        ({"label": -2}, "label"),
        ({"label": True}, "label"),
        ({"steps": "s1\ns2"}, "steps"),
        ({"steps": ["s1", 3]}, "steps"),
    ],
)
def test_a_bad_processbench_record_names_the_file_line_and_field(tmp_path, change, field):
    good = {"id": "a", "problem": "Q", "steps": ["s1", "s2"], "label": 1, "final_answer_correct": False}
    bad = {**good, **change}
    (tmp_path / "set.jsonl").write_text(json.dumps(good) + "\n\n" + json.dumps(bad) + "\n")
    with pytest.raises(RecordError, match=rf"set.jsonl:3: field '{field}'"):
        read_processbench(tmp_path / "set.jsonl")
    text = json.dumps([good, bad], indent=2)
    (tmp_path / "set.json").write_text(text)
    line = text[: text.index("{", text.index("}"))].count("\n") + 1  # where the second item starts
    assert line > 2
    with pytest.raises(RecordError, match=rf"set.json:{line}: field '{field}'"):
        read_processbench(tmp_path / "set.json")


def fake_datasets(monkeypatch, load_dataset):
    """The `datasets` module replaced by one whose load_dataset is given (no hub is reached)."""
    monkeypatch.setitem(sys.modules, "datasets", types.SimpleNamespace(load_dataset=load_dataset))


def test_processbench_hub_splits_read_like_files_and_a_bad_row_is_named(tmp_path, monkeypatch):
    rows = [
        {
            "id": "gsm8k-0",
            "generator": "g",
            "problem": "Q",
            "steps": ["s1", "s2"],
            "label": 1,
            "final_answer_correct": False,
        },
        {
            "id": "gsm8k-1",
            "generator": "g",
            "problem": "Q2",
            "steps": ["s1"],
            "label": -1,
            "final_answer_correct": True,
        },
    ]
    calls = []
    fake_datasets(
        monkeypatch,
        lambda hub_id, config=None, *, split, streaming=False: calls.append((hub_id, config, split)) or rows,
    )
    assert processbench_source("hf://Qwen/ProcessBench/gsm8k") == ("Qwen/ProcessBench", None, "gsm8k")
    assert processbench_source("hf://owner/name[main]/test") == ("owner/name", "main", "test")
    assert processbench_source(str(tmp_path / "gsm8k.json")) is None
    with pytest.raises(ValueError, match="hf://owner/name/split"):
        processbench_source("hf://Qwen/ProcessBench")
    cases = read_processbench_hub("Qwen/ProcessBench", None, "gsm8k")
    assert calls == [("Qwen/ProcessBench", None, "gsm8k")]
    (tmp_path / "gsm8k.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))
    from_file = read_processbench(tmp_path / "gsm8k.jsonl")
    assert [(c.id, c.problem, c.steps, c.label, c.final_answer_correct) for c in cases] == [
        (c.id, c.problem, c.steps, c.label, c.final_answer_correct) for c in from_file
    ]
    rows[1]["label"] = 1
    with pytest.raises(RecordError, match=r"hf://Qwen/ProcessBench/gsm8k: row 1: field 'label'"):
        read_processbench_hub("Qwen/ProcessBench", None, "gsm8k")


def test_prm_bench_says_what_to_do_when_the_hub_is_unreachable_and_refuses_two_sets_of_one_name(tmp_path, monkeypatch):
    from stages import prm_bench

    def unreachable(hub_id, config=None, *, split, streaming=False):
        raise ConnectionError(f"Couldn't reach '{hub_id}' on the Hub (LocalEntryNotFoundError)")

    fake_datasets(monkeypatch, unreachable)
    (
        tmp_path / "no-prm"
    ).mkdir()  # a folder (it passes the stage's model check); the sets are read before any PRM loads
    args = ["--config", REPO_CONFIG, f"runs_root={tmp_path / 'runs'}", f"model.prm={tmp_path / 'no-prm'}"]
    with pytest.raises(
        SystemExit, match=r"could not read hf://Qwen/ProcessBench/math from the hub .*download the split"
    ):
        prm_bench.main([*args, "run=hub", "prm_bench.processbench_paths=[hf://Qwen/ProcessBench/math]"])
    record = {"id": "a", "problem": "Q", "steps": ["s"], "label": -1, "final_answer_correct": True}
    for folder in ("one", "two"):
        (tmp_path / folder).mkdir()
        (tmp_path / folder / "math.jsonl").write_text(json.dumps(record) + "\n")
    with pytest.raises(SystemExit, match=r"two sets named 'math'"):
        prm_bench.main(
            [
                *args,
                "run=names",
                f"prm_bench.processbench_paths=[{tmp_path / 'one' / 'math.jsonl'}, {tmp_path / 'two' / 'math.jsonl'}]",
            ]
        )


def test_a_prm_folder_of_no_known_format_lists_the_formats_tried(tmp_path):
    (tmp_path / "lm").mkdir()
    (tmp_path / "lm" / "config.json").write_text(
        json.dumps({"architectures": ["LlamaForCausalLM"], "model_type": "llama"})
    )
    with pytest.raises(ValueError, match=r"tried stepflow .* token_classification .* qwen_prm .*math_shepherd"):
        detect_format(str(tmp_path / "lm"))


def test_the_stage_benchmarks_a_prm_on_prm800k_and_on_the_tiny_worlds_policy_samples(
    benchmarks_dir, random_tiny_world, tmp_path
):
    from stages import prm_bench

    sample = benchmarks_dir / "prm800k_phase2_sample.jsonl"
    solutions = load_prm800k(sample)
    tokenizer = english_tokenizer([s.question for s in solutions] + [step for s in solutions for step in s.steps])
    torch.manual_seed(0)
    lm = LlamaForCausalLM(
        LlamaConfig(
            vocab_size=len(tokenizer),
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=4,
            max_position_embeddings=4096,
        )
    )
    ProcessRewardModel.from_backbone(lm).save_pretrained(tmp_path / "prm", tokenizer=tokenizer)
    (tmp_path / "mine.jsonl").write_text(
        json.dumps(
            {
                "id": "m",
                "problem": "What is 1 + 1 ?",
                "steps": ["1 + 1 = 2", "The answer is 2"],
                "label": -1,
                "final_answer_correct": True,
            }
        )
        + "\n"
    )
    results = prm_bench.main(
        [
            "--config",
            REPO_CONFIG,
            f"runs_root={tmp_path / 'runs'}",
            "run=b",
            f"model.prm={tmp_path / 'prm'}",
            f"model.policy={random_tiny_world / 'policy'}",
            f"data.validation_path={random_tiny_world / 'problems_train.jsonl'}",
            f"prm_bench.prm800k_path={sample}",
            f"prm_bench.processbench_paths=[{tmp_path / 'mine.jsonl'}]",
            "prm_bench.policy_problems=3",
            "prm_bench.policy_samples=2",
            "generation.max_new_tokens=24",
            "prm_bench.bootstrap_resamples=100",
        ]
    )
    assert set(results) == {"prm800k", "tiny_policy", "mine"}
    assert json.loads((tmp_path / "runs" / "b" / "prm_bench" / "results.json").read_text()) == results
    prm800k = results["prm800k"]
    assert len(prm800k["cases"]) == 9 and prm800k["n_held_out"] + prm800k["n_erroneous"] + prm800k["n_correct"] == 9
    assert prm800k["f1"] is None and prm800k["n_correct"] == 0 and prm800k["threshold_from"].startswith("the best")
    tiny = results["tiny_policy"]
    assert 0 < len(tiny["cases"]) <= 6 and all(c["label"] >= -1 for c in tiny["cases"])
    assert np.isfinite(prm800k["threshold"])
