"""search_batched: one batched guided search over all questions against one search per question
(the same strategy, k, settings and seeds): step-level best-of-k with a PRM head on the tiny
world's model."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from perf.rows import ratio_row, seconds_of
from perf.world import tiny_world
from prm.model import ProcessRewardModel
from prm.scorer import PRMScorer
from prm.search import search_many
from prm.search.candidates import default_prompts, search_settings

NAME = "search_batched"
GOAL = 4.0
REFERENCE = "step-level best-of-k one problem at a time"


def run(cfg, out_dir: Path) -> dict:
    """16 tiny-world test problems, step_best_of_k with k = 4, greedy, at most 6 steps."""
    world = tiny_world(cfg, out_dir)
    prm = PRMScorer(ProcessRewardModel.from_backbone(world.model), world.tokenizer, cfg.format, "tiny")
    row = bench_batched_search(
        [p.question for p in world.problems[:16]],
        world.generator,
        prm,
        "step_best_of_k",
        k=4,
        prompts=world.prompts[:16],
        kind="tiny",
        temperature=0.0,
        max_depth=6,
        max_step_tokens=cfg.generation.max_step_tokens,
        format_config=cfg.format,
    )
    return {**row, "model": world.note}


def bench_batched_search(
    questions: Sequence[str],
    policy,
    prm,
    strategy: str = "step_best_of_k",
    k: int = 4,
    prompts: Sequence[str] | None = None,
    **settings,
) -> dict:
    """Seconds for one batched search over all questions vs one search per question (the same
    strategy, k, settings and seeds), after a one-question warm-up.

    returns: the ratio row (ratio = reference_s / ours_s: > 1, batching is faster) with problems,
             tokens_generated
    """
    if not questions:
        raise ValueError("bench_batched_search: no questions")
    prompts = list(prompts) if prompts is not None else default_prompts(questions, policy, search_settings(settings))
    search_many(
        questions[:1], policy, prm, strategy, min(k, 2), prompts=prompts[:1], **{**settings, "max_depth": 1}
    )  # warm-up

    ours: list = []
    ours_s = seconds_of(
        lambda: ours.extend(search_many(questions, policy, prm, strategy, k, prompts=prompts, **settings))
    )
    reference_s = seconds_of(
        lambda: [
            search_many([question], policy, prm, strategy, k, prompts=[prompt], **settings)
            for question, prompt in zip(questions, prompts)
        ]
    )
    return ratio_row(
        NAME,
        ours_s=ours_s,
        reference_s=reference_s,
        goal=GOAL,
        reference=REFERENCE,
        problems=len(questions),
        tokens_generated=sum(r.tokens_generated for r in ours),
    )
