"""OmegaPRM-style MCTS with continuous Monte Carlo values (paper 3.1, appendix E.1, Alg. 1).

Each problem's search is written as a coroutine that reads like the algorithm box: it
*yields* a step prefix whose Monte Carlo value it needs and receives the k rollouts from that
prefix. A driver (``run_mcts``) advances every active problem together and sends ALL pending
prefixes of a round into ONE generator call (n = k per prefix, the prompt cache shared), so
the search is batched across problems instead of one prefix at a time.

Definitions (docs/mcts.md):
- MC(s) = fraction of the k rollouts from the prefix s whose final answer grades correct.
- Candidate pool: (state, rollout) pairs, one per *incorrect* rollout of a tree state (a
  correct rollout holds no error to locate).
- Selection: argmax over the pool of Q(s, r) + U(s), with
  Q(s, r) = alpha^(1 - MC(s)) * beta^(len(r) / L)  (len in generated tokens) and
  U(s) = c_puct * sqrt(sum_i N(s_i)) / (1 + N(s))  (sum over all tree states).
- Binary search for the first wrong step of the selected rollout r_1..r_m (its whole
  trajectory is known to be wrong): probe mid = (lo + hi) // 2 with k fresh rollouts;
  MC == 0 moves left (hi = mid), otherwise right (lo = mid + 1). A probe with 0 < MC < 1
  becomes a tree state whose incorrect rollouts join the pool.
- Records (Algorithm 1, lines 17-22): every probe with MC > 0 (it lies before the first
  error) and the first error the search resolved (lo == hi), with value 0; nothing after it.
  MC == 0 probes at a larger index than the first error, and every MC == 0 probe of a search
  the rollout budget cut short (lo < hi: the first error is unknown), are not recorded.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Generator, Iterable, Sequence
from dataclasses import dataclass

from pipeline.config.schema import MCTSConfig
from pipeline.generation.base import stream_seed
from pipeline.records import MCTSRecord, MCTSRollout, MCTSSummary
from pipeline.steps import join_steps, split_steps

# A search coroutine yields a prefix (tuple of steps) and receives its rollouts.
SearchCoroutine = Generator[tuple[str, ...], list["Rollout"], "ProblemResult"]


@dataclass
class Rollout:
    """One completion from a prefix: its steps after the prefix, answer and correctness, and
    its length in generated tokens (the selection score's beta term; not recorded)."""

    steps: list[str]
    answer: str | None
    correct: bool
    num_tokens: int

    def to_record(self) -> MCTSRollout:
        return MCTSRollout(self.steps, self.answer, self.correct)


@dataclass
class TreeState:
    """A tree state: a step prefix with 0 < MC < 1 (or the root)."""

    prefix: tuple[str, ...]
    mc: float
    visits: int = 0


@dataclass
class ProblemResult:
    """What one problem's search produced: its mcts records and its summary."""

    records: list[MCTSRecord]
    summary: MCTSSummary


def mc_value(rollouts: Sequence[Rollout]) -> float:
    """Fraction of rollouts whose answer is correct (0 when there are none)."""
    return sum(r.correct for r in rollouts) / len(rollouts) if rollouts else 0.0


def selection_score(
    state_mc: float, rollout_tokens: int, state_visits: int, total_visits: int, params: MCTSConfig
) -> float:
    """Q(s, r) + U(s) of the pool entry (s, r)."""
    q = params.alpha ** (1.0 - state_mc) * params.beta ** (rollout_tokens / params.length_scale)
    u = params.c_puct * math.sqrt(total_visits) / (1 + state_visits)
    return q + u


def select_from_pool(pool: list[tuple[TreeState, Rollout]], states: Iterable[TreeState], params: MCTSConfig) -> int:
    """Index of the pool entry with the highest Q + U (first one on ties)."""
    total_visits = sum(s.visits for s in states)
    scores = [selection_score(s.mc, r.num_tokens, s.visits, total_visits, params) for s, r in pool]
    return max(range(len(pool)), key=scores.__getitem__)


def search_problem(problem_id: str, question: str, params: MCTSConfig) -> SearchCoroutine:
    """Algorithm 1 for one problem, as a coroutine (see the module docstring)."""
    records: list[MCTSRecord] = []
    # The MC value of every prefix probed so far, recorded or not: a prefix is never probed
    # twice. A prefix whose record was dropped lies after a recorded MC == 0 step (the first
    # error of its search, itself recorded or after one), so it must stay unrecorded even when a
    # later search reaches it through the cache.
    evaluated: dict[tuple[str, ...], float] = {}
    spent = 0

    def step_record(prefix: tuple[str, ...], rollouts: list[Rollout], mc: float) -> MCTSRecord:
        return MCTSRecord(
            problem_id=problem_id,
            question=question,
            prefix_steps=list(prefix[:-1]),
            step=prefix[-1],
            mc=mc,
            n_correct=sum(r.correct for r in rollouts),
            n_rollouts=len(rollouts),
            rollouts=[r.to_record() for r in rollouts],
            depth=len(prefix),
        )

    root_rollouts: list[Rollout] = yield ()
    spent += len(root_rollouts)
    root = TreeState((), mc_value(root_rollouts))
    states = [root]
    pool = [(root, r) for r in root_rollouts if not r.correct and r.steps]
    searched = params.search_trivial or 0.0 < root.mc < 1.0
    iterations = 0
    while searched and pool and iterations < params.max_iterations and spent + params.k <= params.max_rollouts:
        state, rollout = pool.pop(select_from_pool(pool, states, params))
        state.visits += 1
        iterations += 1
        path = state.prefix + tuple(rollout.steps)
        lo, hi = len(state.prefix) + 1, len(path)  # the whole path is wrong: MC(path) == 0
        probes: list[tuple[int, MCTSRecord]] = []  # (index on the path, record), in probe order
        while lo < hi and spent + params.k <= params.max_rollouts:
            mid = (lo + hi) // 2
            prefix = path[:mid]
            if prefix in evaluated:
                mc = evaluated[prefix]
            else:
                probe_rollouts = yield prefix
                spent += len(probe_rollouts)
                mc = mc_value(probe_rollouts)
                evaluated[prefix] = mc
                probes.append((mid, step_record(prefix, probe_rollouts, mc)))
                if 0.0 < mc < 1.0:
                    child = TreeState(prefix, mc)
                    states.append(child)
                    pool.extend((child, r) for r in probe_rollouts if not r.correct and r.steps)
            if mc == 0.0:
                hi = mid
            else:
                lo = mid + 1
        resolved = lo == hi  # else the budget stopped the search: the first error is unknown
        # Algorithm 1 keeps the steps before the first error and the first error itself (value
        # 0), nothing after it: an MC == 0 probe is kept only when it is the first error found.
        records.extend(record for index, record in probes if record.mc > 0.0 or (resolved and index == lo))
        if resolved and lo == len(path) and path not in evaluated:
            # The first error is the rollout's last step: its value is its own (wrong) outcome.
            evaluated[path] = 0.0
            records.append(step_record(path, [], 0.0))
    summary = MCTSSummary(
        problem_id=problem_id,
        root_mc=root.mc,
        root_n_correct=sum(r.correct for r in root_rollouts),
        root_rollouts=[r.to_record() for r in root_rollouts],
        searched=searched,
        iterations=iterations,
        steps_evaluated=len(records),
        rollouts_spent=spent,
        tree_states=len(states),
    )
    return ProblemResult(records, summary)


# A rollout function takes (problem index, prefix) requests and returns their rollouts, all
# in one generator call.
RolloutFn = Callable[[list[tuple[int, tuple[str, ...]]]], list[list[Rollout]]]


def run_mcts(
    problems: Sequence[tuple[str, str]],
    params: MCTSConfig,
    rollout_fn: RolloutFn,
    on_done: Callable[[ProblemResult], None],
    max_active: int | None = None,
    progress: Callable[[int, int], None] | None = None,
) -> None:
    """Advance every problem's search together; one rollout_fn call per round.

    problems: (problem_id, question) pairs; ``on_done`` receives each finished problem's
    result as soon as it completes (so the caller can commit it); ``max_active`` bounds how
    many problems are in flight (memory), new ones start as others finish; ``progress``
    receives (rollouts generated, problems finished) after every round.
    """
    queue = list(range(len(problems)))[::-1]
    active: dict[int, tuple[SearchCoroutine, tuple[str, ...]]] = {}
    limit = max_active or len(problems)

    def start(index: int) -> None:
        problem_id, question = problems[index]
        coroutine = search_problem(problem_id, question, params)
        active[index] = (coroutine, next(coroutine))

    while queue and len(active) < limit:
        start(queue.pop())
    while active:
        indices = list(active)
        results = rollout_fn([(i, active[i][1]) for i in indices])
        finished = 0
        for index, rollouts in zip(indices, results):
            coroutine, _ = active[index]
            try:
                active[index] = (coroutine, coroutine.send(rollouts))
            except StopIteration as stop:
                del active[index]
                on_done(stop.value)
                finished += 1
                if queue:
                    start(queue.pop())
        if progress is not None:
            progress(sum(len(r) for r in results), finished)


def probe_seed(seed: int, problem_id: str, prefix: Sequence[str]) -> int:
    """The random stream of one probe: a 62-bit integer drawn from (seed, problem id, prefix).

    A search probes each prefix of its problem at most once (``evaluated``), so every probe of a
    run has its own stream, and a problem's rollouts depend on nothing but the problem: not on
    which problems ran before it or beside it in a round, so a resumed run (or another
    ``mcts.shard`` split, or another ``max_active``) writes the records an uninterrupted run
    writes (pipeline.generation.base.stream_seed).
    """
    return stream_seed(int(seed), str(problem_id), list(prefix))


def make_rollout_fn(
    generator,
    prompts: Sequence[str],
    golds: Sequence[str],
    kind: str,
    k: int,
    temperature: float,
    top_p: float,
    max_new_tokens: int,
    separator: str,
    grade_many: Callable[[list[str], list[str], str], list[bool]],
    extract_answer: Callable[[str, str], str | None],
    seed: int = 0,
    problem_ids: Sequence[str] | None = None,
    root_temperature: float | None = None,
) -> RolloutFn:
    """Rollouts through the one generation interface: all requests of a round in one call.

    The prompt of a request is the problem's prompt followed by its prefix in the step format;
    each of the k completions is split into steps and graded against the problem's gold.
    Each request draws from its own stream, ``probe_seed(seed, problem id, prefix)`` (one seed per
    prompt of the call), so its rollouts do not depend on the rest of the round.
    problem_ids: the id of each prompt's problem; None: the prompt's index stands for it (only
    for a caller whose list of prompts is the same on every run).
    root_temperature: the temperature of the rollouts from the question itself (the empty prefix:
    the root's, which decide whether a problem is searched and hold the first wrong paths), drawn
    in a generator call of their own; every other prefix's rollouts (the Monte Carlo values, and
    what augmentation reuses) are drawn at ``temperature``. None: ``temperature`` for all.
    """
    if problem_ids is not None and len(problem_ids) != len(prompts):
        raise ValueError(f"make_rollout_fn: {len(problem_ids)} problem ids for {len(prompts)} prompts")
    ids = [str(i) for i in range(len(prompts))] if problem_ids is None else list(problem_ids)

    def rollout_fn(requests: list[tuple[int, tuple[str, ...]]]) -> list[list[Rollout]]:
        if root_temperature is None or root_temperature == temperature:
            return sample(requests, temperature)
        roots = [index for index, (_, prefix) in enumerate(requests) if not prefix]
        probes = [index for index, (_, prefix) in enumerate(requests) if prefix]
        results: list[list[Rollout]] = [[] for _ in requests]
        for indices, at in ((roots, root_temperature), (probes, temperature)):
            if indices:
                for index, rollouts in zip(indices, sample([requests[i] for i in indices], at)):
                    results[index] = rollouts
        return results

    def sample(requests: list[tuple[int, tuple[str, ...]]], temperature: float) -> list[list[Rollout]]:
        texts = [prompts[i] + join_steps(prefix, separator) for i, prefix in requests]
        completions = generator.generate(
            texts,
            n=k,
            temperature=temperature,
            top_p=top_p,
            max_new_tokens=max_new_tokens,
            seed=[probe_seed(seed, ids[i], prefix) for i, prefix in requests],
        )
        flat_texts, flat_golds = [], []
        for (i, prefix), outs in zip(requests, completions):
            for out in outs:
                flat_texts.append(join_steps(prefix, separator) + out.text)
                flat_golds.append(golds[i])
        verdicts = grade_many(flat_texts, flat_golds, kind)
        results, pos = [], 0
        for outs in completions:
            rollouts = []
            for out in outs:
                rollouts.append(
                    Rollout(
                        steps=split_steps(out.text, separator),
                        answer=extract_answer(out.text, kind),
                        correct=bool(verdicts[pos]),
                        num_tokens=len(out.token_ids),
                    )
                )
                pos += 1
            results.append(rollouts)
        return results

    return rollout_fn
