"""The asynchronous mode's buffer: B questions x K distinct completions, recency by weights
version, reward priority within a question, FIFO capacity, the newer version of a repeat."""

from __future__ import annotations

import json
import math
from collections import Counter

import pytest

from pipeline.finetune.grouped_replay import GroupedReplay
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
