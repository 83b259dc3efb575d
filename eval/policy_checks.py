"""Quick checks of a freshly trained tiny-world policy (make bootstrap writes them to metrics.json).

The accuracy part is the evaluation library's own sample -> grade -> score path
(``eval.sampling.generate_samples`` / ``eval.sample_metrics.score_samples``) with the bootstrap's sampling settings
(bootstrap.eval_samples samples at bootstrap.sample_temperature, seed bootstrap.seed + 1, plus
the greedy sample). On top of it, what only the tiny world can tell: how many distinct valid
step orders the correct samples use, the share of sampled steps with an arithmetic slip, and
the share of sampled step prefixes whose Monte Carlo value is strictly between 0 and 1 (room
for a PRM to learn something).
"""

from __future__ import annotations

import dataclasses
import time

from eval.sample_metrics import score_samples
from eval.sampling import GREEDY_SAMPLE_IDX, generate_samples, problem_kind
from pipeline.config.schema import Config
from pipeline.grading import extract_answer, grade_many
from pipeline.prompts import prompt_from_config
from pipeline.records import Sample
from pipeline.rollouts.mcts import make_rollout_fn, mc_value
from pipeline.tinyworld.checker import arithmetic_errors, num_strategies, solution_strategy


def _mean(values: list) -> float | None:
    return round(sum(values) / len(values), 3) if values else None


def policy_checks(generator, problems, config: Config) -> dict:
    """Greedy and sampled accuracy, strategy diversity, arithmetic slips and MC-value spread of
    ``generator`` on held-out tiny-world problems."""
    boot, sep = config.bootstrap, config.format.separator
    if not problems:
        return {"eval_problems": 0}
    kinds = {p.kind for p in problems}
    if len(kinds) > 1:
        raise ValueError(f"bootstrap checks: the test problems mix answer kinds {sorted(kinds)}")
    kind = kinds.pop()
    k = boot.eval_samples
    settings = dataclasses.replace(
        config,
        eval=dataclasses.replace(
            config.eval, k=k, temperature=boot.sample_temperature, seed=boot.seed + 1, greedy=True
        ),
    )

    start = time.monotonic()
    records = generate_samples(generator, problems, problem_kind, settings, model="bootstrap")
    accuracy = score_samples(records, problems, problem_kind, settings)["accuracy"]
    sampled: dict[str, list[Sample]] = {p.problem_id: [] for p in problems}
    for record in records:
        if record.sample_idx != GREEDY_SAMPLE_IDX:
            sampled[record.problem_id].append(record)
    checks: dict = {
        "eval_problems": len(problems),
        "greedy_accuracy": round(accuracy["greedy_pass@1"]["mean"], 4),
        "sample_temperature": boot.sample_temperature,
        "samples_per_problem": k,
        "sampled_accuracy": round(accuracy["pass@1"]["mean"], 4),
        f"pass@{k}": round(accuracy["pass@k"]["mean"], 4),
        f"maj@{k}": round(accuracy["maj@k"]["mean"], 4),
    }
    strategies, steps_total, slips, slip_examples = [], 0, 0, []
    for problem in problems:
        rows = sampled[problem.problem_id]
        used = {solution_strategy(problem, r.steps) for r in rows if r.correct}
        strategies.append((len(used - {None}), num_strategies(problem)))
        for r in rows:
            steps_total += len(r.steps)
            wrong = arithmetic_errors(r.steps)
            slips += len(wrong)
            slip_examples.extend(wrong[: max(0, 5 - len(slip_examples))])
    all_sampled = [r for rows in sampled.values() for r in rows]
    checks.update(
        {
            "finished_share": round(sum(bool(r.finished) for r in all_sampled) / max(len(all_sampled), 1), 4),
            # distinct valid strategies among a problem's correct samples, over problems with >1 valid strategy
            "mean_correct_strategies_multi": _mean([used for used, total in strategies if total > 1]),
            "mean_valid_strategies": _mean([total for _, total in strategies]),
            "step_arithmetic_error_rate": round(slips / max(steps_total, 1), 4),
            "example_wrong_steps": slip_examples,
            "sampling_seconds": round(time.monotonic() - start, 1),
        }
    )

    # Monte Carlo values of the step prefixes of the first problems' samples: every prefix that
    # ends before the answer step, deduplicated, with mc_rollouts continuations each.
    start = time.monotonic()
    prompts = [prompt_from_config(p.question, p.kind, generator.tokenizer, config.format) for p in problems]
    requests = []
    for i, problem in enumerate(problems[: boot.mc_problems]):
        seen = set()
        for r in sampled[problem.problem_id]:
            for depth in range(1, len(r.steps)):
                prefix = tuple(r.steps[:depth])
                if prefix not in seen and extract_answer(sep.join(prefix), kind) is None:
                    seen.add(prefix)
                    requests.append((i, prefix))
    mcs: list[float] = []
    if requests and boot.mc_rollouts > 0:
        rollout_fn = make_rollout_fn(
            generator,
            prompts,
            [p.answer for p in problems],
            kind,
            k=boot.mc_rollouts,
            temperature=boot.sample_temperature,
            top_p=config.generation.top_p,
            max_new_tokens=config.generation.max_new_tokens,
            separator=sep,
            grade_many=grade_many,
            extract_answer=extract_answer,
            seed=boot.seed + 2,
        )
        mcs = [mc_value(rollouts) for rollouts in rollout_fn(requests)]
    between = sum(0 < mc < 1 for mc in mcs)
    checks.update(
        {
            "mc_prefixes": len(mcs),
            "mc_rollouts_per_prefix": boot.mc_rollouts,
            "mc_strictly_between": between,
            "mc_share_strictly_between": round(between / len(mcs), 4) if mcs else None,
            "mc_share_zero": round(sum(mc == 0 for mc in mcs) / len(mcs), 4) if mcs else None,
            "mc_share_one": round(sum(mc == 1 for mc in mcs) / len(mcs), 4) if mcs else None,
            "mc_seconds": round(time.monotonic() - start, 1),
        }
    )
    return checks
