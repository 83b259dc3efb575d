"""Whole-solution search over k complete samples per problem: best_of_n, weighted_vote, majority.

    best_of_n       the sample with the best aggregated PRM score
    weighted_vote   majority vote over the samples' answers weighted by aggregated PRM score
    majority        unweighted majority vote; no PRM (the unguided baseline; k=1 is pass@1 of a
                    single sample)

ONE generate call for every problem, and ONE score_many call unless the strategy is majority.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from pipeline.generation.base import stream_seed
from pipeline.grading import normalize_answer
from pipeline.steps import split_steps
from prm.search.candidates import (
    Candidate,
    SearchProblem,
    SearchResult,
    SearchSettings,
    aggregate,
    answerless,
    best_of_first_tier,
    new_candidate,
    score_candidates,
    states_answer,
    to_result,
)


@dataclass
class WholeSolutionState:
    """One problem's k whole solutions and the policy tokens they took."""

    problem: SearchProblem
    samples: list[Candidate] = field(default_factory=list)
    tokens_generated: int = 0


def whole_solution_search(
    problems: Sequence[SearchProblem], *, policy, prm, strategy: str, k: int, s: SearchSettings
) -> list[SearchResult]:
    """best_of_n, weighted_vote and majority over k whole solutions per problem."""
    outputs = policy.generate(
        [problem.prompt for problem in problems],
        n=k,
        temperature=s.temperature,
        top_p=s.top_p,
        max_new_tokens=s.max_new_tokens,
        stop=None,
        seed=None if s.seed is None else [stream_seed(s.seed, problem.key, "whole") for problem in problems],
    )
    states = []
    for problem, completions in zip(problems, outputs):
        states.append(
            WholeSolutionState(
                problem,
                samples=[
                    new_candidate(
                        split_steps(c.text, s.separator), c.finish_reason == "eos" or states_answer(c.text, s), s
                    )
                    for c in completions
                ],
                tokens_generated=sum(len(c.token_ids) for c in completions),
            )
        )
    if strategy != "majority":
        score_candidates(prm, [(state.problem, c) for state in states for c in state.samples if c.steps])

    results = []
    for state in states:
        if strategy == "best_of_n":
            chosen = best_answered_first(state.samples, s)
        else:
            weights = None
            if strategy == "weighted_vote":
                weights = [aggregate(c.step_scores, s.aggregation) for c in state.samples]
            chosen = vote(state.samples, weights, s)
        results.append(to_result(chosen, state.tokens_generated))
    return results


def best_answered_first(group: Sequence[Candidate], s: SearchSettings) -> Candidate:
    """The best finished sample that states an answer, else the best unfinished one, else the best
    answerless one (the last two are graded wrong alike; an answerless one comes last, as in
    the step-level search)."""
    answered = [c for c in group if c.finished and not answerless(c, s)]
    unfinished = [c for c in group if not c.finished]
    answerless_ones = [c for c in group if answerless(c, s)]
    return best_of_first_tier([answered, unfinished, answerless_ones], s.aggregation)


def vote(group: Sequence[Candidate], weights: Sequence[float] | None, s: SearchSettings) -> Candidate:
    """The (weighted) majority answer's representative: the best-scored sample of the winning
    bucket (the first one when unweighted). No answer anywhere: best_of_n's (or the first) choice."""
    answers = [c.answer for c in group]
    totals: dict[str, float] = {}
    for i, answer in enumerate(answers):
        if answer is None:
            continue
        bucket = normalize_answer(answer, s.kind)
        totals[bucket] = totals.get(bucket, 0.0) + (1.0 if weights is None else weights[i])
    if not totals:
        return group[0] if weights is None else best_answered_first(group, s)
    winner = max(totals, key=totals.__getitem__)  # first-seen bucket wins ties
    members = [i for i, a in enumerate(answers) if a is not None and normalize_answer(a, s.kind) == winner]
    if weights is None:
        return group[members[0]]
    return group[max(members, key=lambda i: weights[i])]
