"""SubTB(lambda) and TB-VarGrad on an enumerable world under the language model's conditions.

`python -m perf.subtb_enumerable [seed] [lr=X] [log_flow=stop|learned] [loss=subtb|tb_vargrad ...]` prints, for each loss, the
total variation distance of the learned terminal distribution to the target R/Z (start and end)
and the last updates' residual shares (SubTB). Deterministic for a given seed on one machine.

The world: steps A, B, C with PRM scores 0.9, 0.6, 0.3 up to depth 3, as in tests/test_gflownet.py,
but only C states a final answer, so every state whose last step is not C (s_0 included) carries
gfn.unfinished_log_reward / reward temperature in log R, as on the LM path (pipeline.finetune.rewards).
The policy's logits over (A, B, C, stop) are E[s] W, a rank-3 embedding of each state times one
shared matrix, so no state's stop probability can be fit alone (a free logit per state could).
It runs through the production loop, objectives, losses and sampler (``make_trainer``).
"""

from __future__ import annotations

import itertools
import math
import sys
import tempfile
from pathlib import Path
from types import SimpleNamespace

import torch

from pipeline.config.schema import GFNConfig, ModelConfig
from pipeline.finetune.objectives import build_objective
from pipeline.finetune.policy import SampledSolution
from pipeline.finetune.run import optimizer_settings
from pipeline.finetune.sampling import TrainProblem, TrajectorySampler
from pipeline.finetune.trainer import FinetuneTrainer
from pipeline.training import TrainingBase, make_accelerator

ACTIONS = ("A", "B", "C")
SCORES = {"A": 0.9, "B": 0.6, "C": 0.3}
ANSWER_STEP = "C"  # the one step that states a final answer
DEPTH = 3
RANK = 3
HIDDEN = RANK + 13  # a state's features: its embedding E[s] and a one-hot of the 13 states with an action left

# The budget of the check: Adam at lr 0.01 for 200 updates of 16 samples (the LM: 1e-4 for 56
# updates of 64; the tabular test: 0.1 for 250), sampling temperature 1, reward temperature 1,
# no replay (both losses train on the same fresh samples).
SETTINGS = dict(
    lr=0.01,
    scheduler="constant",
    warmup_steps=0,
    num_train_steps=200,
    questions_per_step=1,
    samples_per_question=16,
    micro_batch_size=64,
    temperature=1.0,
    reward_temperature=1.0,
    unfinished_log_reward=-10.0,
    replay_fraction=0.0,
    save_every=0,
    grad_clip=10.0,
)


def states() -> list[tuple[str, ...]]:
    """Every state with an action left (depth < DEPTH), s_0 first."""
    return [s for d in range(DEPTH) for s in itertools.product(ACTIONS, repeat=d)]


def answered(state: tuple[str, ...]) -> bool:
    return bool(state) and state[-1] == ANSWER_STEP


def log_reward(state: tuple[str, ...], unfinished_log_reward: float, reward_temperature: float = 1.0) -> float:
    """log R(s) as pipeline.finetune.rewards shapes it: (sum log U + penalty if unanswered) / tau."""
    return (sum(math.log(SCORES[a]) for a in state) + (0.0 if answered(state) else unfinished_log_reward)) / (
        reward_temperature
    )


def target_distribution(unfinished_log_reward: float, reward_temperature: float = 1.0) -> dict:
    """R/Z over the terminal states with at least one step."""
    rewards = {
        s: math.exp(log_reward(s, unfinished_log_reward, reward_temperature))
        for d in range(1, DEPTH + 1)
        for s in itertools.product(ACTIONS, repeat=d)
    }
    z = sum(rewards.values())
    return {s: r / z for s, r in rewards.items()}


def total_variation(p: dict, q: dict) -> float:
    return 0.5 * sum(abs(p.get(k, 0.0) - q.get(k, 0.0)) for k in set(p) | set(q))


class LowRankPolicy(torch.nn.Module):
    """Softmax over (A, B, C, stop) with logits E[s] W (E: a rank-RANK embedding per state, W
    shared); only stop at the maximum depth. W starts at 0: every state starts uniform."""

    def __init__(self, seed: int = 0):
        super().__init__()
        self.states = states()
        self.index = {s: i for i, s in enumerate(self.states)}
        generator = torch.Generator().manual_seed(seed)
        self.embedding = torch.nn.Parameter(torch.randn(len(self.states), RANK, generator=generator))
        self.shared = torch.nn.Parameter(torch.zeros(RANK, len(ACTIONS) + 1))

    def dist(self, state: tuple[str, ...]) -> torch.Tensor:
        if len(state) == DEPTH:
            return torch.tensor([-math.inf] * len(ACTIONS) + [0.0])
        return torch.log_softmax(self.embedding[self.index[state]] @ self.shared, dim=-1)

    def features(self, state: tuple[str, ...]) -> torch.Tensor:
        """(HIDDEN,) what a flow head reads at ``state``: its embedding (shared with the policy's
        logits, so the flow's gradient reaches them as an LM's hidden state does) and its one-hot."""
        one_hot = torch.zeros(len(self.states))
        one_hot[self.index[state]] = 1.0
        return torch.cat([self.embedding[self.index[state]], one_hot])

    def sample(self, prompts, n, temperature, seed=None):
        seeds = seed if isinstance(seed, list) else [seed or 0] * len(prompts)
        out = []
        for prompt_seed in seeds:
            generator = torch.Generator().manual_seed(prompt_seed)
            solutions = []
            for _ in range(n):
                state: tuple[str, ...] = ()
                while True:
                    probs = torch.softmax(self.dist(state).detach() / temperature, -1)
                    action = int(torch.multinomial(probs, 1, generator=generator))
                    if action == len(ACTIONS):
                        break
                    state = state + (ACTIONS[action],)
                solutions.append(SampledSolution(list(state), True, len(state)))
            out.append(solutions)
        return out

    def logprobs(self, prompts, step_lists, with_grad, return_entropy=False, return_hidden=False):
        batch, width = len(step_lists), max(len(s) for s in step_lists)
        zero = torch.zeros(())
        forward, stop, entropy = [], [], []
        for steps in step_lists:
            row_forward, row_stop, row_entropy = [], [], []
            for k in range(len(steps) + 1):
                d = self.dist(tuple(steps[:k]))
                row_stop.append(d[len(ACTIONS)])
                if k < len(steps):
                    row_forward.append(d[ACTIONS.index(steps[k])])
                    p = d.exp()
                    row_entropy.append(-(p[p > 0] * d[p > 0]).sum())
            pad = width - len(steps)
            forward.append(torch.stack(row_forward + [zero] * pad))
            stop.append(torch.stack(row_stop + [zero] * pad))
            entropy.append(torch.stack(row_entropy + [zero] * pad))
        mask = torch.tensor([[k < len(s) for k in range(width)] for s in step_lists])
        hidden = torch.zeros(batch, width + 1, HIDDEN)
        for b, steps in enumerate(step_lists):
            for k in range(len(steps) + 1):
                state = tuple(steps[:k])
                if len(state) < DEPTH:  # a state with an action left; the deepest has no flow to learn
                    hidden[b, k] = self.features(state)
        return SimpleNamespace(
            step_logprobs=torch.stack(forward),
            termination_logprobs=torch.stack(stop),
            mask=mask,
            num_steps=mask.sum(1),
            step_entropy=torch.stack(entropy),
            boundary_hidden=hidden if return_hidden else None,
        )

    def after_update(self, version, weights=None):
        pass  # it samples from its live parameters

    def load_weights(self, state, version):
        self.load_state_dict(dict(state))

    def plain_stream(self, weights):
        return weights

    def terminal_distribution(self) -> dict:
        """Exact distribution of the terminal states with at least one step (the trainer drops
        empty samples, so the distribution compared with R/Z is conditioned on one step or more)."""
        probs = {}
        with torch.no_grad():
            for d in range(DEPTH + 1):
                for state in itertools.product(ACTIONS, repeat=d):
                    logp = sum(float(self.dist(state[:k])[ACTIONS.index(state[k])]) for k in range(d))
                    probs[state] = math.exp(logp + float(self.dist(state)[len(ACTIONS)]))
        probs.pop(())
        total = sum(probs.values())
        return {s: p / total for s, p in probs.items()}


class KnownScorer:
    def log_scores_many(self, pairs):
        return [[math.log(SCORES[s]) for s in steps] for _, steps in pairs]


def make_trainer(cfg: GFNConfig, policy, out: Path) -> FinetuneTrainer:
    """The production loop around an enumerable policy: only the answer step states an answer,
    and every stated answer is correct."""
    objective = build_objective(cfg, policy, hidden_size=HIDDEN)
    updates = objective.updates_per_rollout
    base = TrainingBase(
        make_accelerator(ModelConfig(device="cpu", dtype="float32")),
        policy,
        optimizer_settings(cfg, updates),
        out,
        objective=objective,
        objective_lr=objective.lr,
        updates_per_record=updates,
        progress=False,
    )
    sampler = TrajectorySampler(
        policy,
        KnownScorer(),
        [TrainProblem("p0", "q", "q", "1")],
        "enumerable",
        cfg,
        extract=lambda step, kind: step if step == ANSWER_STEP else None,
        grade=lambda texts, golds, kind: [True] * len(texts),
    )
    return FinetuneTrainer(base, sampler, objective, cfg, progress=False)


def measure(loss: str, seed: int = 0, out: Path | None = None, **overrides) -> dict:
    """Train one loss on the world from seed ``seed``; the TV distance to R/Z before and after, and
    the mean of the last 20 records' residual shares (SubTB) and loss."""
    torch.manual_seed(seed)
    cfg = GFNConfig(**{**SETTINGS, "loss": loss, "lam": 1.0, "seed": seed, **overrides})
    policy = LowRankPolicy(seed)
    target = target_distribution(cfg.unfinished_log_reward, cfg.reward_temperature)
    before = total_variation(policy.terminal_distribution(), target)
    with tempfile.TemporaryDirectory() as scratch:
        history = make_trainer(cfg, policy, out or Path(scratch)).train()
    after = total_variation(policy.terminal_distribution(), target)
    tail = history[-20:]
    keys = [k for k in tail[0] if k.startswith("residual_")] + ["loss"]
    return {
        "loss": loss,
        "seed": seed,
        "tv_before": before,
        "tv_after": after,
        **{f"last20_{k}": sum(r[k] for r in tail) / len(tail) for k in keys},
        "first_loss": history[0]["loss"],
    }


def main(argv: list[str]) -> None:
    seed = int(argv[0]) if argv and "=" not in argv[0] else 0
    losses = [a.split("=", 1)[1] for a in argv if a.startswith("loss=")] or ["tb_vargrad", "subtb"]
    lr = [float(a.split("=", 1)[1]) for a in argv if a.startswith("lr=")]
    log_flow = [a.split("=", 1)[1] for a in argv if a.startswith("log_flow=")]
    overrides = {**({"lr": lr[-1]} if lr else {}), **({"log_flow": log_flow[-1]} if log_flow else {})}
    for loss in losses:
        result = measure(loss, seed, **overrides)
        print(" ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}" for k, v in result.items()), flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])
