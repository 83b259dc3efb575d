"""The objective interface of policy fine-tuning, and the registry from a config's name to it.

An objective is a torch module that owns its parameters (TB's log Z, PPO's value head) and turns
trajectories into losses; the loop (pipeline.finetune.trainer) calls backward and the optimizer:

    micro_batches = objective.rollout(fresh, everyone) # what one training step trains on (everyone:
                                                       # every process's fresh trajectories)
    for _ in range(objective.updates_per_rollout):     # PPO: several optimizer steps per rollout
        for micro in micro_batches:
            loss, metrics = objective.loss(micro)      # loss already weighted by the micro-batch's share
            loss.backward()
        optimizer step                                 # (objective.begin_update(step) first: a schedule)
    objective.summary()                                # metrics of the whole update

It holds the step-level policy it trains (for teacher-forced log-probs) and the reward shaping
callable of its own config section; it never reaches back into the loop.
"""

from __future__ import annotations

from typing import Any

import torch

from pipeline.config import GFNConfig, PPOConfig
from pipeline.finetune.gflownet import LOSSES, GFlowNetObjective
from pipeline.finetune.ppo import PPOObjective
from pipeline.finetune.rewards import StateLogRewards, StepRewards
from pipeline.training.distributed import Collective

# config name -> objective class; GFNConfig.loss names the GFlowNet objectives, PPOConfig is "ppo"
OBJECTIVES: dict[str, type[torch.nn.Module]] = {**{name: GFlowNetObjective for name in LOSSES}, "ppo": PPOObjective}


def objective_name(cfg: GFNConfig | PPOConfig) -> str:
    return "ppo" if isinstance(cfg, PPOConfig) else cfg.loss


def needs_reference(cfg: GFNConfig | PPOConfig) -> bool:
    """Whether the objective uses a frozen reference policy (the appendix-F prior, a KL term)."""
    if isinstance(cfg, PPOConfig):
        return cfg.kl_coef > 0
    return cfg.kl_coef > 0 or cfg.reference_prior_coef > 0


def build_objective(cfg: GFNConfig | PPOConfig, policy: Any, hidden_size: int, collective: Collective | None = None,
                    reference: Any = None) -> torch.nn.Module:
    """The objective named by ``cfg`` with the reward shaping of that same section.

    hidden_size: the policy's last hidden size (PPO's value head reads the step-boundary states)
    collective:  the run's processes (default: this one alone)
    reference:   the GFlowNet's reference policy, scored at training time (PPO reads the
                 reference log-probs its sampler stored in the trajectories)
    """
    name = objective_name(cfg)
    if name not in OBJECTIVES:
        raise ValueError(f"gfn.loss must be one of {', '.join(LOSSES)}, got {name!r}")
    if name == "ppo":
        return PPOObjective(cfg, policy, StepRewards(cfg.step_reward, cfg.unfinished_reward), hidden_size, collective)
    reward = StateLogRewards(reward_temperature=cfg.reward_temperature, unfinished_log_reward=cfg.unfinished_log_reward,
                             outcome_coef=cfg.outcome_coef, outcome_floor=cfg.outcome_floor,
                             reference_prior_coef=cfg.reference_prior_coef)
    return GFlowNetObjective(cfg, policy, reward, collective, reference=reference)
