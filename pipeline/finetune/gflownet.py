"""The step-level GFlowNet objective: SubTB(lambda), TB or TB-VarGrad, with prioritized replay.

Each update trains on the fresh trajectories plus trajectories replayed from the buffer. Every
trajectory, replayed or fresh, is re-scored by ONE teacher-forced forward per micro-batch under
the current policy: the buffer stores steps, PRM log-scores and reference log-probs only, never
the trained policy's log-probs. Off-policy: the trajectories may come from an older policy
(replay, or asynchronous searchers), which the losses allow.
"""

from __future__ import annotations

import numpy as np
import torch

from pipeline.config import GFNConfig
from pipeline.finetune.losses import subtb_loss, tb_vargrad_loss, trajectory_balance_loss, trajectory_logprob
from pipeline.finetune.replay_buffer import ReplayBuffer
from pipeline.finetune.rewards import StateLogRewards, pad_rows
from pipeline.records import Trajectory

LOSSES = ("subtb", "tb", "tb_vargrad")


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


class GFlowNetObjective(torch.nn.Module):
    """SubTB(lambda) / TB / TB-VarGrad (gfn.loss) over fresh + replayed trajectories.

    cfg:    the gfn config section (loss, lam, kl_coef, learn_log_z, log_z_lr, buffer settings,
            replay_fraction, micro_batch_size)
    policy: the step-level policy being trained (``logprobs``)
    reward: StateLogRewards, the gfn section's reward shaping
    """

    off_policy = True
    updates_per_rollout = 1

    def __init__(self, cfg: GFNConfig, policy, reward: StateLogRewards):
        super().__init__()
        if cfg.loss not in LOSSES:
            raise ValueError(f"gfn.loss must be one of {', '.join(LOSSES)}, got {cfg.loss!r}")
        self.name = cfg.loss
        self.cfg, self.reward = cfg, reward
        # used, not owned: the policy's parameters are the trained model's, not the objective's
        object.__setattr__(self, "policy", policy)
        self.buffer = ReplayBuffer(capacity=cfg.buffer_size, priority=cfg.buffer_priority, temperature=cfg.buffer_temperature,
                                   recency_fraction=cfg.recency_fraction, seed=cfg.seed)
        self.log_z = torch.nn.Parameter(torch.zeros(())) if cfg.loss == "tb" and cfg.learn_log_z else None
        self.lr = cfg.log_z_lr
        self._update: dict = {}

    # ------------------------------------------------------------------ one update

    def rollout(self, fresh: list[Trajectory]) -> list[list[Trajectory]]:
        """The update's micro-batches: the fresh trajectories and replay_fraction as many replayed
        ones (drawn before the fresh ones join the buffer); TB-VarGrad keeps a question's
        trajectories in one micro-batch (its log Z estimate is per question)."""
        n_replay = int(round(len(fresh) * self.cfg.replay_fraction)) if len(self.buffer) else 0
        replayed = self.buffer.sample(n_replay) if n_replay else []
        self.buffer.add(fresh)
        batch = fresh + replayed
        self._update = {"size": len(batch), "fresh": {id(t) for t in fresh}, "replayed": len(replayed),
                        "log_pi": [], "terminal_log_r": [], "terminal_log_pterm": [], "ids": []}
        key = (lambda t: t.problem_id) if self.cfg.loss == "tb_vargrad" else None
        return micro_batches(batch, self.cfg.micro_batch_size, key=key)

    def trajectory_losses(self, batch: list[Trajectory]) -> tuple[torch.Tensor, dict]:
        """Per-trajectory loss (B,) of one micro-batch, with gradients, and detached extras."""
        lp = self.policy.logprobs([t.prompt for t in batch], [t.steps for t in batch], with_grad=True)
        device = lp.step_logprobs.device
        log_r, mask = (x.to(device) for x in self.reward(batch))
        log_pf, log_pterm = lp.step_logprobs, lp.termination_logprobs
        if self.cfg.loss == "subtb":
            loss = subtb_loss(log_pf, log_pterm, log_r, mask, lam=self.cfg.lam)
        elif self.cfg.loss == "tb":
            log_z = self.log_z if self.log_z is not None else log_r[:, 0] - log_pterm[:, 0].detach()
            loss = trajectory_balance_loss(log_pf, log_pterm, log_r, mask, log_z)
        else:
            log_ref = None
            if self.cfg.kl_coef > 0:
                if any(t.reference_step_logprobs is None for t in batch):
                    raise ValueError("gfn.kl_coef > 0: the trajectories carry no reference log-probs")
                width = mask.shape[1]
                ref_steps = pad_rows([t.reference_step_logprobs for t in batch], width).to(device)
                ref_stop = torch.zeros(len(batch), width + 1, device=device)
                ref_stop[torch.arange(len(batch)), mask.sum(1)] = torch.tensor([t.reference_stop_logprob for t in batch], device=device)
                log_ref = trajectory_logprob(ref_steps, ref_stop, mask)
            loss = tb_vargrad_loss(log_pf, log_pterm, log_r, mask, [t.problem_id for t in batch], log_ref=log_ref, kl_coef=self.cfg.kl_coef)
        lengths = mask.sum(1)
        extras = {
            "log_pi": trajectory_logprob(log_pf.detach(), log_pterm.detach(), mask),
            "terminal_log_r": log_r.gather(1, lengths[:, None]).squeeze(1),
            "terminal_log_pterm": log_pterm.detach().gather(1, lengths[:, None]).squeeze(1),
        }
        return loss, extras

    def loss(self, micro: list[Trajectory]) -> tuple[torch.Tensor, dict]:
        """Sum of the micro-batch's trajectory losses over the update's batch size (so the
        micro-batches' gradients add up to the batch mean)."""
        losses, extras = self.trajectory_losses(micro)
        update = self._update
        for i, t in enumerate(micro):
            if id(t) in update["fresh"]:
                for name in ("log_pi", "terminal_log_r", "terminal_log_pterm"):
                    update[name].append(float(extras[name][i]))
                update["ids"].append(t.problem_id)
        return losses.sum() / update["size"], {"loss": float(losses.detach().sum()) / update["size"]}

    def summary(self) -> dict:
        """Metrics of the update just made, over its fresh trajectories."""
        update = self._update
        return {
            "proportionality_gap": proportionality_gap(torch.tensor(update["log_pi"]), torch.tensor(update["terminal_log_r"]), update["ids"]),
            "termination_logprob": float(np.mean(update["terminal_log_pterm"])) if update["terminal_log_pterm"] else float("nan"),
            "replayed": update["replayed"],
            "buffer_size": len(self.buffer),
            **({"log_z": float(self.log_z)} if self.log_z is not None else {}),
        }

    # ------------------------------------------------------------------ the buffer in state_dict

    def get_extra_state(self) -> dict:
        return {"buffer": self.buffer.state_dict()}

    def set_extra_state(self, state: dict) -> None:
        self.buffer.load_state_dict(state["buffer"])
