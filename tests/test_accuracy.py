"""eval.accuracy against brute-force references and hand examples."""

from __future__ import annotations

import itertools
from fractions import Fraction
from math import comb

import numpy as np
import pytest

from eval.accuracy import (
    ProblemSamples,
    majority_vote,
    majority_vote_index,
    pass_at_k,
    pass_at_k_range,
    per_problem_scores,
    summarize_accuracy,
)
from pipeline.stats import bootstrap_ci, wilson_interval


def brute_force_pass_at_k(n: int, c: int, k: int) -> float:
    """Fraction of the k-subsets of n samples (the first c correct) holding a correct one."""
    subsets = list(itertools.combinations(range(n), k))
    return sum(any(i < c for i in subset) for subset in subsets) / len(subsets)


@pytest.mark.parametrize("n", [1, 2, 5, 8, 10])
def test_pass_at_k_matches_enumeration_of_subsets(n):
    for c in range(n + 1):
        for k in range(1, n + 1):
            assert pass_at_k(n, c, k) == pytest.approx(brute_force_pass_at_k(n, c, k), abs=1e-12)


def test_pass_at_k_is_stable_where_binomials_overflow():
    n, c, k = 2000, 3, 500
    exact = 1 - comb(n - c, k) / comb(n, k)  # Python ints: exact
    assert pass_at_k(n, c, k) == pytest.approx(exact, rel=1e-10)
    assert pass_at_k(8, 2, 1) == pytest.approx(2 / 8)


def test_pass_at_k_rejects_bad_arguments():
    with pytest.raises(ValueError, match="k must be"):
        pass_at_k(4, 1, 5)
    with pytest.raises(ValueError, match="k must be"):
        pass_at_k(4, 1, 0)
    with pytest.raises(ValueError, match="c must be"):
        pass_at_k(4, 5, 2)


def test_majority_vote_counts_and_breaks_ties_by_first_seen():
    assert majority_vote(["3", "5", "5", None, "3", "5"]) == "5"
    assert majority_vote(["7", "4", "4", "7"]) == "7"  # tie: "7" seen first
    assert majority_vote(["4", "7", "7", "4"]) == "4"
    assert majority_vote([None, None]) is None
    assert majority_vote([]) is None


def test_majority_vote_with_weights_and_key():
    answers = ["12", "12", "10", None]
    assert majority_vote(answers, weights=[0.2, 0.3, 0.9, 5.0]) == "10"  # None's weight never votes
    assert majority_vote(answers, weights=[0.5, 0.3, 0.9, 0.0]) == "10"
    assert majority_vote(answers, weights=[0.5, 0.5, 0.9, 0.0]) == "12"
    assert majority_vote(answers, weights=[0.25, 0.5, 0.75, 0.0]) == "12"  # exact tie: first seen
    assert majority_vote(["a", "b", "b"], weights=[2.0, 1.0, 1.0]) == "a"  # tie 2 vs 2: first seen
    # the key buckets "1/2", "0.5" and " 0.50" together; the first-seen spelling is returned
    key = lambda a: Fraction(a.strip())  # noqa: E731 - a tiny normaliser for the test
    assert majority_vote(["3", "1/2", "0.5", " 0.50", "3"], key=key) == "1/2"
    assert majority_vote_index(["3", "1/2", "0.5", " 0.50", "3"], key=key) == 1
    with pytest.raises(ValueError, match="weights"):
        majority_vote(["a"], weights=[1.0, 2.0])


def test_per_problem_scores_and_inferred_majority():
    problems = [
        ProblemSamples("p0", [True, False, True, False], ["4", "5", "4", "6"], majority_correct=True),
        ProblemSamples("p1", [False, False, True, False], ["5", "5", "4", None]),  # vote "5": wrong
        ProblemSamples("p2", [False, False], [None, None]),  # nobody answered: maj wrong
        ProblemSamples("p3", [True, True, False], ["4.0", "4", "9"]),  # inferred with key
    ]
    scores = per_problem_scores(problems, key=lambda a: float(a))
    assert scores["problem_id"] == ["p0", "p1", "p2", "p3"]
    np.testing.assert_array_equal(scores["k"], [4, 4, 2, 3])
    np.testing.assert_allclose(scores["pass@1"], [0.5, 0.25, 0.0, 2 / 3])
    np.testing.assert_allclose(scores["pass@k"], [1.0, 1.0, 0.0, 1.0])
    np.testing.assert_allclose(scores["maj@k"], [1.0, 0.0, 0.0, 1.0])
    with pytest.raises(ValueError, match="'bad'"):
        per_problem_scores([ProblemSamples("bad", [True], ["1", "2"])])


def test_bootstrap_ci_contains_mean_is_deterministic_and_shrinks():
    rng = np.random.default_rng(1)
    small = (rng.random(50) < 0.4).astype(float)
    large = (rng.random(2000) < 0.4).astype(float)
    mean, lo, hi = bootstrap_ci(small, n_resamples=2000, seed=3)
    assert mean == pytest.approx(small.mean())
    assert lo <= mean <= hi and lo < hi
    assert bootstrap_ci(small, n_resamples=2000, seed=3) == (mean, lo, hi)
    assert bootstrap_ci(small, n_resamples=2000, seed=4) != (mean, lo, hi)
    large_mean, large_lo, large_hi = bootstrap_ci(large, n_resamples=2000, seed=3)
    assert large_lo <= large_mean <= large_hi
    assert (large_hi - large_lo) < 0.5 * (hi - lo)  # width ~ 1/sqrt(P): 40x the data, ~1/6 the width
    # about the normal-theory 95% interval of a mean of Bernoullis
    se = large.std() / np.sqrt(large.size)
    assert large_hi - large_lo == pytest.approx(2 * 1.96 * se, rel=0.15)
    assert bootstrap_ci(np.array([0.7])) == (0.7, 0.7, 0.7)
    with pytest.raises(ValueError, match="NaN"):
        bootstrap_ci(np.array([0.1, np.nan]))


def test_wilson_interval_hand_values():
    p, lo, hi = wilson_interval(8, 10)
    assert p == 0.8
    assert (lo, hi) == pytest.approx((0.4902, 0.9433), abs=1e-4)  # textbook values, z=1.96
    assert wilson_interval(0, 20)[1] == 0.0 and wilson_interval(20, 20)[2] == 1.0
    assert 0.0 < wilson_interval(0, 20)[2] < 0.2


def test_summarize_accuracy_shape_and_values():
    problems = [
        ProblemSamples(f"p{i}", [i % 2 == 0, i % 3 == 0], [str(i), str(i)], majority_correct=i % 2 == 0)
        for i in range(12)
    ]
    summary = summarize_accuracy(problems, greedy_correct=[i % 4 == 0 for i in range(12)], n_resamples=500)
    assert set(summary) == {"greedy_pass@1", "pass@1", "maj@k", "pass@k", "n_problems", "k"}
    assert summary["n_problems"] == 12 and summary["k"] == 2
    assert summary["greedy_pass@1"]["mean"] == pytest.approx(3 / 12)
    assert summary["pass@1"]["mean"] == pytest.approx((6 + 4) / 24)
    assert summary["maj@k"]["mean"] == pytest.approx(6 / 12)
    assert summary["pass@k"]["mean"] == pytest.approx(8 / 12)
    for name in ("greedy_pass@1", "pass@1", "maj@k", "pass@k"):
        assert summary[name]["lo"] <= summary[name]["mean"] <= summary[name]["hi"]
    by_id = summarize_accuracy(problems, greedy_correct={f"p{i}": i % 4 == 0 for i in range(12)}, n_resamples=500)
    assert by_id == summary
    assert "greedy_pass@1" not in summarize_accuracy(problems, n_resamples=100)
    with pytest.raises(ValueError, match="same k"):
        summarize_accuracy(problems + [ProblemSamples("odd", [True], ["1"])], n_resamples=10)
    with pytest.raises(ValueError, match="greedy"):
        summarize_accuracy(problems, greedy_correct=[True], n_resamples=10)


def test_pass_at_k_range_matches_subset_enumeration_and_exact_fractions():
    samples, correct = [6, 6, 7], [0, 2, 5]
    curve = pass_at_k_range(samples, correct, k_max=10)
    assert len(curve) == 6  # up to the fewest samples
    for k, value in enumerate(curve, start=1):
        brute = []
        for n, c in zip(samples, correct):
            subsets = list(itertools.combinations([True] * c + [False] * (n - c), k))
            brute.append(sum(any(s) for s in subsets) / len(subsets))
        assert value == pytest.approx(float(np.mean(brute)), rel=1e-12)
    # n = 64 where C(n, k) reaches 1e18: the product form keeps full precision
    big = pass_at_k_range([64], [3], k_max=64)
    for k in (1, 30, 61, 62, 64):
        exact = 1 - Fraction(comb(61, k), comb(64, k))
        assert big[k - 1] == pytest.approx(float(exact), rel=1e-12)
    with pytest.raises(ValueError, match="k_max"):
        pass_at_k_range([4], [1], k_max=0)
