"""Whether a sampler reaches the GFlowNet's target, measured against the base policy's own samples.

The GFlowNet samples in proportion to pi_base x R^(1/T) (the appendix-F prior; R the shaped reward
of the gfn section: PRM likelihood L = prod U, the unfinished-state penalty, the outcome term). N
samples of the base policy per question, drawn at temperature 1, weighted by R^(1/T) and
self-normalised within the question (pipeline.finetune.ceiling.self_normalised_weights, the
reweighting ceiling's weights), estimate that target; Kish's effective sample size says how many
samples the estimate rests on. Against it, per problem family: the strategy shares of the right
answers and the mean log L, of the target and of each model's own samples at temperature 1; the
distance is the total variation between the two families' strategy shares, averaged over
families weighted by question count, and the difference of mean log L, each with a percentile
bootstrap interval that resamples questions. The length effect is the target's strategy shares
against the plain shares among the base's right samples (the same samples unweighted).
Formulas: docs/metrics.md ("The GFlowNet's target").
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping, Sequence

import numpy as np
import torch

from pipeline.finetune.ceiling import effective_sample_size, self_normalised_weights, summarise_effective_samples
from pipeline.finetune.rewards import CORRECT_ANSWER, NO_ANSWER, WRONG_ANSWER, StateLogRewards, shaped_log_rewards
from pipeline.records import Problem, Sample
from pipeline.stats import bootstrap_ci, bootstrap_statistic
from pipeline.strategies import correct_strategy_names

NO_FAMILY = "(none)"  # the family of a problem whose record names none


def strategy_shares(weights: np.ndarray, strategy: np.ndarray, n_strategies: int) -> tuple[np.ndarray, np.ndarray]:
    """Each question's strategy shares among its named samples (the right ones that carry out a
    strategy), weighted.

    weights:  (Q, K) float >= 0, each sample's weight (only ratios within a row matter)
    strategy: (Q, K) int, the index of the strategy a sample carries out, -1 for every other
              sample (wrong, naming none, absent)
    returns:  shares (Q, S) float64, p_qs = sum_{k: s_qk = s} w_qk / sum_{k: s_qk >= 0} w_qk, NaN
              rows where no named sample has weight; named (Q,) bool, where the row is defined
    """
    weights, strategy = np.asarray(weights, dtype=np.float64), np.asarray(strategy)
    if weights.ndim != 2 or strategy.shape != weights.shape:
        raise ValueError(f"strategy_shares: weights {weights.shape} and strategy {strategy.shape} must be (Q, K)")
    if strategy.size and (strategy.max(initial=-1) >= n_strategies or strategy.min(initial=-1) < -1):
        raise ValueError(f"strategy_shares: strategy indices must be in [-1, {n_strategies})")
    one_hot = (strategy[:, :, None] == np.arange(n_strategies)[None, None, :]).astype(np.float64)
    mass = np.einsum("qk,qks->qs", weights, one_hot)
    totals = mass.sum(axis=1)
    named = totals > 0
    shares = np.full(mass.shape, np.nan)
    shares[named] = mass[named] / totals[named, None]
    return shares, named


def family_shares(shares: np.ndarray, named: np.ndarray, family: np.ndarray, n_families: int) -> np.ndarray:
    """Per family, the mean over its named questions of their strategy shares.

    shares, named: (Q, S), (Q,) as strategy_shares returns them; family: (Q,) int in [0, F)
    returns: (F, S) float64, NaN rows for families without a named question
    """
    family = np.asarray(family)
    out = np.full((n_families, shares.shape[1]), np.nan)
    for f in range(n_families):
        rows = named & (family == f)
        if rows.any():
            out[f] = shares[rows].mean(axis=0)
    return out


def share_distance(
    shares_a: np.ndarray,
    named_a: np.ndarray,
    shares_b: np.ndarray,
    named_b: np.ndarray,
    family: np.ndarray,
    n_families: int,
) -> tuple[float | None, np.ndarray, np.ndarray]:
    """Total variation between two sets of per-family strategy shares over the same questions.

    shares_*, named_*: (Q, S), (Q,) of two samplers on the same Q questions; family: (Q,) int
    A question counts when both samplers name a strategy on it. Per family f with n_f counted
    questions: TV_f = 1/2 sum_s |a_fs - b_fs| of the family means of the counted questions' shares.
    returns: (sum_f n_f TV_f / sum_f n_f, or None when no question counts; TV_f (F,), NaN where
             n_f = 0; n_f (F,) int)
    """
    both = np.asarray(named_a) & np.asarray(named_b)
    family = np.asarray(family)
    mean_a = family_shares(shares_a, both, family, n_families)
    mean_b = family_shares(shares_b, both, family, n_families)
    per_family = 0.5 * np.abs(mean_a - mean_b).sum(axis=1)
    counts = np.array([int((both & (family == f)).sum()) for f in range(n_families)])
    per_family[counts == 0] = np.nan
    if counts.sum() == 0:
        return None, per_family, counts
    return float((counts * np.nan_to_num(per_family)).sum() / counts.sum()), per_family, counts


@dataclasses.dataclass(frozen=True)
class DrawnSamples:
    """One sampler's samples of Q questions as arrays (K the most samples of a question).

    mask:           (Q, K) bool, True where a sample exists
    strategy:       (Q, K) int, the strategy index of a right sample carrying one out, else -1
    log_likelihood: (Q, K) float, log L = sum_k log U(s_k|s_{k-1}) of the sample's steps (0 when it has none)
    log_weight:     (Q, K) float, log R^(1/T) of its last state (the GFlowNet's shaped reward)
    """

    mask: np.ndarray
    strategy: np.ndarray
    log_likelihood: np.ndarray
    log_weight: np.ndarray


def compare_to_target(
    base: DrawnSamples,
    sampler: DrawnSamples,
    family: np.ndarray,
    n_strategies: int,
    n_families: int,
    n_resamples: int = 2000,
    seed: int = 0,
) -> dict:
    """A sampler's strategy shares and mean log L against the target estimated from the base's samples.

    base:    the base policy's samples of the Q questions (temperature 1); their self-normalised
             weights exp(log_weight) estimate the target pi_base x R^(1/T)
    sampler: the compared model's samples of the same Q questions (plain weights)
    family:  (Q,) int in [0, F), each question's problem family
    returns: {"questions", "effective_samples": summarise_effective_samples over questions with
              samples, "share_distance": {"estimate", "lo", "hi", "per_family", "questions_per_family"}
              (share_distance of target and sampler; bootstrap over questions, None when no
              question counts), "log_likelihood": {"target", "sampler": means over questions of
              sum_k w_k log L_k and of the plain mean, "difference" (sampler - target), "lo", "hi"},
              "family_shares": {"target", "sampler": (F, S) lists, NaN as None}}
    """
    family = np.asarray(family)
    questions = family.shape[0]
    if base.mask.shape[0] != questions or sampler.mask.shape[0] != questions:
        raise ValueError(
            f"compare_to_target: {base.mask.shape[0]} base and {sampler.mask.shape[0]} sampler rows for {questions} questions"
        )
    weights = self_normalised_weights(base.log_weight, base.mask)
    plain = self_normalised_weights(np.zeros(sampler.mask.shape), sampler.mask)
    target_shares, target_named = strategy_shares(weights, base.strategy, n_strategies)
    sampler_shares, sampler_named = strategy_shares(plain, sampler.strategy, n_strategies)
    with_samples = base.mask.any(axis=1) & sampler.mask.any(axis=1)
    target_log_l = (weights * np.where(base.mask, base.log_likelihood, 0.0)).sum(axis=1)
    sampler_log_l = (plain * np.where(sampler.mask, sampler.log_likelihood, 0.0)).sum(axis=1)

    def distance(rows: np.ndarray) -> float | None:
        return share_distance(
            target_shares[rows], target_named[rows], sampler_shares[rows], sampler_named[rows], family[rows], n_families
        )[0]

    estimate, per_family, counts = share_distance(
        target_shares, target_named, sampler_shares, sampler_named, family, n_families
    )
    lo = hi = None
    if estimate is not None:
        lo, hi = bootstrap_statistic(distance, questions, n_resamples=n_resamples, seed=seed)
    log_l: dict = {"target": None, "sampler": None, "difference": None, "lo": None, "hi": None}
    if with_samples.any():
        difference, d_lo, d_hi = bootstrap_ci(
            sampler_log_l[with_samples] - target_log_l[with_samples], n_resamples=n_resamples, seed=seed
        )
        log_l = {
            "target": float(target_log_l[with_samples].mean()),
            "sampler": float(sampler_log_l[with_samples].mean()),
            "difference": difference,
            "lo": d_lo,
            "hi": d_hi,
        }
    both = target_named & sampler_named
    return {
        "questions": int(with_samples.sum()),
        "effective_samples": summarise_effective_samples(effective_sample_size(weights, base.mask)[with_samples])
        if with_samples.any()
        else None,
        "share_distance": {
            "estimate": estimate,
            "lo": lo,
            "hi": hi,
            "per_family": _listed(per_family),
            "questions_per_family": counts.tolist(),
        },
        "log_likelihood": log_l,
        "family_shares": {
            "target": _listed(family_shares(target_shares, both, family, n_families)),
            "sampler": _listed(family_shares(sampler_shares, both, family, n_families)),
        },
    }


def length_effect(base: DrawnSamples, family: np.ndarray, n_strategies: int, n_families: int) -> dict:
    """Per family, a strategy's share under the target against its share among the base's right
    samples (the same samples, unweighted): how much the target's likelihood moves the mix.

    returns: {"target", "base_correct": (F, S) family_shares lists over the questions where a
              right sample names a strategy (NaN as None), "questions_per_family": (F,)}
    """
    family = np.asarray(family)
    weights = self_normalised_weights(base.log_weight, base.mask)
    plain = self_normalised_weights(np.zeros(base.mask.shape), base.mask)
    target_shares, named = strategy_shares(weights, base.strategy, n_strategies)
    plain_shares, plain_named = strategy_shares(plain, base.strategy, n_strategies)
    both = named & plain_named
    return {
        "target": _listed(family_shares(target_shares, both, family, n_families)),
        "base_correct": _listed(family_shares(plain_shares, both, family, n_families)),
        "questions_per_family": [int((both & (family == f)).sum()) for f in range(n_families)],
    }


def _listed(values: np.ndarray) -> list:
    """A float array as nested lists with NaN as None (JSON has no NaN)."""
    return (
        [_listed(row) for row in values] if values.ndim > 1 else [None if math.isnan(v) else float(v) for v in values]
    )


def drawn_samples(
    problems: Sequence[Problem],
    sampled: Mapping[str, Sequence[Sample]],
    step_scores: Mapping[str, Sequence[Sequence[float]]],
    shaping: StateLogRewards,
    strategy_index: Mapping[str, int],
) -> DrawnSamples:
    """The arrays of DrawnSamples from samples records.

    sampled:        problem_id -> its sampled records; step_scores: problem_id -> per record its
                    PRM step scores U (as many as the record's steps)
    shaping:        the gfn section's reward (pipeline.finetune.rewards.StateLogRewards; its
                    reference prior is left out: the base's samples are the prior's own). A
                    record's last step carries its answer flag: no final answer (NO_ANSWER: the
                    unfinished-state penalty), right or wrong; earlier steps count as unanswered,
                    which only the last state's reward reads
    strategy_index: strategy name -> index (pipeline.strategies.correct_strategy_names names them)
    """
    width = max(1, max(len(sampled[p.problem_id]) for p in problems))
    shape = (len(problems), width)
    mask, strategy = np.zeros(shape, dtype=bool), np.full(shape, -1)
    log_likelihood, log_weight = np.zeros(shape), np.zeros(shape)
    for q, problem in enumerate(problems):
        records = sampled[problem.problem_id]
        scores = step_scores[problem.problem_id]
        if len(scores) != len(records):
            raise ValueError(
                f"drawn_samples: {len(scores)} score lists for {len(records)} samples of {problem.problem_id}"
            )
        for k, (record, row) in enumerate(zip(records, scores)):
            if len(row) != len(record.steps):
                raise ValueError(
                    f"drawn_samples: {len(row)} step scores for the {len(record.steps)} steps of sample "
                    f"{record.sample_idx} of {problem.problem_id}"
                )
            logs = [math.log(max(u, 1e-300)) for u in row]
            names = correct_strategy_names(problem, [record.steps], [record.correct])
            mask[q, k] = True
            strategy[q, k] = strategy_index[names[0]] if names else -1
            log_likelihood[q, k] = math.fsum(logs)
            log_weight[q, k] = terminal_log_reward(logs, record, shaping)
    return DrawnSamples(mask, strategy, log_likelihood, log_weight)


def terminal_log_reward(step_log_scores: Sequence[float], record: Sample, shaping: StateLogRewards) -> float:
    """log R^(1/T) of a sample's last state under the gfn section's shaping (shaped_log_rewards,
    without the reference prior); an empty sample is s_0, unanswered."""
    steps = len(step_log_scores)
    flag = NO_ANSWER if record.final_answer is None else (CORRECT_ANSWER if record.correct else WRONG_ANSWER)
    width = max(1, steps)
    scores = torch.zeros(1, width, dtype=torch.float64)
    scores[0, :steps] = torch.tensor(list(step_log_scores), dtype=torch.float64)
    flags = torch.full((1, width), NO_ANSWER, dtype=torch.long)
    if steps:
        flags[0, steps - 1] = flag
    mask = torch.arange(width)[None, :] < steps
    log_r = shaped_log_rewards(
        scores,
        flags,
        mask,
        reward_temperature=shaping.reward_temperature,
        unfinished_log_reward=shaping.unfinished_log_reward,
        outcome_coef=shaping.outcome_coef,
        outcome_floor=shaping.outcome_floor,
    )
    return float(log_r[0, steps])


def prm_step_scores(
    sampled: Mapping[str, Sequence[Sample]], problems: Sequence[Problem], prm
) -> dict[str, list[list[float]]]:
    """problem_id -> per sampled record its PRM step scores U (an empty sample: none), from ONE
    call of ``prm`` (PRMScorer.score_many: [(question, steps)] -> per pair its step scores)."""
    pairs = [(p.question, r.steps) for p in problems for r in sampled[p.problem_id] if r.steps]
    scores = iter(prm(pairs))
    return {p.problem_id: [list(next(scores)) if r.steps else [] for r in sampled[p.problem_id]] for p in problems}


def score_target(
    problems: Sequence[Problem],
    draws: Mapping[str, Mapping[str, Sequence[Sample]]],
    reference: str,
    prm,
    shaping: StateLogRewards,
    n_resamples: int = 2000,
    seed: int = 0,
) -> dict:
    """The target estimated from the reference model's draw and every model compared with it.

    problems: the Q problems drawn; draws: model -> problem_id -> its sampled records at
              temperature 1; reference: the base model's name (a key of draws)
    prm:      PRMScorer.score_many; shaping: the gfn section's reward
    returns:  {"reference", "strategies": [S] names, "families": [F] names, "reward_temperature",
               "reference_prior_coef" (the gfn section's: the estimate is the GFlowNet's target at 1),
               "effective_samples": {mean, median, min, max} (Kish, per question, summarised),
               "effective_samples_per_question": [Q], "length_effect": length_effect,
               "models": {model: compare_to_target of its draw}}
    """
    records = {p.problem_id: p for p in problems}
    names = sorted(
        {
            name
            for draw in draws.values()
            for pid, rows in draw.items()
            for name in correct_strategy_names(records[pid], [r.steps for r in rows], [r.correct for r in rows]) or []
        }
    )
    families = sorted({p.meta.get("family") or NO_FAMILY for p in problems})
    family = np.array([families.index(p.meta.get("family") or NO_FAMILY) for p in problems])
    index = {name: i for i, name in enumerate(names)}
    arrays = {
        model: drawn_samples(problems, draw, prm_step_scores(draw, problems, prm), shaping, index)
        for model, draw in draws.items()
    }
    base = arrays[reference]
    ess = effective_sample_size(self_normalised_weights(base.log_weight, base.mask), base.mask)
    return {
        "reference": reference,
        "strategies": names,
        "families": families,
        "reward_temperature": shaping.reward_temperature,
        "reference_prior_coef": shaping.reference_prior_coef,
        "effective_samples": summarise_effective_samples(ess),
        "effective_samples_per_question": ess.tolist(),
        "length_effect": length_effect(base, family, len(names), len(families)),
        "models": {
            model: compare_to_target(base, drawn, family, len(names), len(families), n_resamples=n_resamples, seed=seed)
            for model, drawn in arrays.items()
        },
    }


def target_line(benchmark: str, target: dict) -> str:
    """One line: the effective samples the target rests on and each model's distance to it."""
    ess = target["effective_samples"]
    parts = [
        f"target on {benchmark} from {target['reference']}'s draw: effective samples per question mean "
        f"{ess['mean']:.2f}, median {ess['median']:.2f}, min {ess['min']:.2f}"
    ]
    for model, compared in target["models"].items():
        distance, log_l = compared["share_distance"], compared["log_likelihood"]
        shares = (
            "strategy shares: no question with named right samples"
            if distance["estimate"] is None
            else f"strategy-share TV {distance['estimate']:.3f} [{distance['lo']:.3f}, {distance['hi']:.3f}]"
        )
        likelihood = (
            ""
            if log_l["difference"] is None
            else f", mean log L {log_l['sampler']:.3f} vs target {log_l['target']:.3f}: "
            f"{log_l['difference']:+.3f} [{log_l['lo']:+.3f}, {log_l['hi']:+.3f}]"
        )
        parts.append(f"{model}: {shares}{likelihood}")
    return "; ".join(parts)
