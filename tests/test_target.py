"""The target estimate (eval.target): importance weights, strategy shares, the distance to the
target and the length effect against float64 double loops."""

import math

import numpy as np
import pytest

from eval.target import (
    DrawnSamples,
    compare_to_target,
    length_effect,
    share_distance,
    strategy_shares,
    terminal_log_reward,
)
from pipeline.finetune.rewards import StateLogRewards
from pipeline.records import Sample
from pipeline.stats import bootstrap_statistic

S, F = 3, 2


def random_draw(rng, questions, k, scale):
    mask = rng.random((questions, k)) < 0.85
    mask[:, 0] = True
    strategy = np.where(rng.random((questions, k)) < 0.6, rng.integers(0, S, size=(questions, k)), -1)
    strategy[~mask] = -1
    log_likelihood = rng.normal(-3.0, 1.0, size=(questions, k))
    return DrawnSamples(mask, strategy, log_likelihood, log_likelihood * scale)


def loop_weights(draw, q):
    kept = [k for k in range(draw.mask.shape[1]) if draw.mask[q, k]]
    top = max(draw.log_weight[q, k] for k in kept)
    raw = {k: math.exp(draw.log_weight[q, k] - top) for k in kept}
    total = math.fsum(raw.values())
    return {k: v / total for k, v in raw.items()}


def loop_shares(draw, q, weighted):
    weights = loop_weights(draw, q) if weighted else {k: 1.0 for k in range(draw.mask.shape[1]) if draw.mask[q, k]}
    named = {k: w for k, w in weights.items() if draw.strategy[q, k] >= 0}
    total = math.fsum(named.values())
    if total == 0:
        return None
    return [math.fsum(w for k, w in named.items() if draw.strategy[q, k] == s) / total for s in range(S)]


def loop_distance(target, sampler, family, rows):
    per_family, counts = {}, {}
    for f in range(F):
        pairs = [(loop_shares(target, q, True), loop_shares(sampler, q, False)) for q in rows if family[q] == f]
        pairs = [(a, b) for a, b in pairs if a is not None and b is not None]
        if not pairs:
            continue
        mean_a = [math.fsum(a[s] for a, _ in pairs) / len(pairs) for s in range(S)]
        mean_b = [math.fsum(b[s] for _, b in pairs) / len(pairs) for s in range(S)]
        per_family[f] = 0.5 * math.fsum(abs(x - y) for x, y in zip(mean_a, mean_b))
        counts[f] = len(pairs)
    if not counts:
        return None, per_family, counts
    return math.fsum(counts[f] * per_family[f] for f in counts) / sum(counts.values()), per_family, counts


@pytest.mark.parametrize("scale", [1.0, 250.0])  # 250: exp(log R^(1/T)) underflows to 0 everywhere
def test_the_distance_to_the_target_matches_a_double_loop(scale):
    rng = np.random.default_rng(0)
    questions = 14
    target, sampler = random_draw(rng, questions, 6, scale), random_draw(rng, questions, 4, 1.0)
    family = rng.integers(0, F, size=questions)
    result = compare_to_target(target, sampler, family, S, F, n_resamples=300, seed=5)

    distance, per_family, counts = loop_distance(target, sampler, family, range(questions))
    assert result["share_distance"]["estimate"] == pytest.approx(distance, rel=1e-9)
    for f in range(F):
        assert result["share_distance"]["per_family"][f] == pytest.approx(per_family.get(f), rel=1e-9)
        assert result["share_distance"]["questions_per_family"][f] == counts.get(f, 0)
    lo, hi = bootstrap_statistic(
        lambda drawn: loop_distance(target, sampler, family, list(drawn))[0], questions, n_resamples=300, seed=5
    )
    assert (result["share_distance"]["lo"], result["share_distance"]["hi"]) == pytest.approx((lo, hi), rel=1e-9)
    assert result["share_distance"]["lo"] <= distance <= result["share_distance"]["hi"]

    target_log_l = [
        math.fsum(w * target.log_likelihood[q, k] for k, w in loop_weights(target, q).items()) for q in range(questions)
    ]
    sampler_log_l = [sampler.log_likelihood[q][sampler.mask[q]].mean() for q in range(questions)]
    got = result["log_likelihood"]
    assert got["target"] == pytest.approx(np.mean(target_log_l), rel=1e-9)
    assert got["sampler"] == pytest.approx(np.mean(sampler_log_l), rel=1e-9)
    assert got["difference"] == pytest.approx(np.mean(sampler_log_l) - np.mean(target_log_l), rel=1e-9)
    ess = []
    for q in range(questions):
        w = list(loop_weights(target, q).values())
        ess.append(math.fsum(w) ** 2 / math.fsum(x * x for x in w))
    assert result["effective_samples"]["mean"] == pytest.approx(np.mean(ess), rel=1e-9)
    assert result["effective_samples"]["min"] == pytest.approx(min(ess), rel=1e-9)


def test_a_sampler_with_the_targets_shares_is_at_distance_zero_and_a_disjoint_one_at_one():
    mask = np.ones((2, 2), dtype=bool)
    strategy = np.array([[0, 1], [0, 1]])
    base = DrawnSamples(mask, strategy, np.zeros((2, 2)), np.log(np.array([[3.0, 1.0], [3.0, 1.0]])))
    same = DrawnSamples(np.ones((2, 4), dtype=bool), np.array([[0, 0, 0, 1]] * 2), np.zeros((2, 4)), np.zeros((2, 4)))
    other = DrawnSamples(np.ones((2, 1), dtype=bool), np.array([[2], [2]]), np.zeros((2, 1)), np.zeros((2, 1)))
    family = np.array([0, 1])
    assert compare_to_target(base, same, family, S, F, n_resamples=50)["share_distance"]["estimate"] == pytest.approx(
        0.0
    )
    assert compare_to_target(base, other, family, S, F, n_resamples=50)["share_distance"]["estimate"] == pytest.approx(
        1.0
    )
    effect = length_effect(base, family, S, F)
    assert effect["target"][0] == pytest.approx([0.75, 0.25, 0.0])
    assert effect["base_correct"][0] == pytest.approx([0.5, 0.5, 0.0])


def test_shares_and_distance_refuse_bad_input_and_skip_unnamed_questions():
    shares, named = strategy_shares(np.array([[1.0, 2.0], [1.0, 1.0]]), np.array([[0, 1], [-1, -1]]), 2)
    assert named.tolist() == [True, False] and shares[0].tolist() == pytest.approx([1 / 3, 2 / 3])
    assert np.isnan(shares[1]).all()
    with pytest.raises(ValueError, match="strategy indices"):
        strategy_shares(np.ones((1, 1)), np.array([[2]]), 2)
    distance, per_family, counts = share_distance(shares, named, shares, ~named, np.array([0, 0]), 1)
    assert distance is None and counts.tolist() == [0]


def test_the_terminal_reward_is_the_gfn_shaping_of_the_last_state():
    shaping = StateLogRewards(reward_temperature=0.5, unfinished_log_reward=-10.0, outcome_coef=1.0, outcome_floor=0.1)

    def sample(answer, correct):
        return Sample("p", "base", 0, ["a", "b"], answer, correct, True)

    logs = [math.log(0.5), math.log(0.8)]
    assert terminal_log_reward(logs, sample("3", True), shaping) == pytest.approx(math.fsum(logs) / 0.5)
    assert terminal_log_reward(logs, sample("4", False), shaping) == pytest.approx(
        (math.fsum(logs) + math.log(0.1)) / 0.5
    )
    assert terminal_log_reward(logs, sample(None, False), shaping) == pytest.approx((math.fsum(logs) - 10.0) / 0.5)
    empty = Sample("p", "base", 0, [], None, False, True)
    assert terminal_log_reward([], empty, shaping) == pytest.approx(-20.0)
