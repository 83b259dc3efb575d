"""How a policy's rollouts err at each sampling temperature, measured exactly where the problems'
kind has an exact first-wrong-step labeller (the tiny world: ``first_wrong_step``).

``temperature_sweep`` samples ``k`` complete solutions of each problem from its root, through the
rollout function MCTS uses (``make_rollout_fn``: the same prompts, grading and seeds per problem),
at each temperature, and reports per temperature:

- ``first_wrong_per_step``: the per-step slip rate, first wrong steps over the steps sampled after
  a correct prefix (the first wrong step included): how often the policy errs at a step it reaches
  with everything before it right;
- ``arithmetic_slip_rate``: sampled steps that write a wrong calculation (``arithmetic_errors``)
  over all sampled steps, and ``arithmetic_share_of_first_wrong``: first wrong steps that are
  such a slip (a wrong result; the rest take an order or operand no strategy takes, or answer wrongly);
- ``wrong_solutions``: samples with a first wrong step; ``sampled_accuracy``: samples whose final
  answer is right (a wrong step can still reach it);
- ``root_mc_between``: problems whose root MC (the share of their ``k`` samples that are right,
  as MCTS estimates it) is strictly between 0 and 1, the problems MCTS searches; and the shares at
  0 and at 1;
- ``seconds``: the sampling time.

``stages.rollout_temperature`` (make rollout-temperature) runs it on held-out problems and prints
the table; docs/mcts.md, "Rollout temperature", has the figures configs/tiny.yaml's
mcts.temperature comes from.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence

from pipeline.grading import extract_answer, grade_many
from pipeline.prompts import prompt_from_config
from pipeline.records import Problem
from pipeline.rollouts.mcts import make_rollout_fn, mc_value
from pipeline.tinyworld.checker import arithmetic_errors

FirstWrong = Callable[[Problem, Sequence[str]], int]


def slip_counts(problem: Problem, solutions: Sequence[Sequence[str]], first_wrong: FirstWrong) -> dict[str, int]:
    """Counts over ``solutions`` (step lists) of ``problem``: steps, steps after a correct prefix
    (up to and including the first wrong step), first wrong steps, those that are arithmetic slips,
    and steps with an arithmetic slip anywhere."""
    counts = {"steps": 0, "steps_reached": 0, "first_wrong": 0, "first_wrong_arithmetic": 0, "arithmetic_steps": 0}
    for steps in solutions:
        index = first_wrong(problem, steps)
        counts["steps"] += len(steps)
        counts["steps_reached"] += len(steps) if index < 0 else index + 1
        counts["arithmetic_steps"] += len(arithmetic_errors(steps))
        if index >= 0:
            counts["first_wrong"] += 1
            counts["first_wrong_arithmetic"] += bool(arithmetic_errors([steps[index]]))
    return counts


def _share(part: float, whole: float) -> float | None:
    return round(part / whole, 4) if whole else None


def problems_rollout_fn(generator, problems: Sequence[Problem], config, k: int, temperature: float, seed: int):
    """The rollout function (make_rollout_fn) of ``problems``, drawn as MCTS draws its rollouts:
    the one prompt builder's prompts, config.format, config.generation.max_new_tokens,
    config.mcts.top_p, ``k`` rollouts per request at ``temperature``, a stream per (problem, prefix)
    from ``seed``; a request is (index into problems, prefix). One answer kind at a time."""
    kinds = {p.kind for p in problems}
    if len(kinds) != 1:
        raise ValueError(f"the problems mix answer kinds {sorted(kinds)}; use one source at a time")
    kind = kinds.pop()
    prompts = [
        prompt_from_config(p.question, kind, generator.tokenizer, config.format, p.meta.get("options"))
        for p in problems
    ]
    return make_rollout_fn(
        generator,
        prompts,
        [p.answer for p in problems],
        kind,
        k=k,
        temperature=temperature,
        top_p=config.mcts.top_p,
        max_new_tokens=config.generation.max_new_tokens,
        separator=config.format.separator,
        grade_many=grade_many,
        extract_answer=extract_answer,
        seed=seed,
        problem_ids=[p.problem_id for p in problems],
    )


def temperature_sweep(
    generator,
    problems: Sequence[Problem],
    config,
    temperatures: Sequence[float],
    k: int,
    seed: int,
    first_wrong: FirstWrong,
) -> list[dict]:
    """One row per temperature (the module docstring lists its fields) of ``k`` root samples of
    each problem, drawn as MCTS draws its rollouts (config.format, config.generation.max_new_tokens,
    config.mcts.top_p; a stream per problem from ``seed``)."""
    rows = []
    for temperature in temperatures:
        start = time.monotonic()
        rollout_fn = problems_rollout_fn(generator, problems, config, k, temperature, seed)
        results = rollout_fn([(i, ()) for i in range(len(problems))])
        seconds = time.monotonic() - start
        totals = dict.fromkeys(
            ("steps", "steps_reached", "first_wrong", "first_wrong_arithmetic", "arithmetic_steps"), 0
        )
        correct, mcs = 0, []
        for problem, rollouts in zip(problems, results):
            for key, value in slip_counts(problem, [r.steps for r in rollouts], first_wrong).items():
                totals[key] += value
            correct += sum(r.correct for r in rollouts)
            mcs.append(mc_value(rollouts))
        samples = k * len(problems)
        rows.append(
            {
                "temperature": temperature,
                "problems": len(problems),
                "samples": samples,
                "first_wrong_per_step": _share(totals["first_wrong"], totals["steps_reached"]),
                "arithmetic_slip_rate": _share(totals["arithmetic_steps"], totals["steps"]),
                "arithmetic_share_of_first_wrong": _share(totals["first_wrong_arithmetic"], totals["first_wrong"]),
                "wrong_solutions": _share(totals["first_wrong"], samples),
                "sampled_accuracy": _share(correct, samples),
                "root_mc_between": _share(sum(0 < mc < 1 for mc in mcs), len(mcs)),
                "root_mc_zero": _share(sum(mc == 0 for mc in mcs), len(mcs)),
                "root_mc_one": _share(sum(mc == 1 for mc in mcs), len(mcs)),
                "mean_steps": _share(totals["steps"], samples),
                "seconds": round(seconds, 1),
            }
        )
    return rows


COLUMNS = (
    ("temperature", "T"),
    ("first_wrong_per_step", "slip/step"),
    ("arithmetic_slip_rate", "arith steps"),
    ("arithmetic_share_of_first_wrong", "arith of 1st wrong"),
    ("wrong_solutions", "wrong sol."),
    ("sampled_accuracy", "sampled acc."),
    ("root_mc_between", "0<MC<1"),
    ("root_mc_one", "MC=1"),
    ("root_mc_zero", "MC=0"),
    ("seconds", "s"),
)


def sweep_table(rows: Sequence[dict]) -> str:
    """The rows as a Markdown table."""
    lines = ["| " + " | ".join(title for _, title in COLUMNS) + " |", "|" + "---|" * len(COLUMNS)]
    for row in rows:
        lines.append("| " + " | ".join("-" if row[key] is None else f"{row[key]:g}" for key, _ in COLUMNS) + " |")
    return "\n".join(lines)
