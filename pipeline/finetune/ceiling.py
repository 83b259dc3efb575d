"""The reweighting ceiling: how much a GFlowNet could gain by reweighting the base policy's own samples.

Before fine-tuning, the GFlowNet stage draws ``gfn.ceiling_questions`` training questions x
``gfn.samples_per_question`` samples from the base policy (the sampler, temperature and seeds
of the first training steps: the first questions of the stage's question cycle, so the first
``questions_per_step`` of them are exactly the samples training step 1 draws), scores them with
the PRM, and weights each question's samples by the GFlowNet's own target restricted to them:
w_i proportional to R(tau_i)^(1/T), the shaped reward of the gfn section (temperature,
unanswered-state penalty, outcome term), self-normalised per question. Since the samples come
from the base policy, this is the self-normalised importance estimate of sampling from
pi_base x R^(1/T), the target the appendix-F prior gives (with the prior off the GFlowNet's
target is R^(1/T) alone, and this figure describes the reweighting, not that target). The ceiling is the mean PRM reward R = prod U
under that reweighting minus the plain mean (and the same for accuracy), per question, with a
bootstrap interval over questions: when it is 0, the PRM ranks a question's samples alike and
the GFlowNet has nothing to learn from it on these questions.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence

import numpy as np
import torch

from pipeline.finetune.rewards import CORRECT_ANSWER, StateLogRewards
from pipeline.finetune.sampling import TrajectorySampler
from pipeline.records import Trajectory
from pipeline.stats import bootstrap_ci
from pipeline.training.distributed import Collective


def reweighting_ceiling(
    log_weights: np.ndarray,
    rewards: np.ndarray,
    mask: np.ndarray,
    correct: np.ndarray | None = None,
    n_resamples: int = 2000,
    seed: int = 0,
) -> dict:
    """Mean reward (and accuracy) of each question's samples reweighted by exp(log_weights),
    self-normalised per question, minus the plain mean; bootstrap intervals over questions.

    log_weights: (Q, K) float, log of each sample's unnormalised weight (log R^(1/T)); any
                 finite scale: the weights are normalised in log space, so R^(1/T) far below
                 the smallest float is fine
    rewards:     (Q, K) float, the reward reported (R = prod U)
    mask:        (Q, K) bool, True where a sample exists (rows may hold fewer than K samples);
                 questions with none are left out and counted in ``questions_without_samples``
    correct:     (Q, K) bool or None (answers unknown): whether each sample's answer is right
    returns:     {"questions", "samples", "questions_without_samples",
                  "reward": {"base", "reweighted", "gain", "lo", "hi", "per_question"},
                  "accuracy": the same for correct (fractions in [0, 1]), or None}
                 base / reweighted: means over questions of the plain and reweighted means;
                 gain, lo, hi: bootstrap_ci of the per-question differences (per_question)
    """
    log_weights, rewards = np.asarray(log_weights, dtype=np.float64), np.asarray(rewards, dtype=np.float64)
    mask = np.asarray(mask, dtype=bool)
    if log_weights.ndim != 2 or log_weights.shape != rewards.shape or mask.shape != rewards.shape:
        raise ValueError(
            f"reweighting_ceiling: log_weights {log_weights.shape}, rewards {rewards.shape} and mask {mask.shape} "
            "must be the same (Q, K) shape"
        )
    if correct is not None:
        correct = np.asarray(correct, dtype=np.float64)
        if correct.shape != rewards.shape:
            raise ValueError(
                f"reweighting_ceiling: correct {correct.shape} must have the shape of rewards {rewards.shape}"
            )
    if not (np.all(np.isfinite(log_weights[mask])) and np.all(np.isfinite(rewards[mask]))):
        raise ValueError("reweighting_ceiling: log_weights and rewards must be finite where mask is True")
    kept = mask.any(axis=1)
    if not kept.any():
        raise ValueError("reweighting_ceiling: no question has a sample")
    shifted = np.where(mask, log_weights, -np.inf)[kept]
    shifted = shifted - shifted.max(axis=1, keepdims=True)  # log-sum-exp: R^(1/T) may underflow, its ratios do not
    weights = np.exp(shifted)
    weights /= weights.sum(axis=1, keepdims=True)
    counts = mask[kept].sum(axis=1)

    def compare(values: np.ndarray) -> dict:
        values = np.where(mask, values, 0.0)[kept]
        plain = values.sum(axis=1) / counts
        reweighted = (weights * values).sum(axis=1)
        gain, lo, hi = bootstrap_ci(reweighted - plain, n_resamples=n_resamples, seed=seed)
        return {
            "base": float(plain.mean()),
            "reweighted": float(reweighted.mean()),
            "gain": gain,
            "lo": lo,
            "hi": hi,
            "per_question": (reweighted - plain).tolist(),
        }

    return {
        "questions": int(kept.sum()),
        "samples": int(counts.sum()),
        "questions_without_samples": int((~kept).sum()),
        "reward": compare(rewards),
        "accuracy": compare(correct) if correct is not None else None,
    }


def ceiling_arrays(trajectories: Sequence, reward: StateLogRewards, answers_known: bool) -> tuple[np.ndarray, ...]:
    """(log_weights, rewards, mask, correct or None), each (Q, K), of sampled trajectories grouped
    by question in order of first appearance: log R^(1/T) of the terminal state under ``reward``
    (the gfn section's shaping; its reference prior left out, the samples being the base
    policy's own), R = prod U, and whether the last step states the right answer."""
    groups: dict[str, list] = {}
    for t in trajectories:
        groups.setdefault(t.problem_id, []).append(t)
    width = max(len(g) for g in groups.values())
    shape = (len(groups), width)
    log_weights, rewards, mask, correct = (
        np.zeros(shape),
        np.zeros(shape),
        np.zeros(shape, dtype=bool),
        np.zeros(shape, dtype=bool),
    )
    shaping = dataclasses.replace(reward, reference_prior_coef=0.0)
    for q, group in enumerate(groups.values()):
        log_r, steps = shaping(group)
        terminal = log_r.double().gather(1, steps.sum(1)[:, None]).squeeze(1)
        for k, t in enumerate(group):
            log_weights[q, k], rewards[q, k], mask[q, k] = float(terminal[k]), math.exp(t.log_reward), True
            correct[q, k] = t.answer_flags[-1] == CORRECT_ANSWER
    return log_weights, rewards, mask, correct if answers_known else None


def ceiling_verdict(result: dict, temperature: float) -> str:
    """One line: the ceiling's figures and whether the PRM gives the GFlowNet anything to learn."""
    reward, accuracy = result["reward"], result["accuracy"]
    relative = reward["gain"] / reward["base"] if reward["base"] > 0 else float("nan")
    line = (
        f"reweighting ceiling over {result['questions']} questions x their {result['samples']} base-policy samples, weighted by "
        f"R^(1/{temperature:g}): mean R {reward['base']:.4g} -> {reward['reweighted']:.4g}, {reward['gain']:+.4g} "
        f"[{reward['lo']:+.4g}, {reward['hi']:+.4g}] ({100 * relative:+.1f}%)"
    )
    if accuracy is not None:
        line += (
            f"; accuracy {100 * accuracy['base']:.1f}% -> {100 * accuracy['reweighted']:.1f}%, "
            f"{100 * accuracy['gain']:+.1f} [{100 * accuracy['lo']:+.1f}, {100 * accuracy['hi']:+.1f}] points"
        )
    if reward["lo"] > 0:
        line += ": the PRM ranks a question's samples apart, so the GFlowNet has something to learn"
        if accuracy is not None and accuracy["lo"] > 0:
            line += ", toward right answers"
        elif accuracy is not None and accuracy["hi"] < 0:
            line += ", but toward wrong answers (the PRM prefers them)"
        elif accuracy is not None:
            line += " (accuracy: no clear change)"
    else:
        line += ": no measurable gain, the PRM gives the GFlowNet nothing to learn on these questions"
    return line


def measure_ceiling(
    policy, scorer, problems: Sequence, kind: str, cfg, reward: StateLogRewards, collective=None
) -> dict | None:
    """Draw and score the base policy's samples of the first ``cfg.ceiling_questions`` questions
    of the stage's question cycle (capped at the number of problems, rounded down to a multiple
    of the processes; each process samples its share), and return ``reweighting_ceiling`` of
    them with the sampling counts; None when no question is left to draw.

    policy, scorer, problems (TrainProblems), kind, collective: as ``TrajectorySampler`` takes them
    cfg:    the gfn section (ceiling_questions, samples_per_question, temperature, min_steps, seed,
            reward_temperature)
    reward: the gfn section's reward shaping (its reference prior is left out)
    """
    collective = collective or Collective()
    questions = min(cfg.ceiling_questions, len(problems))
    questions -= questions % collective.world
    if questions == 0:
        return None
    sampler = TrajectorySampler(
        policy, scorer, problems, kind, dataclasses.replace(cfg, questions_per_step=questions), collective=collective
    )
    fresh, info = sampler.sample(0)
    everyone = [t for part in collective.gather(fresh, Trajectory) for t in part]
    counts = collective.sum(torch.tensor([info["sampled"], info["empty_solutions"]], dtype=torch.float64)).tolist()
    result = {
        "reward_temperature": cfg.reward_temperature,
        "samples_per_question": cfg.samples_per_question,
        "sampled": int(counts[0]),
        "empty_solutions": int(counts[1]),
    }
    if not everyone:
        raise RuntimeError("reweighting ceiling: every sampled solution was empty (the policy stops at s_0)")
    answers_known = all(p.answer not in (None, "") for p in problems)
    result.update(reweighting_ceiling(*ceiling_arrays(everyone, reward, answers_known), seed=cfg.seed))
    return result
