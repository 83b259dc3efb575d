"""The sibling metrics of a step-level search (prm.search.siblings): the pure computation
against a brute-force double loop, the exact labelling of expansions, and the search stage on
tiny-world problems with a scripted policy and a PRM that knows (or inverts) the exact labels,
with the wrong steps it chose (prm.search.wrong_steps) as written and as read again by
stages.search_wrong_steps."""

from __future__ import annotations

import json
import random
import re

import pytest

from pipeline.config.schema import TinyWorldConfig
from pipeline.generation.base import Completion, truncate_at_stop
from pipeline.records import Problem, SearchRecord, SiblingCandidates
from pipeline.steps import split_steps
from pipeline.tinyworld.checker import first_wrong_step
from pipeline.tinyworld.problems import generate_splits
from prm.search.candidates import Expansion
from prm.search.siblings import (
    expansion_counts,
    label_expansions,
    sibling_labeller,
    sibling_metrics,
    summarize_siblings,
)
from prm.search.wrong_steps import WRONG_STEP_CATEGORIES
from stages import search_wrong_steps

GOLD = ["Ann buys 3 * 4 = 12 apples.", "Ann has 5 + 12 = 17 apples.", "Ann has 17 - 2 = 15 apples.", "The answer is 15"]
OTHER = ["Ann has 5 - 2 = 3 apples.", "Ann buys 3 * 4 = 12 apples.", "Ann has 3 + 12 = 15 apples.", "The answer is 15"]
PROBLEM = Problem("p1", "question p1", "15", "tiny", {"solutions": [GOLD, OTHER]})


def brute_force(per_problem):
    """The metrics written the obvious way: every (right, wrong) pair of every expansion."""
    wins = pairs = 0.0
    distinct, candidates, wrong, expansions, with_pairs = [], 0, 0, 0, 0
    for problem in per_problem:
        for e in problem:
            expansions += 1
            candidates += len(e.scores)
            wrong += sum(not c for c in e.correct)
            distinct.append(len(set(e.texts)))
            mine = 0
            for i in range(len(e.scores)):
                for j in range(len(e.scores)):
                    if e.correct[i] and not e.correct[j]:
                        mine += 1
                        wins += 1.0 if e.scores[i] > e.scores[j] else 0.5 if e.scores[i] == e.scores[j] else 0.0
            pairs += mine
            with_pairs += mine > 0
    return {
        "auc": wins / pairs if pairs else None,
        "n_expansions": expansions,
        "n_expansions_with_pairs": with_pairs,
        "n_pairs": int(pairs),
        "distinct_per_step": sum(distinct) / len(distinct) if distinct else None,
        "candidates_per_step": candidates / expansions if expansions else None,
        "error_rate": wrong / candidates if candidates else None,
    }


def random_expansion(rng: random.Random) -> SiblingCandidates:
    k = rng.randint(1, 8)
    scores = [rng.choice([0.1, 0.3, 0.5, 0.7, 0.9]) for _ in range(k)]  # ties on purpose
    correct = [rng.random() < 0.6 for _ in range(k)]
    texts, first = [], {}
    for i in range(k):
        texts.append(first.setdefault(rng.randint(0, 3), i))
    return SiblingCandidates(scores, correct, texts)


@pytest.mark.parametrize("seed", range(5))
def test_sibling_metrics_match_a_brute_force_double_loop(seed):
    rng = random.Random(seed)
    per_problem = [[random_expansion(rng) for _ in range(rng.randint(0, 4))] for _ in range(rng.randint(2, 7))]
    metrics = sibling_metrics(per_problem, n_resamples=300)
    expected = brute_force(per_problem)
    for key, value in expected.items():
        assert metrics[key] == pytest.approx(value), key
    lo, hi = metrics["interval"]
    if metrics["auc"] is None:
        assert (lo, hi) == (None, None)
    else:
        assert lo <= hi and 0.0 <= lo and hi <= 1.0


def test_the_edges_one_candidate_all_right_all_tied():
    assert expansion_counts([0.4], [True], ["a"]) == (0.0, 0, 1, 0, 1)  # k = 1: no pair
    assert expansion_counts([0.4, 0.9], [True, True], ["a", "a"]) == (0.0, 0, 1, 0, 2)
    assert expansion_counts([0.5, 0.5, 0.5], [True, False, False], ["a", "b", "c"]) == (1.0, 2, 3, 2, 3)
    one = SiblingCandidates([0.9, 0.9, 0.2, 0.95], [True, True, False, False], [0, 0, 2, 3])
    metrics = sibling_metrics([[one]])
    assert metrics["auc"] == pytest.approx(0.5)  # each right copy beats 0.2, loses to 0.95
    assert metrics["interval"] == [0.5, 0.5]  # one problem: every resample is the same
    assert (metrics["distinct_per_step"], metrics["error_rate"], metrics["n_pairs"]) == (3.0, 0.5, 4)
    assert sibling_metrics([[], []])["auc"] is None and sibling_metrics([[], []])["error_rate"] is None


def test_label_expansions_counts_only_correct_prefixes():
    slip = "Ann has 5 + 12 = 18 apples."
    expansions = [
        Expansion([], [[GOLD[0]], [OTHER[0]], [GOLD[0]], ["I like apples."]], [0.9, 0.8, 0.7, 0.1]),
        Expansion([GOLD[0]], [[slip], [GOLD[1]], []], [0.6, 0.4, 0.3]),  # a stop candidate adds no step: right
        Expansion([GOLD[0], slip], [["Ann has 18 - 2 = 16 apples."]], [0.5]),  # after a wrong step: not counted
        Expansion([GOLD[0]], [], []),  # nothing ranked: not counted
        Expansion(GOLD[:3], [[GOLD[3]], ["The answer is 16"]], [0.2, 0.3]),
    ]
    labelled = label_expansions(PROBLEM, expansions, first_wrong_step)
    assert labelled == [
        SiblingCandidates([0.9, 0.8, 0.7, 0.1], [True, True, True, False], [0, 1, 0, 3]),
        SiblingCandidates([0.6, 0.4, 0.3], [False, True, True], [0, 1, 2]),
        SiblingCandidates([0.2, 0.3], [True, False], [0, 1]),
    ]
    metrics = sibling_metrics([labelled])
    assert metrics["auc"] == pytest.approx((3 + 0 + 0) / (3 + 2 + 1))
    assert metrics["error_rate"] == pytest.approx(3 / 9)


def test_not_measured_is_null_with_a_note_never_zero():
    math_problem = Problem("m1", "What is 2 + 2?", "4", "math")
    labeller, why = sibling_labeller([math_problem], "math")
    assert labeller is None and "no exact first-error labeller" in why
    labeller, why = sibling_labeller([Problem("t1", "q", "4", "tiny")], "tiny")  # no solutions to check against
    assert labeller is None and "cannot read problem 't1'" in why
    assert sibling_labeller([PROBLEM], "tiny") == (first_wrong_step, None)
    summary = summarize_siblings([[]], why)
    assert summary["auc"] is None and summary["n_expansions"] is None and summary["error_rate"] is None
    assert summary["note"].endswith("not measured")
    assert "before they were recorded" in summarize_siblings([[], None])["note"]
    with pytest.raises(ValueError, match="texts"):
        SearchRecord.from_json(
            {
                **SearchRecord("p", "beam", 2, [], [], False, None, 0).to_json(),
                "siblings": [{"scores": [0.1, 0.2], "correct": [True, False], "texts": [1, 1]}],
            }
        )


# ---------------------------------------------------------------- the stage on the tiny world


def last_number_plus(step: str, delta: int) -> str:
    """The step with its last number raised by delta: an arithmetic slip (or a wrong answer)."""
    return re.sub(r"(\d+)(?!.*\d)", lambda m: str(int(m.group(1)) + delta), step)


class ScriptedTinyPolicy:
    """Proposes, after a prefix of d steps, the first valid solution's step d twice, then two
    slips of it (result + 1, + 2), cycled: at k = 4 two right copies of one text and two distinct
    wrong steps per expansion."""

    tokenizer = None

    def __init__(self, problems):
        self.problems = {f"Question: {p.question}\nAnswer:\n": p for p in problems}

    def generate(self, prompts, n=1, temperature=1.0, top_p=1.0, max_new_tokens=256, stop=None, seed=None):
        out = []
        for prompt in prompts:
            base = next(b for b in self.problems if prompt.startswith(b))
            gold = self.problems[base].meta["solutions"][0]
            depth = min(len(split_steps(prompt[len(base) :])), len(gold) - 1)
            step = gold[depth]
            variants = [step, step, last_number_plus(step, 1), last_number_plus(step, 2)]
            reason = "eos" if depth == len(gold) - 1 else "stop"
            completions = []
            for i in range(n):
                text, _ = truncate_at_stop(variants[i % 4] + ("" if reason == "eos" else "\n"), stop or [])
                completions.append(Completion(text, list(range(len(text))), reason))
            out.append(completions)
        return out


class ExactPRM:
    """Scores a step 1 when no step up to it is wrong (the exact labeller), else 0; inverted: 1 - that."""

    def __init__(self, problems, inverted: bool):
        self.problems = {p.question: p for p in problems}
        self.inverted = inverted

    def score_many(self, solutions):
        rows = []
        for question, steps in solutions:
            first = first_wrong_step(self.problems[question], steps)
            right = [first < 0 or j < first for j in range(len(steps))]
            rows.append([float(r != self.inverted) for r in right])
        return rows


@pytest.mark.parametrize("inverted", [False, True])
def test_stage_reports_sibling_auc_one_for_an_exact_prm_and_zero_for_its_inverse(
    tmp_path, monkeypatch, capsys, inverted
):
    import stages.search as stage
    from pipeline.datasets.problems import write_problems_jsonl

    problems = generate_splits(TinyWorldConfig(n_train=4, n_val=2, n_test=5))["test"]
    path = tmp_path / "problems.jsonl"
    write_problems_jsonl(problems, path)
    (tmp_path / "prm").mkdir()
    monkeypatch.setattr(stage, "build_generator", lambda config: ScriptedTinyPolicy(problems))
    monkeypatch.setattr(stage, "load_scorer", lambda path, config: ExactPRM(problems, inverted))
    stage.main(
        [
            "--config",
            "configs/tiny.yaml",
            f"runs_root={tmp_path}",
            "run=t",
            f"model.prm={tmp_path}/prm",
            "search.benchmark=problems",
            f"search.benchmark_path={path}",
            "search.ks=[1,4]",
            "search.beam_width=2",
            "search.max_depth=8",
            "search.strategies=[step_best_of_k,beam,best_of_n]",
        ]
    )
    out = tmp_path / "t" / "search"
    rows = {(r["strategy"], r["k"]): r for r in json.loads((out / "results.json").read_text())["rows"]}
    assert "siblings" not in rows["majority", 4] and "siblings" not in rows["best_of_n", 4]
    gold_steps = sum(len(p.meta["solutions"][0]) for p in problems)
    best, beam, single = rows["step_best_of_k", 4], rows["beam", 4], rows["step_best_of_k", 1]
    # k = 1: one candidate per expansion, always the right step: no pair, e = 0
    assert single["siblings"]["auc"] is None and single["siblings"]["error_rate"] == 0.0
    assert single["siblings"]["n_expansions"] == gold_steps and single["siblings"]["distinct_per_step"] == 1.0
    if not inverted:
        # the exact PRM keeps the right step at every depth: every expansion is counted
        assert best["accuracy"]["mean"] == 1.0
        assert best["siblings"]["auc"] == 1.0 and best["siblings"]["interval"] == [1.0, 1.0]
        assert best["siblings"]["n_expansions"] == gold_steps and best["siblings"]["n_pairs"] == 4 * gold_steps
        assert best["siblings"]["distinct_per_step"] == 3.0 and best["siblings"]["error_rate"] == 0.5
    else:
        # the inverse keeps a slip at the root; what follows a wrong prefix is not counted
        assert best["siblings"]["auc"] == 0.0 and best["siblings"]["n_expansions"] == len(problems)
        assert beam["siblings"]["auc"] == 0.0 and beam["siblings"]["n_expansions"] == len(problems)
    assert beam["siblings"]["auc"] == best["siblings"]["auc"]
    records = [json.loads(line) for line in (out / "solutions.jsonl").read_text().splitlines()]
    assert all(("siblings" in r) == (r["strategy"] in ("step_best_of_k", "beam")) for r in records)
    header, _, *lines = (out / "table.md").read_text().splitlines()
    cells = next(line for line in lines if line.startswith("| step_best_of_k | 4 |")).split("|")
    assert header.split("|")[7].strip() == "sibling AUC" and cells[7].strip() == f"{best['siblings']['auc']:.3f}"
    assert cells[9].strip() == f"{best['siblings']['distinct_per_step']:.2f}"
    assert next(line for line in lines if line.startswith("| majority | 4 |")).endswith("| - | - | - | - | 0/0/0/5/0 |")
    # the wrong steps chosen: step-level search ends on the gold answer after any slip (every
    # candidate after a wrong prefix ties and the gold step comes first), so nothing is graded wrong;
    # the scripted policy's whole solutions are one step each: unfinished, with no wrong step
    assert best["wrong_steps"] == {
        "n_wrong": 0,
        "counts": dict.fromkeys(WRONG_STEP_CATEGORIES, 0),
        "shares": dict.fromkeys(WRONG_STEP_CATEGORIES),
    }
    majority = rows["majority", 4]["wrong_steps"]
    assert majority["counts"] == {**dict.fromkeys(WRONG_STEP_CATEGORIES, 0), "unfinished": len(problems)}
    assert majority["shares"]["unfinished"] == 1.0 and majority["n_wrong"] == len(problems)
    assert header.split("|")[11].strip() == "wrong: slip / wrong_operand / premature_answer / unfinished / other"
    assert cells[11].strip() == "0/0/0/0/0"
    # read again from solutions.jsonl without searching: the same classification
    reread = search_wrong_steps.main(["--config", str(out / "config.yaml")])
    assert [(r["strategy"], r["k"], r["wrong_steps"]) for r in reread] == [
        (r["strategy"], r["k"], r["wrong_steps"]) for r in rows.values()
    ]
    assert "| step_best_of_k | 4 |" in capsys.readouterr().out
