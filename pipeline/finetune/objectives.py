"""The objective contract of policy fine-tuning (``Objective``), and the registry from a config's
name to the class that fulfils it.

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

from typing import Any, Protocol, runtime_checkable

import torch

from pipeline.config import GFNConfig, PPOConfig
from pipeline.finetune.gflownet import LOSSES, GFlowNetObjective
from pipeline.finetune.ppo import PPOObjective
from pipeline.finetune.rewards import StateLogRewards, StepRewards
from pipeline.records import Trajectory
from pipeline.training.distributed import Collective


@runtime_checkable
class Objective(Protocol):
    """What the fine-tuning loop (pipeline.finetune.trainer, and the asynchronous trainer for an
    off-policy objective) asks of an objective; every class of ``OBJECTIVES`` satisfies it
    (tests/test_objectives.py checks members and signatures). An objective is also a
    torch.nn.Module: its parameters and state_dict are trained and checkpointed with the model.

    name:                str, the config's name for it ("subtb", "tb", "tb_vargrad", "ppo"; logs)
    off_policy:          bool, True when it may train on trajectories of an older policy (replay,
                         asynchronous searchers); the asynchronous mode refuses an on-policy one
    updates_per_rollout: int >= 1, optimizer steps on one rollout's micro-batches (PPO's epochs)
    lr:                  float, the learning rate of its own parameters (log Z, a value head)

    rollout(fresh, everyone) -> micro_batches
        fresh:    this process's B new Trajectory records; everyone: every process's, in rank order
        returns:  [micro, ...], each a tuple ending in its weight (float; world size / global
                  batch size per trajectory, 0 for a filler) that ``loss`` takes as it is
    loss(micro) -> (loss, metrics)
        loss:     () tensor with gradients, already multiplied by the micro-batch's weight, so the
                  micro-batches' gradients add up to the batch mean
        metrics:  {name: float}, weighted the same way (the loop sums them over micro-batches)
    filler(micro_batches) -> micro
        a micro-batch of weight 0: a process with fewer micro-batches runs it so that every
        process runs as many forwards as the busiest one (FSDP / ZeRO collectives)
    summary() -> {name: float | int}
        metrics of the update just made (after every ``loss`` of it)
    begin_update(step) -> None
        called before the update made at trainer step ``step`` (0-based): a schedule (beta)
    reset_reference(weights, step) -> None
        the reference policy becomes the plain ``weights`` of training step ``step`` (called
        every reference_reset_every steps when the config section has that field)

    An off-policy objective also builds micro-batches of any batch, ``plan(batch, weight)``: the
    asynchronous trainer trains on batches drawn from its searchers' buffer.
    """

    name: str
    off_policy: bool
    updates_per_rollout: int
    lr: float

    def rollout(self, fresh: list[Trajectory], everyone: list[list[Trajectory]]) -> list[tuple]: ...

    def loss(self, micro: tuple) -> tuple[torch.Tensor, dict]: ...

    def filler(self, micro_batches: list) -> tuple: ...

    def summary(self) -> dict: ...

    def begin_update(self, step: int) -> None: ...

    def reset_reference(self, weights: dict, step: int) -> None: ...


# config name -> objective class; GFNConfig.loss names the GFlowNet objectives, PPOConfig is "ppo"
OBJECTIVES: dict[str, type[Objective]] = {**{name: GFlowNetObjective for name in LOSSES}, "ppo": PPOObjective}


def objective_name(cfg: GFNConfig | PPOConfig) -> str:
    return "ppo" if isinstance(cfg, PPOConfig) else cfg.loss


def needs_reference(cfg: GFNConfig | PPOConfig) -> bool:
    """Whether the objective uses a frozen reference policy (the appendix-F prior, a KL term)."""
    if isinstance(cfg, PPOConfig):
        return cfg.kl_coef > 0
    return cfg.kl_coef > 0 or cfg.reference_prior_coef > 0


def build_objective(cfg: GFNConfig | PPOConfig, policy: Any, hidden_size: int, collective: Collective | None = None,
                    reference: Any = None) -> Objective:
    """The objective named by ``cfg`` with the reward shaping of that same section.

    hidden_size: the policy's last hidden size (PPO's value head reads the step-boundary states)
    collective:  the run's processes (default: this one alone)
    reference:   the GFlowNet's reference policy, scored at training time (PPO reads the
                 reference log-probs its sampler stored in the trajectories)
    """
    if objective_name(cfg) == "ppo":
        return PPOObjective(cfg, policy, StepRewards(cfg.step_reward, cfg.unfinished_reward), hidden_size, collective)
    reward = StateLogRewards(reward_temperature=cfg.reward_temperature, unfinished_log_reward=cfg.unfinished_log_reward,
                             outcome_coef=cfg.outcome_coef, outcome_floor=cfg.outcome_floor,
                             reference_prior_coef=cfg.reference_prior_coef)
    return GFlowNetObjective(cfg, policy, reward, collective, reference=reference)
