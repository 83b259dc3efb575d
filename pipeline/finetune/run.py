"""Policy fine-tuning with a step-level objective: the library behind `make gfn` and `make ppo`.

Loads the policy (hub id or path, full fine-tuning or LoRA through peft), the trained PRM as
the reward scorer, the training problems with their prompts, builds the objective and runs the
shared StepPolicyTrainer. The final model is saved with save_pretrained (LoRA merged), so the
evaluation stage loads it like any other model.
"""

from __future__ import annotations

import copy
import json
import shutil
from pathlib import Path
from typing import Sequence

import torch

from pipeline.config import Config
from pipeline.finetune.gflownet import GFlowNetObjective
from pipeline.grading import extract_answer, grade_many
from pipeline.modeling import load_causal_lm, load_tokenizer, upcast_trainable
from pipeline.finetune.policy import LMPolicy
from pipeline.finetune.ppo import PPOObjective
from pipeline.prompts import prompt_from_config
from pipeline.finetune.trainer import StepPolicyTrainer, TrainProblem


def _lora(model, cfg):
    from peft import LoraConfig, get_peft_model

    lora = LoraConfig(r=cfg.lora_r, lora_alpha=cfg.lora_alpha, lora_dropout=cfg.lora_dropout,
                      target_modules=list(cfg.lora_target_modules), task_type="CAUSAL_LM")
    return get_peft_model(model, lora)


def _save_policy(model, tokenizer, path: Path, dtype: torch.dtype | None = None) -> None:
    """save_pretrained with LoRA merged; ``dtype``: floating weights cast to it on the way out
    (float32 master weights saved in the configured half dtype)."""
    path.mkdir(parents=True, exist_ok=True)
    to_save = model
    if hasattr(model, "merge_and_unload"):
        to_save = copy.deepcopy(model).merge_and_unload()
    state_dict = None
    if dtype is not None:
        state_dict = {k: v.to(dtype) if v.is_floating_point() else v for k, v in to_save.state_dict().items()}
    to_save.save_pretrained(path, state_dict=state_dict)
    tokenizer.save_pretrained(path)


def plot_training_curves(metrics_path: Path, out_png: Path, title: str) -> None:
    """The paper's three training curves (Fig. 4): loss, average reward, proportionality gap."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [json.loads(line) for line in metrics_path.read_text().splitlines() if line.strip()]
    names = [n for n in ("loss", "avg_reward", "proportionality_gap") if any(n in r for r in rows)]
    fig, axes = plt.subplots(1, len(names), figsize=(4 * len(names), 3.2))
    for ax, name in zip(axes if len(names) > 1 else [axes], names):
        ax.plot([r["step"] for r in rows if name in r], [r[name] for r in rows if name in r])
        ax.set_xlabel("training step")
        ax.set_title(name.replace("_", " "))
        ax.grid(alpha=0.3)
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(out_png, dpi=120)
    plt.close(fig)


def train_policy(config: Config, stage: str, problems: Sequence, out_dir: Path, progress: bool = True) -> list[dict]:
    """Fine-tune config.model.policy with the objective of ``stage`` ("gfn" or "ppo")."""
    from prm.scorer import PRMScorer
    from pipeline.problems import answer_kind

    cfg = config.gfn if stage == "gfn" else config.ppo
    torch.manual_seed(cfg.seed)
    out_dir = Path(out_dir)
    policy_path = config.resolve(config.model.policy)
    checkpoint_model = out_dir / "checkpoint" / "model"
    tokenizer = load_tokenizer(policy_path, config.model.trust_remote_code)
    model = load_causal_lm(str(checkpoint_model) if checkpoint_model.exists() else policy_path, config.model,
                           adapter=config.resolve(config.model.policy_adapter), is_trainable=True)
    needs_reference = (stage == "gfn" and (cfg.kl_coef > 0 or cfg.reference_prior_coef > 0)) or (stage == "ppo" and cfg.kl_coef > 0)
    reference = None
    if needs_reference:
        frozen = load_causal_lm(policy_path, config.model)
        frozen.requires_grad_(False)
        reference = LMPolicy(frozen, tokenizer, config.format.separator, config.generation.max_new_tokens, config.generation.batch_size)
    if cfg.lora and not hasattr(model, "peft_config"):
        model = _lora(model, cfg)  # peft keeps the adapters in float32 over a half-precision base
    # Full fine-tuning of a bf16/fp16 model: float32 master weights, the forward autocast to the
    # half dtype (and the saved model cast back to it).
    half_dtype = upcast_trainable(model)
    model.train()
    policy = LMPolicy(model, tokenizer, config.format.separator, config.generation.max_new_tokens, config.generation.batch_size,
                      autocast_dtype=half_dtype)
    scorer = PRMScorer.from_pretrained(config.resolve(config.model.prm), config)
    kinds = {answer_kind(p.source) for p in problems}
    if len(kinds) != 1:
        raise ValueError(f"training problems mix answer kinds {sorted(kinds)}")
    kind = kinds.pop()
    train_problems = [
        TrainProblem(p.problem_id, p.question, prompt_from_config(p.question, kind, tokenizer, config.format, p.meta.get("options")), p.answer)
        for p in problems
    ]
    if stage == "gfn":
        objective = GFlowNetObjective(cfg, reference=reference)
    else:
        objective = PPOObjective(cfg, hidden_size=model.config.get_text_config().hidden_size, reference=reference)
    trainer = StepPolicyTrainer(
        policy, scorer, train_problems, objective, cfg, config.gfn, kind, out_dir,
        extract_answer=extract_answer, grade_many=grade_many,
        save_model=lambda path: _save_policy(model, tokenizer, path), progress=progress,
    )
    history = trainer.train()
    _save_policy(model, tokenizer, out_dir / "model", dtype=half_dtype)
    # The checkpoint only serves an interrupted run; left behind, a later `make gfn` in the same
    # run folder would resume from it (a policy trained against an older PRM) instead of training afresh.
    shutil.rmtree(trainer.checkpoint_dir, ignore_errors=True)
    if stage == "ppo":
        from safetensors.torch import save_file

        save_file({k: v.contiguous() for k, v in objective.value_head.state_dict().items()}, str(out_dir / "model" / "value_head.safetensors"))
    plot_training_curves(out_dir / "metrics.jsonl", out_dir / "training_curves.png", f"{stage} training")
    return history
