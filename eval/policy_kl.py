"""Each learner's KL divergence to the reference policy, from its own draw at temperature 1.

KL(pi || pi_ref) = E_{tau ~ pi}[log pi(tau) - log pi_ref(tau)], tau a whole solution: its steps and,
when it ended, the stop. The draw every model makes at temperature 1 (eval.target_samples per
problem on the first eval.target_problems problems; top_p 1, so the samples are pi's own) gives a
Monte Carlo estimate: each sample is scored teacher-forced under the model and under the
reference (the model named "base", else the first of eval.models) by the scoring the GFlowNet's
prior uses (pipeline.finetune.policy.LMPolicy.logprobs), d = log pi(tau) - log pi_ref(tau); per
problem the mean of d over its samples, then the mean over problems with a percentile bootstrap
that resamples problems. A sample cut off at max_new_tokens counts its steps without a stop.

The estimate is reported beside the claims (how far each learner moved from the base), not judged.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path

import numpy as np

from pipeline.prompts import prompt_from_config
from pipeline.records import Problem, Sample
from pipeline.stats import bootstrap_ci
from pipeline.storage.files import read_records


def kl_estimate(differences: Sequence[tuple[str, float]], n_resamples: int = 2000, seed: int = 0) -> dict | None:
    """KL(pi || pi_ref) from a draw of pi.

    differences: (problem_id, d) per sample, d = log pi(tau) - log pi_ref(tau), any order
    returns:     {"mean": mean over problems of each problem's mean d, "lo", "hi" (95% percentile
                 bootstrap over problems), "n_problems", "n_samples"}, or None without samples
    """
    by_problem: dict[str, list[float]] = {}
    for problem_id, value in differences:
        if not np.isfinite(value):
            raise ValueError(f"kl_estimate: problem {problem_id!r} has a non-finite log-ratio {value}")
        by_problem.setdefault(problem_id, []).append(float(value))
    if not by_problem:
        return None
    per_problem = np.array([np.mean(values) for values in by_problem.values()], dtype=np.float64)
    mean, lo, hi = bootstrap_ci(per_problem, n_resamples=n_resamples, seed=seed)
    return {"mean": mean, "lo": lo, "hi": hi, "n_problems": len(by_problem), "n_samples": len(differences)}


def solution_logprobs(
    policy, prompts: Sequence[str], step_lists: Sequence[Sequence[str]], finished: Sequence[bool], micro_batch: int
) -> list[float]:
    """log pi(tau) of each solution under ``policy`` (an LMPolicy), teacher-forced without gradients:
    the sum of its steps' log-probabilities, plus the stop's after its last step where it ended."""
    out: list[float] = []
    for start in range(0, len(prompts), max(1, micro_batch)):
        stop = start + max(1, micro_batch)
        lp = policy.logprobs(prompts[start:stop], step_lists[start:stop], with_grad=False)
        steps, ends = lp.step_logprobs.double().cpu(), lp.termination_logprobs.double().cpu()
        for row, (step_list, ended) in enumerate(zip(step_lists[start:stop], finished[start:stop])):
            n = len(step_list)
            out.append(float(steps[row, :n].sum()) + (float(ends[row, n]) if ended else 0.0))
    return out


def draw_log_ratios(
    draw: Sequence[Sample],
    problems: Mapping[str, Problem],
    policies: Mapping[str, object],
    prompt_of,
    micro_batch: int,
) -> list[tuple[str, float]]:
    """(problem_id, log pi(tau) - log pi_ref(tau)) for each sample of ``draw`` that has a step.

    policies: {"model": its LMPolicy, "reference": the reference's}; prompt_of(problem, tokenizer):
    the prompt the model was sampled with (each policy encodes it with its own tokenizer)."""
    kept = [s for s in draw if s.steps and s.problem_id in problems]
    steps = [list(s.steps) for s in kept]
    finished = [s.finished is not False for s in kept]
    scored = {}
    for role, policy in policies.items():
        prompts = [prompt_of(problems[s.problem_id], policy.tokenizer) for s in kept]
        scored[role] = solution_logprobs(policy, prompts, steps, finished, micro_batch)
    return [(s.problem_id, a - b) for s, a, b in zip(kept, scored["model"], scored["reference"])]


def policy_kls(config, draws: Mapping[str, Mapping[str, Sequence[Sample]]], benchmarks, kind_of, load_policy) -> dict:
    """{benchmark: {model: kl_estimate(...) | {"note": why not}}} for every model of ``draws`` but
    the reference ("base", else the first), each against the reference.

    draws: {benchmark: {model: its samples at temperature 1}}; benchmarks: {benchmark: [Problem]};
    load_policy(model name) -> its LMPolicy (loaded once per model, kept for every benchmark)."""

    def prompt_of(problem: Problem, tokenizer) -> str:
        return prompt_from_config(
            problem.question, kind_of(problem), tokenizer, config.format, problem.meta.get("options")
        )

    loaded: dict[str, object] = {}

    def policy(name: str):
        if name not in loaded:
            loaded[name] = load_policy(name)
        return loaded[name]

    out: dict = {}
    for bench, models in draws.items():
        if not models:
            continue
        reference = "base" if "base" in models else next(iter(models))
        problems = {p.problem_id: p for p in benchmarks[bench]}
        out[bench] = {"reference": reference, "models": {}}
        for name, draw in models.items():
            if name == reference:
                continue
            ratios = draw_log_ratios(
                draw,
                problems,
                {"model": policy(name), "reference": policy(reference)},
                prompt_of,
                config.generation.batch_size,
            )
            estimate = kl_estimate(ratios, config.eval.bootstrap_resamples, config.eval.seed)
            out[bench]["models"][name] = estimate or {"note": "no sample with a step in its draw"}
    return out


def kl_line(bench: str, block: dict) -> str:
    """One log/report line of a benchmark's KL estimates."""
    parts = []
    for name, estimate in block["models"].items():
        if "note" in estimate:
            parts.append(f"{name}: {estimate['note']}")
        else:
            parts.append(
                f"{name} {estimate['mean']:.3f} [{estimate['lo']:.3f}, {estimate['hi']:.3f}] nats "
                f"({estimate['n_samples']} samples of {estimate['n_problems']} problems)"
            )
    return f"KL to {block['reference']} on {bench} (each model's draw at temperature 1): " + "; ".join(parts)


def read_draw(path: Path) -> list[Sample]:
    """A model's draw at temperature 1 as make eval wrote it (its samples file)."""
    return list(read_records(path, Sample))
