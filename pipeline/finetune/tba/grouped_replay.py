"""The asynchronous mode's buffer (TBA, Bartoldson et al., sec. 4): completions kept per question,
drawn as B questions x K distinct completions each.

TB-VarGrad estimates log Z per question from the question's rows in the batch: a question with one
row has exactly zero loss, and two copies of one completion add nothing a single one does not. So
a draw is a list of groups, one per question, each of K distinct completions.

Rules (docs/async.md, "The buffer"):
- identity: (problem_id, tuple(steps)); a completion seen again replaces the stored one (it carries
  the newer policy_version) and counts as just added;
- capacity, per question then overall: after every ``add``, a question holding more than
  ``question_capacity`` completions keeps its newest (TBA keeps a buffer per question); then,
  beyond ``capacity`` completions in all, the oldest (first added) go (FIFO);
- a question is eligible once it holds K = ``per_question`` distinct completions;
- ``sample(questions, latest)``: up to ``questions`` distinct eligible questions. For each, with
  probability m = ``recency`` the question and its K completions are taken from the completions
  sampled by the newest weights that gave some question K completions: a question with K of them,
  uniformly, and K of them uniformly without replacement. Otherwise (or when no such question is
  left) a question is taken uniformly among the eligible ones left and its K completions one after
  another without replacement (Plackett-Luce), each with probability among those left
      softmax: p_i ~ exp(priority_i / temperature)     uniform: p_i = 1 / n
  where priority_i is ``StateLogRewards.priorities`` under ``key`` (gfn.buffer_key; log_reward: the
  trained reward without the prior; log_u: the PRM log-scores alone),
  drawn by Gumbel-top-k on the logits (never exponentiated: rewards hundreds of nats apart draw);
- ``forget_before(version)`` drops completions sampled by weights older than ``version`` (the
  staleness bound);
- ``state_dict()`` is plain JSON data (records in order, the numpy generator's state).
"""

from __future__ import annotations

import copy
from collections import Counter
from collections.abc import Iterable
from typing import Any

import numpy as np

from pipeline.config.asynchronous import AsyncPriority
from pipeline.config.loader import check_choice
from pipeline.config.schema import BufferKey
from pipeline.finetune.replay_buffer import _checked_copy, _identity, _jsonable, draw_without_replacement
from pipeline.finetune.rewards import StateLogRewards
from pipeline.records import Trajectory

__all__ = ["GroupedReplay", "draw_without_replacement"]
STATE_VERSION = 1


class GroupedReplay:
    """Completions per question; draws of B questions x K distinct completions (module docstring).

    capacity:     most completions kept in all (FIFO beyond)
    per_question: K, the completions drawn per question (>= 1)
    priority:     "softmax" (p ~ exp(priority / temperature)) or "uniform", within a question
    temperature:  softmax temperature (> 0)
    recency:      m in [0, 1], the probability that a question's group comes from the newest weights' completions
    seed:         seed of the buffer's numpy Generator (draws are deterministic)
    question_capacity: most completions kept per question, its newest (None: no bound but ``capacity``)
    reward:       the trained reward's shaping, whose ``priorities`` rank a question's completions
    key:          "log_reward" or "log_u": the ``priorities`` key (gfn.buffer_key)
    """

    def __init__(
        self,
        capacity: int,
        per_question: int,
        priority: str = "softmax",
        temperature: float = 1.0,
        recency: float = 0.0,
        seed: int = 0,
        question_capacity: int | None = None,
        reward: StateLogRewards | None = None,
        key: str = "log_reward",
    ) -> None:
        if capacity < 1:
            raise ValueError(f"grouped replay: capacity: expected >= 1, got {capacity}")
        if per_question < 1:
            raise ValueError(f"grouped replay: per_question: expected >= 1, got {per_question}")
        check_choice(priority, AsyncPriority, "grouped replay: priority")
        self.key = check_choice(key, BufferKey, "grouped replay: key")
        if not temperature > 0:
            raise ValueError(f"grouped replay: temperature: expected > 0, got {temperature}")
        if not 0.0 <= recency <= 1.0:
            raise ValueError(f"grouped replay: recency: expected in [0, 1], got {recency}")
        if question_capacity is not None and question_capacity < per_question:
            raise ValueError(
                f"grouped replay: question_capacity: expected >= per_question = {per_question}, got {question_capacity}"
            )
        self.capacity, self.per_question = int(capacity), int(per_question)
        self.question_capacity = capacity if question_capacity is None else int(question_capacity)
        self.reward = reward if reward is not None else StateLogRewards()
        self.priority, self.temperature, self.recency = priority, float(temperature), float(recency)
        self.rng = np.random.default_rng(seed)
        self._items: dict[tuple[str, tuple[str, ...]], Trajectory] = {}  # dict order: oldest first
        self._priority: dict[tuple[str, tuple[str, ...]], float] = {}  # the reward.priorities of each item

    def __len__(self) -> int:
        return len(self._items)

    def add(self, trajectories: Iterable[Trajectory]) -> int:
        """Insert checked copies (a repeat replaces the stored completion and counts as new), then
        drop the oldest beyond each question's capacity and beyond the capacity; returns how many
        were dropped."""
        return self._insert([_checked_copy(trajectory) for trajectory in trajectories])

    def add_json(self, objects: list, where: str) -> int:
        """``add`` for trajectories as parsed JSON objects (what a searcher sends): each record is
        built, and checked, once by Trajectory.from_json (errors name ``where``); nothing is
        inserted unless every object is a valid trajectory. Returns how many were dropped."""
        if not isinstance(objects, list):
            raise ValueError(f"{where}: expected a JSON list of trajectories, got {type(objects).__name__}")
        return self._insert([Trajectory.from_json(obj, where) for obj in objects])

    def _insert(self, checked: list[Trajectory]) -> int:
        for trajectory, priority in zip(checked, self.reward.priorities(checked, self.key)):
            key = _identity(trajectory)
            self._items.pop(key, None)
            self._items[key] = trajectory
            self._priority[key] = priority
        held = Counter(problem_id for problem_id, _ in self._items)
        over = {q: n - self.question_capacity for q, n in held.items() if n > self.question_capacity}
        dropped = []
        for key in self._items:  # oldest first: a question keeps its newest
            if over.get(key[0], 0) > 0:
                over[key[0]] -= 1
                dropped.append(key)
        self._drop(dropped)
        excess = max(0, len(self._items) - self.capacity)
        self._drop(list(self._items)[:excess])
        return len(dropped) + excess

    def _drop(self, keys: Iterable[tuple[str, tuple[str, ...]]]) -> None:
        for key in keys:
            del self._items[key], self._priority[key]

    def forget_before(self, version: int) -> int:
        """Drop completions sampled by weights older than ``version``; returns how many."""
        stale = [key for key, trajectory in self._items.items() if trajectory.policy_version < version]
        self._drop(stale)
        return len(stale)

    def questions(self) -> dict[str, list[Trajectory]]:
        """problem_id -> its completions, oldest first (questions in order of their oldest completion)."""
        groups: dict[str, list[Trajectory]] = {}
        for trajectory in self._items.values():
            groups.setdefault(trajectory.problem_id, []).append(trajectory)
        return groups

    def eligible(self) -> int:
        """How many questions hold at least K distinct completions."""
        return sum(len(group) >= self.per_question for group in self.questions().values())

    def _logits(self, group: list[Trajectory]) -> np.ndarray:
        """The priority draw's logits of a question's completions: priority / temperature, or zeros (uniform)."""
        if self.priority == "uniform":
            return np.zeros(len(group))
        return np.array([self._priority[_identity(t)] for t in group], dtype=np.float64) / self.temperature

    def sample(self, questions: int, latest: int) -> tuple[list[list[Trajectory]], int]:
        """(groups, recent): at most ``questions`` groups of K distinct completions, one group per
        question, copies; ``recent`` of them were taken from the completions of the newest weights
        (at most ``latest``) that gave some question K completions. The weights the trainer has just
        published have none until a searcher finishes a round with them, so "newest" is the newest
        version present in that sense, not ``latest`` itself (with ``latest`` alone the recency draw
        would find nothing whenever searchers lag the trainer by a round)."""
        drawn, recent = self._draw(questions, latest)
        return [[copy.deepcopy(trajectory) for trajectory in group] for group in drawn], recent

    def sample_json(self, questions: int, latest: int) -> tuple[list[list[dict[str, Any]]], int]:
        """``sample``'s draw with each completion written as its JSON object (Trajectory.to_json, new
        objects: no copy of the records is made first), what the store sends the trainer."""
        drawn, recent = self._draw(questions, latest)
        return [[trajectory.to_json() for trajectory in group] for group in drawn], recent

    def _draw(self, questions: int, latest: int) -> tuple[list[list[Trajectory]], int]:
        """``sample``'s groups of the stored completions themselves (not copies)."""
        if questions < 0:
            raise ValueError(f"grouped replay: sample: expected questions >= 0, got {questions}")
        k = self.per_question
        groups = self.questions()
        eligible = [q for q, group in groups.items() if len(group) >= k]
        newest = self.newest_complete_version(groups, eligible, latest)
        fresh = {q: [t for t in groups[q] if t.policy_version == newest] for q in eligible}
        recent_left = [q for q in eligible if len(fresh[q]) >= k]
        left = list(eligible)
        drawn, recent = [], 0
        for _ in range(min(questions, len(eligible))):
            if recent_left and self.rng.random() < self.recency:
                question = recent_left[int(self.rng.integers(len(recent_left)))]
                pool = fresh[question]
                chosen = draw_without_replacement(self.rng, np.zeros(len(pool)), k)
                recent += 1
            else:
                question = left[int(self.rng.integers(len(left)))]
                pool = groups[question]
                chosen = draw_without_replacement(self.rng, self._logits(pool), k)
            left.remove(question)
            if question in recent_left:
                recent_left.remove(question)
            drawn.append([pool[int(i)] for i in chosen])
        return drawn, recent

    def newest_complete_version(
        self, groups: dict[str, list[Trajectory]], eligible: list[str], latest: int
    ) -> int | None:
        """The newest weights version <= ``latest`` of which some eligible question holds K
        completions (None: no such version)."""
        complete = set()
        for q in eligible:
            counts = Counter(t.policy_version for t in groups[q] if t.policy_version <= latest)
            complete.update(version for version, n in counts.items() if n >= self.per_question)
        return max(complete, default=None)

    def state_dict(self) -> dict[str, Any]:
        """Plain JSON-able state: the completions oldest first and the generator's state."""
        return {
            "version": STATE_VERSION,
            "items": [t.to_json() for t in self._items.values()],
            "rng": _jsonable(self.rng.bit_generator.state),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore the completions and the generator; the constructor's settings stay in force."""
        if state.get("version") != STATE_VERSION:
            raise ValueError(
                f"grouped replay state: field version: expected {STATE_VERSION}, got {state.get('version')!r}"
            )
        items = {}
        for position, record in enumerate(state["items"]):
            trajectory = Trajectory.from_json(record, f"grouped replay state: items[{position}]")
            items[_identity(trajectory)] = trajectory
        bit_generator = getattr(np.random, state["rng"]["bit_generator"])()
        bit_generator.state = state["rng"]
        self._items, self._priority, self.rng = {}, {}, np.random.Generator(bit_generator)
        self.add(items.values())
