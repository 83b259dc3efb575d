"""Scoring one model's samples records on one benchmark: accuracy, diversity and the PRM's reward.

Everything here reads samples records only (eval.sampling writes them), so samples that are up
to date are re-scored without generating. Formulas: docs/metrics.md.
"""

from __future__ import annotations

import math
import sys
from collections.abc import Callable, Sequence

import numpy as np

from eval.accuracy import ProblemSamples, majority_vote_index, pass_at_k, pass_at_k_range, summarize_accuracy
from eval.diversity import (
    Embedder,
    distinct_correct_texts,
    distinct_n_per_problem,
    equal_count_strategy_entropy,
    semantic_similarity,
    strategy_diversity,
)
from eval.sampling import GREEDY_SAMPLE_IDX, KindOf
from pipeline.config.schema import Config
from pipeline.grading import normalize_answer
from pipeline.records import Problem, Sample
from pipeline.stats import bootstrap_ci, mann_whitney_auc
from pipeline.steps import join_steps

DISTINCT_NS = (1, 2, 3)

StepScorer = Callable[[Sequence[tuple[str, Sequence[str]]]], list[list[float]]]  # PRMScorer.score_many


def _group_records(records: Sequence[Sample], problems: Sequence[Problem]) -> tuple[dict, dict]:
    """problem_id -> sampled records in sample_idx order, and problem_id -> greedy record."""
    sampled: dict[str, list[Sample]] = {p.problem_id: [] for p in problems}
    greedy: dict[str, Sample] = {}
    for record in records:
        pid = record.problem_id
        if pid not in sampled:
            raise ValueError(f"samples: record for problem {pid!r}, which is not in the benchmark")
        if record.sample_idx == GREEDY_SAMPLE_IDX:
            greedy[pid] = record
        else:
            sampled[pid].append(record)
    for pid, rows in sampled.items():
        rows.sort(key=lambda r: r.sample_idx)
        if not rows:
            raise ValueError(f"samples: no sampled solutions for problem {pid!r}")
    return sampled, greedy


def graded(records: Sequence[Sample], problems: Sequence[Problem], kind_of: KindOf):
    """(problem_id -> sampled records, [ProblemSamples] in problem order, problem_id -> greedy
    correct or None when there are no greedy records)."""
    sampled, greedy = _group_records(records, problems)
    per_problem = []
    for problem in problems:
        rows = sampled[problem.problem_id]
        kind = kind_of(problem)
        answers = [r.final_answer for r in rows]
        flags = [r.correct for r in rows]
        winner = majority_vote_index(answers, key=lambda answer: normalize_answer(answer, kind))
        per_problem.append(ProblemSamples(problem.problem_id, flags, answers, winner is not None and flags[winner]))
    greedy_correct = None
    if greedy:
        missing = [p.problem_id for p in problems if p.problem_id not in greedy]
        if missing:
            raise ValueError(f"samples: greedy sample missing for problem {missing[0]!r}")
        greedy_correct = {pid: r.correct for pid, r in greedy.items()}
    return sampled, per_problem, greedy_correct


def score_samples(
    records: Sequence[Sample],
    problems: Sequence[Problem],
    kind_of: KindOf,
    config: Config,
    embed: Embedder | None = None,
    prm: StepScorer | None = None,
) -> dict:
    """Accuracy and diversity of one model on one benchmark from its samples records.

    Returns {"n_problems", "k", "accuracy": {greedy_pass@1?, pass@1, maj@k, pass@k: {mean, lo, hi}},
    "pass@k_curve": {j: unbiased pass@j}, "pass@k_all": [pass@1..pass@K] (K = min(eval.pass_at_k_max,
    the samples per problem); eval.accuracy.pass_at_k_range), "answered", "mean_steps", "diversity":
    {similarity: {mean, lo, hi, n_scored, per_problem}, vendi, distinct_1..3, strategy_entropy: {mean,
    lo, hi, n_scored, per_problem}, strategy_entropy_equal_count: eval.diversity.equal_count_strategy_entropy
    at m = eval.entropy_samples, distinct_strategies, multi_strategy_problems, correct_without_strategy,
    correct_texts, correct_texts_solved}}.
    Diversity is over the k sampled solutions only; similarity and Vendi (each solution's whole
    text embedded) are None without ``embed``; the strategy figures (eval.diversity.strategy_diversity)
    are None on problems that do not know their strategies.
    With ``prm`` (PRMScorer.score_many), also "prm_reward": {mean, lo, hi}, the mean over problems
    of the mean PRM reward R = prod_k U(s_k|s_{k-1}) of its sampled solutions (an empty solution: 0),
    the quantity the GFlowNet samples in proportion to.
    """
    sampled, per_problem, greedy_correct = graded(records, problems, kind_of)
    settings = config.eval
    accuracy = summarize_accuracy(
        per_problem, greedy_correct, n_resamples=settings.bootstrap_resamples, seed=settings.seed
    )
    k = accuracy.pop("k")
    n_problems = accuracy.pop("n_problems")
    counts = [sum(s.correct) for s in per_problem]
    budgets = sorted({j for j in (1, 2, 4, 8, 16, 32, 64) if j <= k} | {k})
    curve = {str(j): float(np.mean([pass_at_k(k, c, j) for c in counts])) for j in budgets}

    solutions = [[r.steps for r in sampled[p.problem_id]] for p in problems]
    texts = [[join_steps(steps, config.format.separator) for steps in group] for group in solutions]
    correct_texts = [distinct_correct_texts(group, s.correct) for group, s in zip(solutions, per_problem)]
    solved = [n for n, c in zip(correct_texts, counts) if c > 0]
    diversity: dict = {"similarity": {"mean": None, "lo": None, "hi": None, "n_scored": 0}, "vendi": None}
    if embed is not None:
        similarity = semantic_similarity(texts, embed, n_resamples=settings.bootstrap_resamples, seed=settings.seed)
        diversity["similarity"] = {key: similarity[key] for key in ("mean", "lo", "hi", "n_scored", "per_problem")}
        diversity["vendi"] = similarity["vendi_mean"]
    for n in DISTINCT_NS:
        diversity[f"distinct_{n}"] = distinct_n_per_problem(texts, n)["mean"]
    strategies = strategy_diversity(
        problems,
        solutions,
        [s.correct for s in per_problem],
        n_resamples=settings.bootstrap_resamples,
        seed=settings.seed,
    )
    diversity["strategy_entropy"] = strategies["entropy"]  # per_problem in problem order: comparisons pair them
    diversity["distinct_strategies"] = strategies["distinct"]
    diversity["multi_strategy_problems"] = strategies["multi_strategy_problems"]
    diversity["correct_without_strategy"] = strategies["correct_without_strategy"]
    diversity["strategy_entropy_equal_count"] = equal_count_strategy_entropy(
        problems,
        solutions,
        [s.correct for s in per_problem],
        settings.entropy_samples,
        n_resamples=settings.bootstrap_resamples,
        seed=settings.seed,
    )
    diversity["correct_texts"] = float(np.mean(correct_texts))
    diversity["correct_texts_solved"] = float(np.mean(solved)) if solved else None

    all_rows = [r for rows in sampled.values() for r in rows]
    extra = {}
    if prm is not None:
        extra["prm_reward"] = mean_prm_reward(
            sampled,
            problems,
            prm,
            settings.bootstrap_resamples,
            settings.seed,
            unfinished_log_reward=config.gfn.unfinished_log_reward,
        )
    return {
        "n_problems": n_problems,
        "k": k,
        "accuracy": accuracy,
        "pass@k_curve": curve,
        "pass@k_all": pass_at_k_range([len(s.correct) for s in per_problem], counts, settings.pass_at_k_max),
        "answered": float(np.mean([r.final_answer is not None for r in all_rows])),
        "mean_steps": float(np.mean([len(r.steps) for r in all_rows])),
        "diversity": diversity,
        **extra,
    }


def mean_prm_reward(
    sampled: dict[str, list[Sample]],
    problems: Sequence[Problem],
    prm: StepScorer,
    n_resamples: int,
    seed: int,
    unfinished_log_reward: float = -10.0,
) -> dict:
    """How the PRM's reward R = prod U sees one model's samples.

    mean, lo, hi:        per problem, the mean R over its sampled solutions (an empty one: 0); a
                         percentile-bootstrap interval over problems (pipeline.stats.bootstrap_ci)
    per_problem:         those per-problem means, in ``problems`` order (compare_to_reference pairs them)
    log_likelihood:      {mean, lo, hi, per_problem}: the same of log L = sum_k log U(s_k|s_{k-1}) plus
                         ``unfinished_log_reward`` when the solution states no answer (an empty one:
                         that penalty alone): the return the judged GFlowNet and PPO share (the gfn
                         section's penalty), U floored at the smallest positive float
    within_problem_auc:  over the problems with both correct and wrong samples, the mean AUC of R
                         for correctness among that problem's samples (ties count 1/2); None when
                         no problem has both. 0.5: R does not tell a problem's right solutions from
                         its wrong ones, so no fine-tuning toward R can raise accuracy
    n_mixed:             how many problems that mean is over
    reweighted_accuracy: mean over problems of sum_i R_i * correct_i / sum_i R_i, the accuracy of
                         these samples reweighted in proportion to R (self-normalised importance
                         weights for sampling from pi * R); a problem whose samples all have R = 0
                         keeps its plain accuracy
    reweighted_reward:   the same reweighting of R itself, sum R^2 / sum R: the mean reward a
                         policy sampling in proportion to pi * R would reach on these problems
    """
    pairs = [(p.question, r.steps) for p in problems for r in sampled[p.problem_id]]
    scored = iter(prm([pair for pair in pairs if pair[1]]))
    step_scores = [list(next(scored)) if steps else [] for _, steps in pairs]
    rewards = iter([math.prod(scores) if scores else 0.0 for scores in step_scores])
    records = [r for p in problems for r in sampled[p.problem_id]]
    log_likelihoods = iter(
        [
            sum(math.log(max(u, sys.float_info.min)) for u in scores)
            + (unfinished_log_reward if record.final_answer is None else 0.0)
            for scores, record in zip(step_scores, records)
        ]
    )
    per_problem_rewards = [np.array([next(rewards) for _ in sampled[p.problem_id]]) for p in problems]
    per_problem_log_l = [float(np.mean([next(log_likelihoods) for _ in sampled[p.problem_id]])) for p in problems]
    log_l_mean, log_l_lo, log_l_hi = bootstrap_ci(np.array(per_problem_log_l), n_resamples=n_resamples, seed=seed)
    per_problem_correct = [np.array([r.correct for r in sampled[p.problem_id]]) for p in problems]
    per_problem_mean = [float(r.mean()) for r in per_problem_rewards]
    mean, lo, hi = bootstrap_ci(np.array(per_problem_mean), n_resamples=n_resamples, seed=seed)
    aucs = [mann_whitney_auc(r, c) for r, c in zip(per_problem_rewards, per_problem_correct) if 0 < c.sum() < len(c)]
    reweighted_accuracy, reweighted_reward = [], []
    for r, c in zip(per_problem_rewards, per_problem_correct):
        total = r.sum()
        reweighted_accuracy.append(float((r * c).sum() / total) if total > 0 else float(c.mean()))
        reweighted_reward.append(float((r * r).sum() / total) if total > 0 else 0.0)
    return {
        "mean": mean,
        "lo": lo,
        "hi": hi,
        "per_problem": per_problem_mean,  # in problem order: compare_to_reference pairs them
        "within_problem_auc": float(np.mean(aucs)) if aucs else None,
        "n_mixed": len(aucs),
        "reweighted_accuracy": float(np.mean(reweighted_accuracy)),
        "reweighted_reward": float(np.mean(reweighted_reward)),
        "log_likelihood": {"mean": log_l_mean, "lo": log_l_lo, "hi": log_l_hi, "per_problem": per_problem_log_l},
    }
