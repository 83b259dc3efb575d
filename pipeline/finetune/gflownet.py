"""The step-level GFlowNet objective: SubTB(lambda), TB or TB-VarGrad, with prioritized replay.

Each update trains on the fresh batch plus trajectories replayed from the buffer. Every
trajectory, replayed or fresh, is re-scored by ONE teacher-forced forward per micro-batch under
the current policy: the buffer stores steps and PRM log-scores only, never policy log-probs.
"""

from __future__ import annotations

import torch

from pipeline.finetune.losses import subtb_loss, tb_vargrad_loss, trajectory_balance_loss, trajectory_logprob
from pipeline.finetune.replay_buffer import ReplayBuffer, Trajectory
from pipeline.finetune.trainer import micro_batches, proportionality_gap

LOSSES = ("subtb", "tb", "tb_vargrad")


class GFlowNetObjective:
    name = "gfn"

    def __init__(self, cfg, reference=None):
        if cfg.loss not in LOSSES:
            raise ValueError(f"gfn.loss must be one of {LOSSES}, got {cfg.loss!r}")
        self.cfg = cfg
        self.buffer = ReplayBuffer(
            capacity=cfg.buffer_size, priority=cfg.buffer_priority, temperature=cfg.buffer_temperature,
            recency_fraction=cfg.recency_fraction, seed=cfg.seed,
        )
        self.log_z = torch.nn.Parameter(torch.zeros(())) if cfg.loss == "tb" and cfg.learn_log_z else None
        self.lr = cfg.log_z_lr
        # A frozen reference policy (same two-method interface), needed only for the
        # appendix-F prior (reference_prior_coef) and the TB-VarGrad KL term (kl_coef).
        self.reference = reference

    def parameters(self) -> list[torch.nn.Parameter]:
        return [self.log_z] if self.log_z is not None else []

    def losses(self, trainer, batch: list[Trajectory]) -> tuple[torch.Tensor, dict]:
        """Per-trajectory loss (B,) of one micro-batch, with gradients, and detached extras."""
        lp = trainer.teacher_forced(batch, with_grad=True)
        ref_steps = None
        if self.reference is not None:
            ref_steps = self.reference.logprobs([t.prompt for t in batch], [t.steps for t in batch], with_grad=False)
        log_r, mask = trainer.log_rewards(batch, None if ref_steps is None else ref_steps.step_logprobs.float().cpu())
        device = lp.step_logprobs.device
        log_r, mask = log_r.to(device), mask.to(device)
        log_pf, log_pterm = lp.step_logprobs, lp.termination_logprobs
        if self.cfg.loss == "subtb":
            loss = subtb_loss(log_pf, log_pterm, log_r, mask, lam=self.cfg.lam)
        elif self.cfg.loss == "tb":
            log_z = self.log_z if self.log_z is not None else log_r[:, 0] - log_pterm[:, 0].detach()
            loss = trajectory_balance_loss(log_pf, log_pterm, log_r, mask, log_z)
        else:
            log_ref = None
            if self.cfg.kl_coef > 0:
                if ref_steps is None:
                    raise ValueError("gfn.kl_coef > 0 needs a reference policy")
                log_ref = trajectory_logprob(ref_steps.step_logprobs, ref_steps.termination_logprobs, ref_steps.mask).to(device)
            loss = tb_vargrad_loss(log_pf, log_pterm, log_r, mask, [t.problem_id for t in batch], log_ref=log_ref, kl_coef=self.cfg.kl_coef)
        lengths = mask.sum(1)
        extras = {
            "log_pi": trajectory_logprob(log_pf.detach(), log_pterm.detach(), mask),
            "terminal_log_r": log_r.gather(1, lengths[:, None]).squeeze(1),
            "terminal_log_pterm": log_pterm.detach().gather(1, lengths[:, None]).squeeze(1),
        }
        return loss, extras

    def update(self, trainer, fresh: list[Trajectory]) -> dict:
        n_replay = int(round(len(fresh) * self.cfg.replay_fraction)) if len(self.buffer) else 0
        replayed = self.buffer.sample(n_replay) if n_replay else []
        self.buffer.add(fresh)
        batch = fresh + replayed
        key = (lambda t: t.problem_id) if self.cfg.loss == "tb_vargrad" else None
        total, fresh_extras = 0.0, {"log_pi": [], "terminal_log_r": [], "terminal_log_pterm": [], "ids": []}
        fresh_ids = {id(t) for t in fresh}
        for chunk in micro_batches(batch, self.cfg.micro_batch_size, key=key):
            loss, extras = self.losses(trainer, chunk)
            trainer.backward(loss.sum() / len(batch))
            total += float(loss.detach().sum())
            for i, t in enumerate(chunk):
                if id(t) in fresh_ids:
                    for name in ("log_pi", "terminal_log_r", "terminal_log_pterm"):
                        fresh_extras[name].append(float(extras[name][i]))
                    fresh_extras["ids"].append(t.problem_id)
        grad_norm = trainer.optimizer_step()
        log_pi = torch.tensor(fresh_extras["log_pi"])
        log_r = torch.tensor(fresh_extras["terminal_log_r"])
        return {
            "loss": total / len(batch),
            "proportionality_gap": proportionality_gap(log_pi, log_r, fresh_extras["ids"]),
            "termination_logprob": float(torch.tensor(fresh_extras["terminal_log_pterm"]).mean()),
            "grad_norm": grad_norm,
            "replayed": len(replayed),
            "buffer_size": len(self.buffer),
            **({"log_z": float(self.log_z)} if self.log_z is not None else {}),
        }

    def state_dict(self) -> dict:
        state = {"buffer": self.buffer.state_dict()}
        if self.log_z is not None:
            state["log_z"] = self.log_z.detach().clone()
        return state

    def load_state_dict(self, state: dict) -> None:
        self.buffer.load_state_dict(state["buffer"])
        if self.log_z is not None and "log_z" in state:
            with torch.no_grad():
                self.log_z.copy_(state["log_z"])
