"""mcts_batched: MCTS with every pending prefix of a round in one generator call (ours) against one
generator call per prefix (the reference implementation's approach), the same k and budget.

The two runs sample, so they can finish with different numbers of completions: the row compares
completions per second, stated as seconds per completion (ours_s, reference_s), so that
ratio = reference_s / ours_s = ours' completions/s over the reference's."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from perf.rows import per_unit, ratio_row, seconds_of
from perf.world import tiny_world
from pipeline.config.schema import MCTSConfig
from pipeline.grading import extract_answer, grade_many
from pipeline.rollouts.mcts import RolloutFn, make_rollout_fn, run_mcts

NAME = "mcts_batched"
GOAL = 4.0
REFERENCE = (
    "one generator call per pending prefix, same k and budget (ours/reference = s per completion; "
    "ratio = completions/s of ours over the reference)"
)


def run(cfg, out_dir: Path) -> dict:
    """16 tiny-world test problems, k = 8, 2 iterations, at most 64 rollouts each."""
    world = tiny_world(cfg, out_dir)
    k = 8
    problems = world.problems[:16]
    rollout_fn = make_rollout_fn(
        world.generator,
        world.prompts[:16],
        [p.answer for p in problems],
        "tiny",
        k=k,
        temperature=0.6,
        top_p=1.0,
        max_new_tokens=cfg.generation.max_new_tokens,
        separator=cfg.format.separator,
        grade_many=grade_many,
        extract_answer=extract_answer,
    )
    params = MCTSConfig(k=k, max_iterations=2, max_rollouts=64, search_trivial=True)
    return {
        **bench_mcts_batched([(p.problem_id, p.question) for p in problems], params, rollout_fn),
        "model": world.note,
    }


def bench_mcts_batched(problems: Sequence[tuple[str, str]], params: MCTSConfig, batched_fn: RolloutFn) -> dict:
    """MCTS completions per second: every pending prefix of a round in one generator call (ours)
    vs one generator call per prefix (the reference), same k, budget.

    batched_fn: the rollout function of pipeline.rollouts.mcts.make_rollout_fn (one call per round);
    the reference calls it once per request instead.
    returns: the ratio row, ours_s and reference_s in seconds per completion, with each run's
             seconds, completions and completions per second
    """
    counts = {"ours": 0, "reference": 0}

    def counting(name, fn):
        def wrapped(requests):
            out = fn(requests)
            counts[name] += sum(len(r) for r in out)
            return out

        return wrapped

    def one_at_a_time(requests):
        return [batched_fn([request])[0] for request in requests]

    ours = seconds_of(lambda: run_mcts(problems, params, counting("ours", batched_fn), on_done=lambda r: None))
    reference = seconds_of(
        lambda: run_mcts(problems, params, counting("reference", one_at_a_time), on_done=lambda r: None)
    )
    return ratio_row(
        NAME,
        ours_s=per_unit(ours, counts["ours"]),
        reference_s=per_unit(reference, counts["reference"]),
        goal=GOAL,
        reference=REFERENCE,
        ours_total_s=ours,
        reference_total_s=reference,
        ours_completions=counts["ours"],
        reference_completions=counts["reference"],
        ours_completions_per_s=counts["ours"] / ours,
        reference_completions_per_s=counts["reference"] / reference,
        problems=len(problems),
        k=params.k,
    )
