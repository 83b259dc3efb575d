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

import torch
from torch import Tensor

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
