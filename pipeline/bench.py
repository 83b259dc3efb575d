"""Throughput measurements of the batched designs against the one-at-a-time reference.

Each function returns {ours_s, reference_s, ratio = reference_s / ours_s, ...}; `make bench`
(stages.bench) runs them on the tiny model and writes docs/benchmarks.md. Benchmarks measure;
tests never time anything.
"""

from __future__ import annotations

import time
from typing import Callable, Sequence

import torch

from pipeline.config import MCTSConfig
from pipeline.mcts import RolloutFn, run_mcts


def timed(fn: Callable[[], object]) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def bench_mcts_batched(problems: Sequence[tuple[str, str]], params: MCTSConfig, batched_fn: RolloutFn) -> dict:
    """MCTS completions per second: every pending prefix of a round in one generator call (ours)
    vs one generator call per prefix (the reference implementation's approach), same k, budget.

    batched_fn: the rollout function of pipeline.mcts.make_rollout_fn (one call per round);
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


def bench_gfn_step(policy, prompts: Sequence[str], step_lists: Sequence[Sequence[str]], loss_fn: Callable) -> dict:
    """One training step's forward + backward: ONE batched teacher-forced forward over all
    trajectories (ours) vs a batch-1 forward per trajectory (the reference's approach).

    loss_fn(TrajectoryLogprobs) -> (B,) per-trajectory loss (e.g. SubTB with fixed rewards).
    """
    model = policy.model

    def batched():
        lp = policy.logprobs(prompts, step_lists, with_grad=True)
        loss_fn(lp).mean().backward()
        model.zero_grad(set_to_none=True)

    def per_trajectory():
        for p, s in zip(prompts, step_lists):
            lp = policy.logprobs([p], [s], with_grad=True)
            (loss_fn(lp).sum() / len(prompts)).backward()
        model.zero_grad(set_to_none=True)

    batched()  # warm-up
    ours = min(timed(batched) for _ in range(2))
    reference = min(timed(per_trajectory) for _ in range(2))
    return {"ours_s": ours, "reference_s": reference, "ratio": reference / ours, "trajectories": len(prompts)}


def machine_description() -> str:
    import os
    import platform

    if torch.cuda.is_available():
        return f"{torch.cuda.get_device_name(0)} (torch {torch.__version__})"
    return f"CPU {platform.machine()} x{os.cpu_count()} cores, torch {torch.__version__} ({torch.get_num_threads()} threads)"
