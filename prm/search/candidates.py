"""What every search strategy shares: settings, the problem and its candidates, PRM scoring,
aggregation, and the result a search returns."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field, fields
from typing import get_args

from pipeline.config.loader import check_choice
from pipeline.config.schema import Aggregation, FormatConfig, GenerationConfig, SearchConfig, SearchStrategy
from pipeline.grading import extract_answer
from pipeline.prompts import prompt_from_config
from pipeline.steps import join_steps

STRATEGIES = get_args(SearchStrategy)
STEP_STRATEGIES = ("step_best_of_k", "beam")  # the strategies that expand partial solutions step by step
AGGREGATIONS = get_args(Aggregation)

# the defaults of the config sections the search stage builds its settings from
_SEARCH, _GENERATION, _FORMAT = SearchConfig(), GenerationConfig(), FormatConfig()


@dataclass(frozen=True, kw_only=True)
class SearchSettings:
    """Everything a search needs besides the models; each default is that of the config field the
    search stage reads (search.*, generation.*, format.separator)."""

    kind: str | None = None  # grading kind: detects final answers and builds default prompts
    temperature: float = _SEARCH.temperature  # paper 3.4: T = 0.8
    top_p: float = _GENERATION.top_p
    max_depth: int = _SEARCH.max_depth  # steps before a step-level search gives up
    beam_width: int = _SEARCH.beam_width  # beam only
    # last | mean | min | prod: a partial/whole solution's score. last: U of the last step, which a
    # PRM trained on Monte Carlo values makes P(correct) of the whole prefix; min and prod can only
    # fall as steps are added, so they prefer short solutions (docs/search.md)
    aggregation: Aggregation = _SEARCH.aggregation
    max_step_tokens: int = _GENERATION.max_step_tokens  # one step (step-level strategies)
    max_new_tokens: int = _GENERATION.max_new_tokens  # one whole solution (best_of_n, weighted_vote, majority)
    separator: str = _FORMAT.separator
    # the streams of a problem are drawn from (seed, problem id, ...) (prm.search); None: unseeded
    seed: int | None = _SEARCH.seed
    format_config: FormatConfig | None = None  # FormatConfig for default prompts (None: defaults)


def search_settings(settings: dict) -> SearchSettings:
    """SearchSettings from keyword settings; an unknown name, aggregation or max_depth < 1 is refused."""
    known = {f.name for f in fields(SearchSettings)}
    unknown = sorted(set(settings) - known)
    if unknown:
        raise TypeError(f"search: unknown setting(s) {unknown}; expected some of {sorted(known)}")
    s = SearchSettings(**settings)
    aggregate([], s.aggregation)  # validates the name
    if s.max_depth < 1:
        raise ValueError(f"search: max_depth must be >= 1, got {s.max_depth}")
    return s


def default_prompts(questions: Sequence[str], policy, s: SearchSettings) -> list[str]:
    """The policy's prompts built by the one prompt builder (settings.kind, default "math")."""
    format_config = s.format_config if s.format_config is not None else FormatConfig(separator=s.separator)
    tokenizer = getattr(policy, "tokenizer", None)
    return [prompt_from_config(q, s.kind or "math", tokenizer, format_config) for q in questions]


@dataclass(frozen=True)
class SearchProblem:
    """One problem of a batched search.

    index:    its position in the batch (candidates of two problems are never merged, even for
              the same question)
    question: what the PRM sees (its scorer builds its own prompt from the question)
    prompt:   what the policy continues
    key:      what its random streams are keyed by (the problem id, else the question)
    """

    index: int
    question: str
    prompt: str
    key: str


@dataclass
class Candidate:
    """A partial or whole solution under consideration."""

    steps: list[str]
    step_scores: list[float] = field(default_factory=list)
    finished: bool = False
    answer: str | None = None  # extract_answer of the whole solution, read once it is finished


@dataclass
class Expansion:
    """One expansion of a partial solution by a step-level search: the candidates it ranked
    (answerless stops and dropped empty lines, which it never ranks, left out).

    prefix: the partial solution's steps
    steps:  per candidate, its steps after the prefix ([] for a stop candidate)
    scores: per candidate, the score the search ranked it by (its own step score for
            step_best_of_k, the aggregated score of the whole partial for beam)
    """

    prefix: list[str]
    steps: list[list[str]]
    scores: list[float]


@dataclass
class SearchResult:
    """The solution one search returns.

    steps:            the solution's steps
    step_scores:      PRM score U(s_k|s_{k-1}) of each step ([] for the unguided ``majority``)
    finished:         True when the solution ended (end token, or a step stating a final answer)
    answer:           extract_answer of the solution (None when unfinished, when it ended without
                      stating an answer, or when kind is unknown)
    tokens_generated: policy tokens generated for this problem, discarded candidates included
    expansions:       every expansion of a step-level search, in order ([] for the others): what
                      prm.search.siblings measures the PRM's choices on
    """

    steps: list[str]
    step_scores: list[float]
    finished: bool
    answer: str | None
    tokens_generated: int
    expansions: list[Expansion] = field(default_factory=list)


def aggregate(step_scores: Sequence[float], aggregation: str) -> float:
    """One score for a solution from its step scores: the last, the mean, the min or the product.
    A solution without steps scores -inf (it never beats one with steps).

        aggregate([0.5, 0.2, 0.8], "last") -> 0.8;  "min" -> 0.2;  "mean" -> 0.5;  "prod" -> 0.08
    """
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


def states_answer(text: str, s: SearchSettings) -> bool:
    return s.kind is not None and extract_answer(text, s.kind) is not None


def new_candidate(steps: list[str], finished: bool, s: SearchSettings) -> Candidate:
    """A candidate; a finished one has its whole solution's final answer read once, here."""
    answer = None
    if finished and s.kind is not None:
        answer = extract_answer(join_steps(steps, s.separator), s.kind)
    return Candidate(steps, finished=finished, answer=answer)


def answerless(candidate: Candidate, s: SearchSettings) -> bool:
    """A finished candidate that states no final answer: the policy ended a partial solution.
    It is graded wrong whatever the PRM thinks of its steps (its score is that of an unfinished
    prefix). With kind=None no answer can be read, so no candidate counts as answerless."""
    return candidate.finished and s.kind is not None and candidate.answer is None


def score_candidates(prm, items: Sequence[tuple[SearchProblem, Candidate]]) -> None:
    """Fill step_scores of every candidate with ONE score_many call (a problem's duplicates scored once)."""
    unique: dict[tuple[int, tuple[str, ...]], int] = {}
    questions: dict[int, str] = {}
    for problem, candidate in items:
        unique.setdefault((problem.index, tuple(candidate.steps)), len(unique))
        questions[problem.index] = problem.question
    keys = list(unique)
    scores = prm.score_many([(questions[index], list(steps)) for index, steps in keys]) if keys else []
    for problem, candidate in items:
        candidate.step_scores = [float(x) for x in scores[unique[(problem.index, tuple(candidate.steps))]]]


def best(candidates: Sequence[Candidate], aggregation: str) -> Candidate:
    """The highest aggregated score; the first one on ties."""
    return max(candidates, key=lambda c: aggregate(c.step_scores, aggregation))


def best_of_first_tier(tiers: Sequence[Sequence[Candidate]], aggregation: str) -> Candidate | None:
    """The best candidate of the first non-empty tier (None when every tier is empty)."""
    for tier in tiers:
        if tier:
            return best(tier, aggregation)
    return None


def to_result(candidate: Candidate | None, tokens: int) -> SearchResult:
    if candidate is None:
        return SearchResult([], [], False, None, tokens)
    return SearchResult(
        list(candidate.steps), list(candidate.step_scores), candidate.finished, candidate.answer, tokens
    )
