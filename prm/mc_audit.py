"""What the Monte Carlo path can teach a PRM about slips, measured exactly where the problems' kind
has an exact first-wrong-step labeller (prm.exact_check.FIRST_ERROR_LABELLERS: the tiny world).
The labeller is a measuring instrument here: nothing that builds the PRM's data reads this module.

``slip_pair_mc``: the Monte Carlo values of the exact check's slip pairs (a first wrong step that is
an arithmetic slip, and the same step with the right result, after the same clean prefix) at each
rollout temperature, estimated as MCTS estimates them (``make_rollout_fn``: k rollouts from the
prefix and the step, graded). The share of pairs whose counterpart's MC exceeds its slip's (ties
1/2) is the slip-pair AUC of the MC values themselves: the most a PRM trained on those values can
learn about slips; MC(slip) > 0 is a slip the binary search does not find as a first error (its
value is not 0), so it is labelled above 0 and the steps after it can be kept.

``data_audit``: the PRM's training examples (make augment's records) by origin (mcts, augmented):
how many have a prefix holding a wrong step (an arithmetic slip, or any wrong step by the exact
labeller) and what labels those carry, and the clean slip/counterpart sibling pairs the data holds
(two examples of one problem after the same clean prefix, one an arithmetic slip, the other its
corrected text) with the AUC of their labels. docs/prm.md, "What the Monte Carlo path teaches".
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np

from pipeline.records import PRMExample, Problem
from pipeline.rollouts.mcts import mc_value
from pipeline.rollouts.temperature import problems_rollout_fn
from pipeline.tinyworld.checker import arithmetic_errors
from prm.exact_check import SlipPair, pair_auc, slip_counterpart

FirstWrong = Callable[[Problem, Sequence[str]], int]


def _mean(values: Sequence[float]) -> float | None:
    return round(float(np.mean(values)), 4) if len(values) else None


def _share(part: float, whole: float) -> float | None:
    return round(part / whole, 4) if whole else None


def mc_pair_row(slip_mc: Sequence[float], counterpart_mc: Sequence[float], groups: Sequence, seed: int = 0) -> dict:
    """The MC values of n slip pairs summarised.

    slip_mc, counterpart_mc: (n,) MC values in [0, 1] of each pair's slip and counterpart
    groups:                  (n,) each pair's problem (the bootstrap resamples problems)
    Returns {n_pairs, mean_mc_slip, mean_mc_counterpart, slip_mc_zero (share of slips with MC 0:
    found as a first error), slip_mc_one, counterpart_mc_zero, auc (share of pairs with
    MC(counterpart) > MC(slip), ties 1/2), interval (95%, problems resampled)}."""
    slip = np.asarray(slip_mc, dtype=np.float64)
    counterpart = np.asarray(counterpart_mc, dtype=np.float64)
    auc, lo, hi = pair_auc(slip, counterpart, groups, seed=seed)
    n = len(slip)
    return {
        "n_pairs": n,
        "mean_mc_slip": _mean(slip),
        "mean_mc_counterpart": _mean(counterpart),
        "slip_mc_zero": _share(int((slip == 0).sum()), n),
        "slip_mc_one": _share(int((slip == 1).sum()), n),
        "counterpart_mc_zero": _share(int((counterpart == 0).sum()), n),
        "auc": None if auc is None else round(auc, 4),
        "interval": [None if lo is None else round(lo, 4), None if hi is None else round(hi, 4)],
    }


def slip_pair_mc(
    generator,
    pairs: Sequence[SlipPair],
    problems: Sequence[Problem],
    config,
    temperatures: Sequence[float],
    k: int,
    seed: int,
) -> list[dict]:
    """One row per temperature (mc_pair_row's fields and ``temperature``) of the MC values of
    ``pairs``' slips and counterparts, each from ``k`` rollouts of the prefix and the step at that
    temperature, drawn as MCTS draws them (config.format, config.generation.max_new_tokens,
    config.mcts.top_p; one stream per prefix from ``seed``: the same seeds at every temperature).
    problems: the pairs' problems (a pair's ``group`` is its problem id)."""
    by_id = {p.problem_id: i for i, p in enumerate(problems)}
    missing = sorted({pair.group for pair in pairs if pair.group not in by_id})
    if missing:
        raise ValueError(f"slip_pair_mc: pairs of problems not given: {missing[:3]}")
    requests = []
    for pair in pairs:
        index = by_id[pair.group]
        requests += [(index, (*pair.prefix, pair.slip)), (index, (*pair.prefix, pair.counterpart))]
    rows = []
    for temperature in temperatures:
        rollout_fn = problems_rollout_fn(generator, problems, config, k, temperature, seed)
        values = [mc_value(rollouts) for rollouts in rollout_fn(requests)] if requests else []
        row = mc_pair_row(values[0::2], values[1::2], [pair.group for pair in pairs], seed=seed)
        rows.append({"temperature": temperature, **row})
    return rows


def data_audit(
    examples: Sequence[PRMExample], problems: dict[str, Problem], first_wrong: FirstWrong, seed: int = 0
) -> dict:
    """The PRM training examples audited by origin (and "all").

    examples: PRM examples (make augment's prm_train.jsonl and prm_val.jsonl)
    problems: problem id -> Problem (its exact labeller needs the problem); examples of problems
              not given are counted in ``unchecked`` and left out
    Returns {origin: {examples, prefix_arithmetic_slip (share whose prefix holds a step with a
    wrong calculation), prefix_wrong (share whose prefix holds a wrong step by the labeller),
    labels_after_wrong_prefix {mean, share_one, share_above_zero}, labels_after_clean_prefix
    {mean, share_one, share_above_zero}, clean_pairs (mc_pair_row of the labels of clean
    slip/counterpart sibling pairs: same problem and clean prefix, one step a slip, the other its
    corrected text; the labels are merged per distinct path as the PRM merges them: their mean)}},
    plus "unchecked"."""
    by_origin: dict[str, list[PRMExample]] = {}
    unchecked = 0
    for example in examples:
        if example.problem_id not in problems:
            unchecked += 1
            continue
        by_origin.setdefault(example.origin, []).append(example)
        by_origin.setdefault("all", []).append(example)
    report: dict = {"unchecked": unchecked}
    for origin, rows in sorted(by_origin.items()):
        wrong_prefix, arithmetic_prefix = [], 0
        after_wrong, after_clean = [], []
        labels: dict[tuple[str, tuple[str, ...], str], list[float]] = {}
        for example in rows:
            problem = problems[example.problem_id]
            arithmetic_prefix += bool(arithmetic_errors(example.prefix_steps))
            wrong = first_wrong(problem, example.prefix_steps) >= 0
            wrong_prefix.append(wrong)
            (after_wrong if wrong else after_clean).append(example.label)
            if not wrong:
                labels.setdefault((example.problem_id, tuple(example.prefix_steps), example.step), []).append(
                    example.label
                )
        slip, counterpart, groups = [], [], []
        for (problem_id, prefix, step), values in labels.items():
            corrected = slip_counterpart(problems[problem_id], prefix, step, first_wrong)
            other = labels.get((problem_id, prefix, corrected)) if corrected is not None else None
            if other is not None:
                slip.append(float(np.mean(values)))
                counterpart.append(float(np.mean(other)))
                groups.append(problem_id)
        n = len(rows)
        report[origin] = {
            "examples": n,
            "prefix_arithmetic_slip": _share(arithmetic_prefix, n),
            "prefix_wrong": _share(sum(wrong_prefix), n),
            "labels_after_wrong_prefix": _label_summary(after_wrong),
            "labels_after_clean_prefix": _label_summary(after_clean),
            "clean_pairs": mc_pair_row(slip, counterpart, groups, seed=seed),
        }
    return report


def _label_summary(labels: Sequence[float]) -> dict:
    values = np.asarray(labels, dtype=np.float64)
    n = len(values)
    return {
        "n": n,
        "mean": _mean(values),
        "share_one": _share(int((values == 1).sum()), n),
        "share_above_zero": _share(int((values > 0).sum()), n),
    }
