"""How well the PRM ranks the sibling candidates a step-level search chooses between.

At an expansion of a correct prefix, best-of-k keeps the candidate the PRM scores highest. If
the candidates' per-step error rate is e and the PRM's AUC among the candidates of one prefix
(the sibling AUC) is a, it keeps a wrong step with probability about k e (1 - a), against e at
k = 1, when the right candidates are mostly copies of one text and the wrong ones distinct
(docs/search.md, "Sibling AUC"). This module measures a, e and the distinct texts per step on
the expansions a search made, labelled after the fact by the kind's exact first-error labeller
(prm.exact_check.FIRST_ERROR_LABELLERS): the labels are a measuring instrument that the
search's choices never read.

    sibling_labeller    the problems' kind -> its exact labeller, or None and why not
    label_expansions    a problem's expansions -> the labelled candidates of its correct prefixes
    expansion_counts    one expansion -> (correct-above-wrong wins, pairs, distinct texts, wrong, candidates)
    sibling_metrics     every problem's labelled expansions -> sibling AUC (bootstrap interval
                        over problems), distinct texts per step, e
    summarize_siblings  sibling_metrics, or nulls with a note where the candidates were not labelled
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Sequence

import numpy as np

from pipeline.records import Problem, SiblingCandidates
from pipeline.stats import bootstrap_statistic
from prm.exact_check import FIRST_ERROR_LABELLERS
from prm.search.candidates import Expansion


def sibling_labeller(
    problems: Sequence[Problem], kind: str, labellers: dict = FIRST_ERROR_LABELLERS
) -> tuple[Callable[[Problem, Sequence[str]], int] | None, str | None]:
    """The exact first-error labeller of ``kind`` if it can read every problem (it is tried on
    the empty solution of each), else (None, why not): the sibling metrics are then not measured."""
    labeller = labellers.get(kind)
    if labeller is None:
        return None, f"kind {kind!r} has no exact first-error labeller (prm.exact_check.FIRST_ERROR_LABELLERS)"
    for problem in problems:
        try:
            labeller(problem, [])
        except (KeyError, TypeError, ValueError) as error:
            return None, (
                f"the exact first-error labeller of kind {kind!r} cannot read problem {problem.problem_id!r} "
                f"({type(error).__name__}: {error})"
            )
    return labeller, None


def label_expansions(
    problem: Problem, expansions: Sequence[Expansion], labeller: Callable[[Problem, Sequence[str]], int]
) -> list[SiblingCandidates]:
    """The expansions whose prefix is correct (no wrong step), each with its candidates labelled:
    a candidate is correct when none of its steps is wrong (labeller(problem, prefix + steps) is
    -1 or past them). An expansion left with no candidate the search ranked is not counted.
    texts: per candidate the index of the first candidate with the same steps (the search scores
    equal candidates once and compares them by their exact step texts)."""
    labelled = []
    for expansion in expansions:
        if not expansion.steps or labeller(problem, expansion.prefix) >= 0:
            continue
        correct, texts, first_of = [], [], {}
        for index, steps in enumerate(expansion.steps):
            whole = [*expansion.prefix, *steps]
            first_wrong = labeller(problem, whole)
            correct.append(first_wrong < 0 or first_wrong >= len(whole))
            texts.append(first_of.setdefault(tuple(steps), index))
        labelled.append(SiblingCandidates([float(x) for x in expansion.scores], correct, texts))
    return labelled


def expansion_counts(
    scores: Sequence[float], correct: Sequence[bool], texts: Sequence[Hashable]
) -> tuple[float, int, int, int, int]:
    """One expansion's share of the metrics.

    scores:  (k,) the score the search ranked each candidate by
    correct: (k,) whether each candidate's step is right
    texts:   (k,) anything hashable per candidate, equal where the step texts are equal
    returns: (wins, pairs, distinct, wrong, k): wins = sum over (correct c, wrong w) pairs of
             [s_c > s_w] + 1/2 [s_c = s_w]; pairs = n_correct * n_wrong; distinct = the number of
             different texts; wrong = n_wrong
    """
    scores = np.asarray(scores, dtype=np.float64)
    correct = np.asarray(correct, dtype=bool)
    right, wrong = scores[correct], scores[~correct]
    wins = float((right[:, None] > wrong[None, :]).sum() + 0.5 * (right[:, None] == wrong[None, :]).sum())
    return wins, right.size * wrong.size, len(set(texts)), int(wrong.size), int(scores.size)


def sibling_metrics(
    per_problem: Sequence[Sequence[SiblingCandidates]], n_resamples: int = 2000, alpha: float = 0.05, seed: int = 0
) -> dict:
    """The sibling metrics of one (strategy, k) over every problem's labelled expansions.

    per_problem: (P,) per problem its expansions of correct prefixes (label_expansions)
    returns {auc: sum of wins / sum of pairs over every expansion holding a right and a wrong
    candidate (None without such pairs), interval: [lo, hi] percentile bootstrap over problems
    (each drawn problem brings all its expansions; None where no resample has a pair),
    n_expansions, n_expansions_with_pairs, n_pairs, distinct_per_step: mean over expansions of
    the different step texts among the candidates, candidates_per_step: mean candidates,
    error_rate: e = wrong candidates / candidates (None without expansions)}
    """
    counts = [[expansion_counts(e.scores, e.correct, e.texts) for e in expansions] for expansions in per_problem]
    rows = np.array([row for problem in counts for row in problem], dtype=np.float64).reshape(-1, 5)
    wins, pairs, distinct, wrong, candidates = rows.T
    n_expansions = len(rows)
    auc = float(wins.sum() / pairs.sum()) if pairs.sum() else None
    problem_wins = np.array([sum(row[0] for row in problem) for problem in counts], dtype=np.float64)
    problem_pairs = np.array([sum(row[1] for row in problem) for problem in counts], dtype=np.float64)

    def pooled_auc(drawn: np.ndarray) -> float | None:
        total = problem_pairs[drawn].sum()
        return float(problem_wins[drawn].sum() / total) if total else None

    lo, hi = bootstrap_statistic(pooled_auc, len(counts), n_resamples, alpha, seed) if auc is not None else (None, None)
    return {
        "auc": auc,
        "interval": [lo, hi],
        "n_expansions": n_expansions,
        "n_expansions_with_pairs": int((pairs > 0).sum()),
        "n_pairs": int(pairs.sum()),
        "distinct_per_step": float(distinct.mean()) if n_expansions else None,
        "candidates_per_step": float(candidates.mean()) if n_expansions else None,
        "error_rate": float(wrong.sum() / candidates.sum()) if n_expansions else None,
    }


def summarize_siblings(
    per_problem: Sequence[Sequence[SiblingCandidates] | None],
    not_labelled: str | None = None,
    n_resamples: int = 2000,
    seed: int = 0,
) -> dict:
    """sibling_metrics when every problem's expansions were labelled; otherwise the same keys
    with None (never 0) and a note saying why: ``not_labelled`` (sibling_labeller's reason), or
    some solutions recorded without labels."""
    if not_labelled is None and any(expansions is None for expansions in per_problem):
        not_labelled = "some solutions carry no labelled siblings (searched before they were recorded)"
    if not_labelled is not None:
        return {
            **dict.fromkeys(sibling_metrics([]), None),
            "interval": [None, None],
            "note": f"{not_labelled}: not measured",
        }
    return sibling_metrics([list(expansions) for expansions in per_problem], n_resamples=n_resamples, seed=seed)
