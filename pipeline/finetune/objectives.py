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

import math
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

import torch

from pipeline.config.loader import check_choice
from pipeline.config.schema import GFlowNetLoss, GFNConfig, PPOConfig
from pipeline.finetune.gflownet import SubTBObjective, TBObjective, TBVarGradObjective
from pipeline.finetune.ppo import PPOObjective
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
        the reference policy becomes the plain ``weights`` of training step ``step`` (a stream of
        (name, tensor), gathered as it is read; called every ``reference_reset_every(cfg)`` steps:
        gfn.reference_reset_every, never for PPO)

    An off-policy objective also builds micro-batches of any batch, ``plan(batch, weight)``: the
    asynchronous trainer trains on batches drawn from its searchers' buffer. Every class of
    ``OBJECTIVES`` builds itself from its section, with that section's reward shaping:
    ``cls.from_config(cfg, policy, hidden_size, collective, reference)`` (``build_objective``).
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

    def reset_reference(self, weights: Iterable[tuple[str, torch.Tensor]], step: int) -> None: ...


# config name -> objective class; GFNConfig.loss names the GFlowNet objectives, PPOConfig is "ppo"
OBJECTIVES: dict[str, type[Objective]] = {
    cls.name: cls for cls in (SubTBObjective, TBObjective, TBVarGradObjective, PPOObjective)
}


def objective_name(cfg: GFNConfig | PPOConfig) -> str:
    """The registry name of the section's objective (gfn.loss, checked: a config may be built in
    code, not by the loader; or "ppo")."""
    return "ppo" if isinstance(cfg, PPOConfig) else check_choice(cfg.loss, GFlowNetLoss, "gfn.loss")


def needs_reference(cfg: GFNConfig | PPOConfig) -> bool:
    """Whether the objective uses a frozen reference policy (the appendix-F prior, a KL term)."""
    if isinstance(cfg, PPOConfig):
        return cfg.kl_coef > 0
    return cfg.kl_coef > 0 or cfg.reference_prior_coef > 0


def reference_reset_every(cfg: GFNConfig | PPOConfig) -> int:
    """Training steps between resets of the reference to the current policy (gfn.reference_reset_every,
    TBA eq. 5-7); 0: never (PPO's reference stays the starting policy)."""
    return cfg.reference_reset_every if isinstance(cfg, GFNConfig) else 0


def needs_sampling_logprob(cfg: GFNConfig | PPOConfig) -> bool:
    """Whether the objective weighs a trajectory by its probability under the weights that sampled
    it (gfn.importance_correction), which the sampler then records with it."""
    return isinstance(cfg, GFNConfig) and cfg.importance_correction


def build_objective(
    cfg: GFNConfig | PPOConfig,
    policy: Any,
    hidden_size: int,
    collective: Collective | None = None,
    reference: Any = None,
) -> Objective:
    """The objective named by ``cfg`` with the reward shaping of that same section.

    hidden_size: the policy's last hidden size (PPO's value head reads the step-boundary states)
    collective:  the run's processes (default: this one alone)
    reference:   the GFlowNet's reference policy, scored at training time (PPO reads the
                 reference log-probs its sampler stored in the trajectories)
    """
    return OBJECTIVES[objective_name(cfg)].from_config(cfg, policy, hidden_size, collective, reference)


@dataclass(frozen=True)
class RegularizedTarget:
    """The distribution an objective's optimum samples whole trajectories from, with the
    reference policy fixed:

        pi*(tau) proportional to pi_ref(tau)^prior * exp(G(tau) / temperature)

    reward:      what the return G sums per step: "log_score" (log U, so G = log R) or "score" (U)
    temperature: > 0; 0 for pure reward maximisation (no regulariser: pi* puts all its mass on
                 the best trajectories)
    prior:       the exponent of the reference policy
    unfinished:  added to G when the last step states no final answer
    outcome:     added to G when the answer is wrong (the gfn section's outcome_coef * log outcome_floor)

    Two sections with equal targets train toward the same distribution: the comparison of a
    GFlowNet with PPO on equal terms (configs/tiny.yaml; docs/gflownet.md).
    """

    reward: str
    temperature: float
    prior: float
    unfinished: float
    outcome: float = 0.0

    def describe(self) -> str:
        if self.temperature == 0:
            return f"target: the trajectories maximising G = sum of step {self.reward} (no regulariser)"
        return (
            f"target: pi_ref^{self.prior:g} x exp(G / {self.temperature:g}), G = sum of step {self.reward}"
            f" + {self.unfinished:g} if unanswered" + (f" + {self.outcome:g} if wrong" if self.outcome else "")
        )


def regularized_target(cfg: GFNConfig | PPOConfig) -> RegularizedTarget:
    """The target of the section's objective (``RegularizedTarget``).

    GFlowNet: log R = (G / reward_temperature) + reference_prior_coef * log pi_ref, sampled in
    proportion (subtb, tb); TB-VarGrad with kl_coef = beta > 0 samples in proportion to
    pi_ref x R^(1/beta) (losses.tb_vargrad_loss), so temperature reward_temperature x beta and
    prior reference_prior_coef / beta + 1 (beta: kl_coef_final when annealed, the value training ends with).
    PPO maximises E[G] - kl_coef KL(pi || pi_ref) + entropy_coef H(pi), whose optimum is
    pi_ref^(kl / (kl + ent)) x exp(G / (kl + ent)): with step_reward=log_score, kl_coef = T and
    entropy_coef = 0 it is the GFlowNet's pi_ref x R^(1/T) with reference_prior_coef 1.
    """
    if isinstance(cfg, PPOConfig):
        temperature = cfg.kl_coef + cfg.entropy_coef
        prior = cfg.kl_coef / temperature if temperature else 0.0
        return RegularizedTarget(cfg.step_reward, temperature, prior, cfg.unfinished_reward)
    temperature, prior = cfg.reward_temperature, cfg.reference_prior_coef
    beta = cfg.kl_coef_final if cfg.kl_coef_final is not None and cfg.kl_anneal_steps else cfg.kl_coef
    if OBJECTIVES[objective_name(cfg)].kl_in_target and beta > 0:
        temperature, prior = temperature * beta, prior / beta + 1.0
    outcome = cfg.outcome_coef * math.log(cfg.outcome_floor) if cfg.outcome_coef else 0.0
    return RegularizedTarget("log_score", temperature, prior, cfg.unfinished_log_reward, outcome)
