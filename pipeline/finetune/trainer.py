"""The step-level policy trainer shared by the GFlowNet and the PPO baseline.

One loop, read top to bottom: sample K solutions for each of a batch of questions from the
current policy (one generator call), score every step of every solution with the PRM (one
scorer call), hand the batch to the objective (GFlowNet or PPO: they differ only in their loss
and in what they store), step the optimizer, log metrics, checkpoint. Checkpoints hold the
model, optimizer, scheduler, objective state (log Z, value head, replay buffer) and RNG state,
so a stopped run resumes where it was.
"""

from __future__ import annotations

import json
import math
import random
import shutil
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Protocol, Sequence

import numpy as np
import torch
from tqdm import tqdm

from pipeline.io import write_json_atomic
from pipeline.finetune.replay_buffer import Trajectory
from pipeline.finetune.rewards import CORRECT_ANSWER, NO_ANSWER, WRONG_ANSWER, shaped_log_rewards


class Objective(Protocol):
    name: str

    def parameters(self) -> list[torch.nn.Parameter]: ...
    def update(self, trainer: "StepPolicyTrainer", fresh: list[Trajectory]) -> dict: ...
    def state_dict(self) -> dict: ...
    def load_state_dict(self, state: dict) -> None: ...


@dataclass
class TrainProblem:
    problem_id: str
    question: str
    prompt: str
    answer: str


def answer_flags_for(steps_per_traj: Sequence[Sequence[str]], golds: Sequence[str], kind: str, extract_answer, grade_many) -> list[list[int]]:
    """Per step: -1 when the step states no final answer, else 1/0 for a correct/wrong one."""
    flags = [[NO_ANSWER] * len(steps) for steps in steps_per_traj]
    where, texts, refs = [], [], []
    for t, (steps, gold) in enumerate(zip(steps_per_traj, golds)):
        for k, step in enumerate(steps):
            if extract_answer(step, kind) is not None:
                where.append((t, k))
                texts.append(step)
                refs.append(gold)
    for (t, k), ok in zip(where, grade_many(texts, refs, kind) if texts else []):
        flags[t][k] = CORRECT_ANSWER if ok else WRONG_ANSWER
    return flags


def pad_rows(rows: Sequence[Sequence[float]], width: int, value: float = 0.0, dtype=torch.float32) -> torch.Tensor:
    out = torch.full((len(rows), width), value, dtype=dtype)
    for i, row in enumerate(rows):
        if len(row):
            out[i, : len(row)] = torch.as_tensor(list(row), dtype=dtype)
    return out


def micro_batches(items: list, size: int, key: Callable | None = None) -> list[list]:
    """Chunks of at most ``size`` items; with ``key``, items sharing a key stay together."""
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


def proportionality_gap(log_pi: torch.Tensor, log_r: torch.Tensor, group_ids: Sequence) -> float:
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


class StepPolicyTrainer:
    """Sampling, PRM scoring, optimisation, metrics and checkpoints for a step-level objective.

    policy:  has ``sample(prompts, n, temperature, seed)`` and ``logprobs(prompts, steps, with_grad, ...)``
    scorer:  has ``log_scores_many([(question, steps), ...]) -> [[log U_k, ...], ...]``
    cfg:     a GFNConfig or PPOConfig (lr, scheduler, warmup_steps, grad_clip, num_train_steps,
             questions_per_step, samples_per_question, micro_batch_size, temperature, save_every, seed)
    reward:  shaping settings for pipeline.finetune.rewards.shaped_log_rewards (a GFNConfig)
    """

    def __init__(
        self,
        policy,
        scorer,
        problems: Sequence[TrainProblem],
        objective: Objective,
        cfg,
        reward,
        kind: str,
        out_dir: str | Path,
        extract_answer: Callable,
        grade_many: Callable,
        save_model: Callable[[Path], None] | None = None,
        accelerator=None,
        progress: bool = True,
    ):
        self.policy, self.scorer, self.problems = policy, scorer, list(problems)
        self.objective, self.cfg, self.reward, self.kind = objective, cfg, reward, kind
        self.out_dir = Path(out_dir)
        self.out_dir.mkdir(parents=True, exist_ok=True)
        self.extract_answer, self.grade_many = extract_answer, grade_many
        self.save_model = save_model
        self.accelerator = accelerator
        self.progress = progress
        params = [p for p in policy.parameters() if p.requires_grad] + list(objective.parameters())
        self.params = params
        self.optimizer = torch.optim.AdamW(
            [{"params": [p for p in policy.parameters() if p.requires_grad]}]
            + ([{"params": objective.parameters(), "lr": getattr(objective, "lr", cfg.lr)}] if objective.parameters() else []),
            lr=cfg.lr,
            weight_decay=cfg.weight_decay,
        )
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(self.optimizer, self._lr_lambda)
        self.step = 0
        self.rng = random.Random(cfg.seed)
        self._order: list[int] = []

    # -------------------------------------------------------------- schedule and data

    def _lr_lambda(self, step: int) -> float:
        warmup = max(self.cfg.warmup_steps, 0)
        if step < warmup:
            return (step + 1) / warmup
        if self.cfg.scheduler == "constant":
            return 1.0
        progress = (step - warmup) / max(self.cfg.num_train_steps - warmup, 1)
        progress = min(max(progress, 0.0), 1.0)
        if self.cfg.scheduler == "linear":
            return 1.0 - progress
        if self.cfg.scheduler == "cosine":
            return 0.5 * (1.0 + math.cos(math.pi * progress))
        raise ValueError(f"scheduler must be cosine | linear | constant, got {self.cfg.scheduler!r}")

    def _next_problems(self) -> list[TrainProblem]:
        chosen = []
        for _ in range(min(self.cfg.questions_per_step, len(self.problems))):
            if not self._order:
                self._order = list(range(len(self.problems)))
                self.rng.shuffle(self._order)
            chosen.append(self.problems[self._order.pop()])
        return chosen

    # -------------------------------------------------------------- sampling and rewards

    def collect(self) -> tuple[list[Trajectory], dict]:
        """K fresh solutions per question from the current policy, scored by the PRM."""
        problems = self._next_problems()
        samples = self.policy.sample([p.prompt for p in problems], n=self.cfg.samples_per_question,
                                     temperature=self.cfg.temperature, seed=self.cfg.seed * 100003 + self.step)
        kept, empty = [], 0
        for problem, solutions in zip(problems, samples):
            for solution in solutions:
                if len(solution.steps) < max(self.reward.min_steps, 1):
                    empty += 1  # stopping at s_0 is not an action of the step-level policy
                    continue
                kept.append((problem, solution))
        log_scores = self.scorer.log_scores_many([(p.question, s.steps) for p, s in kept]) if kept else []
        flags = answer_flags_for([s.steps for _, s in kept], [p.answer for p, _ in kept], self.kind, self.extract_answer, self.grade_many)
        trajectories = [
            Trajectory(
                problem_id=p.problem_id,
                prompt=p.prompt,
                steps=list(s.steps),
                step_log_rewards=[float(x) for x in scores],
                log_reward=float(sum(scores)),
                meta={"answer_flags": f, "finished": s.finished, "question": p.question},
            )
            for (p, s), scores, f in zip(kept, log_scores, flags)
        ]
        info = {"empty_solutions": empty, "sampled": len(kept) + empty}
        return trajectories, info

    def log_rewards(self, trajectories: Sequence[Trajectory], ref_step_logprobs: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """(log R(s_i) (B, T+1), mask (B, T)) of stored trajectories, shaping applied now."""
        width = max(len(t.steps) for t in trajectories)
        mask = pad_rows([[1.0] * len(t.steps) for t in trajectories], width).bool()
        scores = pad_rows([t.step_log_rewards for t in trajectories], width)
        flags = pad_rows([t.meta["answer_flags"] for t in trajectories], width, value=NO_ANSWER, dtype=torch.long)
        r = self.reward
        log_r = shaped_log_rewards(
            scores, flags, mask, reward_temperature=r.reward_temperature, unfinished_log_reward=r.unfinished_log_reward,
            outcome_coef=r.outcome_coef, outcome_floor=r.outcome_floor,
            ref_step_logprobs=ref_step_logprobs, reference_prior_coef=r.reference_prior_coef,
        )
        return log_r, mask

    def teacher_forced(self, trajectories: Sequence[Trajectory], with_grad: bool, **kwargs):
        return self.policy.logprobs([t.prompt for t in trajectories], [t.steps for t in trajectories], with_grad=with_grad, **kwargs)

    # -------------------------------------------------------------- optimisation

    def backward(self, loss: torch.Tensor) -> None:
        if self.accelerator is not None:
            self.accelerator.backward(loss)
        else:
            loss.backward()

    def optimizer_step(self) -> float:
        grad_norm = torch.nn.utils.clip_grad_norm_(self.params, self.cfg.grad_clip) if self.cfg.grad_clip > 0 else torch.tensor(0.0)
        self.optimizer.step()
        self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        return float(grad_norm)

    # -------------------------------------------------------------- the loop

    def train(self) -> list[dict]:
        self.resume()
        metrics_path = self.out_dir / "metrics.jsonl"
        if metrics_path.exists():  # keep only what the checkpoint we resumed from had logged
            kept = [line for line in metrics_path.read_text().splitlines() if line.strip() and json.loads(line)["step"] <= self.step]
            metrics_path.write_text("".join(line + "\n" for line in kept))
        bar = tqdm(total=self.cfg.num_train_steps, initial=self.step, desc=f"{self.objective.name} steps",
                   dynamic_ncols=True, disable=not self.progress)
        history = []
        while self.step < self.cfg.num_train_steps:
            start = time.monotonic()
            fresh, info = self.collect()
            if not fresh:
                raise RuntimeError("every sampled solution was empty: the policy stops at s_0")
            stats = self.objective.update(self, fresh)
            record = {
                "step": self.step + 1,
                "lr": self.scheduler.get_last_lr()[0],
                "avg_reward": float(np.mean([math.exp(t.log_reward) for t in fresh])),
                "avg_log_reward": float(np.mean([t.log_reward for t in fresh])),
                "accuracy": float(np.mean([CORRECT_ANSWER in t.meta["answer_flags"][-1:] for t in fresh])),
                "finished_fraction": float(np.mean([t.meta["finished"] for t in fresh])),
                "solution_length": float(np.mean([len(t.steps) for t in fresh])),
                "seconds": time.monotonic() - start,
                **info,
                **stats,
            }
            self.step += 1
            with metrics_path.open("a", encoding="utf-8") as handle:
                handle.write(json.dumps(record) + "\n")
            history.append(record)
            bar.update(1)
            bar.set_postfix(loss=f"{record.get('loss', float('nan')):.3g}", reward=f"{record['avg_reward']:.3f}")
            if self.cfg.save_every and self.step % self.cfg.save_every == 0 and self.step < self.cfg.num_train_steps:
                self.save_checkpoint()
        bar.close()
        return history

    # -------------------------------------------------------------- checkpoints

    @property
    def checkpoint_dir(self) -> Path:
        return self.out_dir / "checkpoint"

    def save_checkpoint(self) -> None:
        ckpt = self.checkpoint_dir
        tmp = ckpt.with_name(ckpt.name + ".tmp")
        tmp.mkdir(parents=True, exist_ok=True)
        if self.save_model is not None:
            self.save_model(tmp / "model")
        else:
            torch.save({k: v for k, v in enumerate(self.policy.parameters())}, tmp / "policy.pt")
        torch.save(self.optimizer.state_dict(), tmp / "optimizer.pt")
        torch.save(self.scheduler.state_dict(), tmp / "scheduler.pt")
        torch.save(self.objective.state_dict(), tmp / "objective.pt")
        write_json_atomic(tmp / "trainer_state.json", {"step": self.step, "rng": list(self.rng.getstate()[1]), "order": self._order})
        shutil.rmtree(ckpt, ignore_errors=True)
        tmp.rename(ckpt)

    def resume(self) -> bool:
        """Load the checkpoint of an interrupted run (model weights are loaded by the caller)."""
        state_path = self.checkpoint_dir / "trainer_state.json"
        if not state_path.exists():
            return False
        state = json.loads(state_path.read_text())
        self.step = state["step"]
        self.rng.setstate((3, tuple(state["rng"]), None))
        self._order = state["order"]
        self.optimizer.load_state_dict(torch.load(self.checkpoint_dir / "optimizer.pt", weights_only=True))
        self.scheduler.load_state_dict(torch.load(self.checkpoint_dir / "scheduler.pt", weights_only=True))
        self.objective.load_state_dict(torch.load(self.checkpoint_dir / "objective.pt", weights_only=True))
        if self.save_model is None and (self.checkpoint_dir / "policy.pt").exists():
            saved = torch.load(self.checkpoint_dir / "policy.pt", weights_only=True)
            with torch.no_grad():
                for k, p in enumerate(self.policy.parameters()):
                    p.copy_(saved[k])
        return True
