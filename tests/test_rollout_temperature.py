"""make rollout-temperature: the per-step slip rate, sampled accuracy and searched share by
temperature, counted exactly (pipeline.rollouts.temperature, stages.rollout_temperature)."""

from __future__ import annotations

import json
import re

import pytest

from pipeline.config.loader import load_config
from pipeline.config.schema import TinyWorldConfig
from pipeline.datasets.problems import write_problems_jsonl
from pipeline.rollouts.temperature import slip_counts, sweep_table, temperature_sweep
from pipeline.tinyworld.checker import first_wrong_step
from pipeline.tinyworld.problems import generate_splits

PROBLEMS = generate_splits(TinyWorldConfig(seed=7, n_train=1, n_val=1, n_test=1, n_rl=4))["rl"]


def slipped(steps: list[str], index: int) -> list[str]:
    """The steps with the result of step ``index``'s calculation off by one (an arithmetic slip)."""
    a, op, b, c = re.search(r"(\d+) ([-+*]) (\d+) = (\d+)", steps[index]).groups()
    wrong = list(steps)
    wrong[index] = steps[index].replace(f"{a} {op} {b} = {c}", f"{a} {op} {b} = {int(c) + 1}", 1)
    return wrong


def test_slip_counts_count_first_wrong_steps_over_the_steps_reached_with_a_correct_prefix():
    problem = PROBLEMS[0]
    gold = list(problem.meta["solutions"][0])
    bad = slipped(gold, 0)
    counts = slip_counts(problem, [gold, bad, gold[:1] + ["The answer is 12345"]], first_wrong_step)
    # gold: every step reached, none wrong; bad: wrong at step 0 (1 reached), its later steps still
    # carry the slip's result (arithmetic-wise right or not); the third: wrong at its answer step
    assert counts["steps"] == len(gold) + len(bad) + 2
    assert counts["steps_reached"] == len(gold) + 1 + 2
    assert counts["first_wrong"] == 2 and counts["first_wrong_arithmetic"] == 1
    assert counts["arithmetic_steps"] >= 1


class TemperatureGenerator:
    """At temperature T, of each problem's n samples the first round(n * T / 2) slip at their
    first step and answer wrong; the rest are the gold solution. Records the temperatures asked for."""

    tokenizer = None

    def __init__(self, problems):
        self.problems, self.temperatures = problems, []

    def generate(self, prompts, n=1, temperature=1.0, top_p=1.0, max_new_tokens=16, stop=None, seed=None):
        self.temperatures.append(temperature)
        out = []
        for prompt in prompts:
            problem = next(p for p in self.problems if p.question in prompt)
            gold = list(problem.meta["solutions"][0])
            wrong = slipped(gold, 0)[:-1] + [f"The answer is {int(problem.answer) + 1}"]
            out.append(
                [Completion("\n".join(wrong if j < round(n * temperature / 2) else gold) + "\n") for j in range(n)]
            )
        return out


class Completion:
    def __init__(self, text):
        self.text, self.token_ids, self.finish_reason = text, [1] * len(text), "eos"


def test_the_sweep_reports_slips_accuracy_and_the_searched_share_at_each_temperature():
    generator = TemperatureGenerator(PROBLEMS)
    config = load_config(None, ["format.use_chat_template=false"])
    rows = temperature_sweep(generator, PROBLEMS, config, [0.0, 1.0, 2.0], k=4, seed=0, first_wrong=first_wrong_step)
    assert generator.temperatures == [0.0, 1.0, 2.0]
    steps = sum(len(p.meta["solutions"][0]) for p in PROBLEMS)
    cold, warm, hot = rows
    assert cold["first_wrong_per_step"] == 0 and cold["sampled_accuracy"] == 1 and cold["root_mc_one"] == 1
    assert cold["root_mc_between"] == 0 and cold["arithmetic_share_of_first_wrong"] is None
    # T = 1: 2 of 4 samples per problem slip at their first step: 2 first wrong steps over 2 + 2 * steps reached
    assert warm["first_wrong_per_step"] == round(2 * len(PROBLEMS) / (2 * len(PROBLEMS) + 2 * steps), 4)
    assert (
        warm["wrong_solutions"] == 0.5
        and warm["sampled_accuracy"] == 0.5
        and warm["arithmetic_share_of_first_wrong"] == 1
    )
    assert warm["root_mc_between"] == 1 and warm["root_mc_one"] == 0
    assert hot["wrong_solutions"] == 1 and hot["first_wrong_per_step"] == 1 and hot["root_mc_between"] == 0
    assert hot["sampled_accuracy"] == 0 and hot["root_mc_zero"] == 1
    table = sweep_table(rows).splitlines()
    assert len(table) == 5 and table[0].startswith("| T | slip/step |") and table[3].startswith("| 1 | ")


def test_the_stage_writes_and_prints_the_table_for_a_policy(random_tiny_world, tmp_path, capsys):
    from stages import rollout_temperature

    val = tmp_path / "val.jsonl"
    write_problems_jsonl(PROBLEMS[:2], val)
    result = rollout_temperature.main(
        [
            "--config",
            "configs/tiny.yaml",
            f"runs_root={tmp_path / 'runs'}",
            "run=t",
            f"model.policy={random_tiny_world / 'policy'}",
            f"data.validation_path={val}",
            "rollout_temperature.temperatures=[0.6, 1.2]",
            "rollout_temperature.k=2",
            "generation.max_new_tokens=12",
            "model.torch_threads=1",
        ]
    )
    written = json.loads((tmp_path / "runs" / "t" / "rollout_temperature" / "results.json").read_text())
    assert written == json.loads(json.dumps(result))
    assert [row["temperature"] for row in written["rows"]] == [0.6, 1.2]
    assert all(row["samples"] == 4 and row["problems"] == 2 for row in written["rows"])
    assert written["settings"]["k"] == 2 and written["settings"]["validation"] == str(val)
    printed = capsys.readouterr().out
    assert "| T | slip/step |" in printed and "\n| 0.6 | " in printed and "\n| 1.2 | " in printed


def test_the_stage_refuses_problems_without_an_exact_labeller(tmp_path):
    from stages import rollout_temperature

    val = tmp_path / "val.jsonl"
    val.write_text(json.dumps({"problem_id": "g1", "question": "1 + 1?", "answer": "2", "source": "gsm8k"}) + "\n")
    with pytest.raises(
        SystemExit, match=r"kind\(s\) \['gsm8k'\]; the slip rate needs one kind with an exact first-wrong-step labeller"
    ):
        rollout_temperature.main(
            ["--config", "configs/tiny.yaml", f"runs_root={tmp_path / 'runs'}", "run=t", f"data.validation_path={val}"]
        )
    assert not (tmp_path / "runs").exists()
