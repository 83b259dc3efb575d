"""generation_vllm_vs_hf: the vLLM backend against the HF backend on the same model folder, the
same prompts, samples and token budget, one generate call each after a warm-up (engine start not
timed). Runs where vllm is installed (`make bench-vllm`, in .venv-vllm); make bench in .venv logs
that it did not run the row and keeps the row make bench-vllm wrote."""

from __future__ import annotations

import importlib.util
from collections.abc import Sequence
from pathlib import Path

from perf.rows import NotRunHere, ratio_row, seconds_of
from perf.world import tiny_world
from pipeline.generation.base import Generator
from pipeline.generation.hf import HFGenerator
from pipeline.generation.vllm_backend import VLLMGenerator
from pipeline.modeling import load_causal_lm, load_tokenizer

NAME = "generation_vllm_vs_hf"
GOAL = None
REFERENCE = (
    "the HF backend on the same model folder: one generate call, 64 prompts x n=16 x 48 new tokens "
    "(ours = the vLLM backend; engine start excluded)"
)


def run(cfg, out_dir: Path) -> dict:
    if importlib.util.find_spec("vllm") is None:
        raise NotRunHere("vllm is not installed here: `make bench-vllm` builds .venv-vllm and runs this row there")
    world = tiny_world(cfg, out_dir)
    prompts = world.prompts
    engine = VLLMGenerator(world.model_path, cfg)
    try:
        hf = HFGenerator(
            load_causal_lm(world.model_path, cfg.model),
            load_tokenizer(world.model_path),
            batch_size=cfg.generation.batch_size,
        )
        return {**bench_backends(engine, hf, prompts, n_prompts=64, n=16, max_new_tokens=48), "model": world.note}
    finally:
        engine.close()


def bench_backends(
    ours: Generator,
    reference: Generator,
    prompts: Sequence[str],
    n_prompts: int = 64,
    n: int = 16,
    max_new_tokens: int = 48,
    temperature: float = 1.0,
    seed: int = 0,
) -> dict:
    """Seconds for ONE generate call over the same ``n_prompts`` prompts, n samples each and the
    same token budget, with two generators (e.g. the vLLM backend vs the HF backend on the same
    model folder), each warmed up first; engine start-up is not timed.

    returns: the ratio row (ratio = reference_s / ours_s: > 1, ours is faster) with sequences,
             ours_tokens, reference_tokens (generated tokens: a sample that ends on the end token
             stops early, so the two counts can differ)
    """
    if not prompts:
        raise ValueError("bench_backends: no prompts")
    chosen = [prompts[i % len(prompts)] for i in range(n_prompts)]
    seconds, tokens = {}, {}
    for name, generator in (("ours", ours), ("reference", reference)):
        generator.generate(chosen[:2], n=2, temperature=temperature, max_new_tokens=4, seed=seed)  # warm-up
        outputs: list = []
        seconds[name] = seconds_of(
            lambda: outputs.extend(
                generator.generate(chosen, n=n, temperature=temperature, max_new_tokens=max_new_tokens, seed=seed)
            )
        )
        tokens[name] = sum(len(c.token_ids) for outs in outputs for c in outs)
    return ratio_row(
        NAME,
        ours_s=seconds["ours"],
        reference_s=seconds["reference"],
        goal=GOAL,
        reference=REFERENCE,
        sequences=n_prompts * n,
        ours_tokens=tokens["ours"],
        reference_tokens=tokens["reference"],
    )
