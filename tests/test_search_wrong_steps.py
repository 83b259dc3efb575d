"""The wrong steps a search chooses (prm.search.wrong_steps): hand-written solutions of each
category, every category built at every depth of generated tiny-world problems against the
classifier, the counts against a counting loop, and what happens where the kind has no exact
instrument. The stage's columns and the re-reading entry are tested in test_search_siblings.py."""

from __future__ import annotations

import random
import re

import pytest

from pipeline.config.schema import TinyWorldConfig
from pipeline.records import Problem
from pipeline.tinyworld.checker import first_wrong_step, step_equations
from pipeline.tinyworld.problems import generate_splits
from prm.search.wrong_steps import (
    WRONG_STEP_CATEGORIES,
    classify_wrong_step,
    summarize_wrong_steps,
    wrong_step_classifier,
)

GOLD = ["Ann buys 3 * 4 = 12 apples.", "Ann has 5 + 12 = 17 apples.", "Ann has 17 - 2 = 15 apples.", "The answer is 15"]
OTHER = ["Ann has 5 - 2 = 3 apples.", "Ann buys 3 * 4 = 12 apples.", "Ann has 3 + 12 = 15 apples.", "The answer is 15"]
PROBLEM = Problem("p1", "question p1", "15", "tiny", {"solutions": [GOLD, OTHER]})


def classify(problem, steps, finished=True, answer="x"):
    classifier, why = wrong_step_classifier([problem], problem.kind)
    assert why is None
    return classifier(problem, steps, finished, answer)


@pytest.mark.parametrize(
    "steps, finished, answer, category",
    [
        (
            [GOLD[0], "Ann has 5 + 12 = 18 apples.", "Ann has 18 - 2 = 16 apples.", "The answer is 16"],
            True,
            "16",
            "slip",
        ),
        (["Ann has 5 - 2 = 4 apples."], False, None, "slip"),  # a slip on the other strategy, left unfinished
        ([GOLD[0], "Ann has 6 + 12 = 18 apples.", "The answer is 18"], True, "18", "wrong_operand"),
        (["Ann has 5 + 12 = 17 apples.", "Ann buys 3 * 4 = 12 apples."], True, "17", "wrong_operand"),  # an order
        ([GOLD[0], "The answer is 12"], True, "12", "premature_answer"),
        (["The answer is 7"], True, "7", "premature_answer"),
        (GOLD[:2], False, None, "unfinished"),
        (GOLD[:3], True, None, "unfinished"),  # an answerless stop
        ([*GOLD[:3], "The answer is 16"], True, "16", "other"),  # a wrong answer after a finished calculation
        ([GOLD[0], "Ann has 6 + 12 = 19 apples."], True, "19", "other"),  # a wrong result on a wrong operand
        ([GOLD[0], "Ann likes apples."], True, None, "other"),
    ],
)
def test_hand_written_solutions(steps, finished, answer, category):
    assert classify(PROBLEM, steps, finished, answer) == category


def plus(number: str, delta: int) -> str:
    return str(int(number) + delta)


def built_solutions(problem: Problem):
    """(steps, finished, answer, category, d: the index of the step built wrong, None for an
    unfinished solution) built from the gold solution at every depth d: a slip
    (its result + 1), a wrong operand (its first operand + 1, the result recomputed), an answer
    stated after d < n calculations, the first d steps unfinished, and a wrong final answer. The
    rest of the gold solution follows a wrong calculation (it does not change the category)."""
    gold = problem.meta["solutions"][0]
    calculations = [i for i, step in enumerate(gold) if step_equations([step])]
    apply = {"+": lambda a, b: a + b, "-": lambda a, b: a - b, "*": lambda a, b: a * b}
    for d in calculations:
        (a, op, b, c) = step_equations([gold[d]])[0]
        slip = re.sub(rf"= {c}\b", f"= {c + 1}", gold[d], count=1)
        operand = re.sub(rf"\b{a} \{op} {b} = {c}\b", f"{a + 1} {op} {b} = {apply[op](a + 1, b)}", gold[d], count=1)
        yield [*gold[:d], slip, *gold[d + 1 :]], True, "0", "slip", d
        if apply[op](a + 1, b) >= 0:
            yield [*gold[:d], operand, *gold[d + 1 :]], True, "0", "wrong_operand", d
        stated = str(step_equations(gold[:d])[-1][3]) if d else "0"
        yield [*gold[:d], f"The answer is {stated}"], True, stated, "premature_answer", d
        yield gold[:d], False, None, "unfinished", None
    wrong_answer = plus(problem.answer, 1)
    yield [*gold[:-1], f"The answer is {wrong_answer}"], True, wrong_answer, "other", len(gold) - 1


def test_every_category_built_at_every_depth_of_generated_problems():
    problems = generate_splits(TinyWorldConfig(n_train=2, n_val=2, n_test=40))["test"]
    classifier, why = wrong_step_classifier(problems, "tiny")
    assert why is None
    checked = {category: 0 for category in WRONG_STEP_CATEGORIES}
    for problem in problems:
        for steps, finished, answer, category, d in built_solutions(problem):
            if first_wrong_step(problem, steps) != (-1 if d is None else d):
                continue  # the changed step happens to start another valid solution, or states the answer
            assert classifier(problem, steps, finished, answer) == category, (problem.meta["solutions"], steps)
            checked[category] += 1
    assert all(count >= 20 for category, count in checked.items()), checked


@pytest.mark.parametrize("seed", range(5))
def test_summary_counts_match_a_counting_loop(seed):
    rng = random.Random(seed)
    categories = [rng.choice(WRONG_STEP_CATEGORIES) for _ in range(rng.randint(0, 30))]
    summary = summarize_wrong_steps(categories)
    assert summary["n_wrong"] == len(categories)
    for category in WRONG_STEP_CATEGORIES:
        count = 0
        for c in categories:
            count += c == category
        assert summary["counts"][category] == count
        assert summary["shares"][category] == (count / len(categories) if categories else None)
    assert "note" not in summary
    with pytest.raises(ValueError, match="unknown categories"):
        summarize_wrong_steps(["slip", "typo"])


def test_not_measured_without_an_exact_instrument_is_null_with_a_note():
    classifier, why = wrong_step_classifier([Problem("m1", "What is 2 + 2?", "4", "math")], "math")
    assert classifier is None and "no exact first-error labeller" in why
    classifier, why = wrong_step_classifier([Problem("t1", "q", "4", "tiny")], "tiny")  # no solutions to check
    assert classifier is None and "cannot read problem 't1'" in why
    classifier, why = wrong_step_classifier([PROBLEM], "tiny", complete_tests={})
    assert classifier is None and "no test of a whole valid solution" in why
    summary = summarize_wrong_steps(None, why)
    assert summary["n_wrong"] is None and set(summary["counts"].values()) == {None}
    assert set(summary["shares"].values()) == {None} and summary["note"].endswith("not measured")


def test_classify_takes_its_instruments_as_arguments():
    """A pure function: the same solution under another labeller gets that labeller's category."""
    steps = [GOLD[0], "The answer is 12"]
    assert classify_wrong_step(
        PROBLEM, steps, True, "12", kind="tiny", labeller=first_wrong_step, complete=lambda p, s: False
    ) == ("premature_answer")
    assert (
        classify_wrong_step(
            PROBLEM, steps, True, "12", kind="tiny", labeller=first_wrong_step, complete=lambda p, s: True
        )
        == "other"
    )
    assert (
        classify_wrong_step(
            PROBLEM, steps, True, "12", kind="tiny", labeller=lambda p, s: -1, complete=lambda p, s: True
        )
        == "other"
    )
