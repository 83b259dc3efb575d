"""PRM training: BCE against soft step labels, with accelerate (paper 3.3, appendix E.2-E.3).

One optimizer step = ``batch_size`` sequences (all processes together), taken as micro-batches
of ``micro_batch_size`` sequences per process with gradient accumulation. AdamW (no decay on
biases and norm weights), linear warmup then cosine / linear / constant, clipping at
``max_grad_norm``. Runs unchanged on CPU, one GPU, and ``accelerate launch`` (DDP, FSDP,
DeepSpeed; configs/accelerate/, docs/prm.md).

Outputs under ``output_dir``: model/ (the final PRM, PRMScorer.from_pretrained loads it),
metrics.jsonl (step, loss, lr, examples/s, tokens/s, ...), checkpoints/last/ (resumable accelerate state,
every ``save_every`` steps), tensorboard/ when tensorboard is installed.
"""

from __future__ import annotations

import json
import logging
import math
import shutil
import time
from pathlib import Path
from typing import Sequence

import torch
import torch.nn.functional as F
from torch import Tensor

from prm.data import PRMCollator, PRMDataset, iter_training_batches, pad_token_id
from pipeline.modeling import upcast_trainable
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


def _parameter_groups(model: torch.nn.Module, weight_decay: float) -> list[dict]:
    """AdamW groups: decay on matrices, none on biases, norms and the head's bias."""
    decay, no_decay = [], []
    for name, param in model.named_parameters():
        if not param.requires_grad:
            continue
        (no_decay if param.ndim < 2 or name.endswith(".bias") else decay).append(param)
    return [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]


def _scheduler(optimizer, name: str, warmup_steps: int, total_steps: int):
    from transformers import get_constant_schedule_with_warmup, get_cosine_schedule_with_warmup, get_linear_schedule_with_warmup

    if name == "cosine":
        return get_cosine_schedule_with_warmup(optimizer, warmup_steps, total_steps)
    if name == "linear":
        return get_linear_schedule_with_warmup(optimizer, warmup_steps, total_steps)
    if name == "constant":
        return get_constant_schedule_with_warmup(optimizer, warmup_steps)
    raise ValueError(f"prm.scheduler must be cosine | linear | constant, got {name!r}")


def _tensorboard_writer(directory: Path):
    try:
        from torch.utils.tensorboard import SummaryWriter
    except ImportError:  # tensorboard is optional
        return None
    return SummaryWriter(str(directory))


@torch.no_grad()
def evaluate_loss(model: torch.nn.Module, dataset: PRMDataset, collator: PRMCollator, micro_batch_size: int, device) -> float:
    """Mean BCE over every labelled step of a dataset (weighted by records)."""
    from prm.data import sorted_batches

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
    train_records: Sequence[dict],
    val_records: Sequence[dict] | None,
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
    from accelerate import Accelerator
    from accelerate.utils import set_seed
    from tqdm import tqdm

    from pipeline.modeling import load_tokenizer, resolve_device

    cfg = config.prm
    output_dir = Path(output_dir)
    kind = kind or cfg.kind or (model.info.kind if model is not None else "math")
    device_hint = resolve_device(config.model.device)
    use_cpu = device_hint.type == "cpu"
    mixed = "bf16" if not use_cpu and torch.cuda.is_bf16_supported() else "no"
    accelerator = Accelerator(mixed_precision=mixed, cpu=use_cpu, dynamo_backend="inductor" if cfg.compile else "no")
    world = accelerator.num_processes
    accumulation = max(1, round(cfg.batch_size / (cfg.micro_batch_size * world)))
    accelerator.gradient_accumulation_steps = accumulation
    deepspeed = getattr(accelerator.state, "deepspeed_plugin", None)
    if deepspeed is not None:  # no prepared dataloader to infer these from (accelerate's documented route)
        deepspeed.deepspeed_config["train_micro_batch_size_per_gpu"] = cfg.micro_batch_size
        deepspeed.deepspeed_config["gradient_accumulation_steps"] = accumulation
        deepspeed.deepspeed_config["gradient_clipping"] = cfg.max_grad_norm
    set_seed(cfg.seed)  # the same fresh head on every process

    if model is None:
        backbone = config.resolve(config.model.prm_backbone)
        tokenizer = tokenizer or load_tokenizer(backbone, trust_remote_code=config.model.trust_remote_code)
        model = new_prm(backbone, config.model, config.format, kind, device=accelerator.device)
    if tokenizer is None:
        raise ValueError("train_prm: pass the tokenizer together with the model")
    model.info.kind = kind
    if cfg.lora and not model.has_lora:
        model.add_lora(cfg.lora_r, cfg.lora_alpha, cfg.lora_dropout, cfg.lora_target_modules)
    if cfg.gradient_checkpointing:
        base = model.backbone.get_base_model() if model.has_lora else model.backbone
        base.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    upcast_trainable(model)  # float32 master weights; accelerate autocasts to bf16 on GPU
    model.train()

    format_config = model.info.format_config()
    train_set = PRMDataset(train_records, tokenizer, format_config, kind, cfg.max_length, cfg.merge_prefixes)
    val_set = PRMDataset(val_records, tokenizer, format_config, kind, cfg.max_length, cfg.merge_prefixes) if val_records else None
    if len(train_set) == 0:
        raise ValueError("train_prm: no training sequences (no records, or every label beyond prm.max_length)")
    collator = PRMCollator(pad_token_id(tokenizer))

    micro_per_epoch = math.ceil(len(train_set) / cfg.micro_batch_size)
    total_steps = max(1, round(cfg.epochs * micro_per_epoch / (accumulation * world)))
    warmup_steps = int(round(cfg.warmup_ratio * total_steps))
    # fused: one kernel per step instead of several per tensor; CUDA, plain or DDP parameters only
    # (FSDP and DeepSpeed shard or replace the parameters and keep the default implementation)
    fused = accelerator.device.type == "cuda" and accelerator.distributed_type.value in ("NO", "MULTI_GPU")
    optimizer = torch.optim.AdamW(_parameter_groups(model, cfg.weight_decay), lr=cfg.lr, fused=fused)
    scheduler = _scheduler(optimizer, cfg.scheduler, warmup_steps, total_steps)
    model, optimizer = accelerator.prepare(model, optimizer)
    accelerator.register_for_checkpointing(scheduler)

    checkpoint_dir = output_dir / "checkpoints" / "last"
    start_step = 0
    if cfg.resume and (checkpoint_dir / "trainer_state.json").exists():
        accelerator.load_state(str(checkpoint_dir))
        start_step = json.loads((checkpoint_dir / "trainer_state.json").read_text())["step"]
        log.info("prm: resuming at optimizer step %d of %d", start_step, total_steps)

    # Every process walks the same seeded stream of micro-batches and keeps its own share.
    stream = iter_training_batches(train_set.lengths, cfg.micro_batch_size, total_steps * accumulation * world, cfg.seed,
                                   cfg.group_by_length)
    rank = accelerator.process_index
    is_main = accelerator.is_main_process
    if is_main:
        output_dir.mkdir(parents=True, exist_ok=True)
        log.info("prm: %d records -> %d sequences (%d labels dropped beyond max_length=%d); %d steps of %d micro-batches x %d processes",
                 train_set.n_records, len(train_set), int(train_set.dropped_labels), cfg.max_length, total_steps, accumulation, world)
    metrics_path = output_dir / "metrics.jsonl"
    if is_main:
        _trim_metrics(metrics_path, start_step)
    writer = _tensorboard_writer(output_dir / "tensorboard") if is_main else None
    bar = tqdm(total=total_steps, initial=start_step, desc="prm", disable=not (progress and is_main))

    step, window_loss, window_batches, window_examples, window_tokens = start_step, torch.zeros(()), 0, 0.0, 0.0
    micro_batches, train_tokens = 0, 0
    window_start = time.monotonic()
    train_start = time.monotonic()
    last_loss = float("nan")
    for micro_index, indices in enumerate(stream):
        if micro_index % world != rank:
            continue
        if micro_index < start_step * accumulation * world:
            continue
        batch = collator([train_set[i] for i in indices])
        # counted on the host before the copy: no device sync per micro-batch
        window_examples += batch["label_mask"].sum().item()
        tokens = batch["attention_mask"].sum().item()
        window_tokens += tokens
        train_tokens += tokens
        batch = {k: v.to(accelerator.device, non_blocking=True) for k, v in batch.items()}
        with accelerator.accumulate(model):
            logits = model(batch["input_ids"], batch["attention_mask"], batch["score_positions"])
            loss = prm_bce_loss(logits.float(), batch["labels"], batch["label_mask"])
            accelerator.backward(loss)
            if accelerator.sync_gradients and cfg.max_grad_norm > 0:
                accelerator.clip_grad_norm_(model.parameters(), cfg.max_grad_norm)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
        micro_batches += 1
        window_loss = window_loss + loss.detach().float()  # stays on the device: read once per logged step
        window_batches += 1
        if not accelerator.sync_gradients:
            continue
        scheduler.step()
        step += 1
        bar.update(1)
        if step % max(cfg.log_every, 1) == 0 or step == total_steps:
            stats = torch.stack([window_loss.to(accelerator.device),
                                 *torch.tensor([window_batches, window_examples, window_tokens], device=accelerator.device)])
            stats = accelerator.reduce(stats, reduction="sum")
            elapsed = max(time.monotonic() - window_start, 1e-9)
            last_loss = (stats[0] / stats[1].clamp_min(1)).item()
            record = {"step": step, "loss": last_loss, "lr": scheduler.get_last_lr()[0],
                      "examples_per_s": stats[2].item() / elapsed, "tokens_per_s": stats[3].item() / elapsed,
                      "epoch": step * accumulation * world / micro_per_epoch}
            if is_main:
                with metrics_path.open("a", encoding="utf-8") as handle:
                    handle.write(json.dumps(record) + "\n")
                if writer is not None:
                    for key in ("loss", "lr", "examples_per_s"):
                        writer.add_scalar(f"prm/{key}", record[key], step)
                bar.set_postfix(loss=f"{last_loss:.4f}")
            window_loss, window_batches, window_examples, window_tokens, window_start = torch.zeros(()), 0, 0.0, 0.0, time.monotonic()
        if cfg.save_every > 0 and step % cfg.save_every == 0 and step < total_steps:
            accelerator.save_state(str(checkpoint_dir))
            if is_main:
                (checkpoint_dir / "trainer_state.json").write_text(json.dumps({"step": step}))
        if step >= total_steps:
            break
    bar.close()
    train_seconds = time.monotonic() - train_start

    accelerator.wait_for_everyone()
    unwrapped: ProcessRewardModel = accelerator.unwrap_model(model)
    state_dict = accelerator.get_state_dict(model)
    save_dtype = _save_dtype(config.model)
    if is_main:
        unwrapped.save_pretrained(output_dir / "model", tokenizer=tokenizer, state_dict=state_dict, dtype=save_dtype)
        # The resumable state only serves an interrupted run (for a 7B model it is ~12 bytes a
        # parameter); once model/ is written it goes, and a rerun trains afresh.
        shutil.rmtree(checkpoint_dir, ignore_errors=True)
    metrics = {
        "steps": step,
        "resumed_from": start_step,
        "micro_batches": micro_batches,
        "train_loss": last_loss,
        "train_seconds": train_seconds,
        "train_tokens": train_tokens,  # non-padding tokens this process read
        "n_train_records": train_set.n_records,
        "n_train_sequences": len(train_set),
        "n_train_labels": train_set.n_labels,
        "dropped_labels": train_set.dropped_labels,
        "accumulation": accumulation,
        "processes": world,
        "effective_batch_size": accumulation * world * cfg.micro_batch_size,
    }
    if val_set is not None and len(val_set):
        # Every process runs the same batches: a sharded (FSDP/DeepSpeed) model needs them all.
        metrics["val_bce"] = evaluate_loss(model, val_set, collator, cfg.micro_batch_size, accelerator.device)
        metrics["n_val_records"] = val_set.n_records
    if writer is not None:
        writer.close()
    accelerator.wait_for_everyone()
    accelerator.end_training()
    return metrics


def _trim_metrics(path: Path, keep_through_step: int) -> None:
    """A fresh run starts an empty metrics.jsonl; a resumed one keeps the lines up to its checkpoint."""
    if not path.exists():
        return
    if keep_through_step <= 0:
        path.unlink()
        return
    kept = [line for line in path.read_text(encoding="utf-8").splitlines() if line.strip() and json.loads(line)["step"] <= keep_through_step]
    path.write_text("".join(line + "\n" for line in kept), encoding="utf-8")


def _save_dtype(model_config) -> torch.dtype:
    from pipeline.modeling import resolve_device, resolve_dtype

    return resolve_dtype(model_config.dtype, resolve_device(model_config.device))
