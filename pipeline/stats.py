"""Statistics every stage reports with: percentile-bootstrap intervals, the Wilson interval and
the Mann-Whitney AUC. Pure numpy functions; the formulas are in docs/metrics.md.

Neutral ground: the PRM's validation, guided search and the evaluation all use these, so none of
them imports another for its statistics.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from statistics import NormalDist

import numpy as np

# Rows of the (resamples, problems) index matrix drawn at once: bounds memory at ~32 MB.
_BOOTSTRAP_CELLS_PER_CHUNK = 1 << 22


def bootstrap_ci(
    values: np.ndarray,
    n_resamples: int = 2000,
    alpha: float = 0.05,
    seed: int = 0,
) -> tuple[float, float, float]:
    """Percentile bootstrap CI of the mean of per-problem values, resampling problems.

    values: (P,) one score per problem (e.g. pass@1 in [0, 1]).
    Returns (mean, lo, hi): the sample mean and the alpha/2, 1-alpha/2 quantiles of the means of
    n_resamples resamples of P problems drawn with replacement. Same inputs and seed, same output.
    """
    values = np.asarray(values, dtype=np.float64)
    if values.ndim != 1 or values.size == 0:
        raise ValueError(f"bootstrap_ci: values must be a non-empty 1-D array, got shape {values.shape}")
    if not np.all(np.isfinite(values)):
        raise ValueError("bootstrap_ci: values contain NaN or inf; drop unscored problems first")
    if n_resamples < 1:
        raise ValueError(f"bootstrap_ci: n_resamples must be >= 1, got {n_resamples}")
    if not 0.0 < alpha < 1.0:
        raise ValueError(f"bootstrap_ci: alpha must be in (0, 1), got {alpha}")
    n = values.size
    rng = np.random.default_rng(seed)
    rows = max(1, _BOOTSTRAP_CELLS_PER_CHUNK // n)
    means = np.empty(n_resamples, dtype=np.float64)
    for start in range(0, n_resamples, rows):
        stop = min(start + rows, n_resamples)
        index = rng.integers(0, n, size=(stop - start, n))
        means[start:stop] = values[index].mean(axis=1)
    lo, hi = np.quantile(means, [alpha / 2, 1 - alpha / 2])
    return float(values.mean()), float(lo), float(hi)


def wilson_interval(successes: int, n: int, alpha: float = 0.05) -> tuple[float, float, float]:
    """Wilson score interval of one binomial proportion.

    successes of n trials (0 <= successes <= n, n >= 1). Returns (p_hat, lo, hi) with
    centre (p + z^2/2n) / (1 + z^2/n), half-width z sqrt(p(1-p)/n + z^2/4n^2) / (1 + z^2/n),
    z = Phi^-1(1 - alpha/2).
    """
    if n < 1:
        raise ValueError(f"wilson_interval: n must be >= 1, got {n}")
    if not 0 <= successes <= n:
        raise ValueError(f"wilson_interval: successes must be in [0, n={n}], got {successes}")
    z = NormalDist().inv_cdf(1 - alpha / 2)
    p = successes / n
    denominator = 1 + z * z / n
    centre = (p + z * z / (2 * n)) / denominator
    half_width = z * np.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / denominator
    # at 0 or n successes the bound is exactly 0 or 1; rounding would leave ~1e-17
    lo = 0.0 if successes == 0 else max(0.0, centre - half_width)
    hi = 1.0 if successes == n else min(1.0, centre + half_width)
    return float(p), float(lo), float(hi)


def mann_whitney_auc(scores: Sequence[float], positive: Sequence[bool]) -> float:
    """Area under the ROC curve: P(score of a positive > score of a negative), ties counting 1/2.

    Computed from average ranks (Mann-Whitney U): AUC = (R_pos - n_pos (n_pos + 1) / 2) / (n_pos n_neg).
    NaN when either class is empty.
    """
    scores = np.asarray(scores, dtype=np.float64)
    positive = np.asarray(positive, dtype=bool)
    n_pos, n_neg = int(positive.sum()), int((~positive).sum())
    if n_pos == 0 or n_neg == 0:
        return float("nan")
    order = np.argsort(scores, kind="mergesort")
    sorted_scores = scores[order]
    ranks = np.empty(len(scores), dtype=np.float64)
    # Tied scores share the mean of the ranks they span (1-based).
    _, starts, counts = np.unique(sorted_scores, return_index=True, return_counts=True)
    mean_ranks = starts + (counts + 1) / 2.0
    ranks[order] = np.repeat(mean_ranks, counts)
    rank_sum = ranks[positive].sum()
    return float((rank_sum - n_pos * (n_pos + 1) / 2.0) / (n_pos * n_neg))


def grouped_bootstrap_auc(
    scores: Sequence[float],
    positive: Sequence[bool],
    groups: Sequence,
    n_resamples: int = 1000,
    alpha: float = 0.05,
    seed: int = 0,
) -> tuple[float, float | None, float | None]:
    """Mann-Whitney AUC with a percentile-bootstrap interval that resamples groups (problems), not
    items: a problem's steps are not independent of each other.

    scores, positive, groups: (N,) aligned. Returns (auc, lo, hi); lo and hi are None when fewer
    than two groups exist, and resamples that lack either class are skipped.
    """
    scores = np.asarray(scores, dtype=np.float64)
    positive = np.asarray(positive, dtype=bool)
    auc = mann_whitney_auc(scores, positive)
    members: dict = {}
    for index, group in enumerate(groups):
        members.setdefault(group, []).append(index)
    blocks = [np.asarray(rows) for rows in members.values()]
    if len(blocks) < 2:
        return auc, None, None
    rng = np.random.default_rng(seed)
    values = []
    for _ in range(n_resamples):
        rows = np.concatenate([blocks[i] for i in rng.integers(0, len(blocks), size=len(blocks))])
        value = mann_whitney_auc(scores[rows], positive[rows])
        if not np.isnan(value):
            values.append(value)
    if not values:
        return auc, None, None
    lo, hi = np.quantile(values, [alpha / 2, 1 - alpha / 2])
    return auc, float(lo), float(hi)


def bootstrap_statistic(
    statistic: Callable[[np.ndarray], float | None], n: int, n_resamples: int = 1000, alpha: float = 0.05, seed: int = 0
) -> tuple[float | None, float | None]:
    """Percentile-bootstrap interval of any statistic of n items (e.g. an F1 that is no mean).

    statistic: (index array of length n, drawn with replacement) -> value, or None where the
    resample cannot give one (such resamples are skipped). Returns (lo, hi); (None, None) when
    no resample gave a value.
    """
    if n < 1:
        raise ValueError(f"bootstrap_statistic: n must be >= 1, got {n}")
    rng = np.random.default_rng(seed)
    values = [
        value for value in (statistic(rng.integers(0, n, size=n)) for _ in range(n_resamples)) if value is not None
    ]
    if not values:
        return None, None
    lo, hi = np.quantile(values, [alpha / 2, 1 - alpha / 2])
    return float(lo), float(hi)


def grouped_mean_interval(
    values: Sequence[float], groups: Sequence, n_resamples: int = 1000, alpha: float = 0.05, seed: int = 0
) -> tuple[float | None, float | None, float | None]:
    """The mean of per-item values with a percentile-bootstrap interval that resamples groups
    (problems) and takes every item of each drawn group.

    values: (n,) finite; groups: (n,) each item's group. Returns (mean, lo, hi); (None, None, None)
    without items, lo and hi None with fewer than two groups."""
    values = np.asarray(values, dtype=np.float64)
    if values.size == 0:
        return None, None, None
    members: dict = {}
    for index, group in enumerate(groups):
        members.setdefault(group, []).append(index)
    blocks = [np.asarray(rows) for rows in members.values()]
    if len(blocks) < 2:
        return float(values.mean()), None, None
    lo, hi = bootstrap_statistic(
        lambda drawn: float(values[np.concatenate([blocks[i] for i in drawn])].mean()),
        len(blocks),
        n_resamples,
        alpha,
        seed,
    )
    return float(values.mean()), lo, hi


def pool_intervals(estimates: Sequence[dict], alpha: float = 0.05) -> dict:
    """One figure measured on S independent replicates (the seeds of make experiment, each on its
    own problems), pooled with equal weights: the mean of the S estimates, with the normal interval
    of that mean built from each replicate's own (1 - alpha) interval.

    estimates: S dicts {"mean", "lo", "hi"}, each replicate's estimate and its interval (e.g. a
               percentile bootstrap over its problems); every one finite, lo <= hi
    returns:   {"mean": m = (1/S) sum_s m_s, "lo", "hi": m -/+ z se, "se": sqrt(sum_s se_s^2) / S
               with se_s = (hi_s - lo_s) / (2 z), z = the standard normal's 1 - alpha/2 quantile,
               "seeds": S, "per_seed": [m_s], "sd": the sample standard deviation of the m_s (None
               for S = 1: the spread between replicates, reported, not in the interval)}

    With equal problem counts per replicate this is the normal approximation of the stratified
    bootstrap (problems resampled within each replicate) of the pooled mean: its variance is the
    sum of the replicates' variances over S^2. The interval carries the problems' sampling error;
    what a new training seed would change beyond it is the spread ``sd``.
    """
    if not estimates:
        raise ValueError("pool_intervals: no estimates to pool")
    if not 0.0 < alpha < 1.0:
        raise ValueError(f"pool_intervals: alpha must be in (0, 1), got {alpha}")
    means, los, his = (np.asarray([e[key] for e in estimates], dtype=np.float64) for key in ("mean", "lo", "hi"))
    if not (np.all(np.isfinite(means)) and np.all(np.isfinite(los)) and np.all(np.isfinite(his))):
        raise ValueError("pool_intervals: every estimate needs a finite mean, lo and hi")
    if np.any(los > his):
        raise ValueError("pool_intervals: an estimate has lo above hi")
    z = NormalDist().inv_cdf(1 - alpha / 2)
    count = means.size
    se = float(np.sqrt(np.sum(((his - los) / (2 * z)) ** 2)) / count)
    mean = float(means.mean())
    return {
        "mean": mean,
        "lo": mean - z * se,
        "hi": mean + z * se,
        "se": se,
        "seeds": count,
        "per_seed": [float(m) for m in means],
        "sd": float(means.std(ddof=1)) if count > 1 else None,
    }
