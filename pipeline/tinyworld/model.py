"""The tiny world's base policy: a small transformers causal LM trained from scratch.

The model is an ordinary transformers architecture (LlamaConfig by default) built from the
sizes in BootstrapConfig, trained on the gold solutions of the training problems, and saved
with save_pretrained (safetensors) beside its tokenizer, so every later stage loads it
exactly as it loads a hub model. Training inputs are built with the project's one prompt
builder and one trajectory encoder (pipeline.prompts, pipeline.steps): the token
segmentation the model learns is the one every stage feeds it. The loss covers only the
solution tokens (the steps, their separators and the end token), not the prompt.

Schedule: linear warmup, then cosine decay driven by the larger of the step fraction
(step / max_train_steps) and the wall-clock fraction (elapsed / train_seconds), so the
learning rate reaches its floor when the time budget runs out whatever the machine's speed.
"""

from __future__ import annotations

import math
import random
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Sequence

import torch

from pipeline.prompts import prompt_from_config
from pipeline.steps import encode_trajectory

IGNORE_INDEX = -100

# bootstrap.architecture -> transformers config class. Only families for which AutoTokenizer
# reloads our saved tokenizer unchanged: with a Qwen2 config it builds a Qwen2Tokenizer with
# Qwen's pre-tokenizer (DESIGN.md), so the ids would no longer be the ones trained on.
ARCHITECTURES = {"llama": "LlamaConfig"}


def model_config(cfg, tokenizer, attn_implementation: str = "eager"):
    """A transformers config of the size BootstrapConfig asks for, special ids from the tokenizer."""
    import transformers

    if cfg.architecture not in ARCHITECTURES:
        raise ValueError(f"bootstrap.architecture: expected one of {sorted(ARCHITECTURES)}, got {cfg.architecture!r}")
    if cfg.hidden_size % cfg.num_heads:
        raise ValueError(f"bootstrap.hidden_size ({cfg.hidden_size}) must be a multiple of bootstrap.num_heads ({cfg.num_heads})")
    config_class = getattr(transformers, ARCHITECTURES[cfg.architecture])
    return config_class(
        vocab_size=len(tokenizer),
        hidden_size=cfg.hidden_size,
        intermediate_size=cfg.intermediate_size,
        num_hidden_layers=cfg.num_layers,
        num_attention_heads=cfg.num_heads,
        num_key_value_heads=cfg.num_heads,
        max_position_embeddings=cfg.max_position_embeddings,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        tie_word_embeddings=True,
        attn_implementation=attn_implementation,
    )


def build_model(cfg, tokenizer, attn_implementation: str = "eager"):
    """A freshly initialised causal LM (seeded by cfg.seed)."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(cfg.seed)
    config = model_config(cfg, tokenizer, attn_implementation)
    return AutoModelForCausalLM.from_config(config, attn_implementation=attn_implementation)


def count_parameters(model) -> int:
    """Distinct trainable parameters (tied embeddings counted once)."""
    seen, total = set(), 0
    for p in model.parameters():
        if id(p) not in seen:
            seen.add(id(p))
            total += p.numel()
    return total


# ----------------------------------------------------------------------------- data


@dataclass
class TrainingExample:
    """Token ids of prompt + solution, and the labels: -100 over the prompt, the ids after it."""

    input_ids: list[int]
    labels: list[int]


def training_examples(problems, tokenizer, format_config, max_length: int | None = None) -> list[TrainingExample]:
    """One example per problem: its prompt and its gold solution (``meta["solutions"][0]``).

    Examples longer than ``max_length`` tokens are an error naming the problem: a model cannot
    learn to finish a solution it never sees the end of.
    """
    examples = []
    for problem in problems:
        prompt = prompt_from_config(problem.question, problem.kind, tokenizer, format_config)
        steps = problem.meta["solutions"][0]
        segmented = encode_trajectory(tokenizer, prompt, steps, format_config.separator, add_end=True)
        ids = segmented.input_ids
        if max_length is not None and len(ids) > max_length:
            raise ValueError(
                f"problem {problem.problem_id}: {len(ids)} tokens exceed bootstrap.max_position_embeddings={max_length}"
            )
        labels = [IGNORE_INDEX] * segmented.prompt_len + ids[segmented.prompt_len:]
        examples.append(TrainingExample(ids, labels))
    return examples


def length_grouped_batches(examples: Sequence[TrainingExample], batch_size: int, rng: random.Random) -> list[list[int]]:
    """One epoch of batches (example indices): shuffled, then sorted by length within windows
    of 50 batches so a batch pads little, then the batches shuffled."""
    order = list(range(len(examples)))
    rng.shuffle(order)
    window = batch_size * 50
    batches = []
    for start in range(0, len(order), window):
        chunk = sorted(order[start:start + window], key=lambda i: len(examples[i].input_ids))
        batches.extend(chunk[i:i + batch_size] for i in range(0, len(chunk), batch_size))
    rng.shuffle(batches)
    return batches


def collate(examples: Sequence[TrainingExample], pad_id: int) -> dict[str, torch.Tensor]:
    """Right-padded input_ids, attention_mask and labels (-100 on padding)."""
    width = max(len(e.input_ids) for e in examples)
    input_ids = torch.full((len(examples), width), pad_id, dtype=torch.long)
    labels = torch.full((len(examples), width), IGNORE_INDEX, dtype=torch.long)
    mask = torch.zeros((len(examples), width), dtype=torch.long)
    for row, e in enumerate(examples):
        n = len(e.input_ids)
        input_ids[row, :n] = torch.tensor(e.input_ids)
        labels[row, :n] = torch.tensor(e.labels)
        mask[row, :n] = 1
    return {"input_ids": input_ids, "attention_mask": mask, "labels": labels}


# ----------------------------------------------------------------------------- training


@dataclass
class TrainStats:
    steps: int
    seconds: float
    final_loss: float  # mean over the last 20 steps
    epochs: float
    tokens: int  # non-padding tokens seen
    losses: list[float]  # every 10th step's loss


def learning_rate(step: int, progress: float, cfg) -> float:
    """Warmup over cfg.warmup_steps, then cosine from cfg.lr down to cfg.lr * cfg.min_lr_ratio."""
    if step < cfg.warmup_steps:
        return cfg.lr * (step + 1) / cfg.warmup_steps
    cosine = 0.5 * (1.0 + math.cos(math.pi * min(progress, 1.0)))
    return cfg.lr * (cfg.min_lr_ratio + (1.0 - cfg.min_lr_ratio) * cosine)


def train_policy(
    model,
    examples: Sequence[TrainingExample],
    cfg,
    pad_id: int,
    on_step: Callable[[int, float, float, float], None] | None = None,
) -> TrainStats:
    """Train ``model`` on ``examples`` until cfg.train_seconds or cfg.max_train_steps.

    AdamW (betas 0.9/0.95, weight decay on matrices only), gradient clipping at cfg.grad_clip,
    the schedule of ``learning_rate``. ``on_step(step, loss, lr, elapsed)`` reports progress.
    """
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    optimizer = torch.optim.AdamW(
        [{"params": decay, "weight_decay": cfg.weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
        lr=cfg.lr, betas=(0.9, 0.95),
    )
    rng = random.Random(cfg.seed)
    model.train()
    losses: list[float] = []
    step, tokens, batches_seen = 0, 0, 0
    batches: list[list[int]] = []
    start = time.monotonic()
    while True:
        elapsed = time.monotonic() - start
        progress = max(step / cfg.max_train_steps, elapsed / cfg.train_seconds)
        if step >= cfg.max_train_steps or elapsed >= cfg.train_seconds:
            break
        if not batches:
            batches = length_grouped_batches(examples, cfg.batch_size, rng)
        batch = collate([examples[i] for i in batches.pop()], pad_id)
        batches_seen += 1
        lr = learning_rate(step, progress, cfg)
        for group in optimizer.param_groups:
            group["lr"] = lr
        loss = model(**batch).loss
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.grad_clip)
        optimizer.step()
        step += 1
        tokens += int(batch["attention_mask"].sum())
        losses.append(float(loss.detach()))
        if on_step is not None:
            on_step(step, losses[-1], lr, time.monotonic() - start)
    model.eval()
    tail = losses[-20:]
    return TrainStats(
        steps=step,
        seconds=time.monotonic() - start,
        final_loss=sum(tail) / len(tail) if tail else float("nan"),
        epochs=batches_seen * cfg.batch_size / max(len(examples), 1),
        tokens=tokens,
        losses=losses[::10],
    )


def save_policy(model, tokenizer, path: str | Path) -> Path:
    """Weights (safetensors), config and tokenizer in one folder, loadable like a hub model."""
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(path, safe_serialization=True)
    tokenizer.save_pretrained(path)
    return path
