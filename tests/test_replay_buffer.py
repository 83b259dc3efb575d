"""The replay buffer: priorities, dedup, eviction, recency mix, JSON state round trip; its scope
(global or per question, and what that does to TB-VarGrad's groups), priority key and draws with
or without replacement."""

from __future__ import annotations

import dataclasses
import itertools
import json
import math
from collections import Counter

import numpy as np
import pytest

from pipeline.config.schema import GFNConfig
from pipeline.finetune.objectives import build_objective
from pipeline.finetune.replay_buffer import ReplayBuffer
from pipeline.finetune.rewards import StateLogRewards
from pipeline.records import Trajectory
from tests.test_gflownet import HIDDEN, SCORES, TabularPolicy

# chi-square critical values at p = 0.001, by degrees of freedom
CHI2_DF2_P001, CHI2_DF4_P001, CHI2_DF5_P001 = 13.816, 18.467, 20.515


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


# ----------------------------------------------------------------------------- scope, key, replacement


def unanswered(trajectory):
    return dataclasses.replace(trajectory, answer_flags=[-1] * len(trajectory.steps))


def previous_rule(rng, records, priorities, n, temperature, recency_fraction, recency_window):
    """The draw before gfn.buffer_scope/buffer_key/buffer_replacement existed, written out: the
    defaults must reproduce it number for number."""
    expected_recent = recency_fraction * n
    n_recent = int(math.floor(expected_recent))
    if rng.random() < expected_recent - n_recent:
        n_recent += 1
    window = min(recency_window, len(records))
    recent = len(records) - window + rng.integers(0, window, size=n_recent)
    logits = np.array(priorities) / temperature
    weights = np.exp(logits - logits.max())
    prioritized = rng.choice(len(records), size=n - n_recent, p=weights / weights.sum())
    return [records[i] for i in rng.permutation(np.concatenate([recent, prioritized]))]


def test_the_default_settings_draw_exactly_as_the_previous_rule():
    reward = StateLogRewards(reward_temperature=0.25)
    buffer = ReplayBuffer(capacity=8, temperature=0.7, recency_fraction=0.5, recency_window=3, seed=4, reward=reward)
    items = [make_trajectory(f"p{i % 3}", [f"s{i}"], log_reward=-0.3 * i) for i in range(6)]
    items[2] = unanswered(items[2])
    buffer.add(items)
    assert (buffer.scope, buffer.key, buffer.replacement) == ("global", "log_reward", True)
    rng = np.random.default_rng(4)
    priorities = reward.priorities(items)
    assert priorities[2] == pytest.approx((-0.6 - 10.0) / 0.25)  # the trained reward: penalty over temperature
    fresh = [make_trajectory("new", [f"f{i}"]) for i in range(7)]
    for _ in range(5):
        expected = previous_rule(rng, items, priorities, round(7 * 0.5), 0.7, 0.5, 3)
        assert buffer.replayed(fresh, 0.5) == expected
        assert buffer.sample(9) == previous_rule(rng, items, priorities, 9, 0.7, 0.5, 3)


def successive_set_probabilities(weights: dict, n: int) -> dict:
    """Exact probability of each unordered set of n items drawn one after another without replacement,
    each with probability w_i / (sum of the w of those not yet drawn): the sum over the set's orders."""
    out: dict = {}
    for order in itertools.permutations(weights, n):
        p, left = 1.0, sum(weights.values())
        for name in order:
            p *= weights[name] / left
            left -= weights[name]
        out[frozenset(order)] = out.get(frozenset(order), 0.0) + p
    return out


@pytest.mark.parametrize("priority,temperature", [("softmax", 0.5), ("proportional", 1.0)])
def test_without_replacement_a_draw_is_distinct_items_by_the_sequential_rule(priority, temperature):
    buffer = ReplayBuffer(capacity=10, priority=priority, temperature=temperature, replacement=False, seed=6)
    names = ["s0", "s1", "s2", "s3"]
    buffer.add(make_trajectory(steps=[name], log_reward=LOG_REWARDS[name]) for name in names)
    scale = temperature if priority == "softmax" else 1.0
    expected = successive_set_probabilities({name: math.exp(LOG_REWARDS[name] / scale) for name in names}, 2)
    draws = 6000
    counts = Counter()
    for _ in range(draws):
        drawn = [traj.steps[0] for traj in buffer.sample(2)]
        assert len(set(drawn)) == 2
        counts[frozenset(drawn)] += 1
    assert chi_square(counts, expected, draws) < CHI2_DF5_P001, (counts, expected)
    assert sorted(traj.steps[0] for traj in buffer.sample(9)) == names  # at most every item, once


def test_without_replacement_recent_draws_come_first_from_the_window_then_the_rest_by_priority():
    """recency 0.5 of n = 2: one draw uniform over the 2 newest, the other by priority among the 3 left."""
    buffer = ReplayBuffer(capacity=10, recency_fraction=0.5, recency_window=2, replacement=False, seed=8)
    names = ["s0", "s1", "s2", "s3"]  # s2, s3 the newest
    buffer.add(make_trajectory(steps=[name], log_reward=LOG_REWARDS[name]) for name in names)
    weights = {name: math.exp(LOG_REWARDS[name]) for name in names}
    expected: dict = {}
    for recent in ("s2", "s3"):
        rest = {name: w for name, w in weights.items() if name != recent}
        for other, w in rest.items():
            key = frozenset((recent, other))
            expected[key] = expected.get(key, 0.0) + 0.5 * w / sum(rest.values())
    draws = 6000
    counts = Counter(frozenset(traj.steps[0] for traj in buffer.sample(2)) for _ in range(draws))
    assert set(counts) <= set(expected)  # never the two oldest together: one draw is always recent
    assert chi_square(counts, expected, draws) < CHI2_DF4_P001, (counts, expected)


def test_per_question_scope_replays_each_fresh_questions_own_trajectories():
    """Questions a (3 stored), b (2 stored), c (stored, not in the update), d (fresh only): with
    replay_fraction 0.5 an update of 4 a's, 2 b's and 2 d's replays 2 of a's and 1 of b's, each by
    the priority rule among that question's items alone; global scope draws 4 from all of them."""
    stored = {"a0": -0.5, "a1": -1.0, "a2": -2.0, "b0": -1.0, "b1": -3.0, "c0": 0.0}
    buffer = ReplayBuffer(capacity=20, scope="per_question", seed=9)
    buffer.add(make_trajectory(name[0], [name], log_reward=value) for name, value in stored.items())
    fresh = [make_trajectory(q, [f"new{q}{i}"]) for q, n in (("a", 4), ("b", 2), ("d", 2)) for i in range(n)]
    draws = 3000
    counts = Counter()
    for _ in range(draws):
        drawn = buffer.replayed(fresh, 0.5)
        assert Counter(traj.problem_id for traj in drawn) == {"a": 2, "b": 1}
        counts.update(traj.steps[0] for traj in drawn)
    a_weights = {name: math.exp(value) for name, value in stored.items() if name[0] == "a"}
    expected = {name: w / sum(a_weights.values()) for name, w in a_weights.items()}
    assert chi_square(counts, expected, 2 * draws) < CHI2_DF2_P001, counts
    everything = ReplayBuffer(capacity=20, seed=9)
    everything.add(make_trajectory(name[0], [name], log_reward=value) for name, value in stored.items())
    drawn = [traj.problem_id for _ in range(200) for traj in everything.replayed(fresh, 0.5)]
    assert len(drawn) == 800 and set(drawn) == {"a", "b", "c"}


def test_the_priority_key_ranks_evicts_and_draws_by_the_trained_reward_or_the_prm_log_scores():
    """A short unanswered solution (sum log U = -0.1) against an answered one (-2.0), reward temperature
    0.5, penalty -10: log_reward ranks them (-0.1 - 10) / 0.5 = -20.2 and -4.0, log_u -0.1 and -2.0."""
    reward = StateLogRewards(reward_temperature=0.5, unfinished_log_reward=-10.0)
    short = unanswered(make_trajectory(steps=["short"], log_reward=-0.1))
    answered = make_trajectory(steps=["answered", "end"], log_reward=-2.0)
    for key, priorities in (("log_reward", [-20.2, -4.0]), ("log_u", [-0.1, -2.0])):
        buffer = ReplayBuffer(capacity=2, reward=reward, key=key)
        buffer.add([short, answered])
        weights = np.exp(np.array(priorities) - max(priorities))
        assert buffer.probabilities().tolist() == pytest.approx((weights / weights.sum()).tolist())
        kept = ReplayBuffer(capacity=1, reward=reward, key=key)
        kept.add([short, answered])
        assert kept.sample(1)[0].steps[0] == ("answered" if key == "log_reward" else "short")
        resumed = ReplayBuffer(capacity=2, reward=reward, key=key)
        resumed.load_state_dict(json.loads(json.dumps(buffer.state_dict())))
        assert resumed.probabilities().tolist() == pytest.approx(buffer.probabilities().tolist())


def test_a_bad_scope_or_key_is_refused_naming_it():
    with pytest.raises(ValueError, match="replay buffer: scope must be one of global, per_question, got 'question'"):
        ReplayBuffer(scope="question")
    with pytest.raises(ValueError, match="replay buffer: key must be one of log_reward, log_u, got 'log_R'"):
        ReplayBuffer(key="log_R")


def tabular_trajectory(problem_id, steps):
    scores = [math.log(SCORES[step]) for step in steps]
    return Trajectory(
        problem_id=problem_id,
        question=problem_id,
        prompt=problem_id,
        steps=list(steps),
        step_log_scores=scores,
        answer_flags=[-1] * (len(steps) - 1) + [1],
        finished=True,
        log_reward=sum(scores),
    )


def update_losses(scope, stored, fresh, replay_fraction=0.5):
    """{(question, steps): TB-VarGrad loss} of the rows of one update, and the replayed rows' keys."""
    cfg = GFNConfig(loss="tb_vargrad", replay_fraction=replay_fraction, buffer_scope=scope, micro_batch_size=64)
    objective = build_objective(cfg, TabularPolicy(), hidden_size=HIDDEN)
    objective.buffer.add(stored)
    losses, replayed = {}, []
    for chunk, _ in objective.rollout(fresh, [fresh]):
        values, _ = objective.trajectory_losses(chunk)
        for trajectory, value in zip(chunk, values.tolist()):
            key = (trajectory.problem_id, tuple(trajectory.steps))
            losses[key] = value
            if id(trajectory) not in {id(t) for t in fresh}:
                replayed.append(key)
    return losses, replayed


def test_under_tb_vargrad_only_per_question_replay_joins_the_questions_group():
    """Questions that never recur (the demo draws 448 of 1,000 without repeating one): globally
    replayed rows of past questions, one each, form groups of their own, whose VarGrad loss is exactly
    0, and leave the fresh rows' losses as they are. Per question, the replayed rows are the
    question's own earlier ones: they join its group, with a loss of their own, and move its log Z."""
    fresh = [tabular_trajectory("q", steps) for steps in (["A"], ["B"], ["A", "B"], ["C"])]
    past = [tabular_trajectory("old0", ["B", "B"]), tabular_trajectory("old1", ["C", "A"])]
    alone, _ = update_losses("global", [], fresh, replay_fraction=0.0)

    losses, replayed = update_losses("global", past, fresh)
    assert len(replayed) == 2 and {question for question, _ in replayed} <= {"old0", "old1"}
    assert all(losses[key] == 0.0 for key in replayed)
    assert {key: losses[key] for key in alone} == pytest.approx(alone, abs=1e-6)

    own = [tabular_trajectory("q", ["C", "C"]), tabular_trajectory("q", ["B", "A", "A"])]
    losses, replayed = update_losses("per_question", past + own, fresh)
    assert len(replayed) == 2 and {question for question, _ in replayed} == {"q"}
    assert min(losses[key] for key in replayed) > 1e-3
    assert max(abs(losses[key] - alone[key]) for key in alone) > 1e-3
