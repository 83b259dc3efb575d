"""Diversity at matched reward: one learner's diversity against another's at the same held-out reward.

A GFlowNet and a reward maximiser move along different curves of diversity against reward as they
train, and a learner that trained less sits nearer the base policy on both. So their diversity is
compared where their rewards match (issue "The paper's experiment, decided"): each learner's
checkpoints in training order (the base policy first) give a curve of (mean reward, mean
diversity) over the same held-out problems. The reward both reach is the last reward r* of the
learner that moved less (the anchor: its last reward nearer its first); the anchor's diversity
there is its last checkpoint's, the other's is read where its curve first reaches r*, linear
between the two checkpoints that bracket it:

    d = h_A(r*) - h_B(r*),    h(r*) = h_i + t (h_{i+1} - h_i),  t = (r* - r_i) / (r_{i+1} - r_i)

on the first segment i of the other's curve with r* between r_i and r_{i+1} (A is always the
first learner: d is A minus B whichever is the anchor). When the other's curve never reaches r*
(the two moved in opposite directions), they are not matched and d is None. The interval
resamples problems (the same resample for every checkpoint of both learners: the checkpoints are
paired over problems) and recomputes every mean, both curves, the anchor, r* and d; resamples
that do not match are counted and left out.
"""

from __future__ import annotations

import numpy as np


def value_at_reward(rewards: np.ndarray, values: np.ndarray, target: float) -> float | None:
    """A curve's value where its reward first reaches ``target``.

    rewards, values: (C,) the curve's points in training order
    returns: the value linearly interpolated on the first segment [i, i+1] whose rewards bracket
             ``target`` (a point equal to it: its value), None when no segment does
    """
    rewards, values = np.asarray(rewards, dtype=np.float64), np.asarray(values, dtype=np.float64)
    if rewards.shape != values.shape or rewards.ndim != 1 or rewards.size == 0:
        raise ValueError(f"value_at_reward: expected two equal (C,) arrays, got {rewards.shape} and {values.shape}")
    if rewards[0] == target:
        return float(values[0])
    for i in range(rewards.size - 1):
        lo, hi = sorted((rewards[i], rewards[i + 1]))
        if lo <= target <= hi:
            step = rewards[i + 1] - rewards[i]
            t = 0.0 if step == 0 else (target - rewards[i]) / step
            return float(values[i] + t * (values[i + 1] - values[i]))
    return None


def _curve(rewards: np.ndarray, values: np.ndarray, rows: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Per checkpoint, the mean reward and the mean value (over the problems where it is defined)
    of the problems ``rows``."""
    reward = rewards[:, rows].mean(axis=1)
    picked = values[:, rows]
    counted = np.isfinite(picked).sum(axis=1)
    total = np.where(np.isfinite(picked), picked, 0.0).sum(axis=1)
    value = np.divide(total, counted, out=np.full(total.shape, np.nan), where=counted > 0)
    return reward, value


def _difference(
    a: tuple[np.ndarray, np.ndarray], b: tuple[np.ndarray, np.ndarray]
) -> tuple[str, float, float | None, float | None]:
    """(anchor "a" | "b", r*, h_A(r*), h_B(r*)) of two curves ((C,) rewards, (C,) values); a value
    is None where its curve does not reach r* or has a checkpoint without a value."""
    anchor = "a" if abs(a[0][-1] - a[0][0]) <= abs(b[0][-1] - b[0][0]) else "b"
    target = float((a if anchor == "a" else b)[0][-1])
    values = []
    for name, (rewards, diversity) in (("a", a), ("b", b)):
        if not np.all(np.isfinite(diversity)):
            values.append(None)
        elif name == anchor:
            values.append(float(diversity[-1]))
        else:
            values.append(value_at_reward(rewards, diversity, target))
    return anchor, target, values[0], values[1]


def matched_difference(
    a_rewards: np.ndarray,
    a_values: np.ndarray,
    b_rewards: np.ndarray,
    b_values: np.ndarray,
    n_resamples: int = 2000,
    seed: int = 0,
) -> dict:
    """Learner A's diversity minus learner B's at the held-out reward both reach (module docstring).

    a_rewards, a_values: (C_A, P) per checkpoint of A (training order, the base first) and problem
              its mean reward and its diversity value (NaN where a problem has none, e.g. strategy
              entropy of a problem without two right strategies)
    b_rewards, b_values: (C_B, P) the same of B, on the same P problems in the same order
    returns:  {"matched": bool, "reason": why not (None when matched), "anchor": "a" | "b" (whose
               last reward is r*), "reward": r*,
               "a": h_A(r*), "b": h_B(r*) (None where not reached), "mean": d or None, "lo", "hi" (2.5%
               and 97.5% of d over the resamples that match, None when none does), "resamples":
               n_resamples, "resamples_matched": how many of them, "curves": {"a": [[reward, value]
               per checkpoint], "b": [...]}}
    """
    arrays = [np.asarray(x, dtype=np.float64) for x in (a_rewards, a_values, b_rewards, b_values)]
    if arrays[0].shape != arrays[1].shape or arrays[2].shape != arrays[3].shape:
        raise ValueError("matched_difference: each learner's rewards and values must have one shape (C, P)")
    if arrays[0].ndim != 2 or arrays[2].ndim != 2 or arrays[0].shape[1] != arrays[2].shape[1]:
        raise ValueError(
            f"matched_difference: expected (C, P) arrays over the same P problems, got {arrays[0].shape} and {arrays[2].shape}"
        )
    if not (np.all(np.isfinite(arrays[0])) and np.all(np.isfinite(arrays[2]))):
        raise ValueError("matched_difference: every reward must be finite (a problem's mean over its samples)")
    problems = arrays[0].shape[1]
    every = np.arange(problems)
    a, b = _curve(arrays[0], arrays[1], every), _curve(arrays[2], arrays[3], every)
    anchor, target, value_a, value_b = _difference(a, b)
    mean = None if value_a is None or value_b is None else value_a - value_b
    if mean is not None:
        reason = None
    elif not (np.all(np.isfinite(a[1])) and np.all(np.isfinite(b[1]))):
        reason = "a checkpoint has no diversity value (no problem with one)"
    else:
        reason = "the other curve never reaches that reward"
    rng = np.random.default_rng(seed)
    resampled = []
    for _ in range(n_resamples):
        rows = rng.integers(0, problems, size=problems)
        _, _, x, y = _difference(_curve(arrays[0], arrays[1], rows), _curve(arrays[2], arrays[3], rows))
        if x is not None and y is not None:
            resampled.append(x - y)
    lo, hi = (float(np.quantile(resampled, 0.025)), float(np.quantile(resampled, 0.975))) if resampled else (None, None)
    return {
        "matched": mean is not None,
        "reason": reason,
        "anchor": anchor,
        "reward": target,
        "a": value_a,
        "b": value_b,
        "mean": mean,
        "lo": lo,
        "hi": hi,
        "resamples": n_resamples,
        "resamples_matched": len(resampled),
        "curves": {
            "a": [[float(r), float(v)] for r, v in zip(*a)],
            "b": [[float(r), float(v)] for r, v in zip(*b)],
        },
    }
