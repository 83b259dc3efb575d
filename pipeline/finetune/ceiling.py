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

Where the problems know their strategies (a tiny-world record lists its valid solutions: the rule
eval.diversity uses), the same weights give the strategy level: per question that admits more
than one strategy and has a right sample carrying one out, the entropy of the strategies of its
right samples, plain (eval.diversity.strategy_diversity's figure) and reweighted by R^(1/T), and
the difference with a bootstrap interval over questions: how diverse in strategies the target is
against the base policy. Both are plug-in entropies of at most K samples, biased low, the
reweighted one more so the more the weights concentrate on few samples (fewer effective
samples): compare the two, do not read the reweighted one as the target's exact entropy.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping, Sequence

import numpy as np
import torch

from pipeline.finetune.rewards import CORRECT_ANSWER, StateLogRewards
from pipeline.finetune.sampling import TrajectorySampler
from pipeline.records import Problem, Trajectory
from pipeline.stats import bootstrap_ci
from pipeline.strategies import admitted_strategies, correct_strategy_names, strategy_entropy
from pipeline.training.distributed import Collective


def self_normalised_weights(log_weights: np.ndarray, mask: np.ndarray) -> np.ndarray:
    """Each question's self-normalised importance weights w_qk = exp(l_qk) / sum_j exp(l_qj),
    the sum over the samples that exist, computed in log space (exp(l) may underflow, its
    ratios do not).

    log_weights: (Q, K) float, log of each sample's unnormalised weight (any finite scale where
                 mask is True; ignored elsewhere)
    mask:        (Q, K) bool, True where a sample exists
    returns:     (Q, K) float64, rows summing to 1; 0 where mask is False, an all-zero row for a
                 question without samples
    """
    log_weights, mask = np.asarray(log_weights, dtype=np.float64), np.asarray(mask, dtype=bool)
    if log_weights.ndim != 2 or mask.shape != log_weights.shape:
        raise ValueError(
            f"self_normalised_weights: log_weights {log_weights.shape} and mask {mask.shape} must be (Q, K)"
        )
    if not np.all(np.isfinite(log_weights[mask])):
        raise ValueError("self_normalised_weights: log_weights must be finite where mask is True")
    shifted = np.where(mask, log_weights, -np.inf)
    top = shifted.max(axis=1, keepdims=True, initial=-np.inf)
    weights = np.where(mask, np.exp(shifted - np.where(np.isfinite(top), top, 0.0)), 0.0)
    totals = weights.sum(axis=1, keepdims=True)
    return np.divide(weights, totals, out=np.zeros_like(weights), where=totals > 0)


def effective_sample_size(weights: np.ndarray, mask: np.ndarray) -> np.ndarray:
    """Kish's effective sample size of each question's weights: (sum_k w_k)^2 / sum_k w_k^2.

    weights: (Q, K) float >= 0 (any scale; self_normalised_weights' rows sum to 1)
    mask:    (Q, K) bool, True where a sample exists
    returns: (Q,) float64 in [1, samples of the question]: K for equal weights, 1 when one sample
             holds all the weight; 0 for a question without samples
    """
    weights = np.where(np.asarray(mask, dtype=bool), np.asarray(weights, dtype=np.float64), 0.0)
    squares = (weights * weights).sum(axis=1)
    return np.divide(weights.sum(axis=1) ** 2, squares, out=np.zeros(weights.shape[0]), where=squares > 0)


def summarise_effective_samples(ess: np.ndarray) -> dict:
    """{"mean", "median", "min", "max"} of per-question effective sample sizes (Q,), Q >= 1."""
    ess = np.asarray(ess, dtype=np.float64)
    return {
        "mean": float(ess.mean()),
        "median": float(np.median(ess)),
        "min": float(ess.min()),
        "max": float(ess.max()),
    }


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
                  "effective_samples": {"mean", "median", "min", "max"} of the questions' Kish
                  effective sample sizes (effective_sample_size),
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
    weights = self_normalised_weights(log_weights, mask)[kept]
    counts = mask[kept].sum(axis=1)
    ess = effective_sample_size(weights, mask[kept])

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
        "effective_samples": summarise_effective_samples(ess),
        "reward": compare(rewards),
        "accuracy": compare(correct) if correct is not None else None,
    }


def strategy_entropy_ceiling(
    log_weights: np.ndarray,
    mask: np.ndarray,
    strategies: Sequence[Sequence[str | None]],
    multi_strategy: np.ndarray,
    n_resamples: int = 2000,
    seed: int = 0,
) -> dict:
    """Strategy entropy (bits) of each question's right samples, plain and reweighted by
    exp(log_weights), minus one another; a bootstrap interval over the questions counted.

    log_weights, mask: (Q, K), as reweighting_ceiling takes them (any finite scale)
    strategies:        (Q, K): the strategy name of each right sample that carries one out
                       (pipeline.strategies.correct_strategy_names), None for every other sample
    multi_strategy:    (Q,) bool: whether the question's problem admits more than one strategy
    A question counts when it admits more than one strategy and a sample of it has a name. Its
    plain figure is strategy_entropy of those names (each counts once), its reweighted one
    strategy_entropy with the names' weights, normalised among them in log space (the
    self-normalised weights of reweighting_ceiling restricted to these samples: their
    ratios are the same, and none underflows to 0 where wrong samples hold the largest weight).
    returns: {"questions": counted, "multi_strategy_questions", "base", "reweighted": means over
              the counted questions, "difference", "lo", "hi": bootstrap_ci of the per-question
              reweighted - plain, "per_question": those differences}; the figures None when no
              question counts
    """
    log_weights, mask = np.asarray(log_weights, dtype=np.float64), np.asarray(mask, dtype=bool)
    multi_strategy = np.asarray(multi_strategy, dtype=bool)
    if log_weights.ndim != 2 or mask.shape != log_weights.shape or multi_strategy.shape != log_weights.shape[:1]:
        raise ValueError(
            f"strategy_entropy_ceiling: log_weights {log_weights.shape}, mask {mask.shape} must be (Q, K) "
            f"and multi_strategy {multi_strategy.shape} (Q,)"
        )
    if len(strategies) != log_weights.shape[0] or any(len(row) > log_weights.shape[1] for row in strategies):
        raise ValueError(
            f"strategy_entropy_ceiling: strategies must be {log_weights.shape[0]} rows of at most {log_weights.shape[1]}"
        )
    plain, reweighted = [], []
    for q, row in enumerate(strategies):
        named = [k for k, name in enumerate(row) if name is not None and mask[q, k]]
        if not multi_strategy[q] or not named:
            continue
        names, logs = [row[k] for k in named], log_weights[q, named]
        if not np.all(np.isfinite(logs)):
            raise ValueError("strategy_entropy_ceiling: log_weights must be finite where a sample has a strategy")
        plain.append(strategy_entropy(names))
        reweighted.append(strategy_entropy(names, weights=np.exp(logs - logs.max())))
    result = {
        "questions": len(plain),
        "multi_strategy_questions": int(multi_strategy.sum()),
        "base": None,
        "reweighted": None,
        "difference": None,
        "lo": None,
        "hi": None,
        "per_question": [],
    }
    if plain:
        differences = np.array(reweighted) - np.array(plain)
        difference, lo, hi = bootstrap_ci(differences, n_resamples=n_resamples, seed=seed)
        result.update(
            base=float(np.mean(plain)),
            reweighted=float(np.mean(reweighted)),
            difference=difference,
            lo=lo,
            hi=hi,
            per_question=differences.tolist(),
        )
    return result


def by_question(trajectories: Sequence) -> list[list]:
    """Trajectories grouped by problem_id, the groups in order of first appearance."""
    groups: dict[str, list] = {}
    for t in trajectories:
        groups.setdefault(t.problem_id, []).append(t)
    return list(groups.values())


def ceiling_strategies(
    trajectories: Sequence, records: Mapping[str, Problem]
) -> tuple[list[list[str | None]], np.ndarray] | None:
    """(strategies, multi_strategy) of sampled trajectories grouped as ceiling_arrays groups them,
    as strategy_entropy_ceiling takes them: per sample the strategy name of a right solution
    (last step states the right answer) that carries one out, else None; per question whether its
    problem admits more than one strategy. None when no question's problem knows its strategies
    (pipeline.strategies.admitted_strategies: its record lists no valid solutions).

    records: the problem records by problem_id (every sampled question's)"""
    groups = by_question(trajectories)
    missing = sorted({g[0].problem_id for g in groups} - set(records))
    if missing:
        raise KeyError(f"ceiling_strategies: no problem record for {missing[:5]}")
    strategies, multi, known = [], [], False
    for group in groups:
        problem = records[group[0].problem_id]
        admitted = admitted_strategies(problem)
        known = known or admitted is not None
        multi.append(admitted is not None and admitted > 1)
        row = []
        for t in group:
            names = correct_strategy_names(problem, [t.steps], [t.answer_flags[-1] == CORRECT_ANSWER])
            row.append(names[0] if names else None)
        strategies.append(row)
    return (strategies, np.array(multi, dtype=bool)) if known else None


def ceiling_arrays(trajectories: Sequence, reward: StateLogRewards, answers_known: bool) -> tuple[np.ndarray, ...]:
    """(log_weights, rewards, mask, correct or None), each (Q, K), of sampled trajectories grouped
    by question in order of first appearance: log R^(1/T) of the terminal state under ``reward``
    (the gfn section's shaping; its reference prior left out, the samples being the base
    policy's own), R = prod U, and whether the last step states the right answer."""
    groups = by_question(trajectories)
    width = max(len(g) for g in groups)
    shape = (len(groups), width)
    log_weights, rewards, mask, correct = (
        np.zeros(shape),
        np.zeros(shape),
        np.zeros(shape, dtype=bool),
        np.zeros(shape, dtype=bool),
    )
    shaping = dataclasses.replace(reward, reference_prior_coef=0.0)
    for q, group in enumerate(groups):
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
    ess = result.get("effective_samples")
    if ess is not None:
        line += f" (effective samples per question: mean {ess['mean']:.2f}, min {ess['min']:.2f})"
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
    strategy = result.get("strategy_entropy")
    if strategy is not None and strategy["questions"]:
        line += (
            f"; strategy entropy of the right samples over {strategy['questions']} questions with several "
            f"strategies {strategy['base']:.3f} -> {strategy['reweighted']:.3f} bits, {strategy['difference']:+.3f} "
            f"[{strategy['lo']:+.3f}, {strategy['hi']:+.3f}]: "
        )
        if strategy["hi"] < 0:
            line += "the target is less diverse in strategies than the base policy"
        elif strategy["lo"] > 0:
            line += "the target is more diverse in strategies than the base policy"
        else:
            line += "the target's strategy diversity is not clearly apart from the base policy's"
    elif strategy is not None:
        line += "; strategy entropy: no question with several strategies has a right sample that carries one out"
    return line


def measure_ceiling(
    policy,
    scorer,
    problems: Sequence,
    kind: str,
    cfg,
    reward: StateLogRewards,
    collective=None,
    records: Sequence[Problem] = (),
) -> dict | None:
    """Draw and score the base policy's samples of the first ``cfg.ceiling_questions`` questions
    of the stage's question cycle (capped at the number of problems, rounded down to a multiple
    of the processes; each process samples its share), and return ``reweighting_ceiling`` of
    them with the sampling counts and, under "strategy_entropy", ``strategy_entropy_ceiling`` of
    them with the same weights (None when the answers or the problems' strategies are unknown);
    None when no question is left to draw.

    policy, scorer, problems (TrainProblems), kind, collective: as ``TrajectorySampler`` takes them
    cfg:     the gfn section (ceiling_questions, samples_per_question, temperature, min_steps, seed,
             reward_temperature)
    reward:  the gfn section's reward shaping (its reference prior is left out)
    records: the problem records the TrainProblems were built from (their valid solutions name
             the strategies); none given: strategies unknown
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
    log_weights, rewards, mask, correct = ceiling_arrays(everyone, reward, answers_known)
    result.update(reweighting_ceiling(log_weights, rewards, mask, correct, seed=cfg.seed))
    strategies = ceiling_strategies(everyone, {p.problem_id: p for p in records}) if answers_known and records else None
    result["strategy_entropy"] = (
        strategy_entropy_ceiling(log_weights, mask, *strategies, seed=cfg.seed) if strategies is not None else None
    )
    return result
