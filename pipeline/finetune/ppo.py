"""The PPO baseline objective (paper 5, appendix D) on the shared step-level trainer.

The policy builds a solution one step at a time; each new step is rewarded with its PRM step
score U(s_k|s_{k-1}) (the paper evaluates only the newly proposed step), or with log U under
``ppo.step_reward=log_score`` (step_rewards). One action = one
whole step; the stop action is folded into the last step (its log-prob includes the end
token), so PPO also learns when to stop. A solution whose last step states no final answer
gets ``unfinished_reward`` added to its last reward. Values come from a linear head on the
policy's last hidden state at each step boundary; advantages from GAE over steps.
"""

from __future__ import annotations

import torch

from pipeline.finetune.losses import gae, ppo_loss
from pipeline.finetune.replay_buffer import Trajectory
from pipeline.finetune.rewards import NO_ANSWER
from pipeline.finetune.trainer import micro_batches, pad_rows


def step_action_logprobs(lp) -> torch.Tensor:
    """(B, T) log-prob of each step action; the last step's includes the stop action."""
    lengths = lp.mask.sum(1)
    stop = torch.zeros_like(lp.step_logprobs)
    rows = torch.arange(stop.shape[0], device=stop.device)
    stop[rows, lengths - 1] = lp.termination_logprobs[rows, lengths]
    return lp.step_logprobs + stop


STEP_REWARDS = ("score", "log_score")


def step_rewards(trajectories: list[Trajectory], width: int, unfinished_reward: float, kind: str = "score") -> torch.Tensor:
    """(B, T) step rewards (+ unfinished_reward on the last step without an answer).

    kind "score" (the paper's): r_k = U(s_k|s_{k-1}); every step earns a positive reward, so the
    return grows with the number of steps (docs/gflownet.md: PPO lengthened its solutions 4 -> 20
    steps against a PRM with headroom). "log_score": r_k = log U(s_k|s_{k-1}); the undiscounted
    return from s_0 is then log R = sum_k log U, the GFlowNet's log-reward, which no added step raises.
    """
    if kind not in STEP_REWARDS:
        raise ValueError(f"ppo.step_reward: expected one of {STEP_REWARDS}, got {kind!r}")
    rows = []
    for t in trajectories:
        row = [float(x) if kind == "log_score" else float(torch.tensor(x).exp()) for x in t.step_log_rewards]
        if t.meta["answer_flags"][-1] == NO_ANSWER:
            row[-1] += unfinished_reward
        rows.append(row)
    return pad_rows(rows, width)


class PPOObjective:
    name = "ppo"

    def __init__(self, cfg, hidden_size: int, reference=None):
        self.cfg = cfg
        self.value_head = torch.nn.Linear(hidden_size, 1)
        torch.nn.init.zeros_(self.value_head.weight)
        torch.nn.init.zeros_(self.value_head.bias)
        self.reference = reference
        self.lr = cfg.lr

    def parameters(self) -> list[torch.nn.Parameter]:
        return list(self.value_head.parameters())

    def values(self, lp) -> torch.Tensor:
        hidden = lp.boundary_hidden
        head = self.value_head.to(device=hidden.device)  # stays float32 (its optimizer state too) under a bf16 policy
        return head(hidden.to(head.weight.dtype)).squeeze(-1).float()

    def update(self, trainer, fresh: list[Trajectory]) -> dict:
        size = self.cfg.micro_batch_size
        chunks = micro_batches(fresh, size)
        # Rollout phase: old log-probs, values and rewards under the policy that sampled.
        old = []
        for chunk in chunks:
            with torch.no_grad():
                lp = trainer.teacher_forced(chunk, with_grad=False, return_hidden=True)
                values = self.values(lp)
                old_logp = step_action_logprobs(lp).float()
                rewards = step_rewards(chunk, lp.mask.shape[1], self.cfg.unfinished_reward, self.cfg.step_reward).to(old_logp.device)
                if self.reference is not None and self.cfg.kl_coef > 0:
                    ref = self.reference.logprobs([t.prompt for t in chunk], [t.steps for t in chunk], with_grad=False)
                    rewards = rewards - self.cfg.kl_coef * (old_logp - step_action_logprobs(ref).float().to(old_logp.device)) * lp.mask
                terminated = torch.tensor([bool(t.meta["finished"]) for t in chunk], device=old_logp.device)
                adv, ret = gae(rewards, values, lp.mask, gamma=self.cfg.gamma, lam=self.cfg.gae_lambda, terminated=terminated)
            old.append((chunk, old_logp, values[:, :-1], adv, ret, lp.mask))
        # Normalise advantages over the whole batch (standard PPO practice).
        all_adv = torch.cat([adv[mask] for *_, adv, _, mask in old])
        mean = all_adv.mean()
        std = all_adv.std().clamp_min(1e-6) if all_adv.numel() > 1 else torch.ones(())
        totals: dict[str, float] = {}
        steps = 0
        for _ in range(self.cfg.ppo_epochs):
            for chunk, old_logp, old_values, adv, ret, _ in old:
                lp = trainer.teacher_forced(chunk, with_grad=True, return_entropy=True, return_hidden=True)
                new_logp = step_action_logprobs(lp).float()
                new_values = self.values(lp)[:, :-1]
                norm_adv = (adv - mean.to(adv.device)) / std.to(adv.device)
                loss, stats = ppo_loss(
                    new_logp, old_logp, norm_adv, ret, new_values, old_values, lp.step_entropy.float(), lp.mask,
                    clip=self.cfg.clip, value_coef=self.cfg.value_coef, entropy_coef=self.cfg.entropy_coef,
                )
                trainer.backward(loss * len(chunk) / len(fresh))
                for name, value in stats.items():
                    totals[name] = totals.get(name, 0.0) + float(value) * len(chunk) / len(fresh)
                totals["loss"] = totals.get("loss", 0.0) + float(loss.detach()) * len(chunk) / len(fresh)
            totals["grad_norm"] = trainer.optimizer_step()
            steps += 1
        out = {name: value / steps for name, value in totals.items() if name != "grad_norm"}
        out["grad_norm"] = totals["grad_norm"]
        return out

    def state_dict(self) -> dict:
        return {f"value_head.{k}": v.detach().clone() for k, v in self.value_head.state_dict().items()}

    def load_state_dict(self, state: dict) -> None:
        self.value_head.load_state_dict({k.split(".", 1)[1]: v for k, v in state.items() if k.startswith("value_head.")})
