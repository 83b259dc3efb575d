"""Diversity at matched reward (eval/matched.py) against a float64 loop written the obvious way."""

from __future__ import annotations

import numpy as np
import pytest

from eval.matched import matched_difference, value_at_reward


def brute_curve(rewards, values, rows):
    """Mean reward and mean defined value per checkpoint of the problems `rows`, by hand."""
    out = []
    for c in range(len(rewards)):
        r = sum(rewards[c][p] for p in rows) / len(rows)
        defined = [values[c][p] for p in rows if values[c][p] == values[c][p]]  # NaN != NaN
        out.append((r, sum(defined) / len(defined) if defined else float("nan")))
    return out


def brute_at(curve, target):
    if curve[0][0] == target:
        return curve[0][1]
    for (r0, v0), (r1, v1) in zip(curve, curve[1:]):
        if min(r0, r1) <= target <= max(r0, r1):
            return v0 if r1 == r0 else v0 + (target - r0) / (r1 - r0) * (v1 - v0)
    return None


def test_value_at_reward_interpolates_on_the_first_bracketing_segment():
    rewards, values = np.array([0.0, 1.0, 3.0, 1.5]), np.array([2.0, 1.0, 0.0, 5.0])
    assert value_at_reward(rewards, values, 0.5) == pytest.approx(1.5)
    assert value_at_reward(rewards, values, 2.0) == pytest.approx(0.5)  # segment [1, 3], not the later [3, 1.5]
    assert value_at_reward(rewards, values, 0.0) == 2.0
    assert value_at_reward(rewards, values, 4.0) is None and value_at_reward(rewards, values, -1.0) is None
    assert value_at_reward(np.array([1.0, 1.0]), np.array([3.0, 4.0]), 1.0) == 3.0
    with pytest.raises(ValueError, match="equal"):
        value_at_reward(rewards, values[:2], 1.0)


def test_matched_difference_matches_a_loop_point_and_resamples():
    rng = np.random.default_rng(0)
    problems = 30
    base_r, base_h = rng.normal(-4.0, 0.5, problems), rng.uniform(0.0, 1.0, problems)
    base_h[rng.random(problems) < 0.3] = np.nan  # problems without an entropy
    # A: the reward rises a little and the entropy stays; B: the reward rises far and the entropy falls
    a_r = np.stack([base_r + s * 0.1 + rng.normal(0, 0.05, problems) for s in range(4)])
    b_r = np.stack([base_r + s * 0.3 + rng.normal(0, 0.05, problems) for s in range(4)])
    a_h = np.stack([base_h + rng.normal(0, 0.02, problems) for _ in range(4)])
    b_h = np.stack([base_h - 0.15 * s + rng.normal(0, 0.02, problems) for s in range(4)])
    a_r[0], b_r[0], a_h[0], b_h[0] = base_r, base_r, base_h, base_h  # both curves start at the base
    result = matched_difference(a_r, a_h, b_r, b_h, n_resamples=300, seed=4)
    every = list(range(problems))
    curve_a, curve_b = brute_curve(a_r.tolist(), a_h.tolist(), every), brute_curve(b_r.tolist(), b_h.tolist(), every)
    target = curve_a[-1][0]  # A moved less: the reward both reach is A's last
    expected = curve_a[-1][1] - brute_at(curve_b, target)
    assert result["matched"] and result["anchor"] == "a" and result["reward"] == pytest.approx(target)
    assert result["mean"] == pytest.approx(expected, rel=1e-12)
    assert result["b"] == pytest.approx(brute_at(curve_b, target), rel=1e-12)
    assert np.allclose(result["curves"]["a"], curve_a, rtol=1e-12)
    assert result["mean"] > 0.05  # A keeps what B loses at A's reward
    assert result["lo"] <= result["mean"] <= result["hi"] and result["resamples_matched"] > 250
    # the resamples by hand: the same generator draws the same rows
    draws = np.random.default_rng(4)
    diffs = []
    for _ in range(300):
        rows = draws.integers(0, problems, size=problems).tolist()
        ca, cb = brute_curve(a_r.tolist(), a_h.tolist(), rows), brute_curve(b_r.tolist(), b_h.tolist(), rows)
        if abs(ca[-1][0] - ca[0][0]) <= abs(cb[-1][0] - cb[0][0]):
            mine, other = ca[-1][1], brute_at(cb, ca[-1][0])
        else:
            mine, other = brute_at(ca, cb[-1][0]), cb[-1][1]
        if mine is not None and other is not None:
            diffs.append(mine - other)
    assert result["resamples_matched"] == len(diffs)
    assert (result["lo"], result["hi"]) == pytest.approx((np.quantile(diffs, 0.025), np.quantile(diffs, 0.975)))


def test_the_learner_that_moved_less_sets_the_reward_and_opposite_moves_do_not_match():
    r = np.array([[0.0, 0.0], [1.0, 1.0]])  # A's mean reward rises from 0 to 1
    h = np.array([[0.5, 0.5], [0.4, 0.4]])
    low = np.array([[0.0, 0.0], [0.5, 0.5]])  # B's rises to 0.5 only
    result = matched_difference(r, h, low, h, n_resamples=50)
    # B is the anchor: at 0.5, A is half-way along its first segment (0.45), B at its last (0.4)
    assert result["matched"] and result["anchor"] == "b" and result["reward"] == 0.5
    assert (result["a"], result["b"], result["mean"]) == pytest.approx((0.45, 0.4, 0.05))
    assert result["resamples_matched"] == 50 and result["lo"] == pytest.approx(0.05)
    back = matched_difference(low, h, r, h, n_resamples=50)  # the same pair the other way round: A minus B
    assert back["anchor"] == "a" and back["mean"] == pytest.approx(-0.05)
    falls = np.array([[0.0, 0.0], [-0.5, -0.5]])  # B's reward falls: no reward both reach
    apart = matched_difference(r, h, falls, h, n_resamples=50)
    assert not apart["matched"] and apart["mean"] is None and apart["anchor"] == "b" and apart["a"] is None
    assert apart["reason"] == "the other curve never reaches that reward" and result["reason"] is None
    empty = matched_difference(r, np.full((2, 2), np.nan), low, h, n_resamples=5)  # A has no entropy anywhere
    assert not empty["matched"] and empty["reason"].startswith("a checkpoint has no diversity value")
    assert apart["resamples_matched"] == 0 and apart["lo"] is None


def test_bad_shapes_and_rewards_are_refused():
    r, h = np.zeros((3, 4)), np.zeros((3, 4))
    with pytest.raises(ValueError, match="same P problems"):
        matched_difference(r, h, np.zeros((3, 5)), np.zeros((3, 5)))
    with pytest.raises(ValueError, match="one shape"):
        matched_difference(r, h[:2], r, h)
    bad = r.copy()
    bad[0, 0] = np.nan
    with pytest.raises(ValueError, match="finite"):
        matched_difference(bad, h, r, h)
