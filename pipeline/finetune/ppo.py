"""The PPO baseline objective (paper 5, appendix D) on the shared fine-tuning loop.

The policy builds a solution one step at a time; each new step is rewarded with its PRM step
score U(s_k|s_{k-1}) (the paper evaluates only the newly proposed step), or with log U under
``ppo.step_reward=log_score`` (pipeline.finetune.rewards.StepRewards). One action = one whole
step; the stop action is folded into the last step (its log-prob includes the end token), so
PPO also learns when to stop. With ``ppo.kl_coef`` each step's reward pays kl_coef times the
log-ratio of the sampling policy to the frozen reference. Values come from a linear head on the
policy's last hidden state at each step boundary; advantages from GAE over steps, normalised
over the whole batch. On-policy: ``rollout`` records the sampling policy's log-probs and values
before any update, and ``ppo.ppo_epochs`` optimizer steps follow on the same batch.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch

from pipeline.config.schema import PPOConfig
from pipeline.finetune.gflownet import micro_batches
from pipeline.finetune.losses import gae, ppo_loss
from pipeline.finetune.rewards import StepRewards, pad_rows
from pipeline.records import Trajectory
from pipeline.training.distributed import Collective


def step_action_logprobs(lp) -> torch.Tensor:
    """(B, T) log-prob of each step action; the last step's includes the stop action."""
    lengths = lp.mask.sum(1)
    stop = torch.zeros_like(lp.step_logprobs)
    rows = torch.arange(stop.shape[0], device=stop.device)
    stop[rows, lengths - 1] = lp.termination_logprobs[rows, lengths]
    return lp.step_logprobs + stop


def reference_action_logprobs(trajectories: list[Trajectory], width: int) -> torch.Tensor:
    """(B, T) the frozen reference's step-action log-probs, stored with each trajectory."""
    if any(t.reference_step_logprobs is None for t in trajectories):
        raise ValueError("ppo.kl_coef > 0: the trajectories carry no reference log-probs")
    rows = [
        list(t.reference_step_logprobs[:-1]) + [t.reference_step_logprobs[-1] + t.reference_stop_logprob]
        for t in trajectories
    ]
    return pad_rows(rows, width)


class PPOObjective(torch.nn.Module):
    """Clipped PPO with a value head (ppo config section).

    policy: the step-level policy being trained (``logprobs`` with entropy and boundary states)
    reward: StepRewards, the ppo section's reward shaping
    hidden_size: the policy's last hidden size (the value head's input)
    collective: the run's processes; advantages are normalised over all of them
    """

    name = "ppo"
    off_policy = False

    def __init__(
        self, cfg: PPOConfig, policy, reward: StepRewards, hidden_size: int, collective: Collective | None = None
    ):
        super().__init__()
        self.collective = collective or Collective()
        self.cfg, self.reward = cfg, reward
        # used, not owned: the policy's parameters are the trained model's, not the objective's
        object.__setattr__(self, "policy", policy)
        self.value_head = torch.nn.Linear(hidden_size, 1)
        torch.nn.init.zeros_(self.value_head.weight)
        torch.nn.init.zeros_(self.value_head.bias)
        self.updates_per_rollout = cfg.ppo_epochs
        self.lr = cfg.lr

    @classmethod
    def from_config(
        cls, cfg: PPOConfig, policy, hidden_size: int, collective: Collective | None = None, reference=None
    ) -> PPOObjective:
        """The objective with the ppo section's reward shaping (reference: unused, PPO reads the
        reference log-probs its sampler stored in the trajectories)."""
        return cls(cfg, policy, StepRewards(cfg.step_reward, cfg.unfinished_reward), hidden_size, collective)

    def begin_update(self, step: int) -> None:
        """Nothing of PPO's depends on the training step."""

    def reset_reference(self, weights: Iterable[tuple[str, torch.Tensor]], step: int) -> None:
        """PPO's reference stays frozen: its log-probs come with the trajectories (the sampler's),
        and the ppo section has no reference_reset_every."""

    def values(self, lp) -> torch.Tensor:
        hidden = lp.boundary_hidden
        head = self.value_head  # stays float32 (its optimizer state too) under a bf16 policy
        return head(hidden.to(device=head.weight.device, dtype=head.weight.dtype)).squeeze(-1).float()

    def rollout(self, fresh: list[Trajectory], everyone: list[list[Trajectory]]) -> list[tuple]:
        """Micro-batches of (trajectories, old step log-probs, old values, normalised advantages,
        returns, weight), all computed under the policy that sampled, before any update.

        Advantages are normalised over every process's batch; weight = world size / global batch
        size per trajectory (0 for the filler of a process left with nothing to train on).
        """
        total = sum(len(part) for part in everyone)
        weight = self.collective.world / total
        if not fresh:
            fresh, weight = [t for part in everyone for t in part][:1], 0.0
        old = []
        for chunk in micro_batches(fresh, self.cfg.micro_batch_size):
            with torch.no_grad():
                lp = self.policy.logprobs(
                    [t.prompt for t in chunk], [t.steps for t in chunk], with_grad=False, return_hidden=True
                )
                values = self.values(lp)
                old_logp = step_action_logprobs(lp).float()
                width = lp.mask.shape[1]
                rewards = self.reward(chunk, width).to(old_logp.device)
                if self.cfg.kl_coef > 0:
                    reference = reference_action_logprobs(chunk, width).to(old_logp.device)
                    rewards = rewards - self.cfg.kl_coef * (old_logp - reference) * lp.mask
                terminated = torch.tensor([t.finished for t in chunk], device=old_logp.device)
                advantages, returns = gae(
                    rewards, values, lp.mask, gamma=self.cfg.gamma, lam=self.cfg.gae_lambda, terminated=terminated
                )
            old.append([chunk, old_logp, values[:, :-1], advantages, returns, lp.mask])
        if self.collective.lockstep:  # the same number of forwards on every process (FSDP, ZeRO collectives)
            for _ in range(self.collective.max(len(old)) - len(old)):
                with torch.no_grad():
                    self.policy.logprobs([t.prompt for t in old[-1][0]], [t.steps for t in old[-1][0]], with_grad=False)
        # Normalise advantages over the whole batch of every process (standard PPO practice).
        local = (
            torch.cat([advantages[mask].double().cpu() for *_, advantages, _, mask in old])
            if weight
            else torch.zeros(0, dtype=torch.float64)
        )
        count, total_sum, total_square = self.collective.sum(
            torch.stack([torch.tensor(float(local.numel()), dtype=torch.float64), local.sum(), local.square().sum()])
        ).tolist()
        mean = total_sum / count
        std = max(((total_square - count * mean * mean) / (count - 1)) ** 0.5, 1e-6) if count > 1 else 1.0
        for item in old:
            item[3] = (item[3] - mean) / std
        return [
            (chunk, old_logp, old_values, advantages, returns, weight * len(chunk))
            for chunk, old_logp, old_values, advantages, returns, _ in old
        ]

    def filler(self, micro_batches: list) -> tuple:
        """A micro-batch of weight 0 (processes must run as many as the busiest one under FSDP)."""
        return (*micro_batches[-1][:5], 0.0)

    def loss(self, micro: tuple) -> tuple[torch.Tensor, dict]:
        chunk, old_logp, old_values, advantages, returns, weight = micro
        lp = self.policy.logprobs(
            [t.prompt for t in chunk], [t.steps for t in chunk], with_grad=True, return_entropy=True, return_hidden=True
        )
        new_logp = step_action_logprobs(lp).float()
        new_values = self.values(lp)[:, :-1]
        loss, stats = ppo_loss(
            new_logp,
            old_logp,
            advantages,
            returns,
            new_values,
            old_values,
            lp.step_entropy.float(),
            lp.mask,
            clip=self.cfg.clip,
            value_coef=self.cfg.value_coef,
            entropy_coef=self.cfg.entropy_coef,
        )
        metrics = {name: float(value) * weight for name, value in stats.items()}
        metrics["loss"] = float(loss.detach()) * weight
        return loss * weight, metrics

    def summary(self) -> dict:
        return {}
