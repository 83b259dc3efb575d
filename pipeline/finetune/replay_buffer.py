"""Prioritized replay buffer of complete trajectories for GFlowNet fine-tuning.

The buffer stores what a trajectory IS (problem, prompt, steps, PRM step log-scores, answer flags,
the frozen reference policy's log-probs), never what the trained policy thought of it: no policy
log-probs, no reward temperature. The objective re-scores every replayed trajectory under the
current policy in one teacher-forced pass and applies reward shaping and temperature itself, so a
checkpoint stays valid when either changes.

Rules (docs/losses.md, "Replay buffer", has the reasons):
- identity: (problem_id, tuple(steps)); adding a duplicate keeps the stored record and only marks
  it as the most recent;
- priority: ``StateLogRewards.priorities`` of the item under ``key`` (gfn.buffer_key; log_reward: the
  trained reward without the prior, i.e. PRM log-scores, the unfinished-state penalty and the outcome
  term over the reward temperature; log_u: the PRM log-scores alone), computed once when an item is
  added, by the function the asynchronous buffer ranks by too;
- capacity: after every `add`, the buffer keeps the `capacity` items with the highest priority,
  ties going to the more recent (so the item dropped is the lowest-priority, oldest one -- which may
  be one just added);
- `sample(n)`: a fraction `recency_fraction` of the draws (stochastic rounding of
  recency_fraction * n) is uniform over the `recency_window` most recently added or refreshed
  items, the rest is drawn with probability
      softmax:      p_i = exp(priority_i / temperature) / sum_j exp(priority_j / temperature)
      proportional: p_i = exp(priority_i) / sum_j exp(priority_j)   (= R_i / sum R; temperature unused)
  with ``replacement`` (gfn.buffer_replacement) each draw independent; without it the n items are
  distinct (at most all of them): the recent ones uniformly without replacement from the window,
  the others one after another among the items not yet drawn, each with p_i renormalised over
  those (``draw_without_replacement``);
- `replayed(fresh, fraction)`, what an update replays beside its fresh trajectories, by ``scope``
  (gfn.buffer_scope): global: `sample(round(len(fresh) * fraction))` over every item; per_question:
  for each question of ``fresh``, round(its fresh count * fraction) draws by the rule above among
  that question's own items only (its recency window: its ``recency_window`` newest), none when it
  has none; capacity and eviction stay global;
- `state_dict()` is plain JSON data (records, recency order, the numpy generator's state).
"""

from __future__ import annotations

import copy
import heapq
import math
from collections import Counter
from collections.abc import Iterable
from typing import Any

import numpy as np

from pipeline.config.loader import check_choice
from pipeline.config.schema import BufferKey, BufferScope
from pipeline.finetune.rewards import StateLogRewards
from pipeline.records import Trajectory

__all__ = ["ReplayBuffer", "draw_without_replacement"]

STATE_VERSION = 2


def _identity(trajectory: Trajectory) -> tuple[str, tuple[str, ...]]:
    return (trajectory.problem_id, tuple(trajectory.steps))


def draw_without_replacement(rng: np.random.Generator, logits: np.ndarray, k: int) -> np.ndarray:
    """k distinct indices of ``logits`` (n,), drawn one after another with probability
    softmax(logits) among those not yet drawn (Plackett-Luce), in the order drawn: Gumbel-top-k,
    the k largest of logits + independent Gumbel(0, 1) noise in decreasing order (Kool et al.,
    2019). Nothing is exponentiated, so logits hundreds of nats apart give a valid draw where
    softmax weights would underflow to zero. Needs 1 <= k <= n and finite logits."""
    keys = np.asarray(logits, dtype=np.float64) + rng.gumbel(size=len(logits))
    return np.argsort(-keys, kind="stable")[:k]


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
    scope:            "global" or "per_question": whose items ``replayed`` draws for a question
    key:              "log_reward" or "log_u": the ``priorities`` key the items are ranked by
    replacement:      draws with replacement (True) or distinct within one call (False)
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
        scope: str = "global",
        key: str = "log_reward",
        replacement: bool = True,
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
        check_choice(scope, BufferScope, "replay buffer: scope")
        check_choice(key, BufferKey, "replay buffer: key")
        self.scope, self.key, self.replacement = scope, key, bool(replacement)
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
        for trajectory, priority in zip(checked, self.reward.priorities(checked, self.key)):
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

    def _logits(self, keys: list) -> np.ndarray:
        """The priority draw's logits of the items ``keys``: priority / temperature (softmax) or priority."""
        priorities = np.array([self._priority[key] for key in keys], dtype=np.float64)
        return priorities / self.temperature if self.priority == "softmax" else priorities

    def probabilities(self) -> np.ndarray:
        """Priority-draw probability of each stored item, in recency order (oldest first)."""
        logits = self._logits(list(self._items))
        weights = np.exp(logits - logits.max())
        return weights / weights.sum()

    def sample(self, n: int) -> list[Trajectory]:
        """n trajectories drawn from every item (copies: mutating them leaves the buffer alone);
        without replacement at most all of them."""
        if n < 0:
            raise ValueError(f"replay buffer: sample: expected n >= 0, got {n}")
        if n == 0:
            return []
        if not self._items:
            raise ValueError("replay buffer: sample: the buffer is empty; add trajectories first")
        return self._draw(list(self._items), n)

    def replayed(self, fresh: list[Trajectory], fraction: float) -> list[Trajectory]:
        """The trajectories an update replays beside its ``fresh`` ones (every process's), drawn before
        those join the buffer, ``fraction`` (gfn.replay_fraction) of them by ``scope`` (module docstring)."""
        if not self._items:
            return []
        if self.scope == "global":
            return self.sample(int(round(len(fresh) * fraction)))
        held: dict[str, list] = {}
        for key in self._items:  # recency order, oldest first
            held.setdefault(key[0], []).append(key)
        drawn = []
        for question, count in Counter(t.problem_id for t in fresh).items():  # in order of first appearance
            n = int(round(count * fraction))
            if n and question in held:
                drawn.extend(self._draw(held[question], n))
        return drawn

    def _draw(self, keys: list, n: int) -> list[Trajectory]:
        """n >= 1 copies drawn from the items ``keys`` (non-empty, recency order) by the module's rule."""
        records = [self._items[key][1] for key in keys]
        if not self.replacement:
            n = min(n, len(records))
        expected_recent = self.recency_fraction * n
        n_recent = int(math.floor(expected_recent))
        if self.rng.random() < expected_recent - n_recent:
            n_recent += 1
        window = min(self.recency_window, len(records))
        if self.replacement:
            recent = len(records) - window + self.rng.integers(0, window, size=n_recent)
            logits = self._logits(keys)
            weights = np.exp(logits - logits.max())
            prioritized = self.rng.choice(len(records), size=n - n_recent, p=weights / weights.sum())
        else:
            recent = len(records) - window + self.rng.permutation(window)[: min(n_recent, window)]
            others = np.setdiff1d(np.arange(len(records)), recent)
            chosen = draw_without_replacement(self.rng, self._logits(keys)[others], n - len(recent))
            prioritized = others[chosen]
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
        self._priority = dict(zip(items, self.reward.priorities([traj for _, traj in items.values()], self.key)))
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
