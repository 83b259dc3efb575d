"""Step-level rewards of the GFlowNet (paper 4.1) with the shaping that keeps them honest.

log R(s_i) = (1/tau) * ( sum_{k<=i} log U(s_k|s_{k-1})         PRM step scores (paper 4.1)
                        + [s_i has no final answer] * unfinished_log_reward  (s_0 included)
                        + [s_i's answer is wrong] * outcome_coef * log(outcome_floor) )  (off by default)
           + reference_prior_coef * log pi_ref(s_1..s_i | s_0)  (appendix F prior; off by default)

Every state of a step-level trajectory can terminate, and a product of scores in (0, 1) is
largest for the shortest prefix: without the second line, stopping at s_0 or before the answer
would be the cheapest high reward. A state counts as answered when its LAST step states a final
answer (pipeline.grading.extract_answer), so stopping right after the answer line is the only
unpenalised way to finish. The inverse temperature 1/tau tempers the whole shaped reward, penalty
included: tempering the PRM term alone would let a sharpened (tau < 1) reward of a long answered
solution fall below the fixed penalty of stopping at s_0.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from pipeline.config.loader import check_choice
from pipeline.config.schema import BufferKey

NO_ANSWER, WRONG_ANSWER, CORRECT_ANSWER = -1, 0, 1


def shaped_log_rewards(
    step_log_scores: Tensor,
    answer_flags: Tensor,
    mask: Tensor,
    *,
    reward_temperature: float = 1.0,
    unfinished_log_reward: float = -10.0,
    outcome_coef: float = 0.0,
    outcome_floor: float = 0.01,
    ref_step_logprobs: Tensor | None = None,
    reference_prior_coef: float = 0.0,
) -> Tensor:
    """log R(s_i) for i = 0..T of a batch of trajectories.

    step_log_scores:   (B, T) log U(s_k|s_{k-1}) of step k (PRM log-scores; padding ignored)
    answer_flags:      (B, T) int, per step: -1 no final answer, 0 wrong answer, 1 correct answer
    mask:              (B, T) bool, True where step k exists
    ref_step_logprobs: (B, T) log pi_ref(s_k|s_{k-1}) when reference_prior_coef > 0
    returns:           (B, T+1) log R(s_i); padding positions hold the last valid value
    """
    if reward_temperature <= 0:
        raise ValueError(f"reward_temperature must be > 0, got {reward_temperature}")
    maskf = mask.to(step_log_scores.dtype)
    batch = step_log_scores.shape[0]
    zeros = step_log_scores.new_zeros(batch, 1)
    cumulative = torch.cat([zeros, torch.cumsum(step_log_scores * maskf, dim=1)], dim=1)
    flags = torch.cat([answer_flags.new_full((batch, 1), NO_ANSWER), answer_flags], dim=1)
    log_r = cumulative + torch.where(flags == NO_ANSWER, unfinished_log_reward, 0.0).to(cumulative.dtype)
    if outcome_coef:
        wrong = (flags == WRONG_ANSWER).to(cumulative.dtype)
        log_r = log_r + outcome_coef * math.log(outcome_floor) * wrong
    log_r = log_r / reward_temperature
    if reference_prior_coef:
        if ref_step_logprobs is None:
            raise ValueError("reference_prior_coef > 0 needs ref_step_logprobs")
        log_r = log_r + reference_prior_coef * torch.cat([zeros, torch.cumsum(ref_step_logprobs * maskf, dim=1)], dim=1)
    return log_r


def pad_rows(rows: Sequence[Sequence[float]], width: int, value: float = 0.0, dtype=torch.float32) -> Tensor:
    """(len(rows), width) tensor of ragged rows, right-padded with ``value``."""
    out = torch.full((len(rows), width), value, dtype=dtype)
    for i, row in enumerate(rows):
        if len(row):
            out[i, : len(row)] = torch.as_tensor(list(row), dtype=dtype)
    return out


@dataclass(frozen=True)
class StateLogRewards:
    """The GFlowNet's reward shaping: trajectories -> (log R(s_i) (B, T+1), mask (B, T)).

    ``shaped_log_rewards`` of the trajectories' stored PRM log-scores, answer flags and (for the
    appendix-F prior) reference step log-probs, with the settings of the gfn config section.
    """

    reward_temperature: float = 1.0
    unfinished_log_reward: float = -10.0
    outcome_coef: float = 0.0
    outcome_floor: float = 0.01
    reference_prior_coef: float = 0.0

    def __call__(self, trajectories: Sequence) -> tuple[Tensor, Tensor]:
        return self._shaped(trajectories, prior=True, dtype=torch.float32)

    def _shaped(self, trajectories: Sequence, prior: bool, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
        """(log R(s_i) (B, T+1), mask (B, T)) in ``dtype``, with the appendix-F prior when ``prior``."""
        width = max(len(t.steps) for t in trajectories)
        mask = pad_rows([[1.0] * len(t.steps) for t in trajectories], width).bool()
        scores = pad_rows([t.step_log_scores for t in trajectories], width, dtype=dtype)
        flags = pad_rows([t.answer_flags for t in trajectories], width, value=NO_ANSWER, dtype=torch.long)
        reference = None
        if prior and self.reference_prior_coef:
            if any(t.reference_step_logprobs is None for t in trajectories):
                raise ValueError("gfn.reference_prior_coef > 0: the trajectories carry no reference log-probs")
            reference = pad_rows([t.reference_step_logprobs for t in trajectories], width, dtype=dtype)
        log_r = shaped_log_rewards(
            scores,
            flags,
            mask,
            reward_temperature=self.reward_temperature,
            unfinished_log_reward=self.unfinished_log_reward,
            outcome_coef=self.outcome_coef,
            outcome_floor=self.outcome_floor,
            ref_step_logprobs=reference,
            reference_prior_coef=self.reference_prior_coef if prior else 0.0,
        )
        return log_r, mask

    @classmethod
    def of(cls, cfg) -> StateLogRewards:
        """The shaping of a gfn config section (reward_temperature, unfinished_log_reward,
        outcome_coef, outcome_floor, reference_prior_coef)."""
        return cls(
            reward_temperature=cfg.reward_temperature,
            unfinished_log_reward=cfg.unfinished_log_reward,
            outcome_coef=cfg.outcome_coef,
            outcome_floor=cfg.outcome_floor,
            reference_prior_coef=cfg.reference_prior_coef,
        )

    def priorities(self, trajectories: Sequence, key: BufferKey = "log_reward") -> list[float]:
        """The replay priority of each trajectory (gfn.buffer_key), in float64. Both replay buffers
        rank by it (pipeline.finetune.replay_buffer, pipeline.finetune.tba.grouped_replay).

        log_reward: log R(s_n) of its last state as the objective trains it (PRM log-scores, the
                    unfinished-state penalty, the outcome term, all over the reward temperature),
                    without the appendix-F prior. The prior is left out: neither sampler records
                    reference log-probs (the objective scores them at training time), and a
                    reference reset would leave every stored priority stale.
        log_u:      sum_k log U(s_k|s_{k-1}), the PRM log-scores alone (the same shaping with
                    temperature 1 and no penalty or outcome term).

        Example: steps with log-scores [-0.5, -0.5] and answer flags [-1, 1], temperature 0.25:
        log_reward (-0.5 - 0.5) / 0.25 = -4.0, log_u -1.0; the same steps with flags [-1, -1] (no
        answer) and unfinished_log_reward -10: log_reward (-1.0 - 10) / 0.25 = -44.0, log_u -1.0."""
        if not trajectories:
            return []
        shaping = self if check_choice(key, BufferKey, "priority key") == "log_reward" else PRM_LOG_SCORES
        log_r, _ = shaping._shaped(trajectories, prior=False, dtype=torch.float64)
        last = torch.tensor([len(t.steps) for t in trajectories])
        return log_r[torch.arange(len(trajectories)), last].tolist()


# The shaping whose log R(s_n) is the sum of the PRM log-scores alone (the priority key log_u)
PRM_LOG_SCORES = StateLogRewards(reward_temperature=1.0, unfinished_log_reward=0.0, outcome_coef=0.0)

STEP_REWARDS = ("score", "log_score")


@dataclass(frozen=True)
class StepRewards:
    """PPO's reward shaping: trajectories -> (B, T) step rewards.

    kind "score" (the paper's): r_k = U(s_k|s_{k-1}); every step earns a positive reward, so the
    return grows with the number of steps (docs/gflownet.md: PPO lengthened its solutions 4 -> 20
    steps against a PRM with headroom). "log_score": r_k = log U(s_k|s_{k-1}); the undiscounted
    return from s_0 is then log R = sum_k log U, the GFlowNet's log-reward, which no added step
    raises. A last step that states no final answer gets ``unfinished_reward`` added.
    """

    kind: str = "score"
    unfinished_reward: float = -1.0

    def __post_init__(self):
        if self.kind not in STEP_REWARDS:
            raise ValueError(f"ppo.step_reward: expected one of {STEP_REWARDS}, got {self.kind!r}")

    def __call__(self, trajectories: Sequence, width: int) -> Tensor:
        rows = []
        for t in trajectories:
            row = [float(x) if self.kind == "log_score" else float(torch.tensor(x).exp()) for x in t.step_log_scores]
            if t.answer_flags[-1] == NO_ANSWER:
                row[-1] += self.unfinished_reward
            rows.append(row)
        return pad_rows(rows, width)
