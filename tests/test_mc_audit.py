"""make mc-audit: the MC values of slip pairs by rollout temperature and the PRM data audited
exactly (prm.mc_audit, stages.mc_audit)."""

from __future__ import annotations

import json
import re

import numpy as np

from pipeline.config.loader import load_config
from pipeline.config.schema import TinyWorldConfig
from pipeline.datasets.problems import write_problems_jsonl
from pipeline.records import PRMExample
from pipeline.storage.files import write_records_atomic as write_records
from pipeline.tinyworld.checker import arithmetic_errors, first_wrong_step
from pipeline.tinyworld.problems import generate_splits
from prm.exact_check import SlipPair
from prm.mc_audit import data_audit, mc_pair_row, slip_pair_mc

PROBLEMS = generate_splits(TinyWorldConfig(seed=7, n_train=1, n_val=1, n_test=1, n_rl=4))["rl"]


def slipped(step: str) -> str:
    """The step with its calculation's result one too high (an arithmetic slip)."""
    a, op, b, c = re.search(r"(\d+) ([-+*]) (\d+) = (\d+)", step).groups()
    return step.replace(f"{a} {op} {b} = {c}", f"{a} {op} {b} = {int(c) + 1}", 1)


def brute_pair_auc(slip, counterpart) -> float:
    wins = [1.0 if c > s else 0.5 if c == s else 0.0 for s, c in zip(slip, counterpart)]
    return sum(wins) / len(wins)


def test_mc_pair_row_matches_a_float64_brute_force_reference():
    rng = np.random.default_rng(0)
    slip = rng.integers(0, 5, 40) / 4
    counterpart = rng.integers(0, 5, 40) / 4
    groups = [f"p{i % 7}" for i in range(40)]
    row = mc_pair_row(slip, counterpart, groups)
    assert row["n_pairs"] == 40
    assert row["auc"] == round(brute_pair_auc(slip, counterpart), 4)
    assert row["mean_mc_slip"] == round(float(np.mean(slip)), 4)
    assert row["slip_mc_zero"] == round(float(np.mean(slip == 0)), 4)
    assert row["counterpart_mc_zero"] == round(float(np.mean(counterpart == 0)), 4)
    lo, hi = row["interval"]
    assert lo <= row["auc"] <= hi
    empty = mc_pair_row([], [], [])
    assert empty["n_pairs"] == 0 and empty["auc"] is None and empty["mean_mc_slip"] is None


def example(problem, prefix, step, label, origin="augmented"):
    return PRMExample(problem.problem_id, problem.question, list(prefix), step, label, origin)


def test_data_audit_counts_slipped_prefixes_their_labels_and_clean_slip_pairs():
    problem = PROBLEMS[0]
    gold = list(problem.meta["solutions"][0])
    slip = slipped(gold[0])
    examples = [
        example(problem, [], gold[0], 0.75, "mcts"),  # clean step after a clean (empty) prefix
        example(problem, [], slip, 0.0, "mcts"),  # its slip: a clean pair, counterpart labelled higher
        example(problem, [], slip, 0.5),  # the same slip again (augmented): merged by mean within an origin
        example(problem, [slip], gold[1], 1.0),  # after a slipped prefix, labelled 1: the contamination
        example(problem, [gold[0]], gold[1], 0.5),
        PRMExample("elsewhere", "q", [], "x", 0.5, "augmented"),  # no problem given: unchecked
    ]
    audit = data_audit(examples, {problem.problem_id: problem}, first_wrong_step)
    assert audit["unchecked"] == 1
    mcts, augmented, everything = audit["mcts"], audit["augmented"], audit["all"]
    assert mcts["examples"] == 2 and augmented["examples"] == 3 and everything["examples"] == 5
    assert mcts["prefix_arithmetic_slip"] == 0 and mcts["clean_pairs"]["n_pairs"] == 1
    assert mcts["clean_pairs"]["auc"] == 1.0 and mcts["clean_pairs"]["mean_mc_slip"] == 0.0
    assert augmented["prefix_arithmetic_slip"] == round(1 / 3, 4) and augmented["prefix_wrong"] == round(1 / 3, 4)
    assert augmented["labels_after_wrong_prefix"] == {"n": 1, "mean": 1.0, "share_one": 1.0, "share_above_zero": 1.0}
    assert augmented["clean_pairs"]["n_pairs"] == 0  # the slip's counterpart is an mcts example only
    # all origins together: the slip's two labels merge to 0.25 against the counterpart's 0.75
    assert everything["clean_pairs"]["n_pairs"] == 1 and everything["clean_pairs"]["mean_mc_slip"] == 0.25
    assert everything["labels_after_clean_prefix"]["n"] == 4


class RecoveringGenerator:
    """From a prefix holding an arithmetic slip, round(n * T / 2) of n completions still answer
    right (a slip recovered from); from a clean prefix every completion answers right. Records the
    temperatures asked for."""

    tokenizer = None

    def __init__(self, problems):
        self.problems, self.temperatures = problems, []

    def generate(self, prompts, n=1, temperature=1.0, top_p=1.0, max_new_tokens=16, stop=None, seed=None):
        self.temperatures.append(temperature)
        out = []
        for prompt in prompts:
            problem = next(p for p in self.problems if p.question in prompt)
            right = f"The answer is {problem.answer}\n"
            if arithmetic_errors(prompt.split("\n")):
                recovered = round(n * temperature / 2)
                out.append([Completion(right if j < recovered else "The answer is 0\n") for j in range(n)])
            else:
                out.append([Completion(right) for _ in range(n)])
        return out


class Completion:
    def __init__(self, text):
        self.text, self.token_ids, self.finish_reason = text, [1] * len(text), "eos"


def test_slip_pair_mc_estimates_each_side_at_each_temperature():
    pairs = []
    for problem in PROBLEMS:
        gold = list(problem.meta["solutions"][0])
        pairs.append(SlipPair(problem.problem_id, problem.question, [], slipped(gold[0]), gold[0], 0))
    generator = RecoveringGenerator(PROBLEMS)
    config = load_config(None, ["format.use_chat_template=false"])
    rows = slip_pair_mc(generator, pairs, PROBLEMS, config, [0.5, 1.0], k=4, seed=0)
    assert generator.temperatures == [0.5, 1.0]
    cold, warm = rows
    # T = 0.5: 1 of 4 rollouts from a slip recovers; T = 1: 2 of 4; from the counterpart all 4 are right
    assert cold["temperature"] == 0.5 and cold["n_pairs"] == len(PROBLEMS)
    assert cold["mean_mc_slip"] == 0.25 and warm["mean_mc_slip"] == 0.5
    assert cold["mean_mc_counterpart"] == warm["mean_mc_counterpart"] == 1.0
    assert cold["auc"] == warm["auc"] == 1.0 and cold["slip_mc_zero"] == 0.0


def test_the_stage_writes_the_pairs_and_the_data_audit(random_tiny_world, tmp_path, capsys):
    from stages import mc_audit

    problems = PROBLEMS
    val, rl = tmp_path / "val.jsonl", tmp_path / "rl.jsonl"
    write_problems_jsonl(problems[:2], val)
    write_problems_jsonl(problems, rl)
    augment = tmp_path / "runs" / "t" / "augment"
    augment.mkdir(parents=True)
    gold = list(problems[0].meta["solutions"][0])
    write_records(
        augment / "prm_train.jsonl",
        [example(problems[0], [], gold[0], 0.75, "mcts"), example(problems[0], [], slipped(gold[0]), 0.0, "mcts")],
    )
    write_records(augment / "prm_val.jsonl", [example(problems[1], [slipped(gold[0])], gold[1], 1.0)])
    result = mc_audit.main(
        [
            "--config",
            "configs/tiny.yaml",
            f"runs_root={tmp_path / 'runs'}",
            "run=t",
            f"model.policy={random_tiny_world / 'policy'}",
            f"data.validation_path={val}",
            f"data.train_path={rl}",
            "data.disjoint_from=[]",
            "mc_audit.temperatures=[0.6, 1.2]",
            "mc_audit.k=2",
            "prm.exact_check_samples=2",
            "generation.max_new_tokens=12",
            "model.torch_threads=1",
        ]
    )
    written = json.loads((tmp_path / "runs" / "t" / "mc_audit" / "results.json").read_text())
    assert written == json.loads(json.dumps(result))
    assert [row["temperature"] for row in written["slip_pairs"]] == [0.6, 1.2]
    assert written["data"]["mcts"]["clean_pairs"]["n_pairs"] == 1
    assert written["data"]["all"]["examples"] == 3 and written["mcts"] is None
    assert written["settings"]["k"] == 2
    printed = capsys.readouterr().out
    assert "| T | pairs |" in printed and "| mcts | 2 |" in printed


def test_every_pair_of_a_prefix_is_one_pair_only_when_the_corrected_text_is_a_sibling():
    problem = PROBLEMS[1]
    gold = list(problem.meta["solutions"][0])
    # two different slips of the same step: neither is the other's corrected text
    a = slipped(gold[0])
    b = slipped(a)
    examples = [example(problem, [], text, 0.0) for text in (a, b)]
    audit = data_audit(examples, {problem.problem_id: problem}, first_wrong_step)
    assert audit["all"]["clean_pairs"]["n_pairs"] == 0
