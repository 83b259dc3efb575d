"""The KL coefficient's schedule and the reference the trainer scores itself (and resets every rho steps)."""

from __future__ import annotations

import copy
import dataclasses
import sys
from pathlib import Path

import pytest
import torch

from pipeline.config.schema import GFNConfig, ModelConfig
from pipeline.finetune.gflownet import kl_coef_at
from pipeline.finetune.objectives import build_objective
from pipeline.finetune.run import optimizer_settings
from pipeline.finetune.sampling import TrainProblem, TrajectorySampler
from pipeline.finetune.trainer import FinetuneTrainer
from pipeline.training import TrainingBase, make_accelerator

sys.path.insert(0, str(Path(__file__).resolve().parent))
from test_gflownet import KnownScorer, TabularPolicy  # noqa: E402


def test_kl_coef_is_constant_or_a_linear_anneal():
    for step in range(0, 30, 3):
        assert kl_coef_at(step, 0.012, None, 10) == 0.012
        expected = 0.012 + (0.004 - 0.012) * min(step, 10) / 10  # written the obvious way
        assert kl_coef_at(step, 0.012, 0.004, 10) == pytest.approx(expected, rel=1e-12, abs=1e-15)
    assert kl_coef_at(0, 0.5, 0.1, 0) == 0.1  # no anneal steps: the final value at once


def trainer_with_reference(tmp_path, **overrides):
    cfg = GFNConfig(
        **{
            **dict(
                loss="tb_vargrad",
                lr=0.1,
                scheduler="constant",
                warmup_steps=0,
                num_train_steps=5,
                questions_per_step=2,
                samples_per_question=4,
                micro_batch_size=64,
                temperature=1.0,
                save_every=0,
                replay_fraction=0.0,
                kl_coef=0.5,
            ),
            **overrides,
        }
    )
    torch.manual_seed(0)
    policy, reference = TabularPolicy(), TabularPolicy()
    objective = build_objective(cfg, policy, hidden_size=8, reference=reference)
    base = TrainingBase(
        make_accelerator(ModelConfig(device="cpu", dtype="float32")),
        policy,
        optimizer_settings(cfg, 1),
        tmp_path,
        objective=objective,
        objective_lr=objective.lr,
        progress=False,
    )
    sampler = TrajectorySampler(
        policy,
        KnownScorer(),
        [TrainProblem(f"p{i}", "q", "q", "1") for i in range(4)],
        "tiny",
        cfg,
        extract=lambda step, kind: step,
        grade=lambda texts, golds, kind: [True] * len(texts),
    )
    return FinetuneTrainer(base, sampler, objective, cfg, progress=False), policy, reference


def test_the_reference_is_reset_to_the_policy_every_rho_steps(tmp_path):
    trainer, policy, reference = trainer_with_reference(tmp_path, reference_reset_every=2, num_train_steps=5)
    start = reference.logits.detach().clone()
    snapshots, records = {}, []
    for _ in range(5):
        records.append(trainer.train_step())
        snapshots[trainer.step] = policy.logits.detach().clone()
        expected = snapshots[trainer.step // 2 * 2] if trainer.step >= 2 else start
        torch.testing.assert_close(reference.logits.detach(), expected, rtol=0, atol=0)
    assert [r["reference_version"] for r in records] == [0, 2, 2, 4, 4]  # the reference after each step
    assert not torch.equal(snapshots[4], start)


def test_the_trainer_scores_the_reference_itself_not_what_the_trajectories_carry(tmp_path):
    trainer, policy, reference = trainer_with_reference(tmp_path)
    batch, _ = trainer.sampler.sample(0)
    with torch.no_grad():
        reference.logits.add_(torch.randn_like(reference.logits))  # a reference the trajectories knew nothing of
    carried = [
        dataclasses.replace(t, reference_step_logprobs=[-1.0] * len(t.steps), reference_stop_logprob=-1.0)
        for t in batch
    ]
    objective = trainer.objective
    objective.begin_update(0)
    with torch.no_grad():
        from_reference, _ = objective.trajectory_losses(batch)
        from_carried, _ = objective.trajectory_losses(carried)
        objective_without = copy.copy(objective)
        object.__setattr__(objective_without, "reference", None)
        stored, _ = objective_without.trajectory_losses(carried)
    torch.testing.assert_close(from_reference, from_carried)  # whatever the trajectories carry
    assert not torch.allclose(from_reference, stored)  # and the carried values would give another loss


def test_beta_follows_the_schedule_in_the_update(tmp_path):
    trainer, _, _ = trainer_with_reference(tmp_path, kl_coef=0.5, kl_coef_final=0.1, kl_anneal_steps=4)
    betas = [trainer.train_step()["kl_coef"] for _ in range(5)]
    assert betas == pytest.approx([0.5, 0.4, 0.3, 0.2, 0.1])
