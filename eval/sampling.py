"""Sampling one model on one benchmark: prompts, two batched generate calls, grading, samples records.

Per benchmark: ONE generate call with every problem and n = eval.k at eval.temperature, plus ONE
greedy call (temperature 0, n = 1); every completion is split into steps, graded, and becomes a
pipeline.records.Sample (sample_idx -1 = greedy). Problem p's samples draw from the stream
stream_seed(eval.seed, p's id) (sample j: + j), so they depend on nothing but the problem.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from pipeline.config.schema import Config
from pipeline.generation.base import stream_seed
from pipeline.grading import extract_answer, grade_many
from pipeline.prompts import prompt_from_config
from pipeline.records import Problem, Sample
from pipeline.steps import split_steps

GREEDY_SAMPLE_IDX = -1

KindOf = Callable[[Problem], str]


def problem_kind(problem: Problem) -> str:
    """The default ``kind_of``: the grading kind of the problem's source."""
    return problem.kind


def _prompts(problems: Sequence[Problem], kind_of: KindOf, tokenizer, config: Config) -> list[str]:
    return [
        prompt_from_config(p.question, kind_of(p), tokenizer, config.format, p.meta.get("options")) for p in problems
    ]


def _check_outputs(outputs, problems: Sequence[Problem], n: int, what: str) -> None:
    if len(outputs) != len(problems):
        raise ValueError(
            f"generate ({what}) returned {len(outputs)} lists for {len(problems)} prompts; expected one each"
        )
    for problem, completions in zip(problems, outputs):
        if len(completions) != n:
            raise ValueError(
                f"generate ({what}) returned {len(completions)} completions for {problem.problem_id}; expected {n}"
            )


def generate_samples(
    generator, problems: Sequence[Problem], kind_of: KindOf, config: Config, model: str
) -> list[Sample]:
    """The samples of one model on one benchmark, problem by problem: the greedy sample
    (sample_idx -1, when eval.greedy) then samples 0..k-1; a sample cut off at max_new_tokens
    is recorded as not finished.

    Two generate calls in all: every problem with n = eval.k at eval.temperature, and every
    problem with n = 1 at temperature 0. Grading is one grade_many call per answer kind. Each
    problem samples from its own stream, stream_seed(eval.seed, problem id): its samples are the
    same whatever other problems share the call (a chunk, a worker's share).
    """
    prompts = _prompts(problems, kind_of, getattr(generator, "tokenizer", None), config)
    seeds = [stream_seed(config.eval.seed, p.problem_id) for p in problems]
    common = {"top_p": config.generation.top_p, "max_new_tokens": config.generation.max_new_tokens, "seed": seeds}
    k = config.eval.k
    sampled = generator.generate(prompts, n=k, temperature=config.eval.temperature, **common)
    _check_outputs(sampled, problems, k, f"n={k}")
    completions_per_problem = [list(completions) for completions in sampled]
    indices = [list(range(k)) for _ in problems]
    if config.eval.greedy:
        greedy = generator.generate(prompts, n=1, temperature=0.0, **{**common, "top_p": 1.0})
        _check_outputs(greedy, problems, 1, "greedy")
        completions_per_problem = [g + completions for g, completions in zip(greedy, completions_per_problem)]
        indices = [[GREEDY_SAMPLE_IDX] + idx for idx in indices]

    # one grade_many per kind keeps every Math-Verify comparison of the benchmark in one batch
    flat = [(p, i, c) for p, completions in enumerate(completions_per_problem) for i, c in enumerate(completions)]
    correct = [False] * len(flat)
    by_kind: dict[str, list[int]] = {}
    for position, (p, _, _) in enumerate(flat):
        by_kind.setdefault(kind_of(problems[p]), []).append(position)
    for kind, positions in by_kind.items():
        verdicts = grade_many(
            [flat[j][2].text for j in positions], [problems[flat[j][0]].answer for j in positions], kind
        )
        for j, verdict in zip(positions, verdicts):
            correct[j] = bool(verdict)

    return [
        Sample(
            problem_id=problems[p].problem_id,
            model=model,
            sample_idx=indices[p][i],
            steps=split_steps(completion.text, config.format.separator),
            final_answer=extract_answer(completion.text, kind_of(problems[p])),
            correct=is_correct,
            finished=completion.finish_reason != "length",
        )
        for (p, i, completion), is_correct in zip(flat, correct)
    ]
