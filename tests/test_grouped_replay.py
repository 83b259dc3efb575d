"""The asynchronous mode's buffer: B questions x K distinct completions, recency by weights
version, reward priority within a question, FIFO capacity, the newer version of a repeat."""

from __future__ import annotations

import dataclasses
import json
import math
from collections import Counter

import pytest

from pipeline.config.schema import GFNConfig
from pipeline.finetune.tba.grouped_replay import GroupedReplay
from pipeline.finetune.tba.settings import store_buffer_settings
from pipeline.records import Trajectory

CHI2_DF3_P001 = 16.266  # chi-square critical value, 3 degrees of freedom, p = 0.001


def make_trajectory(problem_id, steps, log_reward=None, version=0):
    steps = list(steps)
    scores = [-0.1] * len(steps) if log_reward is None else [log_reward / len(steps)] * len(steps)
    return Trajectory(
        problem_id=problem_id,
        question=f"question {problem_id}",
        prompt=f"Q: {problem_id}",
        steps=steps,
        step_log_scores=scores,
        answer_flags=[1] * len(steps),
        finished=True,
        log_reward=sum(scores),
        policy_version=version,
    )


def fill(buffer, questions=6, per_question=4, version=0, log_reward=None):
    buffer.add(
        make_trajectory(f"q{q}", (f"s{j}",), log_reward=log_reward, version=version)
        for q in range(questions)
        for j in range(per_question)
    )


def test_every_group_is_one_question_with_k_distinct_completions():
    buffer = GroupedReplay(capacity=100, per_question=3, seed=1)
    fill(buffer, questions=6, per_question=4)
    for _ in range(50):
        groups, _ = buffer.sample(4, latest=0)
        assert len(groups) == 4
        assert len({group[0].problem_id for group in groups}) == 4  # distinct questions
        for group in groups:
            assert len(group) == 3 and len({t.problem_id for t in group}) == 1
            assert len({tuple(t.steps) for t in group}) == 3  # distinct completions


def test_a_question_is_eligible_only_with_k_distinct_completions():
    buffer = GroupedReplay(capacity=100, per_question=3, seed=0)
    buffer.add(
        [make_trajectory("q0", ("a",)), make_trajectory("q0", ("a",)), make_trajectory("q0", ("b",))]
    )  # a repeat: 2 distinct
    buffer.add(make_trajectory("q1", (s,)) for s in "abc")
    assert buffer.eligible() == 1
    groups, _ = buffer.sample(5, latest=0)
    assert [group[0].problem_id for group in groups] == ["q1"]


def test_recency_draws_groups_from_the_newest_weights():
    buffer = GroupedReplay(capacity=100, per_question=2, recency=1.0, seed=3)
    fill(buffer, questions=5, per_question=3, version=0)
    buffer.add(make_trajectory("q7", (s,), version=2) for s in "ab")
    buffer.add(make_trajectory("q8", (s,), version=2) for s in "abc")
    for _ in range(20):
        groups, recent = buffer.sample(2, latest=2)
        assert recent == 2 and {group[0].problem_id for group in groups} == {"q7", "q8"}
        assert all(t.policy_version == 2 for group in groups for t in group)
    # with m = 1 but fewer recent questions than asked, the rest come from the priority draw
    groups, recent = buffer.sample(4, latest=2)
    assert recent == 2 and len(groups) == 4


def test_recency_draws_from_the_newest_weights_with_completions_when_the_just_published_have_none():
    """The trainer asks with the version it has just published (latest = 3); searchers still sample
    with older weights, so the recent groups come from the newest version holding K completions of
    a question (2), not from nothing."""
    buffer = GroupedReplay(capacity=100, per_question=2, recency=1.0, seed=3)
    fill(buffer, questions=5, per_question=3, version=0)
    buffer.add(make_trajectory("q7", (s,), version=2) for s in "ab")
    buffer.add([make_trajectory("q8", ("a",), version=3)])  # one completion of the newest: not K
    for _ in range(20):
        groups, recent = buffer.sample(1, latest=3)
        assert recent == 1 and groups[0][0].problem_id == "q7"
        assert all(t.policy_version == 2 for t in groups[0])


def test_recency_fraction_m_is_the_share_of_recent_groups():
    buffer = GroupedReplay(capacity=1000, per_question=2, recency=0.3, seed=4)
    fill(buffer, questions=20, per_question=2, version=0)
    buffer.add(make_trajectory(f"r{q}", (s,), version=1) for q in range(20) for s in "ab")
    draws = [buffer.sample(5, latest=1)[1] for _ in range(2000)]
    share = sum(draws) / (5 * len(draws))  # groups taken by the recency draw (a recent question is always left)
    assert abs(share - 0.3) < 0.02, share


@pytest.mark.parametrize("priority,temperature", [("softmax", 0.5), ("softmax", 2.0), ("uniform", 1.0)])
def test_completions_within_a_question_follow_the_priority(priority, temperature):
    log_rewards = {"a": -0.5, "b": -1.0, "c": -2.0, "d": -3.0}
    buffer = GroupedReplay(capacity=100, per_question=1, priority=priority, temperature=temperature, seed=5)
    buffer.add(make_trajectory("q0", (name,), log_reward=value) for name, value in log_rewards.items())
    counts = Counter(buffer.sample(1, latest=-1)[0][0][0].steps[0] for _ in range(4000))
    weights = {
        name: math.exp(value / temperature) if priority == "softmax" else 1.0 for name, value in log_rewards.items()
    }
    total = sum(weights.values())
    chi2 = sum((counts[name] - 4000 * w / total) ** 2 / (4000 * w / total) for name, w in weights.items())
    assert chi2 < CHI2_DF3_P001, (counts, weights)


def test_every_completion_is_kept_up_to_capacity_then_the_oldest_go():
    buffer = GroupedReplay(capacity=5, per_question=1)
    low = make_trajectory("q0", ("low",), log_reward=-9.0)
    buffer.add([low] + [make_trajectory("q0", (f"s{i}",), log_reward=-0.1) for i in range(4)])
    assert len(buffer) == 5  # the low-reward completion is kept while there is room
    dropped = buffer.add([make_trajectory("q1", ("new",))])
    assert dropped == 1 and {t.steps[0] for t in buffer.questions()["q0"]} == {"s0", "s1", "s2", "s3"}


def test_a_completion_seen_again_takes_the_newer_version():
    buffer = GroupedReplay(capacity=3, per_question=1)
    buffer.add([make_trajectory("q0", ("a",), version=0), make_trajectory("q0", ("b",), version=0)])
    buffer.add([make_trajectory("q0", ("a",), version=4)])
    assert len(buffer) == 2
    assert {t.steps[0]: t.policy_version for t in buffer.questions()["q0"]} == {"a": 4, "b": 0}
    assert buffer.forget_before(1) == 1  # the old "b" is stale; the refreshed "a" is not
    buffer.add([make_trajectory("q0", (s,)) for s in "cd"])
    buffer.add([make_trajectory("q0", ("e",))])  # over capacity: the oldest goes, and "a" counts as added after "b"
    assert [t.steps[0] for t in buffer.questions()["q0"]] == ["c", "d", "e"]


def test_json_completions_are_checked_once_named_and_added_all_or_none():
    from pipeline.records import RecordError

    buffer = GroupedReplay(capacity=10, per_question=1)
    good = [make_trajectory("q0", (s,)).to_json() for s in "ab"]
    bad = {**make_trajectory("q1", ("c",)).to_json(), "log_reward": "high"}
    with pytest.raises(RecordError, match=r"from searcher 3: .*log_reward"):
        buffer.add_json([*good, bad], "trajectories from searcher 3")
    assert len(buffer) == 0  # the valid ones of a bad round are not kept either
    with pytest.raises(ValueError, match="from searcher 3: expected a JSON list"):
        buffer.add_json({"q0": good}, "trajectories from searcher 3")
    assert buffer.add_json(good, "trajectories from searcher 3") == 0
    assert [t.steps for t in buffer.questions()["q0"]] == [["a"], ["b"]]
    assert all(type(t) is Trajectory for t in buffer.questions()["q0"])


def test_draws_are_deterministic_and_the_state_round_trips_through_json():
    first, second = (
        GroupedReplay(capacity=50, per_question=2, recency=0.5, seed=9),
        GroupedReplay(capacity=50, per_question=2, recency=0.5, seed=9),
    )
    for buffer in (first, second):
        fill(buffer, questions=5, per_question=3)
    assert [[t.steps for t in g] for g in first.sample(3, 0)[0]] == [
        [t.steps for t in g] for g in second.sample(3, 0)[0]
    ]
    resumed = GroupedReplay(capacity=50, per_question=2, recency=0.5, seed=0)
    resumed.load_state_dict(json.loads(json.dumps(first.state_dict())))
    expected = [[(t.problem_id, t.steps) for t in g] for g in first.sample(3, 0)[0]]
    assert [[(t.problem_id, t.steps) for t in g] for g in resumed.sample(3, 0)[0]] == expected


def test_bad_settings_are_named():
    with pytest.raises(ValueError, match="recency"):
        GroupedReplay(capacity=5, per_question=1, recency=1.5)
    with pytest.raises(ValueError, match="priority"):
        GroupedReplay(capacity=5, per_question=1, priority="proportional")
    with pytest.raises(ValueError, match="per_question"):
        GroupedReplay(capacity=5, per_question=0)


def test_a_json_draw_is_the_same_draw_written_as_records_and_leaves_the_buffer_untouched():
    """sample_json (what the store sends the trainer) draws what sample draws from the same state,
    as Trajectory.to_json objects; changing what it returned changes nothing stored."""
    first, second = (GroupedReplay(capacity=50, per_question=2, recency=0.5, seed=3) for _ in range(2))
    for buffer in (first, second):
        fill(buffer, questions=5, per_question=3, version=0)
        fill(buffer, questions=3, per_question=2, version=1)
    for _ in range(5):
        groups, recent = first.sample(4, 1)
        objects, recent_json = second.sample_json(4, 1)
        assert recent_json == recent
        assert objects == [[t.to_json() for t in group] for group in groups]
    objects, _ = second.sample_json(4, 1)
    objects[0][0]["steps"].append("changed")
    objects[0][0]["log_reward"] = 99.0
    stored = [t for group in second.questions().values() for t in group]
    assert all("changed" not in t.steps and t.log_reward != 99.0 for t in stored)


# ----------------------------------------------------------------------------- the priority draw of K > 1


def plackett_luce(weights: dict[str, float], order: tuple[str, ...]) -> float:
    """The probability of drawing ``order`` one after another without replacement, each with
    probability proportional to its weight among those left (the obvious product)."""
    left, probability = dict(weights), 1.0
    for name in order:
        probability *= left[name] / sum(left.values())
        del left[name]
    return probability


def chi_square(counts: Counter, expected: dict, draws: int) -> float:
    return sum((counts[key] - draws * p) ** 2 / (draws * p) for key, p in expected.items())


CHI2_P001 = {3: 16.266, 11: 31.264, 14: 36.123}  # chi-square critical values at p = 0.001, by degrees of freedom


@pytest.mark.parametrize("priority,temperature", [("softmax", 1.0), ("softmax", 2.0), ("uniform", 1.0)])
def test_k_completions_of_a_question_follow_the_sequential_draw_without_replacement(priority, temperature):
    """K = 2 of 4: the ordered pairs drawn against the exact Plackett-Luce probabilities
    p(a then b) = w_a / W x w_b / (W - w_a), w = exp(priority / temperature) (12 outcomes)."""
    log_rewards = {"a": -0.5, "b": -1.0, "c": -2.0, "d": -3.0}
    buffer = GroupedReplay(capacity=100, per_question=2, priority=priority, temperature=temperature, seed=11)
    buffer.add(make_trajectory("q0", (name,), log_reward=value) for name, value in log_rewards.items())
    draws = 4000
    counts = Counter(tuple(t.steps[0] for t in buffer.sample(1, latest=-1)[0][0]) for _ in range(draws))
    weights = {
        name: math.exp(value / temperature) if priority == "softmax" else 1.0 for name, value in log_rewards.items()
    }
    expected = {(a, b): plackett_luce(weights, (a, b)) for a in weights for b in weights if a != b}
    assert set(counts) <= set(expected)
    assert chi_square(counts, expected, draws) < CHI2_P001[11], (counts, expected)


def test_k_of_three_completions_follow_the_without_replacement_probabilities_as_sets():
    """K = 3 of 4 at temperature 2: which completion is left out, against the exact probability of
    the set (the sum over its 6 orders of the sequential draw)."""
    from itertools import permutations

    log_rewards = {"a": -0.5, "b": -1.0, "c": -2.0, "d": -3.0}
    buffer = GroupedReplay(capacity=100, per_question=3, priority="softmax", temperature=2.0, seed=12)
    buffer.add(make_trajectory("q0", (name,), log_reward=value) for name, value in log_rewards.items())
    draws = 4000
    counts = Counter(frozenset(t.steps[0] for t in buffer.sample(1, latest=-1)[0][0]) for _ in range(draws))
    weights = {name: math.exp(value / 2.0) for name, value in log_rewards.items()}
    expected = {}
    for left_out in weights:
        chosen = [name for name in weights if name != left_out]
        expected[frozenset(chosen)] = sum(plackett_luce(weights, order) for order in permutations(chosen))
    assert sum(expected.values()) == pytest.approx(1.0)
    assert chi_square(counts, expected, draws) < CHI2_P001[3], (counts, expected)


def test_the_priority_draw_never_raises_with_rewards_hundreds_of_nats_apart():
    """exp(-80 / 0.1) underflows to 0: a draw of K = 2 by softmax weights would find one non-zero
    entry for two places. The draw works on the logits: the best completion first, then one of the
    two others, every time; rewards 300 nats apart come out in the order of their rewards."""
    buffer = GroupedReplay(capacity=100, per_question=2, priority="softmax", temperature=0.1, seed=13)
    buffer.add(
        make_trajectory("q0", (name,), log_reward=value) for name, value in {"a": -0.1, "b": -80.0, "c": -80.0}.items()
    )
    second_place = Counter()
    for _ in range(400):
        group = buffer.sample(1, latest=-1)[0][0]
        assert group[0].steps == ["a"] and group[1].steps != ["a"]
        second_place[group[1].steps[0]] += 1
    assert second_place["b"] > 150 and second_place["c"] > 150  # the two equal ones, each about half the time
    far = GroupedReplay(capacity=100, per_question=4, priority="softmax", temperature=1.0, seed=14)
    far.add(make_trajectory("q0", (f"s{i}",), log_reward=-300.0 * i) for i in (3, 1, 0, 2))
    for _ in range(50):
        assert [t.steps[0] for t in far.sample(1, latest=-1)[0][0]] == ["s0", "s1", "s2", "s3"]


# ----------------------------------------------------------------------------- the priority: the trained reward


def shaped(problem_id, name, log_scores, flags, version=0, reference=None):
    return Trajectory(
        problem_id=problem_id,
        question=f"question {problem_id}",
        prompt=f"Q: {problem_id}",
        steps=[f"{name}{k}" for k in range(len(log_scores))],
        step_log_scores=list(log_scores),
        answer_flags=list(flags),
        finished=True,
        log_reward=sum(log_scores),
        reference_step_logprobs=reference,
        policy_version=version,
    )


def test_the_priority_is_the_trained_reward_without_the_prior():
    """log R(s_n) as the objective trains it (PRM log-scores + the unfinished-state penalty + the
    outcome term, over the reward temperature), the appendix-F prior left out, in float64: the
    number shaped_log_rewards gives the last state without reference log-probs."""
    import torch

    from pipeline.finetune.rewards import StateLogRewards, shaped_log_rewards

    shaping = StateLogRewards(
        reward_temperature=0.25,
        unfinished_log_reward=-10.0,
        outcome_coef=1.0,
        outcome_floor=0.01,
        reference_prior_coef=1.0,
    )
    answered = shaped("q0", "a", [-0.5, -0.5], [-1, 1], reference=[-3.0, -4.0])
    unanswered = shaped("q0", "u", [-0.25], [-1], reference=[-0.1])
    wrong = shaped("q0", "w", [-0.1, -0.2, -0.3], [-1, -1, 0], reference=[-1.0, -1.0, -1.0])
    priorities = shaping.priorities([answered, unanswered, wrong])
    assert priorities == [-4.0, (-0.25 - 10.0) / 0.25, pytest.approx((-0.6 + math.log(0.01)) / 0.25, abs=1e-12)]
    for trajectory, priority in zip([answered, unanswered, wrong], priorities):
        n = len(trajectory.steps)
        row = shaped_log_rewards(
            torch.tensor([trajectory.step_log_scores], dtype=torch.float64),
            torch.tensor([trajectory.answer_flags]),
            torch.ones(1, n, dtype=torch.bool),
            reward_temperature=0.25,
            unfinished_log_reward=-10.0,
            outcome_coef=1.0,
        )
        assert priority == float(row[0, n])


@pytest.mark.parametrize("buffer_kind", ["grouped", "synchronous"])
def test_both_buffers_draw_by_the_trained_reward_not_the_raw_prm_sum(buffer_kind):
    """An unanswered one-step completion has the higher raw sum of PRM log-scores (-0.2 against
    -1.0) but the lower trained reward ((-0.2 - 10) / 0.5 against -1.0 / 0.5): the answered one is
    drawn (the raw sum would draw the unanswered one e^0.8 / (1 + e^0.8) = 69% of the time)."""
    from pipeline.finetune.replay_buffer import ReplayBuffer
    from pipeline.finetune.rewards import StateLogRewards

    shaping = StateLogRewards(reward_temperature=0.5, unfinished_log_reward=-10.0)
    answered = shaped("q0", "a", [-0.5, -0.5], [-1, 1])
    unanswered = shaped("q0", "u", [-0.2], [-1])
    if buffer_kind == "grouped":
        buffer = GroupedReplay(capacity=10, per_question=1, priority="softmax", reward=shaping, seed=2)
        buffer.add([unanswered, answered])
        drawn = [buffer.sample(1, latest=-1)[0][0][0].steps[0] for _ in range(300)]
    else:
        buffer = ReplayBuffer(capacity=10, priority="softmax", reward=shaping, seed=2)
        buffer.add([unanswered, answered])
        assert buffer.probabilities().tolist() == pytest.approx(
            [math.exp(-18.4) / (1 + math.exp(-18.4)), 1 / (1 + math.exp(-18.4))], abs=1e-9
        )
        drawn = [t.steps[0] for t in buffer.sample(300)]
        small = ReplayBuffer(capacity=1, reward=shaping)
        small.add([answered, unanswered])
        assert [t.steps for t in small.sample(3)] == [answered.steps] * 3  # the capacity keeps the higher priority
    assert drawn == ["a0"] * 300


# ----------------------------------------------------------------------------- a buffer per question


def test_a_question_keeps_its_newest_completions_up_to_its_capacity_and_the_buffer_its_newest_overall():
    buffer = GroupedReplay(capacity=7, per_question=2, question_capacity=3)
    dropped = buffer.add(make_trajectory("q0", (f"a{i}",)) for i in range(5))
    assert dropped == 2 and [t.steps[0] for t in buffer.questions()["q0"]] == ["a2", "a3", "a4"]
    buffer.add(make_trajectory("q1", (f"b{i}",)) for i in range(3))
    buffer.add([make_trajectory("q0", ("a5",))])  # q0's oldest goes (its cap), nothing else
    assert [t.steps[0] for t in buffer.questions()["q0"]] == ["a3", "a4", "a5"]
    assert len(buffer) == 6
    buffer.add(make_trajectory("q2", (f"c{i}",)) for i in range(2))  # 8 > 7: the oldest in all goes (FIFO)
    assert {q: [t.steps[0] for t in group] for q, group in buffer.questions().items()} == {
        "q1": ["b0", "b1", "b2"],
        "q0": ["a4", "a5"],
        "q2": ["c0", "c1"],
    }
    with pytest.raises(ValueError, match="question_capacity"):
        GroupedReplay(capacity=10, per_question=3, question_capacity=2)


def test_a_round_larger_than_the_buffer_keeps_whole_questions_of_its_end():
    """B = 4, S = 4, K = 3, buffer 12 (the issue's hang): the round's 16 completions, question by
    question, leave the last 3 questions; (B - 1) x S + K = 15 holds all 4 with K each."""
    for capacity, eligible in ((12, 3), (15, 4)):
        buffer = GroupedReplay(capacity=capacity, per_question=3, question_capacity=4)
        buffer.add(make_trajectory(f"q{q}", (f"s{j}",)) for q in range(4) for j in range(4))
        assert buffer.eligible() == eligible


# ----------------------------------------------------------------------------- priority and recency with versions


def test_the_draw_follows_recency_then_priority_with_more_than_k_completions_of_several_versions():
    """One question, 6 completions of versions 0, 0, 1, 1, 2, 2, K = 2, m = 0.5: with probability m
    the pair of the newest version that holds K (2, or 1 when the newest asked for is 1), otherwise
    a pair of all six by the sequential priority draw. The 15 pairs' frequencies against that exact
    mixture (chi-square); with m = 0 the newest pair comes no more often than its priority gives."""
    from itertools import permutations

    rewards = {"v0a": -0.2, "v0b": -0.4, "v1a": -0.6, "v1b": -0.8, "v2a": -1.0, "v2b": -1.2}
    versions = {name: int(name[1]) for name in rewards}
    for latest in (2, 1):
        buffer = GroupedReplay(capacity=100, per_question=2, priority="softmax", recency=0.5, seed=21 + latest)
        buffer.add(make_trajectory("q0", (n,), log_reward=r, version=versions[n]) for n, r in rewards.items())
        draws = 6000
        counts = Counter(frozenset(t.steps[0] for t in buffer.sample(1, latest=latest)[0][0]) for _ in range(draws))
        weights = {name: math.exp(value) for name, value in rewards.items()}
        newest = frozenset(name for name in rewards if versions[name] == latest)
        expected = {}
        for pair in {frozenset(p) for p in permutations(rewards, 2)}:
            by_priority = sum(plackett_luce(weights, order) for order in permutations(pair))
            expected[pair] = 0.5 * by_priority + 0.5 * (pair == newest)
        assert sum(expected.values()) == pytest.approx(1.0)
        assert chi_square(counts, expected, draws) < CHI2_P001[14], (latest, counts)
    plain = GroupedReplay(capacity=100, per_question=2, priority="softmax", recency=0.0, seed=5)
    plain.add(make_trajectory("q0", (n,), log_reward=r, version=versions[n]) for n, r in rewards.items())
    newest_pairs = sum({t.steps[0] for t in plain.sample(1, latest=2)[0][0]} == {"v2a", "v2b"} for _ in range(2000))
    assert newest_pairs < 2000 * 0.1  # by priority alone about 3% of draws


def test_questions_with_more_than_k_completions_of_several_versions_give_recent_groups_of_one_version():
    """Three questions with 5 completions each over versions 0-2 (K = 3): with m = 1 every group is
    K completions of one question from the newest version with K of them (q2 holds 3 of version 2,
    the others 2); the rest of the batch comes from the priority draw over all their completions."""
    buffer = GroupedReplay(capacity=100, per_question=3, priority="softmax", recency=1.0, seed=8)
    layout = {"q0": [0, 0, 1, 1, 2], "q1": [0, 1, 1, 2, 2], "q2": [0, 1, 2, 2, 2]}
    buffer.add(
        make_trajectory(q, (f"{q}-{j}",), log_reward=-0.1 * j, version=v)
        for q, vs in layout.items()
        for j, v in enumerate(vs)
    )
    for _ in range(30):
        groups, recent = buffer.sample(3, latest=2)
        assert recent == 1 and groups[0][0].problem_id == "q2"
        assert sorted(t.policy_version for t in groups[0]) == [2, 2, 2]
        assert {group[0].problem_id for group in groups} == {"q0", "q1", "q2"}
        assert all(len({tuple(t.steps) for t in group}) == 3 for group in groups)


@pytest.mark.parametrize("key", ["log_reward", "log_u"])
def test_the_store_ranks_a_questions_completions_by_the_configured_priority_key(key):
    """gfn.buffer_key reaches the asynchronous store (store_buffer_settings): an unanswered completion
    with the better PRM log-scores ranks first under log_u, last under log_reward (the penalty)."""
    cfg = GFNConfig(async_priority="softmax", buffer_key=key, samples_per_question=2, reward_temperature=0.5)
    settings = store_buffer_settings(cfg)
    assert settings["key"] == key and settings["per_question"] == 2
    buffer = GroupedReplay(**settings)
    short = dataclasses.replace(make_trajectory("q0", ("short",), log_reward=-0.1), answer_flags=[-1])
    buffer.add([short, make_trajectory("q0", ("answered",), log_reward=-2.0)])
    expected = [(-0.1 - 10.0) / 0.5, -2.0 / 0.5] if key == "log_reward" else [-0.1, -2.0]
    assert buffer._logits(list(buffer._items.values())).tolist() == pytest.approx(expected)
    with pytest.raises(ValueError, match="grouped replay: key must be one of log_reward, log_u"):
        GroupedReplay(**{**settings, "key": "log_R"})
