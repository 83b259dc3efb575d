"""Grading the solutions a search returns, and the accuracy of a (strategy, k) run."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from pipeline.grading import answers_equal_many
from pipeline.stats import bootstrap_ci
from prm.search.candidates import SearchResult


def grade_results(results: Sequence[SearchResult], golds: Sequence[str], kind: str) -> list[bool]:
    """Whether each returned solution is correct; an unfinished one, or one without an answer,
    always counts as wrong."""
    predictions = [r.answer if r.finished else None for r in results]
    return answers_equal_many(predictions, list(golds), kind)


def summarize_search(
    results: Sequence[SearchResult], golds: Sequence[str], kind: str, n_resamples: int = 2000, seed: int = 0
) -> dict:
    """{accuracy: {mean, lo, hi} (bootstrap over problems), finished_fraction, tokens_per_problem,
    n_problems, correct: per problem, in order (what a paired comparison of two k needs)}."""
    correct = np.asarray(grade_results(results, golds, kind), dtype=np.float64)
    mean, lo, hi = bootstrap_ci(correct, n_resamples=n_resamples, seed=seed)
    return {
        "accuracy": {"mean": mean, "lo": lo, "hi": hi},
        "finished_fraction": float(np.mean([r.finished for r in results])),
        "tokens_per_problem": float(np.mean([r.tokens_generated for r in results])),
        "n_problems": len(results),
        "correct": [bool(c) for c in correct],
    }


def paired_difference(
    rows: Sequence[dict], a: tuple[str, int], b: tuple[str, int], n_resamples: int = 2000, seed: int = 0
) -> dict | None:
    """Accuracy of row ``a`` = (strategy, k) minus row ``b``, paired per problem, with a 95%
    percentile bootstrap interval over problems: {mean, lo, hi, n_problems} (fractions), or None
    when either row, or its per-problem ``correct``, is missing.

    rows: make search's results.json rows ({strategy, k, correct: [bool] * P, ...}), every row over
    the same P problems in the same order (summarize_search writes them so)."""
    found = {(row["strategy"], row["k"]): row.get("correct") for row in rows}
    first, second = found.get(tuple(a)), found.get(tuple(b))
    if first is None or second is None:
        return None
    if len(first) != len(second):
        raise ValueError(f"paired_difference: {a} has {len(first)} problems, {b} has {len(second)}; expected the same")
    values = np.asarray(first, dtype=np.float64) - np.asarray(second, dtype=np.float64)
    mean, lo, hi = bootstrap_ci(values, n_resamples=n_resamples, seed=seed)
    return {"mean": mean, "lo": lo, "hi": hi, "n_problems": len(values)}


def vote_comparisons(rows: Sequence[dict], ks: Sequence[int], seed: int = 0) -> list[dict]:
    """What the PRM adds over counting: PRM-weighted voting minus majority voting at each k, on the
    same k samples (the whole-solution strategies share them), paired per problem.
    [{k, difference: paired_difference(...)}] for the ks where both rows exist."""
    out = []
    for k in ks:
        difference = paired_difference(rows, ("weighted_vote", k), ("majority", k), seed=seed)
        if difference is not None:
            out.append({"k": k, "difference": difference})
    return out
