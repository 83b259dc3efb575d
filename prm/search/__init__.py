"""PRM-guided search at inference (paper 3.4, Figure 2), batched across problems.

Strategies (docs/search.md has the rules in full), one module per family:
    prm.search.step_level       step_best_of_k: at each step the policy proposes k candidate next
                                steps, the PRM scores each (prefix + candidate), the best is kept;
                                until a finished candidate wins or max_depth (the paper's).
                                beam: the top ``beam_width`` partial solutions by aggregated PRM
                                score, each expanded with k // beam_width candidates (the root with k)
    prm.search.whole_solution   best_of_n, weighted_vote and majority over k whole solutions
    prm.search.candidates       settings, candidates, PRM scoring, aggregation, SearchResult
    prm.search.summary          grading the returned solutions, accuracy of a run
    prm.search.siblings         sibling AUC, distinct candidates and their error rate per step,
                                measured on the expansions a step-level search recorded

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

from collections.abc import Sequence

from pipeline.config.loader import check_choice
from pipeline.config.schema import SearchStrategy
from prm.search.candidates import SearchProblem, SearchResult, default_prompts, search_settings
from prm.search.step_level import step_search
from prm.search.whole_solution import whole_solution_search


def search(
    question: str,
    policy,
    prm,
    strategy: str,
    k: int,
    *,
    prompt: str | None = None,
    problem_id: str | None = None,
    **settings,
) -> SearchResult:
    """One problem: ``search_many`` with a single question (settings: SearchSettings fields)."""
    return search_many(
        [question],
        policy,
        prm,
        strategy,
        k,
        prompts=None if prompt is None else [prompt],
        problem_ids=None if problem_id is None else [problem_id],
        **settings,
    )[0]


def search_many(
    questions: Sequence[str],
    policy,
    prm,
    strategy: str,
    k: int,
    *,
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
    settings:  SearchSettings fields (prm.search.candidates)
    """
    s = search_settings(settings)
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
    problems = [
        SearchProblem(index, question, prompt, key)
        for index, (question, prompt, key) in enumerate(zip(questions, prompts, keys))
    ]
    if strategy == "step_best_of_k":
        return step_search(problems, policy=policy, prm=prm, k=k, width=1, rank_by_last=True, s=s)
    if strategy == "beam":
        width = max(1, min(s.beam_width, k))
        return step_search(problems, policy=policy, prm=prm, k=k, width=width, rank_by_last=False, s=s)
    return whole_solution_search(problems, policy=policy, prm=prm, strategy=strategy, k=k, s=s)
