"""prm_one_pass: every step of a solution scored in one forward pass, against the reference way of
scoring each prefix s_1..s_k as its own sequence (a PRM that reads only the last position, as in a
naive loop over prefixes). Both run through the same batched scorer, so the ratio measures the
one-pass design alone: for n-step solutions the reference feeds (n+1)/2 times the tokens when the
prompt is negligible, up to n times when the prompt dominates."""

from __future__ import annotations

import random
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import torch
from transformers import LlamaConfig, LlamaModel

from perf.rows import best_seconds, ratio_row
from perf.world import tiny_world
from pipeline.config.schema import BootstrapConfig, FormatConfig
from pipeline.prompts import prompt_from_config
from pipeline.tinyworld.tokenizer import train_tokenizer
from prm.model import PRMInfo, ProcessRewardModel
from prm.scorer import PRMScorer, Solution

NAME = "prm_one_pass"
GOAL = 3.0
REFERENCE = "one forward per step prefix of 8-step solutions"

_NAMES = ["Tom", "Ana", "Lee", "Mia", "Sam"]
_THINGS = ["apples", "pens", "coins", "books", "cards"]


def run(cfg, out_dir: Path) -> dict:
    """A PRM head on the tiny world's model (weights shared, not copied), the config's step format,
    batches of prm.score_batch_size: 32 solutions of 8 steps, best of 3."""
    world = tiny_world(cfg, out_dir)
    prm = ProcessRewardModel.from_backbone(world.model, PRMInfo.from_format(cfg.format, "tiny")).eval()
    scorer = PRMScorer(prm, world.tokenizer, cfg.format, "tiny", batch_size=cfg.prm.score_batch_size)
    return {**bench_prm_one_pass(scorer, n_solutions=32, n_steps=8, repeats=3), "model": world.note}


def synthetic_solutions(n_solutions: int, n_steps: int, seed: int = 0) -> list[Solution]:
    """Word problems with ``n_steps`` arithmetic steps each (text only; scores are irrelevant)."""
    rng = random.Random(seed)
    solutions = []
    for _ in range(n_solutions):
        name, thing = rng.choice(_NAMES), rng.choice(_THINGS)
        value = rng.randint(2, 15)
        question = f"{name} has {value} {thing}. After {n_steps} trades, how many {thing} does {name} have?"
        steps = []
        for _ in range(n_steps):
            delta = rng.randint(1, 9)
            op, new = ("+", value + delta) if rng.random() < 0.6 or value <= delta else ("-", value - delta)
            steps.append(f"{name} trades, so {value} {op} {delta} = {new} {thing}.")
            value = new
        solutions.append((question, steps))
    return solutions


def _random_tiny_scorer(solutions: Sequence[Solution], batch_size: int) -> PRMScorer:
    """A randomly initialised PRM of the tiny world's size (BootstrapConfig defaults) with a
    tokenizer trained on the benchmark texts: timing needs the shapes, not trained weights."""
    format_config = FormatConfig(use_chat_template=False)
    texts = [prompt_from_config(q, "tiny", None, format_config) + "\n".join(s) for q, s in solutions]
    tokenizer = train_tokenizer(texts, vocab_size=256)
    b = BootstrapConfig()
    torch.manual_seed(0)
    backbone = LlamaModel(
        LlamaConfig(
            vocab_size=len(tokenizer),
            hidden_size=b.hidden_size,
            intermediate_size=b.intermediate_size,
            num_hidden_layers=b.num_layers,
            num_attention_heads=b.num_heads,
            num_key_value_heads=b.num_heads,
            max_position_embeddings=1024,
            attn_implementation="eager",
        )
    )
    model = ProcessRewardModel(backbone, PRMInfo.from_format(format_config, "tiny")).eval()
    return PRMScorer(model, tokenizer, format_config, "tiny", batch_size=batch_size)


def bench_prm_one_pass(
    scorer: PRMScorer | None = None,
    n_solutions: int = 32,
    n_steps: int = 8,
    repeats: int = 3,
    seed: int = 0,
    batch_size: int = 32,
) -> dict:
    """The ratio row: best-of-``repeats`` seconds to score ``n_solutions`` ``n_steps``-step
    solutions in one pass each (ours) and prefix by prefix (reference); ratio = reference_s /
    ours_s (above 1: one pass is faster). Raises if the two disagree."""
    solutions = synthetic_solutions(n_solutions, n_steps, seed)
    scorer = scorer or _random_tiny_scorer(solutions, batch_size)
    prefixes = [(question, steps[: k + 1]) for question, steps in solutions for k in range(len(steps))]

    def ours():
        return scorer.score_many(solutions)

    def reference():
        return [scores[-1] for scores in scorer.score_many(prefixes)]

    one_pass, per_prefix = np.concatenate(ours()), np.array(reference())  # also warms up
    if not np.allclose(one_pass, per_prefix, atol=1e-3):  # bf16 on GPU: a loose bound
        raise AssertionError(
            f"one-pass and per-prefix scores differ by up to {np.abs(one_pass - per_prefix).max():.2e}"
        )
    return ratio_row(
        NAME,
        ours_s=best_seconds(ours, repeats),
        reference_s=best_seconds(reference, repeats),
        goal=GOAL,
        reference=REFERENCE,
    )
