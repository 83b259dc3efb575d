"""Step-level search: step_best_of_k and beam (paper 3.4, Figure 2).

At each depth the policy proposes candidate next steps for every live partial solution of every
problem (ONE generate call), the PRM scores each prefix + candidate (ONE score_many call), and
each problem keeps the top candidates:
    step_best_of_k  width 1, candidates ranked by their own step score (the paper's)
    beam            width ``beam_width``, ranked by the aggregated score of the whole partial
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from pipeline.generation.base import stream_seed
from pipeline.steps import join_steps, split_steps
from prm.search.candidates import (
    Candidate,
    Expansion,
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
class StepSearchState:
    """One problem's step-level search.

    live:      the partial solutions expanded at the next depth (the root: one empty partial)
    kept:      finished candidates that won a slot (the answers)
    spares:    finished candidates that lost one
    last_live: the live partials of the last depth that had any
    dead_ends: answerless stops (the policy ended without stating an answer)
    tokens_generated: policy tokens generated for this problem, discarded candidates included
    expansions: every expansion of a live partial with the candidates ranked and their rank scores
    """

    problem: SearchProblem
    live: list[Candidate] = field(default_factory=lambda: [Candidate([])])
    kept: list[Candidate] = field(default_factory=list)
    spares: list[Candidate] = field(default_factory=list)
    last_live: list[Candidate] = field(default_factory=list)
    dead_ends: list[Candidate] = field(default_factory=list)
    tokens_generated: int = 0
    expansions: list[Expansion] = field(default_factory=list)

    def choose(
        self, candidates: Sequence[Candidate], *, width: int, rank: Callable[[Candidate], float], s: SearchSettings
    ) -> None:
        """Answerless stops become dead ends and never take a slot; the other candidates are ranked
        and the top ``width - (finished already kept)`` take the slots: finished ones are kept as
        answers, unfinished ones live on. Finished candidates that lose are kept as spares."""
        self.dead_ends.extend(c for c in candidates if answerless(c, s))
        usable = [c for c in candidates if not answerless(c, s)]
        ranked = sorted(usable, key=rank, reverse=True)  # stable: first seen wins ties
        slots = width - len(self.kept)
        winners, losers = ranked[:slots], ranked[slots:]
        self.kept.extend(c for c in winners if c.finished)
        self.spares.extend(c for c in losers if c.finished)
        self.live = [c for c in winners if not c.finished]
        if self.live:
            self.last_live = self.live

    def result(self, aggregation: str) -> SearchResult:
        """The best kept finished candidate, else the best spare, else the best partial of the last
        depth that had one (finished=False), else the best dead end (answer None)."""
        tiers = [self.kept, self.spares, self.last_live, self.dead_ends]
        result = to_result(best_of_first_tier(tiers, aggregation), self.tokens_generated)
        result.expansions = self.expansions
        return result


def step_search(
    problems: Sequence[SearchProblem], *, policy, prm, k: int, width: int, rank_by_last: bool, s: SearchSettings
) -> list[SearchResult]:
    """step_best_of_k (width 1, rank_by_last: candidates ranked by their own step score) and beam
    (width W, ranked by the aggregated score of the whole partial solution).

    At each depth every live partial is expanded (the root with k candidates, later partials with
    k // width each, so a depth costs at most k candidates per problem) and each problem chooses
    among its candidates (StepSearchState.choose). A problem stops when it has no live partials or
    at max_depth; it returns StepSearchState.result.
    """
    states = [StepSearchState(problem) for problem in problems]
    per_partial = max(1, k // width)
    if rank_by_last:
        # the candidate's own step score (its siblings share the prefix); a stop candidate that
        # adds no step is ranked by the last step of the solution it ends
        def rank(c: Candidate) -> float:
            return c.step_scores[-1]
    else:

        def rank(c: Candidate) -> float:
            return aggregate(c.step_scores, s.aggregation)

    for depth in range(s.max_depth):
        jobs = [(state, j, partial) for state in states for j, partial in enumerate(state.live)]
        if not jobs:
            break
        n = k if depth == 0 else per_partial
        outputs = policy.generate(
            [state.problem.prompt + join_steps(partial.steps, s.separator) for state, _, partial in jobs],
            n=n,
            temperature=s.temperature,
            top_p=s.top_p,
            max_new_tokens=s.max_step_tokens,
            stop=[s.separator],
            seed=None
            if s.seed is None
            else [stream_seed(s.seed, state.problem.key, "step", depth, j) for state, j, _ in jobs],
        )
        candidates: list[tuple[StepSearchState, Candidate]] = []
        siblings: list[tuple[StepSearchState, Candidate, list[Candidate]]] = []  # per job
        for (state, _, partial), completions in zip(jobs, outputs):
            siblings.append((state, partial, []))
            for completion in completions:
                state.tokens_generated += len(completion.token_ids)
                candidate = extend(partial, completion, s)
                if candidate is not None:
                    candidates.append((state, candidate))
                    siblings[-1][2].append(candidate)
        score_candidates(prm, [(state.problem, candidate) for state, candidate in candidates])
        for state, partial, mine in siblings:
            ranked = [c for c in mine if not answerless(c, s)]  # what choose ranks
            state.expansions.append(
                Expansion(
                    list(partial.steps), [c.steps[len(partial.steps) :] for c in ranked], [rank(c) for c in ranked]
                )
            )

        by_problem: dict[int, list[Candidate]] = {state.problem.index: [] for state in states}
        for state, candidate in candidates:
            by_problem[state.problem.index].append(candidate)
        for state in states:
            if state.live:
                state.choose(by_problem[state.problem.index], width=width, rank=rank, s=s)

    return [state.result(s.aggregation) for state in states]


def extend(partial: Candidate, completion, s: SearchSettings) -> Candidate | None:
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
            return new_candidate(list(partial.steps), True, s)
        return None
    finished = ended or states_answer(join_steps(new_steps, s.separator), s)
    return new_candidate(partial.steps + new_steps, finished, s)
