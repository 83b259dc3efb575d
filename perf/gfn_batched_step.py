"""gfn_batched_step: one training step's forward + backward as ONE batched teacher-forced forward
over all trajectories (ours) against a batch-1 forward per trajectory (the reference's approach),
with the SubTB loss at fixed rewards."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path

import torch

from perf.rows import ratio_row, seconds_of
from perf.world import tiny_world
from pipeline.finetune.losses import subtb_loss
from pipeline.finetune.policy import LMPolicy

NAME = "gfn_batched_step"
GOAL = 5.0
REFERENCE = "a batch-1 teacher-forced forward per trajectory (forward + backward)"


def run(cfg, out_dir: Path) -> dict:
    """32 tiny-world test problems' prompts with their first gold solution; the shared model is in
    training mode for the row and back in evaluation mode after it."""
    world = tiny_world(cfg, out_dir)
    model = world.model
    model.train()
    try:
        policy = LMPolicy(model, world.tokenizer, cfg.format.separator)
        gold = [p.meta["solutions"][0] for p in world.problems[:32]]

        def loss_fn(lp):
            log_r = torch.zeros_like(lp.termination_logprobs)
            return subtb_loss(lp.step_logprobs, lp.termination_logprobs, log_r, lp.mask)

        row = bench_gfn_step(policy, world.prompts[:32], gold, loss_fn)
    finally:
        model.eval()
    return {**row, "model": world.note}


def bench_gfn_step(policy, prompts: Sequence[str], step_lists: Sequence[Sequence[str]], loss_fn: Callable) -> dict:
    """The ratio row of one training step's forward + backward: ONE batched teacher-forced forward
    over all trajectories (ours) vs a batch-1 forward per trajectory (the reference), best of two.

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
    ours = min(seconds_of(batched) for _ in range(2))
    reference = min(seconds_of(per_trajectory) for _ in range(2))
    return ratio_row(
        NAME, ours_s=ours, reference_s=reference, goal=GOAL, reference=REFERENCE, trajectories=len(prompts)
    )
