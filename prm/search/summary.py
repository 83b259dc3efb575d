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
