"""PRM-guided search at inference (paper 3.4, Figure 2), batched across problems.

Strategies (docs/search.md has the rules in full):
    step_best_of_k  at each step the policy proposes k candidate next steps, the PRM scores each
                    (prefix + candidate), the best is kept; until a finished candidate wins or
                    max_depth (the paper's)
    beam            the top ``beam_width`` partial solutions by aggregated PRM score, each
                    expanded with k // beam_width candidates (the root with k)
    best_of_n       k whole solutions, the one with the best aggregated PRM score
    weighted_vote   k whole solutions, majority vote over their answers weighted by PRM score
    majority        k whole solutions, unweighted majority vote; no PRM (the unguided baseline;
                    k=1 is pass@1 of a single sample)

Batching: at each depth ONE generate call covers every live partial solution of every problem,
and ONE score_many call scores every new candidate. A returned solution states an answer
whenever any finished candidate that states one was seen for its problem; otherwise the best
partial comes back with ``finished=False``, and only when no partial is left either an
answerless stop (finished, ``answer=None``). The stage counts both wrong.

Seeding: every prompt of a call draws from its own stream (pipeline.generation.base.stream_seed)
keyed by the search seed and the problem's id: (seed, id, "whole") for the k whole solutions,
(seed, id, "step", depth, j) for the j-th live partial of a step-level search at that depth. A
problem's search therefore depends on nothing but the problem (not on the problems beside it in
the batch or on the worker holding it), the whole-solution strategies at one k share their k
samples, and the k samples are the first k of any larger k's.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, fields
from typing import Sequence, get_args

import numpy as np

from pipeline.config import Aggregation, FormatConfig, SearchStrategy
from pipeline.config_loader import check_choice
from pipeline.generation.base import stream_seed
from pipeline.grading import answers_equal_many, extract_answer, normalize_answer
from pipeline.prompts import prompt_from_config
from pipeline.stats import bootstrap_ci
from pipeline.steps import join_steps, split_steps

STRATEGIES = get_args(SearchStrategy)
STEP_STRATEGIES = ("step_best_of_k", "beam")
AGGREGATIONS = get_args(Aggregation)


@dataclass
class SearchResult:
    """The solution one search returns.

    steps:            the solution's steps
    step_scores:      PRM score U(s_k|s_{k-1}) of each step ([] for the unguided ``majority``)
    finished:         True when the solution ended (end token, or a step stating a final answer)
    answer:           extract_answer of the solution (None when unfinished, when it ended without
                      stating an answer, or when kind is unknown)
    tokens_generated: policy tokens generated for this problem, discarded candidates included
    """

    steps: list[str]
    step_scores: list[float]
    finished: bool
    answer: str | None
    tokens_generated: int


@dataclass
class SearchSettings:
    """Everything a search needs besides the models (paper defaults from SearchConfig)."""

    kind: str | None = None  # grading kind: detects final answers and builds default prompts
    temperature: float = 0.8  # paper 3.4: T = 0.8
    top_p: float = 1.0
    max_depth: int = 12  # steps before a step-level search gives up
    beam_width: int = 4  # beam only
    # last | mean | min | prod: a partial/whole solution's score. last: U of the last step, which a
    # PRM trained on Monte Carlo values makes P(correct) of the whole prefix; min and prod can only
    # fall as steps are added, so they prefer short solutions (docs/search.md)
    aggregation: str = "last"
    max_step_tokens: int = 48  # one step (step-level strategies)
    max_new_tokens: int = 160  # one whole solution (best_of_n, weighted_vote, majority)
    separator: str = "\n"
    seed: int | None = 0  # the streams of a problem are drawn from (seed, problem id, ...) (module docstring); None: unseeded
    format_config: object | None = None  # FormatConfig for default prompts (None: defaults)


@dataclass
class _Candidate:
    steps: list[str]
    step_scores: list[float] = field(default_factory=list)
    finished: bool = False
    answer: str | None = None  # extract_answer of the whole solution, read once it is finished


def aggregate(step_scores: Sequence[float], aggregation: str) -> float:
    """One score for a solution from its step scores: the last, the mean, the min or the product.
    A solution without steps scores -inf (it never beats one with steps)."""
    check_choice(aggregation, Aggregation, "aggregation")
    if not step_scores:
        return -math.inf
    if aggregation == "last":
        return float(step_scores[-1])
    if aggregation == "mean":
        return math.fsum(step_scores) / len(step_scores)
    if aggregation == "min":
        return float(min(step_scores))
    return float(math.prod(step_scores))


def search(question: str, policy, prm, strategy: str, k: int, prompt: str | None = None, problem_id: str | None = None,
           **settings) -> SearchResult:
    """One problem: ``search_many`` with a single question (settings: SearchSettings fields)."""
    return search_many([question], policy, prm, strategy, k, prompts=None if prompt is None else [prompt],
                       problem_ids=None if problem_id is None else [problem_id], **settings)[0]


def search_many(
    questions: Sequence[str],
    policy,
    prm,
    strategy: str,
    k: int,
    prompts: Sequence[str] | None = None,
    problem_ids: Sequence[str] | None = None,
    **settings,
) -> list[SearchResult]:
    """Search every question at once, one SearchResult each, in order.

    questions: what the PRM sees (its scorer builds its own prompt from the question)
    policy:    a pipeline.generation Generator
    prm:       anything with score_many([(question, steps), ...]) -> [[U_1..U_n], ...]
               (unused by ``majority``; may be None there)
    prompts:   the policy's prompts (None: prompt_from_config with settings.kind/format_config)
    problem_ids: what each problem's random streams are keyed by (module docstring); None: its question
    settings:  SearchSettings fields
    """
    s = _settings(settings)
    check_choice(strategy, SearchStrategy, "search strategy")
    if k < 1:
        raise ValueError(f"search: k must be >= 1, got {k}")
    if prompts is None:
        prompts = default_prompts(questions, policy, s)
    if len(prompts) != len(questions):
        raise ValueError(f"search: {len(prompts)} prompts for {len(questions)} questions; expected one each")
    keys = list(questions) if problem_ids is None else [str(i) for i in problem_ids]
    if len(keys) != len(questions):
        raise ValueError(f"search: {len(keys)} problem ids for {len(questions)} questions; expected one each")
    if not questions:
        return []
    if strategy == "step_best_of_k":
        return _step_search(questions, prompts, keys, policy, prm, k, 1, True, s)
    if strategy == "beam":
        return _step_search(questions, prompts, keys, policy, prm, k, max(1, min(s.beam_width, k)), False, s)
    return _whole_solution_search(questions, prompts, keys, policy, prm, strategy, k, s)



def default_prompts(questions: Sequence[str], policy, s: SearchSettings) -> list[str]:
    format_config = s.format_config if s.format_config is not None else FormatConfig(separator=s.separator)
    tokenizer = getattr(policy, "tokenizer", None)
    return [prompt_from_config(q, s.kind or "math", tokenizer, format_config) for q in questions]


def _settings(settings: dict) -> SearchSettings:
    known = {f.name for f in fields(SearchSettings)}
    unknown = sorted(set(settings) - known)
    if unknown:
        raise TypeError(f"search: unknown setting(s) {unknown}; expected some of {sorted(known)}")
    s = SearchSettings(**settings)
    aggregate([], s.aggregation)  # validates the name
    if s.max_depth < 1:
        raise ValueError(f"search: max_depth must be >= 1, got {s.max_depth}")
    return s


def _states_answer(text: str, s: SearchSettings) -> bool:
    return s.kind is not None and extract_answer(text, s.kind) is not None


def _candidate(steps: list[str], finished: bool, s: SearchSettings) -> _Candidate:
    """A candidate; a finished one has its whole solution's final answer read once, here."""
    answer = None
    if finished and s.kind is not None:
        answer = extract_answer(join_steps(steps, s.separator), s.kind)
    return _Candidate(steps, finished=finished, answer=answer)


def _answerless(candidate: _Candidate, s: SearchSettings) -> bool:
    """A finished candidate that states no final answer: the policy ended a partial solution.
    It is graded wrong whatever the PRM thinks of its steps (its score is that of an unfinished
    prefix). With kind=None no answer can be read, so no candidate counts as answerless."""
    return candidate.finished and s.kind is not None and candidate.answer is None


def _score_all(prm, questions: Sequence[str], items: list[tuple[int, _Candidate]]) -> None:
    """Fill step_scores of every candidate with ONE score_many call (duplicates scored once)."""
    unique: dict[tuple[int, tuple[str, ...]], int] = {}
    for p, candidate in items:
        unique.setdefault((p, tuple(candidate.steps)), len(unique))
    keys = list(unique)
    scores = prm.score_many([(questions[p], list(steps)) for p, steps in keys]) if keys else []
    for p, candidate in items:
        candidate.step_scores = [float(x) for x in scores[unique[(p, tuple(candidate.steps))]]]


def _best(candidates: Sequence[_Candidate], aggregation: str) -> _Candidate:
    """The highest aggregated score; the first one on ties."""
    return max(candidates, key=lambda c: aggregate(c.step_scores, aggregation))


def _best_of_first_tier(tiers: Sequence[Sequence[_Candidate]], aggregation: str) -> _Candidate | None:
    """The best candidate of the first non-empty tier (None when every tier is empty)."""
    for tier in tiers:
        if tier:
            return _best(tier, aggregation)
    return None


def _result(candidate: _Candidate | None, tokens: int, s: SearchSettings) -> SearchResult:
    if candidate is None:
        return SearchResult([], [], False, None, tokens)
    return SearchResult(list(candidate.steps), list(candidate.step_scores), candidate.finished, candidate.answer, tokens)


# ----------------------------------------------------------------------------- step-level


def _step_search(questions, prompts, keys, policy, prm, k: int, width: int, rank_by_last: bool, s: SearchSettings) -> list[SearchResult]:
    """step_best_of_k (width 1, candidates ranked by their own step score) and beam (width W,
    ranked by the aggregated score of the whole partial solution).

    At each depth every live partial is expanded (the root with k candidates, later partials with
    k // width each, so a depth costs at most k candidates per problem). Answerless stops (the
    policy ended without stating an answer) are set aside as dead ends and never take a slot.
    The problem's other candidates are ranked and the top ``width - (finished already kept)``
    take the slots: finished ones are kept as answers, unfinished ones live on. Finished
    candidates that lose are kept as spares. A problem stops when it has no live partials or at
    max_depth; it returns the best kept finished candidate, else the best spare, else the best
    partial of the last depth that had one (finished=False), else the best dead end (answer None).
    """
    n_problems = len(questions)
    live: list[list[_Candidate]] = [[_Candidate([])] for _ in range(n_problems)]
    kept: list[list[_Candidate]] = [[] for _ in range(n_problems)]
    spares: list[list[_Candidate]] = [[] for _ in range(n_problems)]
    last_live: list[list[_Candidate]] = [[] for _ in range(n_problems)]
    dead_ends: list[list[_Candidate]] = [[] for _ in range(n_problems)]
    tokens = [0] * n_problems
    per_partial = max(1, k // width)
    if rank_by_last:
        # the candidate's own step score (its siblings share the prefix); a stop candidate that
        # adds no step is ranked by the last step of the solution it ends
        def rank(c: _Candidate) -> float:
            return c.step_scores[-1]
    else:
        def rank(c: _Candidate) -> float:
            return aggregate(c.step_scores, s.aggregation)

    for depth in range(s.max_depth):
        jobs = [(p, j, partial) for p in range(n_problems) for j, partial in enumerate(live[p])]
        if not jobs:
            break
        n = k if depth == 0 else per_partial
        outputs = policy.generate(
            [prompts[p] + join_steps(partial.steps, s.separator) for p, _, partial in jobs],
            n=n, temperature=s.temperature, top_p=s.top_p, max_new_tokens=s.max_step_tokens, stop=[s.separator],
            seed=None if s.seed is None else [stream_seed(s.seed, keys[p], "step", depth, j) for p, j, _ in jobs],
        )
        candidates: list[tuple[int, _Candidate]] = []
        for (p, _, partial), completions in zip(jobs, outputs):
            for completion in completions:
                tokens[p] += len(completion.token_ids)
                candidate = _extend(partial, completion, s)
                if candidate is not None:
                    candidates.append((p, candidate))
        _score_all(prm, questions, candidates)

        by_problem: list[list[_Candidate]] = [[] for _ in range(n_problems)]
        for p, candidate in candidates:
            by_problem[p].append(candidate)
        for p in range(n_problems):
            if not live[p]:
                continue
            dead_ends[p].extend(c for c in by_problem[p] if _answerless(c, s))
            usable = [c for c in by_problem[p] if not _answerless(c, s)]
            ranked = sorted(usable, key=rank, reverse=True)  # stable: first seen wins ties
            slots = width - len(kept[p])
            winners, losers = ranked[:slots], ranked[slots:]
            kept[p].extend(c for c in winners if c.finished)
            spares[p].extend(c for c in losers if c.finished)
            live[p] = [c for c in winners if not c.finished]
            if live[p]:
                last_live[p] = live[p]

    return [
        _result(_best_of_first_tier([kept[p], spares[p], last_live[p], dead_ends[p]], s.aggregation), tokens[p], s)
        for p in range(n_problems)
    ]


def _extend(partial: _Candidate, completion, s: SearchSettings) -> _Candidate | None:
    """partial + the step(s) of one completion, or None when it adds nothing usable.

    An empty completion that ended with the end token finishes the partial as it is (if it has
    steps): a stop candidate, whose answer is read from the whole solution (a live partial states
    none, so it is usually answerless); an empty line is dropped (the step format has no empty
    steps).
    """
    new_steps = split_steps(completion.text, s.separator)
    ended = completion.finish_reason == "eos"
    if not new_steps:
        if ended and partial.steps:
            return _candidate(list(partial.steps), True, s)
        return None
    finished = ended or _states_answer(join_steps(new_steps, s.separator), s)
    return _candidate(partial.steps + new_steps, finished, s)


# ----------------------------------------------------------------------------- whole solutions


def _whole_solution_search(questions, prompts, keys, policy, prm, strategy: str, k: int, s: SearchSettings) -> list[SearchResult]:
    """best_of_n, weighted_vote and majority over k whole solutions per problem (one generate
    call, and one score_many call unless the strategy is the unguided majority)."""
    outputs = policy.generate(
        list(prompts), n=k, temperature=s.temperature, top_p=s.top_p,
        max_new_tokens=s.max_new_tokens, stop=None,
        seed=None if s.seed is None else [stream_seed(s.seed, key, "whole") for key in keys],
    )
    samples: list[list[_Candidate]] = []
    tokens: list[int] = []
    for completions in outputs:
        tokens.append(sum(len(c.token_ids) for c in completions))
        samples.append([
            _candidate(split_steps(c.text, s.separator), c.finish_reason == "eos" or _states_answer(c.text, s), s)
            for c in completions
        ])
    if strategy != "majority":
        _score_all(prm, questions, [(p, c) for p, group in enumerate(samples) for c in group if c.steps])

    results = []
    for p, group in enumerate(samples):
        if strategy == "best_of_n":
            chosen = _best_answered_first(group, s)
        else:
            weights = None if strategy == "majority" else [aggregate(c.step_scores, s.aggregation) for c in group]
            chosen = _vote(group, weights, s)
        results.append(_result(chosen, tokens[p], s))
    return results


def _best_answered_first(group: Sequence[_Candidate], s: SearchSettings) -> _Candidate:
    """The best finished sample that states an answer, else the best unfinished one, else the best
    answerless one (the last two are graded wrong alike; an answerless one comes last, as in
    the step-level search)."""
    answered = [c for c in group if c.finished and not _answerless(c, s)]
    unfinished = [c for c in group if not c.finished]
    answerless = [c for c in group if _answerless(c, s)]
    return _best_of_first_tier([answered, unfinished, answerless], s.aggregation)


def _vote(group: Sequence[_Candidate], weights: Sequence[float] | None, s: SearchSettings) -> _Candidate:
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
        return group[0] if weights is None else _best_answered_first(group, s)
    winner = max(totals, key=totals.__getitem__)  # first-seen bucket wins ties
    members = [i for i, a in enumerate(answers) if a is not None and normalize_answer(a, s.kind) == winner]
    if weights is None:
        return group[members[0]]
    return group[max(members, key=lambda i: weights[i])]


# ----------------------------------------------------------------------------- scoring


def grade_results(results: Sequence[SearchResult], golds: Sequence[str], kind: str) -> list[bool]:
    """Whether each returned solution is correct; an unfinished one, or one without an answer,
    always counts as wrong."""
    predictions = [r.answer if r.finished else None for r in results]
    return answers_equal_many(predictions, list(golds), kind)


def summarize_search(results: Sequence[SearchResult], golds: Sequence[str], kind: str,
                     n_resamples: int = 2000, seed: int = 0) -> dict:
    """{accuracy: {mean, lo, hi} (bootstrap over problems), finished_fraction, tokens_per_problem,
    n_problems, correct: per problem, in order (what a paired comparison of two k needs)}."""
    correct = np.asarray(grade_results(results, golds, kind), dtype=np.float64)
    mean, lo, hi = bootstrap_ci(correct, n_resamples=n_resamples, seed=seed)
    return {
        "accuracy": {"mean": mean, "lo": lo, "hi": hi},
        "finished_fraction": float(np.mean([r.finished for r in results])),
        "tokens_per_problem": float(np.mean([r.tokens_generated for r in results])),
        "n_problems": len(results),
        "correct": [bool(c) for c in correct],
    }

