"""Prioritized replay buffer of complete trajectories for GFlowNet fine-tuning.

The buffer stores what a trajectory IS (problem, prompt, steps, PRM step log-scores, answer flags,
the frozen reference policy's log-probs), never what the trained policy thought of it: no policy
log-probs, no reward temperature. The objective re-scores every replayed trajectory under the
current policy in one teacher-forced pass and applies reward shaping and temperature itself, so a
checkpoint stays valid when either changes.

Rules (docs/losses.md, "Replay buffer", has the reasons):
- identity: (problem_id, tuple(steps)); adding a duplicate keeps the stored record and only marks
  it as the most recent;
- priority: the trained reward without the prior (``StateLogRewards.priorities``: PRM log-scores,
  the unfinished-state penalty and the outcome term over the reward temperature), computed once
  when an item is added, by the function the asynchronous buffer ranks by too;
- capacity: after every `add`, the buffer keeps the `capacity` items with the highest priority,
  ties going to the more recent (so the item dropped is the lowest-priority, oldest one -- which may
  be one just added);
- `sample(n)`: with replacement; a fraction `recency_fraction` of the draws (stochastic rounding
  of recency_fraction * n) is uniform over the `recency_window` most recently added or refreshed
  items, the rest is drawn with probability
      softmax:      p_i = exp(priority_i / temperature) / sum_j exp(priority_j / temperature)
      proportional: p_i = exp(priority_i) / sum_j exp(priority_j)   (= R_i / sum R; temperature unused)
- `state_dict()` is plain JSON data (records, recency order, the numpy generator's state).
"""

from __future__ import annotations

import copy
import heapq
import math
from collections.abc import Iterable
from typing import Any

import numpy as np

from pipeline.finetune.rewards import StateLogRewards
from pipeline.records import Trajectory

__all__ = ["ReplayBuffer"]

STATE_VERSION = 2


def _identity(trajectory: Trajectory) -> tuple[str, tuple[str, ...]]:
    return (trajectory.problem_id, tuple(trajectory.steps))


def _checked_copy(trajectory: Trajectory) -> Trajectory:
    """A copy of the trajectory, built through every rule of the Trajectory record (types, one
    score and flag per step, finite log_reward), with the field named."""
    if not isinstance(trajectory, Trajectory):
        raise TypeError(f"replay buffer: expected Trajectory records, got {type(trajectory).__name__}")
    return Trajectory.from_json(trajectory.to_json(), f"trajectory of problem {trajectory.problem_id!r}")


class ReplayBuffer:
    """Prioritized, deduplicated replay of complete trajectories (rules in the module docstring).

    capacity:         most trajectories kept
    priority:         "softmax" (p ~ exp(log_reward / temperature)) or "proportional" (p ~ reward)
    temperature:      softmax temperature (> 0); not used by "proportional"
    recency_fraction: m in [0, 1], the share of draws taken uniformly from the most recent items
    seed:             seed of the buffer's own numpy Generator (sampling is deterministic)
    recency_window:   how many of the most recently added/refreshed items count as recent;
                      default max(1, capacity // 10)
    reward:           the trained reward's shaping, whose ``priorities`` rank the items
    """

    def __init__(
        self,
        capacity: int = 1000,
        priority: str = "softmax",
        temperature: float = 1.0,
        recency_fraction: float = 0.0,
        seed: int = 0,
        recency_window: int | None = None,
        reward: StateLogRewards | None = None,
    ) -> None:
        if capacity < 1:
            raise ValueError(f"replay buffer: capacity: expected >= 1, got {capacity}")
        if priority not in ("softmax", "proportional"):
            raise ValueError(f"replay buffer: priority: expected 'softmax' or 'proportional', got {priority!r}")
        if not temperature > 0:
            raise ValueError(f"replay buffer: temperature: expected > 0, got {temperature}")
        if not 0.0 <= recency_fraction <= 1.0:
            raise ValueError(f"replay buffer: recency_fraction: expected in [0, 1], got {recency_fraction}")
        if recency_window is not None and recency_window < 1:
            raise ValueError(f"replay buffer: recency_window: expected >= 1, got {recency_window}")
        self.capacity = int(capacity)
        self.priority = priority
        self.temperature = float(temperature)
        self.recency_fraction = float(recency_fraction)
        self.recency_window = int(recency_window) if recency_window is not None else max(1, self.capacity // 10)
        self.rng = np.random.default_rng(seed)
        self.reward = reward if reward is not None else StateLogRewards()
        self._priority: dict[tuple[str, tuple[str, ...]], float] = {}  # the reward.priorities of each item
        # key -> (stamp, trajectory); dict order is recency order (oldest first), because a
        # refreshed item is moved to the end. stamp = insertion counter, the eviction tie-break.
        self._items: dict[tuple[str, tuple[str, ...]], tuple[int, Trajectory]] = {}
        self._counter = 0

    def __len__(self) -> int:
        return len(self._items)

    def add(self, trajectories: Iterable[Trajectory]) -> None:
        """Insert trajectories (duplicates refresh recency), then evict down to capacity."""
        checked = [_checked_copy(trajectory) for trajectory in trajectories]
        for trajectory, priority in zip(checked, self.reward.priorities(checked)):
            key = _identity(trajectory)
            stored = self._items.pop(key, None)
            kept = stored[1] if stored is not None else trajectory
            self._items[key] = (self._counter, kept)
            self._priority.setdefault(key, priority)  # the kept record's
            self._counter += 1
        self._evict()

    def forget_before(self, version: int) -> int:
        """Drop the trajectories sampled by a policy older than ``version`` (asynchronous mode's
        staleness bound); returns how many were dropped."""
        stale = [key for key, (_, trajectory) in self._items.items() if trajectory.policy_version < version]
        for key in stale:
            del self._items[key], self._priority[key]
        return len(stale)

    def _evict(self) -> None:
        excess = len(self._items) - self.capacity
        if excess <= 0:
            return
        lowest = heapq.nsmallest(excess, self._items.items(), key=lambda item: (self._priority[item[0]], item[1][0]))
        for key, _ in lowest:
            del self._items[key], self._priority[key]

    def probabilities(self) -> np.ndarray:
        """Priority-draw probability of each stored item, in recency order (oldest first)."""
        priorities = np.array([self._priority[key] for key in self._items], dtype=np.float64)
        logits = priorities / self.temperature if self.priority == "softmax" else priorities
        logits = logits - logits.max()
        weights = np.exp(logits)
        return weights / weights.sum()

    def sample(self, n: int) -> list[Trajectory]:
        """n trajectories drawn with replacement (copies: mutating them leaves the buffer alone)."""
        if n < 0:
            raise ValueError(f"replay buffer: sample: expected n >= 0, got {n}")
        if n == 0:
            return []
        if not self._items:
            raise ValueError("replay buffer: sample: the buffer is empty; add trajectories first")
        records = [traj for _, traj in self._items.values()]
        expected_recent = self.recency_fraction * n
        n_recent = int(math.floor(expected_recent))
        if self.rng.random() < expected_recent - n_recent:
            n_recent += 1
        window = min(self.recency_window, len(records))
        recent = len(records) - window + self.rng.integers(0, window, size=n_recent)
        prioritized = self.rng.choice(len(records), size=n - n_recent, p=self.probabilities())
        order = self.rng.permutation(np.concatenate([recent, prioritized]))
        return [copy.deepcopy(records[index]) for index in order]

    def state_dict(self) -> dict[str, Any]:
        """Plain JSON-able state: records in recency order with their stamps, counter, generator state."""
        return {
            "version": STATE_VERSION,
            "counter": self._counter,
            "items": [{"stamp": stamp, "trajectory": traj.to_json()} for stamp, traj in self._items.values()],
            "rng": _jsonable(self.rng.bit_generator.state),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore records, recency and the generator; the constructor's settings stay in force
        (a smaller capacity evicts by the usual rule)."""
        if state.get("version") != STATE_VERSION:
            raise ValueError(
                f"replay buffer state: field version: expected {STATE_VERSION}, got {state.get('version')!r}"
            )
        items: dict[tuple[str, tuple[str, ...]], tuple[int, Trajectory]] = {}
        for position, record in enumerate(state["items"]):
            try:
                trajectory = Trajectory.from_json(record["trajectory"], f"replay buffer state: items[{position}]")
                stamp = int(record["stamp"])
            except KeyError as error:
                raise ValueError(f"replay buffer state: items[{position}]: missing field {error}") from None
            items[_identity(trajectory)] = (stamp, trajectory)
        bit_generator = getattr(np.random, state["rng"]["bit_generator"])()
        bit_generator.state = state["rng"]
        self._items = items
        self._priority = dict(zip(items, self.reward.priorities([traj for _, traj in items.values()])))
        self._counter = int(state["counter"])
        self.rng = np.random.Generator(bit_generator)
        self._evict()


def _jsonable(value: Any) -> Any:
    """numpy scalars/arrays inside a bit generator state -> plain Python (JSON keeps big ints)."""
    if isinstance(value, dict):
        return {key: _jsonable(item) for key, item in value.items()}
    if isinstance(value, np.ndarray):
        return value.tolist()
    if isinstance(value, np.generic):
        return value.item()
    return value
