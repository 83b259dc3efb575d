"""The `gfn_batched_step` benchmark: one batched teacher-forced forward + backward per training
step against a batch-1 forward per trajectory."""

from __future__ import annotations

from typing import Callable, Sequence

from pipeline.bench import timed


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
