"""The step-level GFlowNet objectives, one class per loss (gfn.loss): SubTB(lambda), TB and
TB-VarGrad, on a shared base (``GFlowNetObjective``: prioritized replay, re-scoring, rewards, the
off-policy correction, micro-batching, metrics).

Each update trains on the fresh trajectories plus trajectories replayed from the buffer. Every
trajectory, replayed or fresh, is re-scored by ONE teacher-forced forward per micro-batch under
the current policy: the buffer stores steps, PRM log-scores and reference log-probs only, never
the trained policy's log-probs. Off-policy: the trajectories may come from an older policy
(replay, or asynchronous searchers), which the losses allow.

With a reference policy (the KL term's beta, the appendix-F prior), the objective scores every
trajectory under it too, at training time: the reference may change (reset to the current policy
every gfn.reference_reset_every steps, TBA eq. 5-7), and beta may follow a schedule (`kl_coef_at`).
"""

from __future__ import annotations

import dataclasses
import math
import typing
from abc import ABC, abstractmethod
from collections.abc import Iterable

import numpy as np
import torch

from pipeline.config.schema import GFlowNetLoss, GFNConfig
from pipeline.finetune.losses import (
    clipped_importance_ratio,
    importance_weighted_losses,
    learned_flow_states,
    subtb_loss,
    tb_vargrad_loss,
    trajectory_balance_loss,
    trajectory_logprob,
)
from pipeline.finetune.replay_buffer import ReplayBuffer
from pipeline.finetune.rewards import NO_ANSWER, StateLogRewards, pad_rows
from pipeline.finetune.subtb_residuals import RESIDUAL_SHARES, subtb_residual_shares, subtb_residual_terms
from pipeline.records import Trajectory
from pipeline.training.distributed import Collective

LOSSES = typing.get_args(GFlowNetLoss)


def micro_batches(items: list, size: int, key=None) -> list[list]:
    """Chunks of at most ``size`` items; with ``key``, items sharing a key stay together (a chunk
    may then exceed ``size`` by one group)."""
    if key is None:
        return [items[i : i + size] for i in range(0, len(items), size)]
    groups: dict = {}
    for item in items:
        groups.setdefault(key(item), []).append(item)
    chunks, current = [], []
    for group in groups.values():
        if current and len(current) + len(group) > size:
            chunks.append(current)
            current = []
        current.extend(group)
    if current:
        chunks.append(current)
    return chunks


def kl_coef_at(step: int, start: float, final: float | None, anneal_steps: int) -> float:
    """beta of the update made at trainer step ``step`` (0-based): ``start`` when ``final`` is None;
    else linear from ``start`` at step 0 to ``final`` at step ``anneal_steps`` and after."""
    if final is None:
        return float(start)
    if anneal_steps <= 0 or step >= anneal_steps:
        return float(final)
    return float(start + (final - start) * step / anneal_steps)


def proportionality_gap(log_pi: torch.Tensor, log_r: torch.Tensor, group_ids) -> float:
    """Mean over questions of the mean absolute deviation of d = log pi(tau) - log R(tau).

    log_pi, log_r: (B,) whole-trajectory log-prob and terminal log-reward of the sampled
    trajectories. Under exact proportional sampling d = -log Z for every trajectory of a
    question, so the gap is 0; it grows as sampling departs from R. (docs/gflownet.md)
    """
    d = (log_pi - log_r).double()
    groups: dict = {}
    for i, g in enumerate(group_ids):
        groups.setdefault(g, []).append(i)
    gaps = [(d[idx] - d[idx].mean()).abs().mean().item() for idx in groups.values() if len(idx) > 1]
    return float(np.mean(gaps)) if gaps else float("nan")


class GFlowNetObjective(torch.nn.Module, ABC):
    """What the GFlowNet objectives share: fresh + replayed trajectories, re-scored under the
    current policy (and the reference), their state log-rewards, the off-policy correction, the
    micro-batches and the update's metrics. A subclass is one loss (gfn.loss): its ``name``, its
    own parameters and its formula, ``balance_losses``.

    cfg:    the gfn config section (loss, lam, kl_coef, learn_log_z, log_z_lr, buffer settings,
            replay_fraction, micro_batch_size)
    policy: the step-level policy being trained (``logprobs``)
    reward: StateLogRewards, the gfn section's reward shaping
    collective: the run's processes. Every process adds every process's fresh trajectories to its
            replay buffer, in rank order, so all hold the same buffer and draw the same replayed
            trajectories (same seed); each trains on its own fresh ones and on the replayed ones
            of the questions it owns (a question's trajectories stay together). The buffer's
            scope (gfn.buffer_scope) says whose trajectories are replayed: any question's, or
            each fresh question's own (``ReplayBuffer.replayed``).
    reference: the reference policy (``logprobs``, ``load_weights``) when the objective needs one
            (kl_coef > 0 or reference_prior_coef > 0); None: the log-probs stored in the
            trajectories are used
    """

    name: str  # the gfn.loss value this class is (objectives.OBJECTIVES maps it back)
    off_policy = True
    updates_per_rollout = 1
    # what keeps trajectories in one micro-batch (a trajectory -> its group), or None: any split
    micro_batch_key = None
    # whether the KL term to the reference (kl_coef = beta > 0) is part of the target the loss
    # samples in proportion to (objectives.regularized_target)
    kl_in_target = False

    def __init__(
        self, cfg: GFNConfig, policy, reward: StateLogRewards, collective: Collective | None = None, reference=None
    ):
        super().__init__()
        self.collective = collective or Collective()
        self.cfg, self.reward = cfg, reward
        # used, not owned: the policy's parameters are the trained model's, not the objective's
        object.__setattr__(self, "policy", policy)
        object.__setattr__(self, "reference", reference)  # not trained, not checkpointed with the objective
        self.kl_coef = cfg.kl_coef
        self.reference_version = 0  # the training step whose weights the reference holds
        self.buffer = ReplayBuffer(
            capacity=cfg.buffer_size,
            priority=cfg.buffer_priority,
            temperature=cfg.buffer_temperature,
            recency_fraction=cfg.recency_fraction,
            seed=cfg.seed,
            reward=reward,
            scope=cfg.buffer_scope,
            key=cfg.buffer_key,
            replacement=cfg.buffer_replacement,
        )
        self.lr = cfg.log_z_lr
        self._update: dict = {}

    @classmethod
    def from_config(
        cls, cfg: GFNConfig, policy, hidden_size: int, collective: Collective | None = None, reference=None
    ) -> GFlowNetObjective:
        """The objective with the gfn section's reward shaping (hidden_size: unused, no value head)."""
        return cls(cfg, policy, StateLogRewards.of(cfg), collective, reference=reference)

    # ------------------------------------------------------------------ one update

    def begin_update(self, step: int) -> None:
        """The update made at trainer step ``step`` uses beta = kl_coef_at(step)."""
        self.kl_coef = kl_coef_at(step, self.cfg.kl_coef, self.cfg.kl_coef_final, self.cfg.kl_anneal_steps)

    def reset_reference(self, weights: Iterable[tuple[str, torch.Tensor]], step: int) -> None:
        """The reference becomes the policy of training step ``step`` (plain weights: (name, tensor)
        pairs, read one at a time, or a state dict)."""
        if self.reference is None:
            return
        self.reference.load_weights(weights, step)
        self.reference_version = step

    def with_reference_logprobs(self, batch: list[Trajectory]) -> list[Trajectory]:
        """The trajectories with the reference's log-probs of now (when the objective holds one)."""
        if self.reference is None:
            return batch
        lp = self.reference.logprobs([t.prompt for t in batch], [t.steps for t in batch], with_grad=False)
        steps, stops = lp.step_logprobs.detach().float().cpu(), lp.termination_logprobs.detach().float().cpu()
        return [
            dataclasses.replace(
                t,
                reference_step_logprobs=steps[row, : len(t.steps)].tolist(),
                reference_stop_logprob=float(stops[row, len(t.steps)]),
            )
            for row, t in enumerate(batch)
        ]

    def rollout(
        self, fresh: list[Trajectory], everyone: list[list[Trajectory]]
    ) -> list[tuple[list[Trajectory], float]]:
        """The update's micro-batches (trajectories, weight) on this process: its fresh
        trajectories and its share of replay_fraction times all processes' fresh ones replayed
        (drawn before the fresh ones join the buffer, by its scope); TB-VarGrad keeps a question's trajectories
        in one micro-batch (its log Z estimate is per question).

        everyone: every process's fresh trajectories, in rank order (``fresh`` is this rank's)
        weight:   world size / global batch size, so that the processes' gradients, averaged,
                  are the mean over the whole batch; 0 for the filler micro-batch of a process
                  left with nothing to train on (it must still take part in the update)
        """
        collective = self.collective
        every = [t for part in everyone for t in part]
        replayed = self.buffer.replayed(every, self.cfg.replay_fraction)
        self.buffer.add(every)
        owners = {t.problem_id: rank for rank, part in enumerate(everyone) for t in part}
        others: dict[str, int] = {}
        mine = []
        for trajectory in replayed:
            owner = owners.get(trajectory.problem_id)
            if owner is None:  # a question of an earlier step: spread such questions over the processes
                owner = others.setdefault(trajectory.problem_id, len(others) % collective.world)
            if owner == collective.rank:
                mine.append(trajectory)
        return self.plan(
            fresh + mine,
            collective.world / (len(every) + len(replayed)),
            fresh=fresh,
            replayed=len(replayed),
            filler=every[:1],
        )

    def plan(
        self,
        batch: list[Trajectory],
        weight: float,
        fresh: list[Trajectory] | None = None,
        replayed: int = 0,
        filler: list[Trajectory] | None = None,
    ) -> list[tuple[list[Trajectory], float]]:
        """Micro-batches (trajectories, weight) of a given batch: what ``rollout`` builds, and
        what the asynchronous trainer trains on (a batch drawn from the searchers' buffer).

        fresh:  the trajectories the update's metrics are about (default: the whole batch)
        filler: what a process with an empty batch runs at weight 0 (it must take part)
        """
        self._update = {
            "fresh": {id(t) for t in (batch if fresh is None else fresh)},
            "replayed": replayed,
            "log_pi": [],
            "terminal_log_r": [],
            "terminal_log_pterm": [],
            "ids": [],
        }
        if not batch:
            return [(filler or [], 0.0)]
        # One row order for a given set of rows, whoever produced them (a sampler, the replay, the
        # asynchronous store): float sums in another order differ in the last bits, and Adam turns
        # such differences on near-zero gradients into full-size steps.
        batch = sorted(batch, key=lambda t: (t.problem_id, t.steps))
        return [(chunk, weight) for chunk in micro_batches(batch, self.cfg.micro_batch_size, key=self.micro_batch_key)]

    def filler(self, micro_batches: list) -> tuple:
        """A micro-batch of weight 0 (processes must run as many as the busiest one under FSDP)."""
        return (micro_batches[-1][0], 0.0)

    def trajectory_losses(self, batch: list[Trajectory]) -> tuple[torch.Tensor, dict]:
        """Per-trajectory loss (B,) of one micro-batch, with gradients, and detached extras."""
        batch = self.with_reference_logprobs(batch)
        reads_hidden = self.reads_hidden
        lp = self.policy.logprobs(
            [t.prompt for t in batch], [t.steps for t in batch], with_grad=True, return_hidden=reads_hidden
        )
        device = lp.step_logprobs.device
        log_r, mask = (x.to(device) for x in self.reward(batch))
        log_pf, log_pterm = lp.step_logprobs, lp.termination_logprobs
        loss = self.balance_losses(batch, log_pf, log_pterm, log_r, mask, lp.boundary_hidden if reads_hidden else None)
        lengths = mask.sum(1)
        log_pi = trajectory_logprob(log_pf.detach(), log_pterm.detach(), mask)
        extras = {}
        if self.cfg.importance_correction:
            sampled = self.sampling_logprobs(batch, log_pi.device)
            low, high = self.cfg.importance_clip_low, self.cfg.importance_clip_high
            loss = importance_weighted_losses(loss, log_pi, sampled, low, high)
            extras["importance_ratio"] = clipped_importance_ratio(log_pi, sampled, low, high)
        extras |= {
            "log_pi": log_pi,
            "terminal_log_r": log_r.gather(1, lengths[:, None]).squeeze(1),
            "terminal_log_pterm": log_pterm.detach().gather(1, lengths[:, None]).squeeze(1),
        }
        return loss, extras

    @property
    def reads_hidden(self) -> bool:
        """Whether ``balance_losses`` reads the policy's hidden state at each state (a learned
        log-flow); the teacher-forced forward then returns it."""
        return False

    @abstractmethod
    def balance_losses(
        self,
        batch: list[Trajectory],
        log_pf: torch.Tensor,
        log_pterm: torch.Tensor,
        log_r: torch.Tensor,
        mask,
        hidden: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """The loss's own formula: (B,) per-trajectory loss of the micro-batch ``batch`` (losses'
        conventions: log_pf (B, T), log_pterm (B, T+1), log_r (B, T+1), mask (B, T) bool; hidden
        (B, T+1, H) the policy's last hidden state at each state when ``reads_hidden``, else None)."""

    def own_metrics(self) -> dict:
        """Metrics of the loss's own parameters (TB: log Z); none by default."""
        return {}

    def sampling_logprobs(self, batch: list[Trajectory], device) -> torch.Tensor:
        """(B,) log pi(tau) under the weights that sampled each trajectory, as its sampler recorded it
        (the off-policy correction's denominator, TBA appendix D)."""
        missing = [t.problem_id for t in batch if t.sampling_logprob is None]
        if missing:
            raise ValueError(
                f"gfn.importance_correction: trajectories of {sorted(set(missing))[:3]} carry no sampling_logprob "
                "(sampled, or stored, with the correction off)"
            )
        return torch.tensor([t.sampling_logprob for t in batch], dtype=torch.float64, device=device)

    def loss(self, micro: tuple[list[Trajectory], float]) -> tuple[torch.Tensor, dict]:
        """Weight times the sum of the micro-batch's trajectory losses (the micro-batches'
        gradients add up to the batch mean)."""
        trajectories, weight = micro
        losses, extras = self.trajectory_losses(trajectories)
        update = self._update
        if weight:
            for i, t in enumerate(trajectories):
                if id(t) in update["fresh"]:
                    for name in ("log_pi", "terminal_log_r", "terminal_log_pterm"):
                        update[name].append(float(extras[name][i]))
                    update["ids"].append(t.problem_id)
            if "importance_ratio" in extras:  # every trained row's, fresh or replayed
                update.setdefault("importance_ratio", []).extend(extras["importance_ratio"].tolist())
        return losses.sum() * weight, {"loss": float(losses.detach().sum()) * weight}

    def summary(self) -> dict:
        """Metrics of the update just made, over the fresh trajectories of every process."""
        update = self._update
        gap = proportionality_gap(torch.tensor(update["log_pi"]), torch.tensor(update["terminal_log_r"]), update["ids"])
        counts: dict[str, int] = {}
        for problem_id in update["ids"]:
            counts[problem_id] = counts.get(problem_id, 0) + 1
        questions = 0 if math.isnan(gap) else sum(n > 1 for n in counts.values())  # those the gap averages over
        pterm = update["terminal_log_pterm"]
        ratios = update.get("importance_ratio", [])
        high = self.cfg.importance_clip_high
        totals = self.collective.sum(
            torch.tensor(
                [gap * questions if questions else 0.0, float(questions), float(sum(pterm)), float(len(pterm))]
                + [float(sum(ratios)), float(sum(r >= high for r in ratios)), float(len(ratios))],
                dtype=torch.float64,
            )
        )
        importance = (
            {
                "importance_ratio_mean": float(totals[4] / totals[6]) if totals[6] else float("nan"),
                "importance_clipped_fraction": float(totals[5] / totals[6]) if totals[6] else float("nan"),
            }
            if self.cfg.importance_correction
            else {}
        )
        return {
            "proportionality_gap": float(totals[0] / totals[1]) if totals[1] else float("nan"),
            "termination_logprob": float(totals[2] / totals[3]) if totals[3] else float("nan"),
            "replayed": update["replayed"],
            "buffer_size": len(self.buffer),
            **({"kl_coef": self.kl_coef, "reference_version": self.reference_version} if self.cfg.kl_coef > 0 else {}),
            **self.own_metrics(),
            **importance,
        }

    # ------------------------------------------------------------------ the buffer in state_dict

    def get_extra_state(self) -> dict:
        return {"buffer": self.buffer.state_dict()}

    def set_extra_state(self, state: dict) -> None:
        self.buffer.load_state_dict(state["buffer"])


class SubTBObjective(GFlowNetObjective):
    """SubTB(lambda) (Step-level GFlowNet, eq. 1; losses.subtb_loss): the lambda-weighted mean over
    the sub-trajectories s_i..s_j of each trajectory of their squared balance residual (gfn.lam).

    log F(s) = log R(s) - log pi(s_f|s) at every state (gfn.log_flow=stop, the paper's), or, with
    gfn.log_flow=learned, a linear head on the policy's hidden state at the states that state no
    answer but a trajectory's last (losses.learned_flow_states), its own parameter trained at
    gfn.log_z_lr and checkpointed with the objective. The head starts at 0 (weight and bias)."""

    name = "subtb"

    def __init__(
        self,
        cfg: GFNConfig,
        policy,
        reward: StateLogRewards,
        collective: Collective | None = None,
        reference=None,
        hidden_size: int | None = None,
    ):
        super().__init__(cfg, policy, reward, collective, reference=reference)
        self.flow_head = None
        self._log_flow_s0 = float("nan")
        if cfg.log_flow == "learned":
            if not hidden_size:
                raise ValueError("gfn.log_flow=learned: the flow head needs the policy's hidden size")
            self.flow_head = torch.nn.Linear(hidden_size, 1)
            torch.nn.init.zeros_(self.flow_head.weight)
            torch.nn.init.zeros_(self.flow_head.bias)

    @classmethod
    def from_config(
        cls, cfg: GFNConfig, policy, hidden_size: int, collective: Collective | None = None, reference=None
    ) -> SubTBObjective:
        """The objective with the gfn section's reward shaping; hidden_size: the flow head's input."""
        return cls(cfg, policy, StateLogRewards.of(cfg), collective, reference=reference, hidden_size=hidden_size)

    @property
    def reads_hidden(self) -> bool:
        return self.flow_head is not None

    def log_flows(self, hidden: torch.Tensor) -> torch.Tensor:
        """(B, T+1) the flow head's log F(s_k) of the hidden states (B, T+1, H); float32 (the head
        stays float32 under a bf16 policy, as PPO's value head)."""
        head = self.flow_head
        return head(hidden.to(device=head.weight.device, dtype=head.weight.dtype)).squeeze(-1).float()

    def balance_losses(self, batch, log_pf, log_pterm, log_r, mask, hidden=None):
        width = mask.shape[1]
        unanswered = torch.ones(len(batch), width + 1, dtype=torch.bool, device=mask.device)
        for row, t in enumerate(batch):
            unanswered[row, 1 : len(t.steps) + 1] = torch.tensor([f == NO_ANSWER for f in t.answer_flags])
        flows = {}
        if self.flow_head is not None:
            if hidden is None:
                raise ValueError("gfn.log_flow=learned: the policy returned no hidden states")
            flows = {
                "log_flow": self.log_flows(hidden).to(log_pterm.device),
                "learned": learned_flow_states(unanswered, mask),
            }
            self._log_flow_s0 = float(flows["log_flow"][:, 0].detach().mean())
        penalty = self.reward.unfinished_log_reward / self.reward.reward_temperature
        # the residual decomposition's per-trajectory sums, from this forward's tensors (no second pass)
        self._residual_terms = (
            subtb_residual_terms(log_pf, log_pterm, log_r, mask, unanswered, penalty, lam=self.cfg.lam, **flows),
            [t.problem_id for t in batch],
        )
        return subtb_loss(log_pf, log_pterm, log_r, mask, lam=self.cfg.lam, **flows)

    def loss(self, micro: tuple[list[Trajectory], float]) -> tuple[torch.Tensor, dict]:
        out = super().loss(micro)
        if micro[1]:  # every trained row, fresh or replayed; not a filler's
            self._update.setdefault("residual_terms", []).append(self._residual_terms)
        return out

    def own_metrics(self) -> dict:
        """log_flow_s0: the flow head's mean log F(s_0) over the update's last micro-batch (an
        amortised log Z of its questions), with gfn.log_flow=learned."""
        return {"log_flow_s0": self._log_flow_s0} if self.flow_head is not None and self._update else {}

    def summary(self) -> dict:
        """The base's metrics and the shares of the update's SubTB loss (losses.subtb_residual_shares,
        over every trained row of every process; docs/gflownet.md, "SubTB's residuals")."""
        parts = self._update.get("residual_terms", [])
        local = torch.zeros(1 + len(RESIDUAL_SHARES), dtype=torch.float64)  # the loss, then each share x the loss
        if parts:
            terms = {key: torch.cat([p[0][key].cpu() for p in parts]) for key in parts[0][0]}
            total = float(terms["loss"].sum())
            if total:
                shares = subtb_residual_shares(terms, [i for p in parts for i in p[1]])
                local = torch.tensor([total] + [shares[n] * total for n in RESIDUAL_SHARES], dtype=torch.float64)
        totals = self.collective.sum(local)
        shares = {
            f"residual_{name}": float(totals[i + 1] / totals[0]) if totals[0] else float("nan")
            for i, name in enumerate(RESIDUAL_SHARES)
        }
        return super().summary() | shares


class TBObjective(GFlowNetObjective):
    """Trajectory balance (losses.trajectory_balance_loss): (log Z + log pi(tau) - log R(s_n))^2.

    log Z is its own parameter, learned at gfn.log_z_lr (gfn.learn_log_z), or, unlearned, each
    trajectory's estimate log R(s_0) - log pi(s_f | s_0) (no gradient through pi)."""

    name = "tb"

    def __init__(
        self, cfg: GFNConfig, policy, reward: StateLogRewards, collective: Collective | None = None, reference=None
    ):
        super().__init__(cfg, policy, reward, collective, reference=reference)
        self.log_z = torch.nn.Parameter(torch.zeros(())) if cfg.learn_log_z else None

    def balance_losses(self, batch, log_pf, log_pterm, log_r, mask, hidden=None):
        log_z = self.log_z if self.log_z is not None else log_r[:, 0] - log_pterm[:, 0].detach()
        return trajectory_balance_loss(log_pf, log_pterm, log_r, mask, log_z)

    def own_metrics(self) -> dict:
        return {"log_z": float(self.log_z)} if self.log_z is not None else {}


class TBVarGradObjective(GFlowNetObjective):
    """TB with the VarGrad log Z (TBA eq. 5; losses.tb_vargrad_loss): log Z estimated per question
    from its trajectories in the micro-batch, which therefore keeps a question's trajectories
    together. With beta = kl_coef > 0 the target is pi_ref(tau) R(s_n)^(1/beta) (the reference's
    log-probs of now, ``with_reference_logprobs``)."""

    name = "tb_vargrad"
    kl_in_target = True

    @staticmethod
    def micro_batch_key(trajectory: Trajectory) -> str:
        return trajectory.problem_id

    def balance_losses(self, batch, log_pf, log_pterm, log_r, mask, hidden=None):
        log_ref = None
        if self.kl_coef > 0:
            if any(t.reference_step_logprobs is None for t in batch):
                raise ValueError("gfn.kl_coef > 0: the trajectories carry no reference log-probs")
            device, width = log_pf.device, mask.shape[1]
            ref_steps = pad_rows([t.reference_step_logprobs for t in batch], width).to(device)
            ref_stop = torch.zeros(len(batch), width + 1, device=device)
            ref_stop[torch.arange(len(batch)), mask.sum(1)] = torch.tensor(
                [t.reference_stop_logprob for t in batch], device=device
            )
            log_ref = trajectory_logprob(ref_steps, ref_stop, mask)
        return tb_vargrad_loss(
            log_pf, log_pterm, log_r, mask, [t.problem_id for t in batch], log_ref=log_ref, kl_coef=self.kl_coef
        )
