"""The `mcts_batched` benchmark: MCTS with one generator call per round against one call per prefix."""

from __future__ import annotations

from typing import Sequence

from pipeline.bench import timed
from pipeline.config import MCTSConfig
from pipeline.rollouts.mcts import RolloutFn, run_mcts


def bench_mcts_batched(problems: Sequence[tuple[str, str]], params: MCTSConfig, batched_fn: RolloutFn) -> dict:
    """MCTS completions per second: every pending prefix of a round in one generator call (ours)
    vs one generator call per prefix (the reference implementation's approach), same k, budget.

    batched_fn: the rollout function of pipeline.rollouts.mcts.make_rollout_fn (one call per round);
    the reference calls it once per request instead.
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

    ours = timed(lambda: run_mcts(problems, params, counting("ours", batched_fn), on_done=lambda r: None))
    reference = timed(lambda: run_mcts(problems, params, counting("reference", one_at_a_time), on_done=lambda r: None))
    ours_rate, ref_rate = counts["ours"] / ours, counts["reference"] / reference
    return {
        "ours_s": ours, "reference_s": reference, "ratio": ours_rate / ref_rate,
        "ours_completions_per_s": ours_rate, "reference_completions_per_s": ref_rate,
        "problems": len(problems), "k": params.k,
    }
