"""The replay buffer: priorities, dedup, eviction, recency mix, JSON state round trip."""

from __future__ import annotations

import dataclasses
import json
import math
from collections import Counter

import pytest

from pipeline.finetune.replay_buffer import ReplayBuffer
from pipeline.records import Trajectory

CHI2_DF4_P001 = 18.467  # chi-square critical value, 4 degrees of freedom, p = 0.001


def make_trajectory(problem_id="p0", steps=("a",), log_reward=None, version=0):
    steps = list(steps)
    step_log_scores = [-0.1] * len(steps) if log_reward is None else [log_reward / len(steps)] * len(steps)
    return Trajectory(
        problem_id=problem_id,
        question=f"question {problem_id}",
        prompt=f"Q: question {problem_id}",
        steps=steps,
        step_log_scores=step_log_scores,
        answer_flags=[-1] * (len(steps) - 1) + [1],
        finished=True,
        log_reward=sum(step_log_scores),
        policy_version=version,
    )


def draw_counts(buffer, calls, n):
    counts = Counter()
    for _ in range(calls):
        counts.update(traj.steps[0] for traj in buffer.sample(n))
    return counts


def chi_square(counts, expected_probabilities, total):
    return sum((counts.get(name, 0) - total * p) ** 2 / (total * p) for name, p in expected_probabilities.items())


LOG_REWARDS = {"s0": -1.0, "s1": -2.0, "s2": -0.5, "s3": -3.0, "s4": -1.5}


@pytest.mark.parametrize("priority,temperature", [("softmax", 0.5), ("softmax", 2.0), ("proportional", 1.0)])
def test_sampling_frequencies_match_priorities(priority, temperature):
    buffer = ReplayBuffer(capacity=10, priority=priority, temperature=temperature, seed=1)
    buffer.add(make_trajectory(steps=[name], log_reward=r) for name, r in LOG_REWARDS.items())
    scale = temperature if priority == "softmax" else 1.0
    weights = {name: math.exp(r / scale) for name, r in LOG_REWARDS.items()}
    expected = {name: w / sum(weights.values()) for name, w in weights.items()}
    counts = draw_counts(buffer, calls=100, n=500)
    assert sum(counts.values()) == 50_000
    assert chi_square(counts, expected, 50_000) < CHI2_DF4_P001
    for name, p in expected.items():
        assert counts[name] / 50_000 == pytest.approx(p, abs=0.01)


def test_sampling_is_deterministic_per_seed():
    def run(seed):
        buffer = ReplayBuffer(capacity=10, seed=seed, recency_fraction=0.4, recency_window=2)
        buffer.add(make_trajectory(steps=[name], log_reward=r) for name, r in LOG_REWARDS.items())
        return [traj.steps[0] for traj in buffer.sample(50)]

    assert run(3) == run(3)
    assert run(3) != run(4)


def test_duplicates_are_stored_once_and_refresh_recency():
    buffer = ReplayBuffer(capacity=10, recency_fraction=1.0, recency_window=1)
    buffer.add([make_trajectory(steps=["x", "y"], version=1), make_trajectory(steps=["z"])])
    assert len(buffer) == 2
    assert {traj.steps[0] for traj in buffer.sample(20)} == {"z"}  # the most recent item
    buffer.add([make_trajectory(steps=["x", "y"], version=2)])
    assert len(buffer) == 2
    drawn = buffer.sample(20)
    assert {tuple(traj.steps) for traj in drawn} == {("x", "y")}  # refreshed: now the most recent
    assert drawn[0].policy_version == 1  # the stored record itself is kept
    buffer.add([make_trajectory(problem_id="p1", steps=["x", "y"])])  # same steps, other problem
    assert len(buffer) == 3


def test_eviction_drops_lowest_priority_then_oldest():
    buffer = ReplayBuffer(capacity=3)
    buffer.add(
        [
            make_trajectory(steps=["low-old"], log_reward=-5.0),
            make_trajectory(steps=["high"], log_reward=-1.0),
            make_trajectory(steps=["low-new"], log_reward=-5.0),
        ]
    )
    buffer.add([make_trajectory(steps=["mid"], log_reward=-2.0)])
    assert len(buffer) == 3
    kept = {traj.steps[0] for traj in buffer.sample(200)}
    assert kept == {"high", "low-new", "mid"}
    buffer.add([make_trajectory(steps=["worst"], log_reward=-9.0)])  # full: the newcomer is the lowest
    assert {traj.steps[0] for traj in buffer.sample(200)} == {"high", "low-new", "mid"}
    buffer.add([make_trajectory(steps=[f"best{i}"], log_reward=0.0) for i in range(5)])
    assert {traj.steps[0] for traj in buffer.sample(200)} == {"best2", "best3", "best4"}  # ties: newest kept


def test_recency_fraction_mixes_uniform_recent_draws():
    buffer = ReplayBuffer(capacity=100, recency_fraction=0.3, recency_window=10, seed=2)
    buffer.add(make_trajectory(steps=[f"old{i}"], log_reward=0.0) for i in range(90))
    # Priority draws never reach these (weight e^-50 against 90 x e^0): every one seen is a recency draw.
    buffer.add(make_trajectory(steps=[f"new{i}"], log_reward=-50.0) for i in range(10))
    counts = draw_counts(buffer, calls=100, n=200)
    recent = {name: c for name, c in counts.items() if name.startswith("new")}
    assert sum(recent.values()) == 100 * 60  # exactly round(0.3 * 200) per call
    assert len(recent) == 10 and all(abs(c / 6000 - 0.1) < 0.02 for c in recent.values())
    single = draw_counts(buffer, calls=4000, n=1)  # 0.3 * 1: one recent draw with probability 0.3
    assert sum(c for name, c in single.items() if name.startswith("new")) / 4000 == pytest.approx(0.3, abs=0.03)


def test_default_recency_window_is_a_tenth_of_capacity():
    buffer = ReplayBuffer(capacity=50, recency_fraction=1.0)
    assert buffer.recency_window == 5
    buffer.add(make_trajectory(steps=[f"t{i}"]) for i in range(20))
    assert {traj.steps[0] for traj in buffer.sample(300)} == {f"t{i}" for i in range(15, 20)}


def test_state_round_trips_through_json():
    buffer = ReplayBuffer(capacity=6, temperature=0.7, recency_fraction=0.5, recency_window=2, seed=5)
    buffer.add(
        make_trajectory(problem_id=f"p{i % 3}", steps=[f"s{i}", "end"], log_reward=-0.3 * i, version=i)
        for i in range(9)
    )
    buffer.sample(7)  # advance the generator: the resumed buffer must continue from here
    state = json.loads(json.dumps(buffer.state_dict()))
    resumed = ReplayBuffer(capacity=6, temperature=0.7, recency_fraction=0.5, recency_window=2, seed=999)
    resumed.load_state_dict(state)
    assert len(resumed) == len(buffer) == 6
    assert resumed.state_dict() == buffer.state_dict()
    assert resumed.sample(40) == buffer.sample(40)
    more = [make_trajectory(steps=["s0", "end"], problem_id="p0"), make_trajectory(steps=["new"], log_reward=-0.1)]
    buffer.add(more)
    resumed.add(more)
    assert resumed.sample(40) == buffer.sample(40)
    smaller = ReplayBuffer(capacity=2)
    smaller.load_state_dict(state)
    assert len(smaller) == 2


def test_samples_are_copies():
    buffer = ReplayBuffer(capacity=3)
    original = make_trajectory(steps=["a", "b"])
    buffer.add([original])
    original.steps.append("mutated after add")
    drawn = buffer.sample(1)[0]
    assert drawn.steps == ["a", "b"]
    drawn.answer_flags[0] = 0
    assert buffer.sample(1)[0].answer_flags == [-1, 1]


def test_invalid_records_and_calls_are_rejected_with_the_field_named():
    buffer = ReplayBuffer(capacity=3)
    with pytest.raises(ValueError, match="empty"):
        buffer.sample(1)
    assert buffer.sample(0) == []
    bad = dataclasses.replace(make_trajectory(steps=["a", "b"]), step_log_scores=[-0.1])
    with pytest.raises(ValueError, match="step_log_scores"):
        buffer.add([bad])
    with pytest.raises(ValueError, match="log_reward"):
        buffer.add([make_trajectory(log_reward=float("nan"))])
    bad = dataclasses.replace(make_trajectory(steps=["a", "b"]), answer_flags=[1])
    with pytest.raises(ValueError, match="answer_flags"):
        buffer.add([bad])
    with pytest.raises(ValueError, match="priority"):
        ReplayBuffer(priority="rank")
    with pytest.raises(ValueError, match="version"):
        buffer.load_state_dict({"version": 0})
    assert len(buffer) == 0
