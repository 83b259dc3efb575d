"""Paired comparisons of two models on the same problems: one model minus a reference, per problem.

Each figure is differenced problem by problem (d_p = model_p - reference_p) and its mean gets a
paired percentile-bootstrap interval (problems resampled once for both models,
pipeline.stats.bootstrap_ci). Pairing removes the problem-difficulty variance two separate
intervals carry, so a change can be clear even where the two models' own intervals overlap.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from eval.accuracy import per_problem_scores
from eval.sample_metrics import graded
from eval.sampling import KindOf, problem_kind
from pipeline.config.schema import Config
from pipeline.records import Problem, Sample
from pipeline.stats import bootstrap_ci


def paired_differences(
    reference_records: Sequence[Sample],
    records: Sequence[Sample],
    problems: Sequence[Problem],
    kind_of: KindOf = problem_kind,
    *,
    n_resamples: int = 2000,
    seed: int = 0,
    reference_metrics: dict | None = None,
    model_metrics: dict | None = None,
) -> dict:
    """``records`` minus ``reference_records`` on the same problems, {figure: {"mean", "lo", "hi"}}.

    Figures: the accuracy metrics (greedy_pass@1 when both have greedy records, pass@1, maj@k,
    pass@k), and where both metrics dicts (eval.sample_metrics.score_samples outputs) carry them per
    problem, the mean PRM reward ("prm_reward"), the mean pairwise similarity of the sampled
    solutions ("similarity", lower = more diverse) and the strategy entropy of the correct solutions
    ("strategy_entropy", bits). A figure is paired over the problems that carry it for both models
    (None = not carried); one no problem carries for both is left out.

    For two problems where the reference solves none of its samples and the model all of them,
    {"pass@1": {"mean": 1.0, "lo": 1.0, "hi": 1.0}, ...}.
    """
    _, reference, reference_greedy = graded(reference_records, problems, kind_of)
    _, model, model_greedy = graded(records, problems, kind_of)
    # figure -> (reference's per-problem values, model's), both in problem order
    per_problem: dict[str, tuple[Sequence, Sequence]] = {}
    if reference_greedy is not None and model_greedy is not None:
        per_problem["greedy_pass@1"] = (
            [float(reference_greedy[p.problem_id]) for p in problems],
            [float(model_greedy[p.problem_id]) for p in problems],
        )
    before, after = per_problem_scores(reference), per_problem_scores(model)
    for metric in ("pass@1", "maj@k", "pass@k"):
        per_problem[metric] = (before[metric], after[metric])

    reference_metrics, model_metrics = reference_metrics or {}, model_metrics or {}
    rewards = [m.get("prm_reward") for m in (reference_metrics, model_metrics)]
    if all(r and "per_problem" in r for r in rewards):
        per_problem["prm_reward"] = (rewards[0]["per_problem"], rewards[1]["per_problem"])
    diversities = [m.get("diversity", {}) for m in (reference_metrics, model_metrics)]
    for name in ("similarity", "strategy_entropy"):
        values = [(d.get(name) or {}).get("per_problem") for d in diversities]
        if all(v is not None for v in values):
            per_problem[name] = (values[0], values[1])

    differences = {}
    for name, (reference_values, model_values) in per_problem.items():
        pairs = [(a, b) for a, b in zip(reference_values, model_values) if a is not None and b is not None]
        if pairs:
            mean, lo, hi = bootstrap_ci(np.array([b - a for a, b in pairs]), n_resamples=n_resamples, seed=seed)
            differences[name] = {"mean": mean, "lo": lo, "hi": hi}
    return differences


def compare_to_reference(
    all_records: dict, benchmarks: dict, kind_of: KindOf, config: Config, metrics: dict | None = None
) -> dict:
    """{"reference": name, "models": {model: {benchmark: paired differences}}, "pairs": {"a_vs_b":
    {benchmark: a minus b}}} against the model named "base" (else the first evaluated one) and
    for every pair of eval.pairs that was evaluated (paired_differences, eval.bootstrap_resamples
    resamples seeded with eval.seed); empty when fewer than two models ran.

    metrics: {model: {benchmark: score_samples output}}: the per-problem PRM reward, similarity and
    strategies the differences beyond accuracy are paired from.
    """
    if len(all_records) < 2:
        return {}
    metrics = metrics or {}
    reference = "base" if "base" in all_records else next(iter(all_records))

    def compare(model: str, against: str) -> dict:
        return {
            bench: paired_differences(
                all_records[against][bench],
                records,
                benchmarks[bench],
                kind_of,
                n_resamples=config.eval.bootstrap_resamples,
                seed=config.eval.seed,
                reference_metrics=metrics.get(against, {}).get(bench),
                model_metrics=metrics.get(model, {}).get(bench),
            )
            for bench, records in all_records[model].items()
            if bench in all_records[against]
        }

    models = {name: compare(name, reference) for name in all_records if name != reference}
    pairs = {f"{a}_vs_{b}": compare(a, b) for a, b in config.eval.pairs if a in all_records and b in all_records}
    return {"reference": reference, "models": {m: d for m, d in models.items() if d}, "pairs": pairs}
