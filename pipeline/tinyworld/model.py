"""The tiny world's base policy: a small transformers causal LM trained from scratch.

The model is an ordinary transformers architecture (LlamaConfig by default) built from the
sizes in BootstrapConfig, trained on the gold solutions of the training problems, and saved
with save_pretrained (safetensors) beside its tokenizer, so every later stage loads it
exactly as it loads a hub model. Training inputs are built with the project's one prompt
builder and one trajectory encoder (pipeline.prompts, pipeline.steps): the token
segmentation the model learns is the one every stage feeds it. The loss covers only the
solution tokens (the steps, their separators and the end token), not the prompt.

Training runs on the project's one training base (pipeline.training): AdamW, linear warmup then
a cosine to lr * min_lr_ratio over max_train_steps optimizer steps, clipping, checkpoints. The
run is bounded by its step count, so the same config gives the same weights on any machine.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
import transformers
from transformers import AutoModelForCausalLM

from pipeline.prompts import prompt_from_config
from pipeline.steps import encode_trajectory
from pipeline.storage.model_folders import commit_folder, staging_folder
from pipeline.tinyworld.checker import strategy_templates
from pipeline.training import OptimizerSettings, Tracking, TrainingBase, make_accelerator

IGNORE_INDEX = -100

# bootstrap.architecture -> transformers config class. Only families for which AutoTokenizer
# reloads our saved tokenizer unchanged: with a Qwen2 config it builds a Qwen2Tokenizer with
# Qwen's pre-tokenizer (DESIGN.md), so the ids would no longer be the ones trained on.
ARCHITECTURES = {"llama": "LlamaConfig"}


def model_config(cfg, tokenizer, attn_implementation: str = "eager"):
    """A transformers config of the size BootstrapConfig asks for, special ids from the tokenizer."""
    if cfg.architecture not in ARCHITECTURES:
        raise ValueError(f"bootstrap.architecture: expected one of {sorted(ARCHITECTURES)}, got {cfg.architecture!r}")
    if cfg.hidden_size % cfg.num_heads:
        raise ValueError(
            f"bootstrap.hidden_size ({cfg.hidden_size}) must be a multiple of bootstrap.num_heads ({cfg.num_heads})"
        )
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


def training_examples(
    problems, tokenizer, format_config, max_length: int | None = None, every_strategy: bool = False
) -> list[TrainingExample]:
    """One example per problem: its prompt and its gold solution (``meta["solutions"][0]``); with
    ``every_strategy``, one per strategy of the problem: its prompt and that strategy's template
    (``pipeline.tinyworld.checker.strategy_templates``, the gold first).

    Examples longer than ``max_length`` tokens are an error naming the problem: a model cannot
    learn to finish a solution it never sees the end of.
    """
    examples = []
    for problem in problems:
        prompt = prompt_from_config(problem.question, problem.kind, tokenizer, format_config)
        for steps in strategy_templates(problem) if every_strategy else [problem.meta["solutions"][0]]:
            segmented = encode_trajectory(tokenizer, prompt, steps, format_config.separator, add_end=True)
            ids = segmented.input_ids
            if max_length is not None and len(ids) > max_length:
                raise ValueError(
                    f"problem {problem.problem_id}: {len(ids)} tokens exceed bootstrap.max_position_embeddings={max_length}"
                )
            labels = [IGNORE_INDEX] * segmented.prompt_len + ids[segmented.prompt_len :]
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
        chunk = sorted(order[start : start + window], key=lambda i: len(examples[i].input_ids))
        batches.extend(chunk[i : i + batch_size] for i in range(0, len(chunk), batch_size))
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
    final_loss: float  # mean loss of the last logging window (20 steps)
    epochs: float
    tokens: int  # non-padding tokens seen by this process
    losses: list[float]  # the mean loss of every logging window
    stopped_by_time: bool  # the wall-clock safety net ended the run before max_train_steps


LOG_EVERY = 20


def optimizer_settings(cfg) -> OptimizerSettings:
    """BootstrapConfig -> the training base's settings: AdamW (betas 0.9/0.95), warmup, then a
    cosine from cfg.lr down to cfg.lr * cfg.min_lr_ratio over cfg.max_train_steps."""
    return OptimizerSettings(
        lr=cfg.lr,
        total_steps=cfg.max_train_steps,
        weight_decay=cfg.weight_decay,
        betas=(0.9, 0.95),
        schedule="cosine",
        warmup_steps=cfg.warmup_steps,
        min_lr_ratio=cfg.min_lr_ratio,
        max_grad_norm=cfg.grad_clip,
    )


def train_language_model(
    model,
    tokenizer,
    examples: Sequence[TrainingExample],
    cfg,
    out_dir: str | Path,
    model_config,
    progress: bool = True,
    settings: dict | None = None,
    tracking: Tracking | None = None,
) -> TrainStats:
    """Train ``model`` on ``examples`` for cfg.max_train_steps optimizer steps on the training
    base (cfg.train_seconds is only a safety net that stops a far too slow run, loudly), then
    save it with its tokenizer to <out_dir>/model (written aside and committed by one rename, with a
    manifest recording ``settings``).

    Batches: one epoch at a time, ``length_grouped_batches`` with Random(cfg.seed); a checkpoint
    every cfg.save_every steps (0: none) holds that generator and the epoch's remaining batches,
    so a resumed run sees the same batches as an uninterrupted one. Metrics go to
    <out_dir>/metrics.jsonl every LOG_EVERY steps, and to the experiment trackers of ``tracking``.
    """
    pad_id = tokenizer.pad_token_id
    base = TrainingBase(
        make_accelerator(model_config, tracking=tracking),
        model,
        optimizer_settings(cfg),
        out_dir,
        save_every=cfg.save_every,
        max_seconds=cfg.train_seconds,
        log_every=LOG_EVERY,
        progress=progress,
        desc="bootstrap",
        tracking=tracking,
    )
    rng = random.Random(cfg.seed)
    pending: list[list[int]] = []
    state = base.resume()
    if state:
        rng.setstate(state["rng"])
        pending = state["pending"]

    def batches():
        while True:
            if not pending:
                pending.extend(length_grouped_batches(examples, cfg.batch_size, rng))
            yield collate([examples[i] for i in pending.pop()], pad_id)

    def loss_fn(model, batch):
        batch = {k: v.to(base.accelerator.device) for k, v in batch.items()}
        return model(**batch).loss, {"tokens": float(batch["attention_mask"].sum())}

    result = base.fit(batches(), loss_fn, loop_state=lambda: {"rng": rng.getstate(), "pending": pending})
    model.eval()
    if base.is_main:  # written aside, committed by one rename: model/ is either absent or whole
        staging = staging_folder(Path(out_dir) / "model")
        save_policy(base.unwrapped, tokenizer, staging)
        commit_folder(staging, Path(out_dir) / "model", steps=result["steps"], settings=settings)
    base.finish()
    losses = [record["loss"] for record in base.metrics.read()]
    return TrainStats(
        steps=result["steps"],
        seconds=result["seconds"],
        final_loss=result["loss"],
        epochs=result["steps"] * cfg.batch_size / max(len(examples), 1),
        tokens=int(result["counts"].get("tokens", 0)),
        losses=losses,
        stopped_by_time=result["stopped_by_time"],
    )


def save_policy(model, tokenizer, path: str | Path) -> Path:
    """Weights (safetensors), config and tokenizer in one folder, loadable like a hub model."""
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(path, safe_serialization=True)
    tokenizer.save_pretrained(path)
    return path
