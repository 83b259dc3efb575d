"""The exact check of a PRM, on the policy's own samples of held-out problems labelled by their
kind's exact labeller (FIRST_ERROR_LABELLERS; the tiny world's knows every valid strategy): the
AUC of correct steps after a correct prefix against first wrong steps, and the slip-pair AUC (a
first wrong step that is an arithmetic slip against the same step with the right result, same
prefix). ``policy_solutions`` samples them; prm.validation reports the check beside the others."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

from pipeline.prompts import prompt_from_config, question_text
from pipeline.records import Problem
from pipeline.stats import grouped_bootstrap_auc, grouped_mean_interval
from pipeline.steps import split_steps
from pipeline.tinyworld.checker import corrected_step, first_wrong_step, solution_strategy

# Problem kind -> (problem, steps) -> index of the first wrong step or -1, where the kind's steps
# can be checked exactly (only the tiny world's: it knows every valid strategy). The exact check
# and the slip pairs skip samples of other kinds; make prm-bench labels the policy's samples with it.
FIRST_ERROR_LABELLERS: dict[str, Callable[[Problem, Sequence[str]], int]] = {"tiny": first_wrong_step}

# Problem kind -> (problem, steps) -> whether the steps' calculations are a whole valid solution,
# where the kind knows its valid solutions: what tells an answer stated too early from a wrong
# answer after a finished calculation (prm.search.wrong_steps).
COMPLETE_SOLUTION_TESTS: dict[str, Callable[[Problem, Sequence[str]], bool]] = {
    "tiny": lambda problem, steps: solution_strategy(problem, steps) is not None
}


@dataclass
class PolicySample:
    """One of the policy's samples of a problem: the question as the PRM reads it and the steps."""

    problem: Problem
    question: str
    steps: list[str]


@dataclass
class SlipPair:
    """A first wrong step that is an arithmetic slip and its correct counterpart under the same
    prefix (the same text with only the wrong result replaced by the right value).

    path: index into exact_paths' paths of the path that ends on the slip"""

    group: str
    question: str
    prefix: list[str]
    slip: str
    counterpart: str
    path: int


def slip_counterpart(
    problem: Problem, prefix: Sequence[str], step: str, labeller: Callable[[Problem, Sequence[str]], int]
) -> str | None:
    """The corrected text of ``step`` (pipeline.tinyworld.checker.corrected_step: each wrong result
    of an ``a op b = c`` replaced by its value) when the step is an arithmetic slip, that is when
    ``labeller`` finds that text right after ``prefix``; None when no calculation in it is wrong, or
    when it stays wrong once corrected (a wrong operand too). The one definition of a slip: the
    exact check's slip pairs, make mc-audit and the wrong steps a search chooses use it.

        prefix ["Ann buys 3 * 4 = 12 apples."], step "Ann has 5 + 12 = 18 apples."  ->  "Ann has 5 + 12 = 17 apples."
        prefix ["Ann buys 3 * 4 = 12 apples."], step "Ann has 6 + 12 = 19 apples."  ->  None (6 is a wrong operand)
    """
    corrected = corrected_step(step)
    if corrected is None or labeller(problem, [*prefix, corrected]) >= 0:
        return None
    return corrected


def exact_paths(
    samples: Sequence[PolicySample], labellers: dict = FIRST_ERROR_LABELLERS
) -> tuple[list[tuple[str, list[str]]], list[bool], list[str], list[SlipPair], int]:
    """The scored paths and exact labels of the exact check, and the slip pairs they hold.

    For every sample whose problem kind has a labeller: its steps up to and including the first
    wrong one (all of them when every step is right). Every step before the first wrong one is a
    correct step after a correct prefix (True); the first wrong step is False; steps after it are
    left out (their prefix is already wrong). A first wrong step that is a slip (slip_counterpart)
    makes a slip pair with its corrected text; a wrong calculation that stays wrong once corrected
    (a wrong operand too) is counted in the last value returned and makes none.
    Returns (paths [(question, path)], labels (one per step of every path, in order), the group
    (problem id) of each step, slip pairs, slips left out)."""
    paths, labels, groups, pairs, left_out = [], [], [], [], 0
    for sample in samples:
        labeller = labellers.get(sample.problem.kind)
        if labeller is None or not sample.steps:
            continue
        first = labeller(sample.problem, sample.steps)
        path = list(sample.steps) if first < 0 else list(sample.steps[: first + 1])
        group = sample.problem.problem_id
        paths.append((sample.question, path))
        labels.extend(k != first for k in range(len(path)))  # only a first wrong step (the path's last) is False
        groups.extend([group] * len(path))
        if first >= 0:
            counterpart = slip_counterpart(sample.problem, path[:-1], path[-1], labeller)
            if counterpart is not None:
                pairs.append(SlipPair(group, sample.question, path[:-1], path[-1], counterpart, len(paths) - 1))
            elif corrected_step(path[-1]) is not None:
                left_out += 1
    return paths, labels, groups, pairs, left_out


def pair_auc(
    slip: Sequence[float],
    counterpart: Sequence[float],
    groups: Sequence,
    n_resamples: int = 1000,
    alpha: float = 0.05,
    seed: int = 0,
) -> tuple[float | None, float | None, float | None]:
    """Share of pairs whose counterpart scores above its slip (ties 1/2), with a percentile-
    bootstrap interval that resamples groups (problems) and takes every pair of each drawn group.
    Returns (auc, lo, hi); None without pairs, lo and hi None with fewer than two groups."""
    slip = np.asarray(slip, dtype=np.float64)
    counterpart = np.asarray(counterpart, dtype=np.float64)
    wins = (counterpart > slip) + 0.5 * (counterpart == slip)
    return grouped_mean_interval(wins, groups, n_resamples, alpha, seed)


def matched_pairs(correct: Sequence[bool], groups: Sequence, depths: Sequence[int]) -> list[tuple[int, int]]:
    """(wrong, correct) step index pairs of the same group (problem) and depth (0-based step index).

    correct, groups, depths: (n,) per step. A first wrong step is compared only with correct steps
    that share its problem and its place in the solution, so the AUC over these pairs cannot be
    earned by telling easy problems or early steps from hard problems or late ones."""
    by_key: dict = {}
    for index, (right, group, depth) in enumerate(zip(correct, groups, depths)):
        by_key.setdefault((group, depth), ([], []))[bool(right)].append(index)
    return [(wrong, right) for wrongs, rights in by_key.values() for wrong in wrongs for right in rights]


def exact_check(
    scorer, samples: Sequence[PolicySample], labellers: dict = FIRST_ERROR_LABELLERS, seed: int = 0
) -> dict | None:
    """How well the PRM tells wrong steps from right ones by exact labels, on the policy's own samples.

    Returns {"exact": {auc (correct steps after a correct prefix above first wrong steps;
    Mann-Whitney, ties 1/2), interval (95%, problems resampled), n_correct, n_wrong, n_solutions,
    mean_correct, mean_wrong, matched {auc, interval, n_pairs: the same with each first wrong step
    against the correct steps of its problem at its depth, matched_pairs}}, "slip_pair": {auc
    (share of pairs whose counterpart scores above the slip, ties 1/2), interval (problems
    resampled), n_pairs, mean_slip, mean_counterpart, n_left_out}}, every score from one
    score_many call; auc and interval are None where a kind of step (or pair) is missing. None when no sample's kind has a labeller."""
    paths, labels, groups, pairs, left_out = exact_paths(samples, labellers)
    if not paths:
        return None
    rows = scorer.score_many(paths + [(pair.question, [*pair.prefix, pair.counterpart]) for pair in pairs])
    scores = np.array([u for row in rows[: len(paths)] for u in row], dtype=np.float64)
    correct = np.array(labels, dtype=bool)
    n_correct, n_wrong = int(correct.sum()), int((~correct).sum())
    auc, lo, hi = (
        grouped_bootstrap_auc(scores, correct, groups, seed=seed) if n_correct and n_wrong else (None, None, None)
    )
    depths = [depth for _, path in paths for depth in range(len(path))]
    matched = matched_pairs(correct, groups, depths)
    matched_value, matched_lo, matched_hi = pair_auc(
        scores[[wrong for wrong, _ in matched]],
        scores[[right for _, right in matched]],
        [groups[wrong] for wrong, _ in matched],
        seed=seed,
    )
    slip = np.array([rows[pair.path][-1] for pair in pairs], dtype=np.float64)
    counterpart = np.array([row[-1] for row in rows[len(paths) :]], dtype=np.float64)
    pair_value, pair_lo, pair_hi = pair_auc(slip, counterpart, [pair.group for pair in pairs], seed=seed)
    return {
        "exact": {
            "auc": auc,
            "interval": [lo, hi],
            "n_correct": n_correct,
            "n_wrong": n_wrong,
            "n_solutions": sum(
                sample.problem.kind in labellers for sample in samples
            ),  # every one checked, empty ones too
            "mean_correct": float(scores[correct].mean()) if n_correct else None,
            "mean_wrong": float(scores[~correct].mean()) if n_wrong else None,
            # each first wrong step against the correct steps of the same problem at the same depth
            "matched": {"auc": matched_value, "interval": [matched_lo, matched_hi], "n_pairs": len(matched)},
        },
        "slip_pair": {
            "auc": pair_value,
            "interval": [pair_lo, pair_hi],
            "n_pairs": len(pairs),
            "mean_slip": float(slip.mean()) if pairs else None,
            "mean_counterpart": float(counterpart.mean()) if pairs else None,
            "n_left_out": left_out,
            "examples": [
                {"slip": p.slip, "counterpart": p.counterpart, "slip_score": float(s), "counterpart_score": float(c)}
                for p, s, c in list(zip(pairs, slip, counterpart))[:5]
            ],
        },
    }


def policy_solutions(
    generator, problems: Sequence[Problem], format_config, n: int, temperature: float, max_new_tokens: int, seed: int
) -> list[PolicySample]:
    """n samples per problem from ``generator`` (one generate call), each beside its problem, in
    the problems' order."""
    kind = problems[0].kind if problems else "tiny"
    prompts = [
        prompt_from_config(p.question, kind, generator.tokenizer, format_config, p.meta.get("options"))
        for p in problems
    ]
    outputs = generator.generate(prompts, n=n, temperature=temperature, max_new_tokens=max_new_tokens, seed=seed)
    return [
        PolicySample(p, question_text(p.question, p.meta.get("options")), split_steps(c.text, format_config.separator))
        for p, completions in zip(problems, outputs)
        for c in completions
    ]
