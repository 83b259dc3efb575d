"""generation_shared_prompt: ONE generate call over all prompts, n samples each (prompts batched
together, each prompt encoded once and its KV cache shared by its n samples), against one generate
call per prompt with the same generator (the per-problem loop a stage would run without
cross-problem batching). Optionally also transformers' own ``model.generate(num_return_sequences=n)``
per prompt, which copies every prompt n times before encoding it (``hf_generate_s``)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path

import torch

from perf.rows import ratio_row, seconds_of
from perf.world import tiny_world
from pipeline.generation.base import Generator
from pipeline.steps import encode_prompt

NAME = "generation_shared_prompt"
GOAL = None
REFERENCE = "one generate call per prompt (64 prompts x n=16 x 48 new tokens)"


def run(cfg, out_dir: Path) -> dict:
    world = tiny_world(cfg, out_dir)
    row = bench_shared_prompt(lambda: world.generator, world.prompts, n_prompts=64, n=16, max_new_tokens=48)
    return {**row, "model": world.note}


def bench_shared_prompt(
    generator_factory: Callable[[], Generator],
    prompts: Sequence[str],
    n_prompts: int = 64,
    n: int = 16,
    max_new_tokens: int = 48,
    temperature: float = 1.0,
    seed: int = 0,
    with_hf_generate: bool = False,
) -> dict:
    """Seconds for one batched call vs one call per prompt over ``n_prompts`` prompts.

    generator_factory: builds the generator to measure (called once)
    prompts:           prompt texts; cycled when fewer than n_prompts
    returns: the ratio row (ours_s, reference_s, ratio = reference_s / ours_s: > 1, batching is
             faster) with sequences, generated_tokens, tokens_per_s, [hf_generate_s]
    """
    if not prompts:
        raise ValueError("bench_shared_prompt: no prompts")
    generator = generator_factory()
    chosen = [prompts[i % len(prompts)] for i in range(n_prompts)]
    kwargs = {"n": n, "temperature": temperature, "max_new_tokens": max_new_tokens}
    generator.generate(chosen[:2], n=2, temperature=temperature, max_new_tokens=4, seed=seed)  # warm-up

    outputs: list = []
    ours = seconds_of(lambda: outputs.extend(generator.generate(chosen, seed=seed, **kwargs)))
    reference = seconds_of(lambda: [generator.generate([p], seed=seed + i, **kwargs) for i, p in enumerate(chosen)])
    tokens = sum(len(c.token_ids) for outs in outputs for c in outs)
    result = ratio_row(
        NAME,
        ours_s=ours,
        reference_s=reference,
        goal=GOAL,
        reference=REFERENCE,
        sequences=n_prompts * n,
        generated_tokens=tokens,
        tokens_per_s=tokens / ours if ours > 0 else float("inf"),
    )
    model, tokenizer = getattr(generator, "model", None), getattr(generator, "tokenizer", None)
    if with_hf_generate and model is not None and tokenizer is not None:
        result["hf_generate_s"] = seconds_of(
            lambda: _hf_generate_per_prompt(model, tokenizer, chosen, n, temperature, max_new_tokens)
        )
    return result


def _hf_generate_per_prompt(model, tokenizer, prompts, n, temperature, max_new_tokens) -> None:
    device = next(model.parameters()).device
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    with torch.inference_mode():
        for prompt in prompts:
            ids = torch.tensor([encode_prompt(tokenizer, prompt)], device=device)
            model.generate(
                ids,
                attention_mask=torch.ones_like(ids),
                do_sample=temperature > 0,
                temperature=temperature or None,
                top_p=1.0,
                num_return_sequences=n,
                max_new_tokens=max_new_tokens,
                pad_token_id=pad,
            )
