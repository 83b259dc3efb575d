"""Benchmark prm_one_pass: every step of a solution scored in one forward pass, against the
reference way of scoring each prefix s_1..s_k as its own sequence (a PRM that reads only the
last position, as in a naive loop over prefixes). Both run through the same batched scorer, so
the ratio measures the one-pass design alone: for n-step solutions the reference feeds (n+1)/2
times the tokens when the prompt is negligible, up to n times when the prompt dominates.

Also here: prm_training (PRM training throughput) and search_batched (bench_batched_search: one
batched PRM-guided search over all questions against one search per question).
"""

from __future__ import annotations

import copy
import dataclasses
import json
import random
import time
from pathlib import Path
from typing import Sequence

import numpy as np
import torch
from transformers import LlamaConfig, LlamaModel, Qwen2Config, Qwen2Model

from pipeline.bench import timed
from pipeline.config import BootstrapConfig, FormatConfig
from pipeline.prompts import prompt_from_config
from pipeline.records import ORIGIN_MCTS, PRMExample
from pipeline.tinyworld.tokenizer import train_tokenizer
from prm.data import PRMDataset
from prm.model import PRMInfo, ProcessRewardModel
from prm.scorer import PRMScorer, Solution
from prm.search import search_many
from prm.search.common import default_prompts, search_settings
from prm.train import train_prm

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
    prm = ProcessRewardModel.from_backbone(model, PRMInfo.from_format(config.format, "tiny")).eval()
    scorer = PRMScorer(prm, tokenizer, config.format, "tiny", batch_size=config.prm.score_batch_size)
    return bench_prm_one_pass(scorer, n_solutions=n_solutions, n_steps=n_steps, repeats=repeats)


def _best_time(fn, repeats: int) -> float:
    return min(timed(fn) for _ in range(max(1, repeats)))


# Qwen2-0.5B's architecture (its config.json on the hub), for a training-throughput benchmark at
# random init: the shapes set the cost, the weights do not.
QWEN2_0_5B = dict(
    vocab_size=151936, hidden_size=896, intermediate_size=4864, num_hidden_layers=24, num_attention_heads=14,
    num_key_value_heads=2, max_position_embeddings=32768, rope_theta=1000000.0, rms_norm_eps=1e-6, tie_word_embeddings=True,
)
# Dense bf16 tensor-core peak of the SXM parts, FLOP/s (vendor datasheets; sparsity not counted).
PEAK_BF16_FLOPS = {"H200": 989.4e12, "H100": 989.4e12, "A100": 312e12}


def peak_bf16_flops(device_name: str) -> float | None:
    """Datasheet dense bf16 peak of a GPU named like torch.cuda.get_device_name(), or None."""
    for key, flops in PEAK_BF16_FLOPS.items():
        if key in device_name:
            return flops
    return None


def training_flops_per_token(backbone_config, seq_len: float) -> float:
    """Training FLOPs (forward + backward) per token of a decoder backbone scored by a PRM head:
    6 * N + 12 * L * H * T (PaLM, appendix B), with N the parameters of the transformer blocks
    (the embedding is a lookup and a PRM has no LM head), L layers, H hidden size and T the
    token-weighted mean sequence length (attention scores and values, causal mask not halved)."""
    h, i, layers = backbone_config.hidden_size, backbone_config.intermediate_size, backbone_config.num_hidden_layers
    head_dim = getattr(backbone_config, "head_dim", None) or h // backbone_config.num_attention_heads
    kv = backbone_config.num_key_value_heads * head_dim
    attention = h * h + 2 * h * kv + h * h  # q, k, v, o projections
    mlp = 3 * h * i  # gate, up, down
    return 6.0 * layers * (attention + mlp) + 12.0 * layers * h * seq_len


def bench_prm_training(
    config,
    work_dir: str | Path,
    backbone_config: dict | None = None,
    n_solutions: int = 3072,
    n_steps: int = 48,
    micro_batch_size: int = 64,
    batch_size: int = 256,
    warmup_steps: int = 4,
    compile: bool = True,
) -> dict:
    """Training throughput and MFU of ``prm.train.train_prm`` (the real trainer: accelerate, bf16
    autocast over float32 master weights on GPU, fused AdamW, clipping) on a randomly initialised
    backbone of ``backbone_config`` (default: Qwen2-0.5B's shapes) and synthetic ``n_steps``-step
    solutions, one merged sequence each; ``compile``: prm.compile (torch.compile through accelerate).

    Returns {tokens_per_s, achieved_tflops, mfu (None when the device's peak is unknown),
    seq_len, params_blocks, ...}: the median over optimizer steps after ``warmup_steps``.
    """
    work_dir = Path(work_dir)
    solutions = synthetic_solutions(n_solutions, n_steps)
    records = [
        PRMExample(f"bench-{i}", q, steps[:k], steps[k], ((i * 31 + k * 7) % 11) / 10, ORIGIN_MCTS)
        for i, (q, steps) in enumerate(solutions) for k in range(len(steps))
    ]
    run_config = copy.deepcopy(config)
    run_config.format = dataclasses.replace(run_config.format, use_chat_template=False)
    texts = [prompt_from_config(q, "tiny", None, run_config.format) + "\n".join(s) for q, s in solutions]
    tokenizer = train_tokenizer(texts)
    backbone_config = Qwen2Config(**(backbone_config or QWEN2_0_5B))
    device = "cuda" if torch.cuda.is_available() else "cpu"
    torch.manual_seed(0)
    with torch.device(device):
        backbone = Qwen2Model(backbone_config).to(torch.bfloat16 if device == "cuda" else torch.float32)
    backbone_dir = work_dir / "backbone"
    backbone.save_pretrained(backbone_dir)
    tokenizer.save_pretrained(backbone_dir)
    del backbone

    run_config.model = dataclasses.replace(run_config.model, prm_backbone=str(backbone_dir), device="auto", dtype="auto",
                                           attn_implementation="sdpa")
    run_config.prm = dataclasses.replace(
        run_config.prm, lr=8e-6, batch_size=batch_size, micro_batch_size=micro_batch_size, epochs=1.0, log_every=1,
        save_every=0, resume=False, max_length=4096, kind="tiny", lora=False, gradient_checkpointing=False,
        compile=compile, group_by_length=True,  # as measured in docs/benchmarks.md: least padding
    )
    lengths = PRMDataset(records, tokenizer, run_config.format, "tiny", run_config.prm.max_length).lengths
    seq_len = sum(n * n for n in lengths) / sum(lengths)  # token-weighted, as the attention cost is
    metrics = train_prm(run_config, records, None, work_dir / "out", tokenizer=tokenizer, progress=False)
    lines = [json.loads(line) for line in (work_dir / "out" / "metrics.jsonl").read_text().splitlines() if line.strip()]
    measured = sorted(line["tokens_per_s"] for line in lines[warmup_steps:]) or [metrics["train_tokens"] / metrics["train_seconds"]]
    tokens_per_s = measured[len(measured) // 2]
    flops = training_flops_per_token(backbone_config, seq_len) * tokens_per_s
    peak = peak_bf16_flops(torch.cuda.get_device_name(0)) if device == "cuda" else None
    return {
        "tokens_per_s": tokens_per_s,
        "achieved_tflops": flops / 1e12,
        "mfu": flops / peak if peak else None,
        "peak_tflops": peak / 1e12 if peak else None,
        "seq_len": seq_len,
        "params_blocks": training_flops_per_token(backbone_config, 0.0) / 6,
        "micro_batch_size": micro_batch_size,
        "batch_size": batch_size,
        "compile": compile,
        "optimizer_steps": metrics["steps"],
        "measured_steps": len(measured),
    }


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
    strategy, k, settings and seeds; `make bench` reports it as search_batched).

    returns: {ours_s, reference_s, ratio = reference_s / ours_s (> 1: batching is faster),
              problems, tokens_generated}
    """
    if not questions:
        raise ValueError("bench_batched_search: no questions")
    prompts = list(prompts) if prompts is not None else default_prompts(questions, policy, search_settings(settings))
    search_many(questions[:1], policy, prm, strategy, min(k, 2), prompts=prompts[:1], **{**settings, "max_depth": 1})  # warm-up

    start = time.perf_counter()
    ours = search_many(questions, policy, prm, strategy, k, prompts=prompts, **settings)
    ours_s = time.perf_counter() - start
    start = time.perf_counter()
    for question, prompt in zip(questions, prompts):
        search_many([question], policy, prm, strategy, k, prompts=[prompt], **settings)
    reference_s = time.perf_counter() - start
    return {
        "ours_s": ours_s,
        "reference_s": reference_s,
        "ratio": reference_s / ours_s if ours_s > 0 else float("inf"),
        "problems": len(questions),
        "tokens_generated": sum(r.tokens_generated for r in ours),
    }
