"""Benchmark prm_one_pass: every step of a solution scored in one forward pass, against the
reference way of scoring each prefix s_1..s_k as its own sequence (a PRM that reads only the
last position, as in a naive loop over prefixes). Both run through the same batched scorer, so
the ratio measures the one-pass design alone: for n-step solutions the reference feeds (n+1)/2
times the tokens when the prompt is negligible, up to n times when the prompt dominates.
"""

from __future__ import annotations

import random
import time
from typing import Sequence

import numpy as np

from prm.scorer import PRMScorer, Solution

_NAMES = ["Tom", "Ana", "Lee", "Mia", "Sam"]
_THINGS = ["apples", "pens", "coins", "books", "cards"]


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
    import torch
    from transformers import LlamaConfig, LlamaModel

    from pipeline.config import BootstrapConfig, FormatConfig
    from pipeline.prompts import prompt_from_config
    from pipeline.tinyworld.tokenizer import train_tokenizer
    from prm.model import PRMInfo, ProcessRewardModel

    format_config = FormatConfig(use_chat_template=False)
    texts = [prompt_from_config(q, "tiny", None, format_config) + "\n".join(s) for q, s in solutions]
    tokenizer = train_tokenizer(texts, vocab_size=256)
    b = BootstrapConfig()
    torch.manual_seed(0)
    backbone = LlamaModel(LlamaConfig(
        vocab_size=len(tokenizer), hidden_size=b.hidden_size, intermediate_size=b.intermediate_size,
        num_hidden_layers=b.num_layers, num_attention_heads=b.num_heads, num_key_value_heads=b.num_heads,
        max_position_embeddings=1024, attn_implementation="eager",
    ))
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
    """{ours_s, reference_s, ratio}: best-of-``repeats`` seconds to score ``n_solutions``
    ``n_steps``-step solutions in one pass each (ours) and prefix by prefix (reference);
    ratio = reference_s / ours_s (above 1: one pass is faster). Raises if the two disagree."""
    solutions = synthetic_solutions(n_solutions, n_steps, seed)
    scorer = scorer or _random_tiny_scorer(solutions, batch_size)
    prefixes = [(question, steps[: k + 1]) for question, steps in solutions for k in range(len(steps))]

    def ours():
        return scorer.score_many(solutions)

    def reference():
        return [scores[-1] for scores in scorer.score_many(prefixes)]

    one_pass, per_prefix = np.concatenate(ours()), np.array(reference())  # also warms up
    if not np.allclose(one_pass, per_prefix, atol=1e-3):  # bf16 on GPU: a loose bound
        raise AssertionError(f"one-pass and per-prefix scores differ by up to {np.abs(one_pass - per_prefix).max():.2e}")
    ours_s = _best_time(ours, repeats)
    reference_s = _best_time(reference, repeats)
    return {"ours_s": ours_s, "reference_s": reference_s, "ratio": reference_s / ours_s}


def bench_one_pass_scoring(config, tokenizer, model, n_solutions: int = 32, n_steps: int = 8, repeats: int = 3) -> dict:
    """prm_one_pass for stages.bench: a PRM head on ``model``'s backbone (a causal LM or base
    model, e.g. the tiny-world policy; weights shared, not copied), the config's step format,
    batches of prm.score_batch_size."""
    from prm.model import PRMInfo, ProcessRewardModel

    prm = ProcessRewardModel.from_backbone(model, PRMInfo.from_format(config.format, "tiny")).eval()
    scorer = PRMScorer(prm, tokenizer, config.format, "tiny", batch_size=config.prm.score_batch_size)
    return bench_prm_one_pass(scorer, n_solutions=n_solutions, n_steps=n_steps, repeats=repeats)


def _best_time(fn, repeats: int) -> float:
    best = float("inf")
    for _ in range(max(1, repeats)):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best
