"""Accuracy metrics of the evaluation stage (paper 5, Table 2): pass@1, pass@k, maj@k and CIs.

Pure functions over graded samples; numpy only. The formulas are written out in docs/metrics.md.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Mapping, Sequence
from dataclasses import dataclass

import numpy as np

from pipeline.stats import bootstrap_ci


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k estimate from n samples of which c are correct (Chen et al. 2021).

    pass@k = 1 - C(n-c, k) / C(n, k), computed as 1 - prod_{i=n-c+1..n} (1 - k/i), which never
    forms a binomial coefficient and so neither overflows nor loses precision.
    n: samples drawn, c: correct among them (0 <= c <= n), k: budget (1 <= k <= n).
    """
    if n < 1:
        raise ValueError(f"pass_at_k: n must be >= 1, got n={n}")
    if not 0 <= c <= n:
        raise ValueError(f"pass_at_k: c must be in [0, n={n}], got c={c}")
    if not 1 <= k <= n:
        raise ValueError(f"pass_at_k: k must be in [1, n={n}], got k={k}")
    if n - c < k:  # every k-subset holds a correct sample
        return 1.0
    return float(1.0 - np.prod(1.0 - k / np.arange(n - c + 1, n + 1, dtype=np.float64)))


def pass_at_k_range(samples: Sequence[int], correct: Sequence[int], k_max: int) -> list[float]:
    """Mean over problems of the unbiased pass@k (pass_at_k) for k = 1..min(k_max, fewest samples).

    samples, correct: (P,) each problem's n and c. returns: [pass@1, pass@2, ...], each in [0, 1]
    """
    if len(samples) != len(correct) or not len(samples):
        raise ValueError(f"pass_at_k_range: {len(samples)} sample counts for {len(correct)} correct counts")
    if k_max < 1:
        raise ValueError(f"pass_at_k_range: k_max must be >= 1, got {k_max}")
    top = min(k_max, min(samples))
    return [float(np.mean([pass_at_k(n, c, k) for n, c in zip(samples, correct)])) for k in range(1, top + 1)]


def majority_vote_index(
    answers: Sequence[str | None],
    weights: Sequence[float] | None = None,
    key: Callable[[str], Hashable] | None = None,
) -> int | None:
    """Index of the first sample in the winning answer bucket, or None if no sample answered.

    answers: (k,) extracted final answers; None = no answer, never votes.
    weights: (k,) vote weight per sample (e.g. a PRM score); None = one vote each.
    key:     maps an answer to its bucket (e.g. the grader's normaliser); None = the string itself.
    The bucket with the highest total weight wins; ties go to the bucket seen first.
    """
    if weights is not None and len(weights) != len(answers):
        raise ValueError(f"majority_vote: {len(weights)} weights for {len(answers)} answers; expected one per answer")
    totals: dict[Hashable, float] = {}
    first_index: dict[Hashable, int] = {}
    for i, answer in enumerate(answers):
        if answer is None:
            continue
        bucket = key(answer) if key is not None else answer
        if bucket is None:  # the normaliser could not read it: same as no answer
            continue
        weight = 1.0 if weights is None else float(weights[i])
        if bucket not in totals:
            totals[bucket] = 0.0
            first_index[bucket] = i
        totals[bucket] += weight
    if not totals:
        return None
    # dicts keep insertion order and max() returns the first maximum: first-seen wins ties
    winner = max(totals, key=totals.__getitem__)
    return first_index[winner]


def majority_vote(
    answers: Sequence[str | None],
    weights: Sequence[float] | None = None,
    key: Callable[[str], Hashable] | None = None,
) -> str | None:
    """Majority (or weighted-majority) answer: the first-seen answer of the winning bucket.

    answers: (k,) extracted final answers, None = no answer. weights: (k,) or None. key: bucket map.
    Returns None when no sample gave an answer. See majority_vote_index for the rule.
    """
    index = majority_vote_index(answers, weights, key)
    return None if index is None else answers[index]


@dataclass
class ProblemSamples:
    """The k graded samples of one problem.

    correct:          (k,) whether sample i's final answer matches the gold answer
    answers:          (k,) sample i's extracted final answer, None if it gave none
    majority_correct: whether the majority-voted answer matches the gold answer; None = infer it
                      as the correctness of the first sample in the winning bucket (False if no
                      sample answered)
    """

    problem_id: str
    correct: list[bool]
    answers: list[str | None]
    majority_correct: bool | None = None


def per_problem_scores(
    problems: Sequence[ProblemSamples],
    key: Callable[[str], Hashable] | None = None,
) -> dict[str, np.ndarray | list[str]]:
    """Per-problem accuracy over each problem's own k = len(correct) samples.

    problems: (P,) graded samples; key: bucket map for inferring majority_correct when it is None.
    Returns {"problem_id": [P], "k": (P,) int, "pass@1": (P,) mean of correct,
             "pass@k": (P,) 1.0 if any sample is correct else 0.0, "maj@k": (P,) 0/1}.
    """
    ids: list[str] = []
    ks = np.zeros(len(problems), dtype=np.int64)
    pass1 = np.zeros(len(problems), dtype=np.float64)
    passk = np.zeros(len(problems), dtype=np.float64)
    majk = np.zeros(len(problems), dtype=np.float64)
    for p, sample in enumerate(problems):
        k = len(sample.correct)
        if k == 0:
            raise ValueError(f"problem {sample.problem_id!r}: no samples (correct is empty)")
        if len(sample.answers) != k:
            raise ValueError(
                f"problem {sample.problem_id!r}: {len(sample.answers)} answers for {k} correctness flags; expected equal"
            )
        majority_correct = sample.majority_correct
        if majority_correct is None:
            winner = majority_vote_index(sample.answers, key=key)
            majority_correct = winner is not None and bool(sample.correct[winner])
        ids.append(sample.problem_id)
        ks[p] = k
        n_correct = int(sum(bool(x) for x in sample.correct))
        pass1[p] = n_correct / k
        passk[p] = pass_at_k(k, n_correct, k)
        majk[p] = float(majority_correct)
    return {"problem_id": ids, "k": ks, "pass@1": pass1, "pass@k": passk, "maj@k": majk}


def summarize_accuracy(
    problems: Sequence[ProblemSamples],
    greedy_correct: Sequence[bool] | Mapping[str, bool] | None = None,
    key: Callable[[str], Hashable] | None = None,
    n_resamples: int = 2000,
    alpha: float = 0.05,
    seed: int = 0,
) -> dict:
    """Table-2 accuracy of one model on one benchmark, with bootstrap CIs over problems.

    problems:       (P,) graded samples, the same k for every problem
    greedy_correct: (P,) greedy-decoding correctness in the order of problems, or a mapping
                    problem_id -> bool covering them; None = no greedy row
    Returns {"greedy_pass@1"?: {mean, lo, hi}, "pass@1": {...}, "maj@k": {...}, "pass@k": {...},
             "n_problems": P, "k": k}. Every metric uses the same seed, so their resamples are
    the same problems (paired), and so are two models' when both are scored on the same problems.
    """
    if not problems:
        raise ValueError("summarize_accuracy: no problems")
    scores = per_problem_scores(problems, key=key)
    ks = scores["k"]
    if np.any(ks != ks[0]):
        odd = int(np.flatnonzero(ks != ks[0])[0])
        raise ValueError(
            f"summarize_accuracy: problem {scores['problem_id'][odd]!r} has {ks[odd]} samples, "
            f"problem {scores['problem_id'][0]!r} has {ks[0]}; expected the same k for all"
        )

    def interval(values: np.ndarray) -> dict[str, float]:
        mean, lo, hi = bootstrap_ci(values, n_resamples=n_resamples, alpha=alpha, seed=seed)
        return {"mean": mean, "lo": lo, "hi": hi}

    summary: dict = {}
    if greedy_correct is not None:
        if isinstance(greedy_correct, Mapping):
            missing = [pid for pid in scores["problem_id"] if pid not in greedy_correct]
            if missing:
                raise ValueError(f"summarize_accuracy: greedy_correct has no entry for problem {missing[0]!r}")
            greedy = [greedy_correct[pid] for pid in scores["problem_id"]]
        else:
            greedy = list(greedy_correct)
            if len(greedy) != len(problems):
                raise ValueError(
                    f"summarize_accuracy: {len(greedy)} greedy results for {len(problems)} problems; expected one each"
                )
        summary["greedy_pass@1"] = interval(np.asarray(greedy, dtype=np.float64))
    for name in ("pass@1", "maj@k", "pass@k"):
        summary[name] = interval(scores[name])
    summary["n_problems"] = len(problems)
    summary["k"] = int(ks[0])
    return summary
