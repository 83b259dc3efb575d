"""The exact checker of a solution to a tiny-world problem: the calculations it writes, which
valid solution (and strategy) it carries out, its first wrong step, its arithmetic slips.

Calculations are compared up to the order of the operands of + and * (``3 + 7 = 10`` is
``7 + 3 = 10``), wording aside.
"""

from __future__ import annotations

import re
from collections.abc import Sequence

from pipeline.records import Problem
from pipeline.tinyworld.stories import ANSWER_STEP

_EQUATION = re.compile(r"(\d+)\s*([-+*])\s*(\d+)\s*=\s*(\d+)")


def step_equations(steps: Sequence[str]) -> tuple[tuple[int, str, int, int], ...]:
    """The calculations ``(a, op, b, c)`` written in a list of steps, in order."""
    found = []
    for step in steps:
        for a, op, b, c in _EQUATION.findall(step):
            found.append((int(a), op, int(b), int(c)))
    return tuple(found)


def _calculation_key(equation: tuple[int, str, int, int]) -> tuple[int, str, int, int]:
    """A calculation up to the order of the operands of + and * (3 + 7 = 10 is 7 + 3 = 10)."""
    a, op, b, c = equation
    return (min(a, b), op, max(a, b), c) if op in "+*" else equation


def calculations_up_to_order(steps: Sequence[str]) -> tuple:
    """The calculations written in ``steps``, each up to the order of the operands of + and *."""
    return tuple(_calculation_key(e) for e in step_equations(steps))


def valid_step_orders(problem: Problem) -> list[list[str]]:
    """Every valid solution's steps (the first is the gold solution)."""
    return [list(steps) for steps in problem.meta["solutions"]]


def num_strategies(problem: Problem) -> int:
    """How many distinct valid solutions (step orders of the problem's strategies) a problem has."""
    return len(problem.meta["solutions"])


def strategy_names(problem: Problem) -> list[str]:
    """The distinct strategy names of a problem's valid solutions, in order of first appearance
    (each solution index as its own name for a problem without ``meta["strategies"]``)."""
    names = problem.meta.get("strategies") or [str(i) for i in range(len(problem.meta["solutions"]))]
    return list(dict.fromkeys(map(str, names)))


def strategy_templates(problem: Problem) -> list[list[str]]:
    """The first listed solution of each strategy name: the gold, then the other strategies'
    templates (make_problem lists them right after the gold)."""
    names = problem.meta.get("strategies") or [str(i) for i in range(len(problem.meta["solutions"]))]
    first: dict[str, list[str]] = {}
    for name, steps in zip(map(str, names), problem.meta["solutions"]):
        first.setdefault(name, list(steps))
    return list(first.values())


def solution_strategy(problem: Problem, steps: Sequence[str]) -> int | None:
    """Index (into valid_step_orders) of the solution whose calculations ``steps`` carry out,
    wording and the order of the operands of + and * aside; None when they match none (a wrong
    or unfinished solution)."""
    calculations = calculations_up_to_order(steps)
    for index, solution in enumerate(problem.meta["solutions"]):
        if calculations_up_to_order(solution) == calculations:
            return index
    return None


def strategy_of(problem: Problem, steps: Sequence[str]) -> str | None:
    """The name of the strategy a solution carries out (``meta["strategies"]`` at the index
    solution_strategy finds; the index as a string for a problem without names), None when it
    matches no valid solution."""
    index = solution_strategy(problem, steps)
    if index is None:
        return None
    names = problem.meta.get("strategies")
    return str(names[index]) if names else str(index)


def arithmetic_errors(steps: Sequence[str]) -> list[str]:
    """The steps that write a wrong calculation (``a op b = c`` with c not its value)."""
    apply = {"+": lambda a, b: a + b, "-": lambda a, b: a - b, "*": lambda a, b: a * b}
    return [step for step in steps if any(apply[op](a, b) != c for a, op, b, c in step_equations([step]))]


def first_wrong_step(problem: Problem, steps: Sequence[str]) -> int:
    """Index of the first wrong step of a solution to a tiny-world problem, or -1 when none is
    (ProcessBench's label), exact because the world knows every valid strategy:

    - a step that writes calculations is right while the calculations written so far are the
      start of some valid solution's (a wrong result, a wrong operand or an order no strategy
      takes is wrong; wording and the operand order of + and * aside, as in solution_strategy);
    - a step without a calculation is right when it is ``The answer is <the answer>``.

        problem with valid solutions [(3*4=12, 5+12=17, 17-2=15), (5-2=3, 3*4=12, 3+12=15)], answer 15
        ["Ann has 5 - 2 = 3 apples.", "Ann buys 3 * 4 = 13 apples.", ...]  ->  1
        ["Ann buys 3 * 4 = 12 apples.", "Ann has 5 + 12 = 17 apples.", "The answer is 17"]  ->  2
    """
    strategies = [calculations_up_to_order(solution) for solution in problem.meta["solutions"]]
    written: tuple = ()
    for index, step in enumerate(steps):
        equations = calculations_up_to_order([step])
        if equations:
            written += equations
            if not any(strategy[: len(written)] == written for strategy in strategies):
                return index
        elif step.strip() != ANSWER_STEP.format(answer=problem.answer):
            return index
    return -1


def corrected_step(step: str) -> str | None:
    """The step with the result of each wrong calculation (``a op b = c``, c not its value)
    replaced by the right value, everything else kept; None when no calculation in it is wrong.

        "Ann has 5 + 3 = 9 apples."  ->  "Ann has 5 + 3 = 8 apples."
    """
    apply = {"+": lambda a, b: a + b, "-": lambda a, b: a - b, "*": lambda a, b: a * b}
    pieces, end = [], 0
    for match in _EQUATION.finditer(step):
        a, op, b, c = match.groups()
        value = apply[op](int(a), int(b))
        if value != int(c):
            pieces += [step[end : match.start(4)], str(value)]
            end = match.end(4)
    return None if not pieces else "".join(pieces) + step[end:]
