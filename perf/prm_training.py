"""prm_training: training throughput and MFU of ``prm.train.train_prm`` on a GPU (Qwen2-0.5B's
architecture at random init, bf16 autocast over float32 master weights, fused AdamW, synthetic
merged step sequences), eager and compiled (prm.compile). Not a time ratio: tokens/s, achieved
TFLOP/s and MFU = achieved / the datasheet's dense bf16 peak (docs/perf.md, "PRM training
throughput"). A GPU benchmark only: make bench on a CPU machine logs that it did not run."""

from __future__ import annotations

import copy
import dataclasses
import json
from pathlib import Path

import torch
from transformers import Qwen2Config, Qwen2Model

from perf import world
from perf.prm_one_pass import synthetic_solutions
from perf.rows import NotRunHere
from pipeline.prompts import prompt_from_config
from pipeline.records import ORIGIN_MCTS, PRMExample
from pipeline.tinyworld.tokenizer import train_tokenizer
from prm.data import PRMDataset
from prm.train import train_prm

NAME = "prm_training"


def run(cfg, out_dir: Path) -> dict:
    """{"name", "runs": [eager, compiled]}: each bench_prm_training's result with its defaults; the
    shared tiny model is released first, so that the GPU's memory is this benchmark's."""
    if not torch.cuda.is_available():
        raise NotRunHere("a 0.5B-parameter model: a GPU benchmark only")
    world.release()
    torch.cuda.empty_cache()
    return {
        "name": NAME,
        "runs": [
            bench_prm_training(cfg, out_dir / f"prm_training_{mode}", compile=mode == "compiled")
            for mode in ("eager", "compiled")
        ],
    }


# Qwen2-0.5B's architecture (its config.json on the hub), for a training-throughput benchmark at
# random init: the shapes set the cost, the weights do not.
QWEN2_0_5B = dict(
    vocab_size=151936,
    hidden_size=896,
    intermediate_size=4864,
    num_hidden_layers=24,
    num_attention_heads=14,
    num_key_value_heads=2,
    max_position_embeddings=32768,
    rope_theta=1000000.0,
    rms_norm_eps=1e-6,
    tie_word_embeddings=True,
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
        for i, (q, steps) in enumerate(solutions)
        for k in range(len(steps))
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

    run_config.model = dataclasses.replace(
        run_config.model, prm_backbone=str(backbone_dir), device="auto", dtype="auto", attn_implementation="sdpa"
    )
    run_config.prm = dataclasses.replace(
        run_config.prm,
        lr=8e-6,
        batch_size=batch_size,
        micro_batch_size=micro_batch_size,
        epochs=1.0,
        log_every=1,
        save_every=0,
        resume=False,
        max_length=4096,
        kind="tiny",
        lora=False,
        gradient_checkpointing=False,
        compile=compile,
        group_by_length=True,  # as measured in docs/perf.md: least padding
    )
    lengths = PRMDataset(records, tokenizer, run_config.format, "tiny", run_config.prm.max_length).lengths
    seq_len = sum(n * n for n in lengths) / sum(lengths)  # token-weighted, as the attention cost is
    metrics = train_prm(run_config, records, None, work_dir / "out", tokenizer=tokenizer, progress=False)
    lines = [json.loads(line) for line in (work_dir / "out" / "metrics.jsonl").read_text().splitlines() if line.strip()]
    measured = sorted(line["tokens_per_s"] for line in lines[warmup_steps:]) or [
        metrics["train_tokens"] / metrics["train_seconds"]
    ]
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
