"""The reweighting ceiling the GFlowNet stage logs before training (pipeline.finetune.ceiling)."""

import dataclasses
import json
import logging
import math
from decimal import Decimal, getcontext
from pathlib import Path

import numpy as np
import pytest
from test_diversity import NARRATIVE, REVERSED  # the example tiny-world problem's two strategies

from pipeline.finetune.ceiling import (
    ceiling_arrays,
    ceiling_strategies,
    ceiling_verdict,
    effective_sample_size,
    reweighting_ceiling,
    self_normalised_weights,
    strategy_entropy_ceiling,
)
from pipeline.finetune.rewards import CORRECT_ANSWER, NO_ANSWER, WRONG_ANSWER, StateLogRewards
from pipeline.records import Problem, Trajectory
from pipeline.stats import bootstrap_ci

REPO = Path(__file__).resolve().parents[1]


def brute_force_gains(log_weights, values, mask):
    """Per question with a sample: sum_i w_i v_i - mean v, w_i = exp(lw_i) / sum_j exp(lw_j), in
    50-digit decimals (no shift, no underflow), one sample at a time."""
    getcontext().prec = 50
    gains = []
    for lw_row, v_row, m_row in zip(log_weights, values, mask):
        kept = [(Decimal(float(lw)).exp(), Decimal(float(v))) for lw, v, m in zip(lw_row, v_row, m_row) if m]
        if not kept:
            continue
        total = sum(w for w, _ in kept)
        reweighted = sum(w * v for w, v in kept) / total
        plain = sum(v for _, v in kept) / len(kept)
        gains.append(float(reweighted - plain))
    return np.array(gains, dtype=np.float64)


@pytest.mark.parametrize("temperature", [0.25, 0.004])
def test_the_ceiling_matches_a_float64_brute_force_with_ragged_groups(temperature):
    rng = np.random.default_rng(0)
    questions, k = 12, 8
    log_r = rng.normal(-12.0, 2.0, size=(questions, k))  # log R = sum log U
    log_weights = log_r / temperature  # at 0.004 every R^(1/T) is far below the smallest float64
    rewards = np.exp(log_r)
    correct = rng.random((questions, k)) < 0.6
    mask = rng.random((questions, k)) < 0.8
    mask[3] = False  # a question whose samples were all dropped
    mask[5] = [True] + [False] * (k - 1)  # one sample: nothing to reweight
    if temperature < 0.01:
        assert np.exp(log_weights[mask]).max() == 0.0  # naive normalisation would divide 0 by 0

    result = reweighting_ceiling(log_weights, rewards, mask, correct, n_resamples=500, seed=3)

    assert result["questions"] == questions - 1 and result["questions_without_samples"] == 1
    assert result["samples"] == int(mask.sum())
    for name, values in (("reward", rewards), ("accuracy", correct.astype(float))):
        gains = brute_force_gains(log_weights, values, mask)
        got = result[name]
        np.testing.assert_allclose(got["per_question"], gains, rtol=1e-9, atol=1e-15)
        assert got["per_question"][4] == pytest.approx(
            0.0, abs=1e-15
        )  # the one-sample question (index 5, after 3 is left out)
        assert (got["gain"], got["lo"], got["hi"]) == pytest.approx(
            bootstrap_ci(gains, n_resamples=500, seed=3), rel=1e-9, abs=1e-15
        )
        plain = [v[m].mean() for v, m in zip(values, mask) if m.any()]
        assert got["base"] == pytest.approx(float(np.mean(plain)), rel=1e-12)
        assert got["reweighted"] == pytest.approx(got["base"] + float(np.mean(gains)), rel=1e-9)
    # weights increasing in R: the reweighted mean R is never below the plain mean
    assert min(result["reward"]["per_question"]) >= -1e-15 and result["reward"]["gain"] > 0


def test_equal_rewards_within_every_question_leave_nothing_to_gain():
    rewards = np.repeat(np.array([[0.2], [0.5], [0.9]]), 4, axis=1)
    result = reweighting_ceiling(
        np.log(rewards) / 0.25, rewards, np.ones_like(rewards, dtype=bool), None, n_resamples=200
    )
    assert result["accuracy"] is None
    assert result["reward"]["gain"] == pytest.approx(0.0, abs=1e-15) and result["reward"]["hi"] == pytest.approx(
        0.0, abs=1e-15
    )
    line = ceiling_verdict(result, 0.25)
    assert "no measurable gain" in line and "nothing to learn" in line


def test_bad_shapes_and_empty_input_are_refused():
    with pytest.raises(ValueError, match="same"):
        reweighting_ceiling(np.zeros((2, 3)), np.zeros((2, 4)), np.ones((2, 3), dtype=bool))
    with pytest.raises(ValueError, match="no question has a sample"):
        reweighting_ceiling(np.zeros((2, 3)), np.zeros((2, 3)), np.zeros((2, 3), dtype=bool))
    with pytest.raises(ValueError, match="finite"):
        reweighting_ceiling(np.full((1, 2), np.nan), np.zeros((1, 2)), np.ones((1, 2), dtype=bool))


def entropy_bits(mass):
    """-sum p log2 p of the distribution proportional to the positive values of ``mass``, one term at a time."""
    total = sum(mass.values())
    return -sum(m / total * math.log2(m / total) for m in mass.values() if m > 0)


def test_the_strategy_entropy_ceiling_matches_a_float64_brute_force():
    # per question: each sample's strategy (None: wrong, or right by no valid strategy) and its
    # weight R^(1/T), given far below the smallest float64 (log scale 1e4 down) to test the
    # normalisation among the named samples
    questions = [
        (["a", "a", "b", None], [1.0, 1.0, 6.0, 100.0], True),  # a wrong sample holds the largest weight
        (["a", "b", None, None], [1.0, 3.0, 1.0, 1.0], True),  # its wrong samples weigh e^1000 times more, below
        (["a", "b", "b", None], [2.0, 1.0, 1.0, 1.0], False),  # admits one strategy: not counted
        ([None, None, None, None], [1.0, 2.0, 3.0, 4.0], True),  # no named sample: not counted
        (["b", "a", None, None], [1.0, 9.0, 1.0, 1.0], True),  # its "a" is masked out below: one strategy, 0 bits
    ]
    strategies = [names for names, _, _ in questions]
    log_weights = np.log([weights for _, weights, _ in questions]) - 1e4
    log_weights[1, 2:] += 1000.0  # normalised over all samples, the named ones' weights would underflow to 0
    multi = np.array([counted for _, _, counted in questions])
    mask = np.ones((5, 4), dtype=bool)
    mask[4, 1] = False
    assert np.exp(log_weights).max() == 0.0

    result = strategy_entropy_ceiling(log_weights, mask, strategies, multi, n_resamples=300, seed=2)

    plain, reweighted = [], []
    for q in (0, 1, 4):
        counts, mass = {}, {}
        for k, name in enumerate(strategies[q]):
            if name is not None and mask[q, k]:
                counts[name] = counts.get(name, 0.0) + 1.0
                mass[name] = mass.get(name, 0.0) + questions[q][1][k]
        plain.append(entropy_bits(counts))
        reweighted.append(entropy_bits(mass))
    assert plain == pytest.approx([0.9182958340544896, 1.0, 0.0], abs=1e-12)  # 2:1, 1:1, one strategy
    assert reweighted == pytest.approx([0.8112781244591328, 0.8112781244591328, 0.0], abs=1e-12)  # 2:6, 1:3
    differences = np.array(reweighted) - np.array(plain)
    assert result["questions"] == 3 and result["multi_strategy_questions"] == 4
    np.testing.assert_allclose(result["per_question"], differences, rtol=1e-12, atol=1e-12)
    assert result["base"] == pytest.approx(np.mean(plain), abs=1e-12)
    assert result["reweighted"] == pytest.approx(np.mean(reweighted), abs=1e-12)
    assert (result["difference"], result["lo"], result["hi"]) == pytest.approx(
        bootstrap_ci(differences, n_resamples=300, seed=2), abs=1e-12
    )

    nothing = strategy_entropy_ceiling(log_weights[2:4], mask[2:4], strategies[2:4], multi[2:4])
    assert nothing["questions"] == 0 and nothing["base"] is None and nothing["difference"] is None
    assert nothing["per_question"] == []


def solved(problem_id, steps, last_flag):
    return dataclasses.replace(trajectory(problem_id, [-0.1] * len(steps), last_flag), steps=list(steps))


def test_the_strategies_are_evals_on_the_ceilings_groups_and_none_where_no_problem_knows_them():
    two = Problem("two", "Ann has 5 apples. ...", "15", "tiny", {"solutions": [NARRATIVE, REVERSED]})
    one = Problem("one", "Ann has 5 apples. ...", "15", "tiny", {"solutions": [NARRATIVE]})
    gsm = Problem("gsm", "How many?", "15", "gsm8k", {"solution": "5 + 10 = 15"})
    samples = [
        solved("two", NARRATIVE, CORRECT_ANSWER),
        solved("one", NARRATIVE, CORRECT_ANSWER),
        solved("two", REVERSED, CORRECT_ANSWER),
        solved("two", REVERSED, WRONG_ANSWER),  # wrong: no strategy counted
        solved("two", ["Ann has 5 + 10 = 15 apples.", "The answer is 15"], CORRECT_ANSWER),  # right by no strategy
        solved("gsm", NARRATIVE, CORRECT_ANSWER),
    ]
    records = {p.problem_id: p for p in (two, one, gsm)}
    strategies, multi = ceiling_strategies(samples, records)
    assert strategies == [["0", "1", None, None], ["0"], [None]]  # the groups of ceiling_arrays, in its order
    assert multi.tolist() == [True, False, False]
    assert ceiling_arrays(samples, StateLogRewards(reward_temperature=1.0), True)[2].sum(1).tolist() == [4, 1, 1]
    assert ceiling_strategies([s for s in samples if s.problem_id == "gsm"], records) is None
    with pytest.raises(KeyError, match="no problem record"):
        ceiling_strategies(samples, {"two": two})


def test_the_verdict_says_how_the_targets_strategy_entropy_compares():
    rewards = np.array([[0.2, 0.4], [0.5, 0.9]])
    result = reweighting_ceiling(np.log(rewards) / 0.25, rewards, np.ones((2, 2), dtype=bool), None, n_resamples=200)
    assert "strategy" not in ceiling_verdict(result, 0.25)  # strategies unknown: no clause
    lower = {"questions": 2, "base": 0.9, "reweighted": 0.4, "difference": -0.5, "lo": -0.7, "hi": -0.3}
    line = ceiling_verdict({**result, "strategy_entropy": lower}, 0.25)
    assert "0.900 -> 0.400 bits" in line and "less diverse in strategies than the base policy" in line
    line = ceiling_verdict({**result, "strategy_entropy": {**lower, "lo": -0.7, "hi": 0.1}}, 0.25)
    assert "not clearly apart" in line
    line = ceiling_verdict({**result, "strategy_entropy": {**lower, "questions": 0}}, 0.25)
    assert "no question with several strategies has a right sample" in line


def trajectory(problem_id, log_scores, last_flag):
    flags = [NO_ANSWER] * (len(log_scores) - 1) + [last_flag]
    return Trajectory(
        problem_id=problem_id,
        question="q",
        prompt="q",
        steps=[f"s{i}" for i in range(len(log_scores))],
        step_log_scores=log_scores,
        answer_flags=flags,
        finished=True,
        log_reward=sum(log_scores),
    )


def test_the_weights_are_the_gflownets_shaped_reward_tempered_without_its_prior():
    shaping = StateLogRewards(reward_temperature=0.25, unfinished_log_reward=-10.0, reference_prior_coef=1.0)
    samples = [
        trajectory("a", [-1.0, -0.5], CORRECT_ANSWER),
        trajectory("a", [-2.0], NO_ANSWER),
        trajectory("b", [-0.1, -0.1, -0.3], WRONG_ANSWER),
    ]
    log_weights, rewards, mask, correct = ceiling_arrays(samples, shaping, answers_known=True)
    assert mask.tolist() == [[True, True], [True, False]]
    np.testing.assert_allclose(log_weights[mask], [-1.5 / 0.25, (-2.0 - 10.0) / 0.25, -0.5 / 0.25])
    np.testing.assert_allclose(rewards[mask], np.exp([-1.5, -2.0, -0.5]))
    assert correct[mask].tolist() == [True, False, False]
    assert ceiling_arrays(samples, shaping, answers_known=False)[3] is None


def test_the_gflownet_stage_logs_and_writes_the_ceiling_before_training(random_tiny_world, tmp_path, caplog):
    from stages import train_gfn

    world = random_tiny_world
    args = [
        "--config",
        str(REPO / "configs" / "tiny.yaml"),
        f"runs_root={tmp_path}",
        "run=c",
        f"model.policy={world / 'policy'}",
        f"model.prm={world / 'prm'}",
        f"data.train_path={world / 'problems_train.jsonl'}",
        "data.disjoint_from=[]",
        "generation.max_new_tokens=16",
        "generation.batch_size=32",
        "gfn.num_train_steps=1",
        "gfn.questions_per_step=2",
        "gfn.samples_per_question=2",
        "gfn.ceiling_questions=6",
        "gfn.save_every=0",
        "gfn.warmup_steps=0",
    ]
    with caplog.at_level(logging.INFO, logger="stepflow"):
        train_gfn.main(args)
    written = json.loads((tmp_path / "c" / "gfn" / "ceiling.json").read_text())
    assert written["questions"] + written["questions_without_samples"] == 6 and written["samples_per_question"] == 2
    assert written["sampled"] == 12 and written["samples"] == 12 - written["empty_solutions"]
    assert written["reward_temperature"] == 1.0 and len(written["reward"]["per_question"]) == written["questions"]
    assert written["reward"]["lo"] <= written["reward"]["gain"] <= written["reward"]["hi"]
    assert written["accuracy"] is not None and math.isfinite(written["accuracy"]["gain"])
    lines = [r.getMessage() for r in caplog.records if "reweighting ceiling" in r.getMessage()]
    assert len(lines) == 1 and lines[0].startswith("gfn: reweighting ceiling over") and "ceiling.json" in lines[0]
    assert ("something to learn" in lines[0]) == (written["reward"]["lo"] > 0)
    # tiny-world records know their strategies: the block is there, counted over the same questions
    strategy = written["strategy_entropy"]
    assert 0 <= strategy["questions"] <= strategy["multi_strategy_questions"] <= written["questions"]
    assert len(strategy["per_question"]) == strategy["questions"] and "strategy entropy" in lines[0]


def test_weights_and_effective_sample_size_match_a_float64_double_loop():
    rng = np.random.default_rng(1)
    log_weights = rng.normal(0.0, 3.0, size=(6, 5)) / 0.004  # exp underflows everywhere
    mask = rng.random((6, 5)) < 0.7
    mask[2] = False
    mask[4] = [True, False, False, False, False]
    weights = self_normalised_weights(log_weights, mask)
    ess = effective_sample_size(weights, mask)
    for q in range(6):
        kept = [k for k in range(5) if mask[q, k]]
        if not kept:
            assert weights[q].sum() == 0.0 and ess[q] == 0.0
            continue
        top = max(log_weights[q, k] for k in kept)
        raw = {k: math.exp(log_weights[q, k] - top) for k in kept}
        total = sum(raw.values())
        for k in range(5):
            assert weights[q, k] == pytest.approx(raw[k] / total if k in raw else 0.0, rel=1e-12, abs=1e-300)
        assert ess[q] == pytest.approx(total**2 / sum(v * v for v in raw.values()), rel=1e-12)
    assert ess[4] == pytest.approx(1.0)
    uniform = effective_sample_size(np.full((1, 4), 0.25), np.ones((1, 4), dtype=bool))
    assert uniform[0] == pytest.approx(4.0)
    result = reweighting_ceiling(log_weights, np.ones((6, 5)), mask, n_resamples=10)
    kept_ess = ess[mask.any(axis=1)]
    assert result["effective_samples"]["mean"] == pytest.approx(float(kept_ess.mean()))
    assert result["effective_samples"]["min"] == pytest.approx(float(kept_ess.min()))
    assert "effective samples per question" in ceiling_verdict(result, 0.004)
