"""PRM training: BCE against step labels (prm.labels: soft MC values or hard 0/1), plus, with
prm.pair_loss_weight > 0, a Bradley-Terry ranking loss over sibling steps (same prefix, labels
that differ), with accelerate (paper 3.3, appendix E.2-E.3; docs/prm.md).

One optimizer step = ``batch_size`` sequences (all processes together), taken as micro-batches
of ``micro_batch_size`` sequences per process with gradient accumulation. AdamW (no decay on
biases and norm weights), linear warmup then cosine / linear / constant, clipping at
``max_grad_norm``. Runs unchanged on CPU, one GPU, and ``accelerate launch`` (DDP, FSDP,
DeepSpeed; configs/accelerate/, docs/prm.md).

Runs on the project's one training base (pipeline.training). Outputs under ``output_dir``:
model/ (the final PRM, PRMScorer.from_pretrained loads it; written aside and committed by one rename with a
manifest), metrics.jsonl (step, loss, lr,
examples/s, tokens/s, epoch), checkpoints/step-<n>/ (crash-safe resumable state every
``save_every`` steps, removed once model/ is written).
"""

from __future__ import annotations

import dataclasses
import logging
import math
from collections.abc import Sequence
from pathlib import Path

import torch
import torch.nn.functional as F
from accelerate.utils import set_seed
from torch import Tensor

from pipeline.batches import gradient_accumulation
from pipeline.config.loader import check_choice
from pipeline.config.schema import PRMLabels
from pipeline.modeling import load_tokenizer, resolve_device, resolve_dtype, upcast_trainable
from pipeline.records import PRMExample
from pipeline.storage.model_folders import commit_folder, staging_folder
from pipeline.training import OptimizerSettings, Tracking, TrainingBase, make_accelerator
from prm.data import PRMCollator, PRMDataset, iter_training_batches, pad_token_id, sorted_batches
from prm.model import ProcessRewardModel, new_prm

log = logging.getLogger("stepflow.prm")


def prm_bce_loss(logits: Tensor, labels: Tensor, mask: Tensor) -> Tensor:
    """Mean binary cross-entropy of step-score logits against soft labels.

    logits: (B, S) head logits at each step's last token (U = sigmoid(logit))
    labels: (B, S) soft labels in [0, 1] (MC values or group labels)
    mask:   (B, S) bool, or float weights (records merged at a position); 0 at padding
    returns: scalar sum_bs mask * BCE(logit, label) / sum_bs mask, where
             BCE(x, y) = -(y log sigmoid(x) + (1 - y) log(1 - sigmoid(x)))
    """
    weights = mask.to(logits.dtype)
    per_step = F.binary_cross_entropy_with_logits(logits, labels.to(logits.dtype), reduction="none")
    return (per_step * weights).sum() / weights.sum().clamp_min(torch.finfo(logits.dtype).tiny)


def prm_pair_loss(logits: Tensor, better: Tensor, worse: Tensor, gap: Tensor) -> Tensor:
    """Gap-weighted Bradley-Terry loss of sibling steps: the higher-labelled one should score higher.

    logits: (B, S) head logits at each step's last token
    better: (P, 2) long, (row, slot) in ``logits`` of the step with the higher label
    worse:  (P, 2) long, (row, slot) of its sibling (same prefix) with the lower label
    gap:    (P,) label(better) - label(worse) > 0, each pair's weight
    returns: scalar sum_p gap_p * softplus(z_worse,p - z_better,p) / sum_p gap_p, i.e. the
             gap-weighted mean of -log sigmoid(z_better - z_worse); 0 (still on the graph) when P = 0
    """
    z_better = logits[better[:, 0], better[:, 1]]
    z_worse = logits[worse[:, 0], worse[:, 1]]
    weights = gap.to(logits.dtype)
    if weights.numel() == 0:
        return logits.sum() * 0.0
    return (weights * F.softplus(z_worse - z_better)).sum() / weights.sum().clamp_min(torch.finfo(logits.dtype).tiny)


def training_targets(records: Sequence[PRMExample], labels: str = "soft", threshold: float = 0.0) -> list[PRMExample]:
    """The records with the label the BCE trains on (prm.labels), the one place it is chosen.

    soft: the stored label (an MCTS step's MC value, a similarity group's label, a human rating's;
    paper 3.3). hard: 1.0 where the stored label exceeds ``threshold``, else 0.0 (Zhang et al. 2025
    train on MC > 0). Validation's MC-label AUC, calibration and E.4 check read the stored labels.
    """
    check_choice(labels, PRMLabels, "prm.labels")
    if labels == "soft":
        return list(records)
    return [dataclasses.replace(record, label=1.0 if record.label > threshold else 0.0) for record in records]


@torch.no_grad()
def evaluate_loss(
    model: torch.nn.Module, dataset: PRMDataset, collator: PRMCollator, micro_batch_size: int, device
) -> float:
    """Mean BCE over every labelled step of a dataset (weighted by records)."""
    was_training = model.training
    model.eval()
    total, weight = 0.0, 0.0
    for indices in sorted_batches(dataset.lengths, micro_batch_size):
        batch = {k: v.to(device) for k, v in collator([dataset[i] for i in indices]).items()}
        logits = model(batch["input_ids"], batch["attention_mask"], batch["score_positions"]).float()
        w = batch["label_mask"].sum().item()
        total += prm_bce_loss(logits, batch["labels"], batch["label_mask"]).item() * w
        weight += w
    model.train(was_training)
    return total / weight if weight else float("nan")


def train_prm(
    config,
    train_records: Sequence,
    val_records: Sequence | None,
    output_dir: str | Path,
    *,
    model: ProcessRewardModel | None = None,
    tokenizer=None,
    kind: str | None = None,
    progress: bool = True,
) -> dict:
    """Train a PRM on PRM records; returns metrics (final train loss, val_bce, steps, speed, counts).

    config:    the pipeline Config (prm section: optimisation; model: backbone, device, dtype;
               format: the prompt and step format)
    model, tokenizer: an already built PRM and its tokenizer (tests, notebooks); default: a new
               head on config.model.prm_backbone and that folder's tokenizer
    kind:      prompt kind; default config.prm.kind, then "math"
    """
    cfg = config.prm
    output_dir = Path(output_dir)
    kind = kind or cfg.kind or (model.info.kind if model is not None else "math")
    tracking = Tracking.from_config(
        config, "prm", output_dir
    )  # before any model loads: a missing tracker package fails here
    accelerator = make_accelerator(config.model, compile=cfg.compile, tracking=tracking)
    world = accelerator.num_processes
    accumulation = gradient_accumulation(cfg.batch_size, cfg.micro_batch_size, world)  # exact, before any model loads
    accelerator.gradient_accumulation_steps = accumulation
    set_seed(cfg.seed)  # the same fresh head on every process

    if model is None:
        backbone = config.resolve(config.model.prm_backbone)
        # new_prm's backbone loader checks the folder
        tokenizer = tokenizer or load_tokenizer(backbone, trust_remote_code=config.model.trust_remote_code, check=False)
        model = new_prm(backbone, config.model, config.format, kind, device=accelerator.device)
    if tokenizer is None:
        raise ValueError("train_prm: pass the tokenizer together with the model")
    model.info.kind = kind
    if cfg.lora and not model.has_lora:
        model.add_lora(cfg.lora_r, cfg.lora_alpha, cfg.lora_dropout, cfg.lora_target_modules)
    if cfg.gradient_checkpointing:
        base_model = model.backbone.get_base_model() if model.has_lora else model.backbone
        base_model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    upcast_trainable(model)  # float32 master weights; accelerate autocasts to bf16 on GPU

    format_config = model.info.format_config()
    train_records = training_targets(train_records, cfg.labels, cfg.hard_label_threshold)
    val_records = training_targets(val_records, cfg.labels, cfg.hard_label_threshold) if val_records else val_records
    train_set = PRMDataset(train_records, tokenizer, format_config, kind, cfg.max_length, cfg.merge_prefixes)
    val_set = (
        PRMDataset(val_records, tokenizer, format_config, kind, cfg.max_length, cfg.merge_prefixes)
        if val_records
        else None
    )
    if len(train_set) == 0:
        raise ValueError("train_prm: no training sequences (no records, or every label beyond prm.max_length)")
    collator = PRMCollator(pad_token_id(tokenizer))
    pair_weight = cfg.pair_loss_weight
    if pair_weight > 0 and cfg.group_by_length:
        raise ValueError(
            "prm.pair_loss_weight > 0 keeps sibling steps in one micro-batch; prm.group_by_length=true cannot be combined "
            "with it"
        )
    sibling_groups = train_set.sibling_groups() if pair_weight > 0 else None

    micro_per_epoch = math.ceil(len(train_set) / cfg.micro_batch_size)
    total_steps = max(1, round(cfg.epochs * micro_per_epoch / (accumulation * world)))
    settings = OptimizerSettings(
        lr=cfg.lr,
        total_steps=total_steps,
        weight_decay=cfg.weight_decay,
        schedule=cfg.scheduler,
        warmup_steps=int(round(cfg.warmup_ratio * total_steps)),
        max_grad_norm=cfg.max_grad_norm,
    )
    base = TrainingBase(
        accelerator,
        model,
        settings,
        output_dir,
        micro_batch_size=cfg.micro_batch_size,
        save_every=cfg.save_every,
        log_every=cfg.log_every,
        progress=progress,
        desc="prm",
        tracking=tracking,
    )
    if cfg.resume:
        base.resume()
    else:
        base.metrics.trim(0)
    start_step = base.step
    if base.is_main:
        log.info(
            "prm: %d records -> %d sequences (%d labels dropped beyond max_length=%d); %d steps of %d micro-batches x %d processes",
            train_set.n_records,
            len(train_set),
            int(train_set.dropped_labels),
            cfg.max_length,
            total_steps,
            accumulation,
            world,
        )

    def my_micro_batches():
        """This process's share of the seeded stream (every process walks the same one), from
        the first micro-batch a resumed run has not trained on."""
        stream = iter_training_batches(
            train_set.lengths,
            cfg.micro_batch_size,
            total_steps * accumulation * world,
            cfg.seed,
            cfg.group_by_length,
            groups=sibling_groups,
        )
        for micro_index, indices in enumerate(stream):
            if micro_index % world == accelerator.process_index and micro_index >= start_step * accumulation * world:
                pairs = train_set.pairs_within(indices) if pair_weight > 0 else None
                yield collator([train_set[i] for i in indices], pairs)

    def loss_fn(model, batch):
        # counted on the host before the copy: no device sync per micro-batch
        counts = {"examples": batch["label_mask"].sum().item(), "tokens": batch["attention_mask"].sum().item()}
        if pair_weight > 0:
            counts["sibling_pairs"] = len(batch["pair_gap"])
        batch = {k: v.to(accelerator.device, non_blocking=True) for k, v in batch.items()}
        logits = model(batch["input_ids"], batch["attention_mask"], batch["score_positions"]).float()
        loss = prm_bce_loss(logits, batch["labels"], batch["label_mask"])
        if pair_weight > 0:
            loss = loss + pair_weight * prm_pair_loss(
                logits, batch["pair_better"], batch["pair_worse"], batch["pair_gap"]
            )
        return loss, counts

    result = base.fit(
        my_micro_batches(), loss_fn, extra_record=lambda step: {"epoch": step * accumulation * world / micro_per_epoch}
    )

    accelerator.wait_for_everyone()
    unwrapped: ProcessRewardModel = base.unwrapped
    state_dict = base.final_state_dict()  # gathered under FSDP / DeepSpeed: every process takes part
    if base.is_main:  # written aside, committed by one rename: model/ is either absent or whole
        staging = staging_folder(output_dir / "model")
        unwrapped.save_pretrained(staging, tokenizer=tokenizer, state_dict=state_dict, dtype=_save_dtype(config.model))
        commit_folder(staging, output_dir / "model", steps=result["steps"], settings=dataclasses.asdict(cfg))
    # The resumable state only serves an interrupted run (for a 7B model it is ~12 bytes a
    # parameter); once model/ is written it goes (make prm started again then says it is finished).
    base.finish()
    metrics = {
        "steps": result["steps"],
        "resumed_from": result["resumed_from"],
        "micro_batches": (result["steps"] - result["resumed_from"]) * accumulation,
        "train_loss": result["loss"],
        "train_seconds": result["seconds"],
        "train_tokens": int(result["counts"].get("tokens", 0)),  # non-padding tokens this process read
        "labels": cfg.labels if cfg.labels == "soft" else f"hard (label > {cfg.hard_label_threshold})",
        "n_train_records": train_set.n_records,
        "n_train_sequences": len(train_set),
        "n_train_labels": train_set.n_labels,
        "pair_loss_weight": pair_weight,
        "n_train_sibling_pairs": len(train_set.pairs),  # pairs in the training set (their labels differ)
        "sibling_pairs_trained": int(
            result["counts"].get("sibling_pairs", 0)
        ),  # pair terms seen in micro-batches, every epoch
        "dropped_labels": train_set.dropped_labels,
        "accumulation": accumulation,
        "processes": world,
        "effective_batch_size": accumulation * world * cfg.micro_batch_size,
        "stopped_by_time": result["stopped_by_time"],
    }
    if val_set is not None and len(val_set):
        # Every process runs the same batches: a sharded (FSDP/DeepSpeed) model needs them all.
        metrics["val_bce"] = evaluate_loss(base.model, val_set, collator, cfg.micro_batch_size, accelerator.device)
        metrics["n_val_records"] = val_set.n_records
    accelerator.wait_for_everyone()
    accelerator.end_training()
    return metrics


def _save_dtype(model_config) -> torch.dtype:
    return resolve_dtype(model_config.dtype, resolve_device(model_config.device))
