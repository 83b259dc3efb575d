"""What a search chooses when it chooses wrong: the first wrong step of every wrongly answered
solution it returned, in closed categories, labelled after the search by the kind's exact
first-error labeller (prm.exact_check.FIRST_ERROR_LABELLERS, the instrument the sibling metrics
use): the search's choices never read it.

    WRONG_STEP_CATEGORIES  slip, wrong_operand, premature_answer, unfinished, other
    classify_wrong_step    one solution -> its category
    wrong_step_classifier  the problems' kind -> a classifier of its solutions, or None and why not
    summarize_wrong_steps  the categories of a (strategy, k) -> counts and shares, or nulls and a note
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from functools import partial

from pipeline.grading import extract_answer
from pipeline.records import Problem
from pipeline.tinyworld.checker import arithmetic_errors, step_equations
from prm.exact_check import COMPLETE_SOLUTION_TESTS, FIRST_ERROR_LABELLERS, slip_counterpart
from prm.search.siblings import sibling_labeller

WRONG_STEP_CATEGORIES = ("slip", "wrong_operand", "premature_answer", "unfinished", "other")

WrongStepClassifier = Callable[[Problem, Sequence[str], bool, "str | None"], str]


def classify_wrong_step(
    problem: Problem,
    steps: Sequence[str],
    finished: bool,
    answer: str | None,
    *,
    kind: str,
    labeller: Callable[[Problem, Sequence[str]], int],
    complete: Callable[[Problem, Sequence[str]], bool],
) -> str:
    """The category of a wrongly answered solution, read from its first wrong step s after the
    prefix p (labeller(problem, steps)):

    slip              s is an arithmetic slip: right once its wrong results are corrected
                      (prm.exact_check.slip_counterpart, the exact check's definition)
    wrong_operand     s writes calculations, every one of them arithmetically right, but an
                      operand or an order that no valid solution takes
    premature_answer  s writes no calculation and states an answer (extract_answer) while p's
                      calculations are not yet a whole valid solution (``complete``)
    other             any other wrong step: a wrong result on a wrong operand (wrong once
                      corrected), a wrong answer after a finished calculation, a step that
                      neither calculates nor states an answer
    and, where no step is wrong:
    unfinished        the solution states no answer (not finished, or answer None)
    other             it states one (graded wrong all the same)

        problem with valid solutions [(3*4=12, 5+12=17, 17-2=15), (5-2=3, 3*4=12, 3+12=15)], answer 15
        ["Ann buys 3 * 4 = 12 apples.", "Ann has 5 + 12 = 18 apples.", ...]   ->  slip
        ["Ann buys 3 * 4 = 12 apples.", "Ann has 6 + 12 = 18 apples.", ...]   ->  wrong_operand
        ["Ann buys 3 * 4 = 12 apples.", "The answer is 12"]                   ->  premature_answer
        ["Ann buys 3 * 4 = 12 apples."], finished False                       ->  unfinished
    """
    first = labeller(problem, steps)
    if first < 0:
        return "unfinished" if not finished or answer is None else "other"
    prefix, step = list(steps[:first]), steps[first]
    if slip_counterpart(problem, prefix, step, labeller) is not None:
        return "slip"
    if step_equations([step]):
        return "wrong_operand" if not arithmetic_errors([step]) else "other"
    if extract_answer(step, kind) is not None and not complete(problem, prefix):
        return "premature_answer"
    return "other"


def wrong_step_classifier(
    problems: Sequence[Problem],
    kind: str,
    labellers: dict = FIRST_ERROR_LABELLERS,
    complete_tests: dict = COMPLETE_SOLUTION_TESTS,
) -> tuple[WrongStepClassifier | None, str | None]:
    """classify_wrong_step with the kind's exact instruments, if it has both (a first-error
    labeller that reads every problem, as the sibling metrics require, and a test of a whole
    valid solution), else (None, why not): the wrong steps are then not measured."""
    labeller, why = sibling_labeller(problems, kind, labellers)
    if labeller is None:
        return None, why
    complete = complete_tests.get(kind)
    if complete is None:
        return None, f"kind {kind!r} has no test of a whole valid solution (prm.exact_check.COMPLETE_SOLUTION_TESTS)"
    return partial(classify_wrong_step, kind=kind, labeller=labeller, complete=complete), None


def summarize_wrong_steps(categories: Sequence[str] | None, not_labelled: str | None = None) -> dict:
    """The wrong solutions of one (strategy, k) by category.

    categories: one WRONG_STEP_CATEGORIES entry per wrongly answered solution, or None with
    ``not_labelled`` saying why they were not classified.
    returns {n_wrong, counts: {category: n}, shares: {category: n / n_wrong (None when n_wrong
    is 0)}}, every category present; where not classified the same keys with None (never 0) and
    a note."""
    if categories is None or not_labelled is not None:
        return {
            "n_wrong": None,
            "counts": dict.fromkeys(WRONG_STEP_CATEGORIES),
            "shares": dict.fromkeys(WRONG_STEP_CATEGORIES),
            "note": f"{not_labelled or 'the solutions were not classified'}: not measured",
        }
    unknown = sorted(set(categories) - set(WRONG_STEP_CATEGORIES))
    if unknown:
        raise ValueError(f"summarize_wrong_steps: unknown categories {unknown}; expected {WRONG_STEP_CATEGORIES}")
    n = len(categories)
    counts = {category: sum(c == category for c in categories) for category in WRONG_STEP_CATEGORIES}
    return {
        "n_wrong": n,
        "counts": counts,
        "shares": {category: count / n if n else None for category, count in counts.items()},
    }
