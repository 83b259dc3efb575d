"""The GFlowNet and PPO objectives on an environment small enough to enumerate.

A tabular policy chooses among the steps A, B, C or stops, up to depth 3, with known PRM step
scores. It runs through the same fine-tuning loop, training base, objectives, losses and replay
buffer as the language model; only the policy's two methods differ.
"""

import dataclasses
import itertools
import json
import math
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from pipeline.config.schema import GFNConfig, ModelConfig, PPOConfig
from pipeline.finetune.gflownet import proportionality_gap
from pipeline.finetune.objectives import build_objective
from pipeline.finetune.policy import SampledSolution
from pipeline.finetune.rewards import shaped_log_rewards
from pipeline.finetune.run import optimizer_settings
from pipeline.finetune.sampling import TrainProblem, TrajectorySampler
from pipeline.finetune.trainer import FinetuneTrainer
from pipeline.training import TrainingBase, make_accelerator

ACTIONS = ["A", "B", "C"]
SCORES = {"A": 0.9, "B": 0.6, "C": 0.3}
DEPTH = 3
HIDDEN = 8


class TabularPolicy(torch.nn.Module):
    """Softmax over (A, B, C, stop) in every state; only stop at the maximum depth."""

    def __init__(self):
        super().__init__()
        self.states = [s for d in range(DEPTH) for s in itertools.product(ACTIONS, repeat=d)]
        self.index = {s: i for i, s in enumerate(self.states)}
        self.logits = torch.nn.Parameter(torch.zeros(len(self.states), 4))
        self.features = torch.nn.Parameter(
            torch.randn(len(self.states) + 1, HIDDEN, generator=torch.Generator().manual_seed(0)), requires_grad=False
        )

    def dist(self, state):
        if len(state) == DEPTH:
            return torch.tensor([-math.inf] * 3 + [0.0])
        return torch.log_softmax(self.logits[self.index[state]], dim=-1)

    def sample(self, prompts, n, temperature, seed=None):
        seeds = seed if isinstance(seed, list) else [seed or 0] * len(prompts)
        out = []
        for prompt_seed in seeds:
            gen = torch.Generator().manual_seed(prompt_seed)
            sols = []
            for _ in range(n):
                state = ()
                while True:
                    probs = torch.softmax(self.dist(state).detach() / temperature, -1)
                    a = int(torch.multinomial(probs, 1, generator=gen))
                    if a == 3:
                        break
                    state = state + (ACTIONS[a],)
                sols.append(SampledSolution(list(state), True, len(state)))
            out.append(sols)
        return out

    def logprobs(self, prompts, step_lists, with_grad, return_entropy=False, return_hidden=False):
        B, T = len(step_lists), max(len(s) for s in step_lists)
        pf, pt, ent = [], [], []
        hidden = torch.zeros(B, T + 1, HIDDEN)
        for b, steps in enumerate(step_lists):
            rows_pf, rows_pt, rows_ent = [], [], []
            for k in range(len(steps) + 1):
                state = tuple(steps[:k])
                d = self.dist(state)
                rows_pt.append(d[3])
                hidden[b, k] = self.features[self.index.get(state, len(self.states))]
                if k < len(steps):
                    rows_pf.append(d[ACTIONS.index(steps[k])])
                    p = d.exp()
                    rows_ent.append(-(p[p > 0] * d[p > 0]).sum())
            pad = T - len(steps)
            zero = torch.zeros(())
            pf.append(torch.stack(rows_pf + [zero] * pad))
            pt.append(torch.stack(rows_pt + [zero] * pad))
            ent.append(torch.stack(rows_ent + [zero] * pad))
        mask = torch.tensor([[k < len(s) for k in range(T)] for s in step_lists])
        return SimpleNamespace(
            step_logprobs=torch.stack(pf),
            termination_logprobs=torch.stack(pt),
            mask=mask,
            num_steps=mask.sum(1),
            step_entropy=torch.stack(ent),
            boundary_hidden=hidden,
        )

    def after_update(self, version, weights=None):
        pass  # it samples from its live parameters

    def load_weights(self, state, version):  # an asynchronous searcher's copy, or a reset reference
        self.load_state_dict(dict(state))  # a state dict or a stream of (name, tensor)

    def plain_stream(self, weights):
        return weights  # no LoRA to merge

    def terminal_distribution(self):
        """Exact distribution of the terminal states with at least one step.

        Stopping at s_0 is not an action of the step-level policy (the trainer drops empty
        samples), so the distribution compared with R/Z is conditioned on at least one step.
        """
        probs = {}
        for d in range(DEPTH + 1):
            for state in itertools.product(ACTIONS, repeat=d):
                logp = sum(float(self.dist(state[:k])[ACTIONS.index(state[k])].detach()) for k in range(d))
                probs[state] = math.exp(logp + float(self.dist(state)[3].detach()))
        probs.pop(())
        total = sum(probs.values())
        return {s: p / total for s, p in probs.items()}


class KnownScorer:
    def log_scores_many(self, pairs):
        return [[math.log(SCORES[s]) for s in steps] for _, steps in pairs]


def target_distribution():
    rewards = {
        s: math.prod(SCORES[a] for a in s) for d in range(1, DEPTH + 1) for s in itertools.product(ACTIONS, repeat=d)
    }
    z = sum(rewards.values())
    return {s: r / z for s, r in rewards.items()}


def jsd(p, q):
    keys = sorted(set(p) | set(q))
    a, b = np.array([p.get(k, 0) for k in keys]), np.array([q.get(k, 0) for k in keys])
    m = (a + b) / 2
    kl = lambda x, y: float(np.sum(x[x > 0] * np.log(x[x > 0] / y[x > 0])))
    return 0.5 * kl(a, m) + 0.5 * kl(b, m)


def entropy(p):
    return -sum(v * math.log(v) for v in p.values() if v > 0)


def expected_reward(p):
    return sum(v * math.prod(SCORES[a] for a in s) for s, v in p.items() if s)


def make_trainer(cfg, policy, tmp_path):
    """The production loop around the tabular policy: every step states the (correct) answer."""
    objective = build_objective(cfg, policy, hidden_size=HIDDEN)
    updates = objective.updates_per_rollout
    base = TrainingBase(
        make_accelerator(ModelConfig(device="cpu", dtype="float32")),
        policy,
        optimizer_settings(cfg, updates),
        tmp_path,
        objective=objective,
        objective_lr=objective.lr,
        updates_per_record=updates,
        progress=False,
    )
    sampler = TrajectorySampler(
        policy,
        KnownScorer(),
        [TrainProblem("p0", "q", "q", "1")],
        "tiny",
        cfg,
        extract=lambda step, kind: step,
        grade=lambda texts, golds, kind: [True] * len(texts),
    )
    return FinetuneTrainer(base, sampler, objective, cfg, progress=False)


@pytest.mark.slow
@pytest.mark.parametrize("loss,replay_fraction", [("subtb", 0.5), ("tb_vargrad", 0.0), ("tb_vargrad", 0.5)])
def test_gflownet_learns_the_reward_proportional_distribution(tmp_path, loss, replay_fraction):
    torch.manual_seed(0)
    policy = TabularPolicy()
    cfg = GFNConfig(
        loss=loss,
        lr=0.1,
        scheduler="constant",
        warmup_steps=0,
        num_train_steps=250,
        questions_per_step=1,
        samples_per_question=16,
        micro_batch_size=64,
        temperature=1.0,
        replay_fraction=replay_fraction,
        buffer_size=100,
        save_every=0,
        grad_clip=10.0,
    )
    trainer = make_trainer(cfg, policy, tmp_path)
    before = jsd(policy.terminal_distribution(), target_distribution())
    history = trainer.train()
    after = jsd(policy.terminal_distribution(), target_distribution())
    assert after < 0.05 and after < before / 10, (before, after)
    assert np.mean([h["proportionality_gap"] for h in history[-20:]]) < np.mean(
        [h["proportionality_gap"] for h in history[:20]]
    )


@pytest.mark.slow
def test_ppo_maximises_reward_and_collapses_entropy_more_than_the_gflownet(tmp_path):
    results = {}
    for name in ("gfn", "ppo"):
        torch.manual_seed(0)
        policy = TabularPolicy()
        if name == "gfn":
            cfg = GFNConfig(
                lr=0.1,
                scheduler="constant",
                warmup_steps=0,
                num_train_steps=150,
                questions_per_step=1,
                samples_per_question=16,
                micro_batch_size=64,
                temperature=1.0,
                save_every=0,
                grad_clip=10.0,
            )
        else:
            cfg = PPOConfig(
                lr=0.1,
                scheduler="constant",
                warmup_steps=0,
                num_train_steps=150,
                questions_per_step=1,
                samples_per_question=16,
                micro_batch_size=64,
                temperature=1.0,
                save_every=0,
                ppo_epochs=2,
                grad_clip=10.0,
            )
        start = policy.terminal_distribution()
        make_trainer(cfg, policy, tmp_path / name).train()
        results[name] = (start, policy.terminal_distribution())
    (s0, ppo_end), (_, gfn_end) = results["ppo"], results["gfn"]
    assert expected_reward(ppo_end) > expected_reward(s0)
    assert expected_reward(ppo_end) > expected_reward(gfn_end)
    assert entropy(ppo_end) < entropy(gfn_end)


def test_replayed_trajectory_logprobs_change_after_an_optimizer_step(tmp_path):
    policy = TabularPolicy()
    cfg = GFNConfig(
        lr=0.1,
        num_train_steps=2,
        questions_per_step=1,
        samples_per_question=8,
        micro_batch_size=64,
        temperature=1.0,
        save_every=0,
        replay_fraction=1.0,
    )
    trainer = make_trainer(cfg, policy, tmp_path)
    history = trainer.train()
    # an update's rows are its fresh samples and the replayed ones (the record says how many of each)
    assert history[1]["replayed"] > 0
    assert [h["trained"] for h in history] == [h["sampled"] - h["empty_solutions"] + h["replayed"] for h in history]
    replayed = trainer.objective.buffer.sample(4)
    before = policy.logprobs(None, [t.steps for t in replayed], with_grad=False).step_logprobs.clone()
    trainer.train_step()
    after = policy.logprobs(None, [t.steps for t in replayed], with_grad=False).step_logprobs
    assert not torch.allclose(before, after)


def test_stopping_early_or_without_answer_is_not_a_cheap_reward():
    # Two steps scored 0.5 each, the second states the answer; one trajectory stops after step 1.
    scores = torch.log(torch.tensor([[0.5, 0.5]]))
    flags = torch.tensor([[-1, 1]])
    log_r = shaped_log_rewards(scores, flags, torch.tensor([[True, True]]), unfinished_log_reward=-10.0)
    assert log_r[0, 2] == pytest.approx(2 * math.log(0.5))
    assert log_r[0, 0] < log_r[0, 2] and log_r[0, 1] < log_r[0, 2], "s_0 and the unanswered s_1 pay the penalty"
    # Without the penalty the shortest prefix would be the best place to stop.
    raw = shaped_log_rewards(scores, flags, torch.tensor([[True, True]]), unfinished_log_reward=0.0)
    assert raw[0, 0] > raw[0, 2]


def test_shaped_rewards_temperature_outcome_and_padding():
    scores = torch.log(torch.tensor([[0.5, 0.25, 0.9], [0.8, 0.0001, 0.0001]]))
    flags = torch.tensor([[-1, -1, 0], [1, -1, -1]])
    mask = torch.tensor([[True, True, True], [True, False, False]])
    log_r = shaped_log_rewards(
        scores, flags, mask, reward_temperature=0.5, unfinished_log_reward=-3.0, outcome_coef=1.0, outcome_floor=0.1
    )
    # 1/tau = 2 tempers the whole shaped reward: PRM term, penalty and outcome term
    expected0 = [-6.0, 2 * math.log(0.5) - 6, 2 * math.log(0.125) - 6, 2 * math.log(0.1125) + 2 * math.log(0.1)]
    assert log_r[0].tolist() == pytest.approx(expected0)
    assert log_r[1, :2].tolist() == pytest.approx([-6.0, 2 * math.log(0.8)])


def test_a_sharpened_reward_never_makes_stopping_at_s0_cheaper_than_answering():
    # A four-step answered solution with log R = 4 log 0.1 = -9.2 beats s_0 (penalty -10) at
    # tau = 1; tempering must keep that order at every tau, as R^(1/tau) of the shaped reward does.
    scores = torch.log(torch.full((1, 4), 0.1))
    flags = torch.tensor([[-1, -1, -1, 1]])
    mask = torch.ones(1, 4, dtype=torch.bool)
    for tau in (1.0, 0.5, 0.25, 0.1):
        log_r = shaped_log_rewards(scores, flags, mask, reward_temperature=tau, unfinished_log_reward=-10.0)
        assert log_r[0, 0] < log_r[0, 4], f"tau={tau}: stopping at s_0 beats the answered solution"
        assert log_r[0, :4].max() < log_r[0, 4]


def test_proportionality_gap_is_zero_under_exact_proportional_sampling():
    log_r = torch.tensor([math.log(0.5), math.log(0.25), math.log(0.2), math.log(0.4)])
    log_pi = log_r - torch.tensor([1.0, 1.0, 2.0, 2.0])
    assert proportionality_gap(log_pi, log_r, ["a", "a", "b", "b"]) == pytest.approx(0.0)
    assert proportionality_gap(
        log_pi + torch.tensor([0.0, 1.0, 0.0, 0.0]), log_r, ["a", "a", "b", "b"]
    ) == pytest.approx(0.25)


def test_an_interrupted_run_resumes_from_its_checkpoint_to_the_same_policy(tmp_path):
    def run(out, steps, interrupt_at=None):
        torch.manual_seed(0)
        policy = TabularPolicy()
        cfg = GFNConfig(
            lr=0.1,
            scheduler="constant",
            warmup_steps=0,
            num_train_steps=steps,
            questions_per_step=1,
            samples_per_question=8,
            micro_batch_size=64,
            temperature=1.0,
            save_every=2,
            replay_fraction=0.5,
        )
        if interrupt_at is not None:  # the same run, killed right after its step-`interrupt_at` checkpoint
            killed = GFNConfig(**{**cfg.__dict__, "num_train_steps": interrupt_at + 1})
            make_trainer(killed, policy, out).train()
            torch.manual_seed(0)
            policy = TabularPolicy()  # a fresh process: weights come back from the checkpoint
        trainer = make_trainer(cfg, policy, out)
        history = trainer.train()
        return policy, trainer, history

    straight, _, _ = run(tmp_path / "straight", 6)
    resumed, trainer, history = run(tmp_path / "resumed", 6, interrupt_at=4)
    assert history[0]["step"] == 5  # steps 1-4 came from the checkpoint
    steps = [json.loads(line)["step"] for line in (tmp_path / "resumed" / "metrics.jsonl").read_text().splitlines()]
    assert steps == [1, 2, 3, 4, 5, 6]  # the killed run's step 5 was dropped and redone
    assert torch.allclose(straight.logits, resumed.logits, atol=1e-6)


def test_the_importance_correction_weights_each_trajectory_by_its_clipped_ratio_to_the_weights_that_sampled_it():
    """The sampler records log pi(tau) under the weights that sampled it; after an update the
    objective's TB-VarGrad losses are the uncorrected ones times min(max(pi / pi_sampled, 0), 8)."""
    import dataclasses

    policy = TabularPolicy()
    cfg = GFNConfig(
        loss="tb_vargrad", questions_per_step=2, samples_per_question=6, temperature=1.0, importance_correction=True
    )
    problems = [TrainProblem(f"p{i}", "q", "q", "1") for i in range(2)]
    every_step, all_true = (lambda step, kind: step), (lambda texts, golds, kind: [True] * len(texts))
    sampler = TrajectorySampler(policy, KnownScorer(), problems, "tiny", cfg, extract=every_step, grade=all_true)
    batch, _ = sampler.sample(0)
    with torch.no_grad():
        lp = policy.logprobs(None, [t.steps for t in batch], with_grad=False)
    sampled = [
        float(lp.step_logprobs[i, : len(t.steps)].sum() + lp.termination_logprobs[i, len(t.steps)])
        for i, t in enumerate(batch)
    ]
    assert [t.sampling_logprob for t in batch] == pytest.approx(sampled, abs=1e-6)
    off = dataclasses.replace(cfg, importance_correction=False)
    plain = TrajectorySampler(policy, KnownScorer(), problems, "tiny", off, extract=every_step, grade=all_true)
    assert all(t.sampling_logprob is None for t in plain.sample(0)[0])

    # the policy moves on; one trajectory's sampler was far less likely to sample it (clipped at 8)
    with torch.no_grad():
        policy.logits.add_(torch.randn(policy.logits.shape, generator=torch.Generator().manual_seed(5)))
    batch[0] = dataclasses.replace(batch[0], sampling_logprob=batch[0].sampling_logprob - 30.0)
    corrected, extras = build_objective(cfg, policy, hidden_size=HIDDEN).trajectory_losses(batch)
    uncorrected, _ = build_objective(off, policy, hidden_size=HIDDEN).trajectory_losses(batch)
    now = extras["log_pi"].tolist()
    weights = [min(max(math.exp(new - t.sampling_logprob), 0.0), 8.0) for new, t in zip(now, batch)]
    assert weights[0] == 8.0 and len(set(weights)) > 2
    expected = [w * float(loss) for w, loss in zip(weights, uncorrected.detach())]
    assert corrected.detach().tolist() == pytest.approx(expected, rel=1e-6)  # the float32 losses, weighted
    assert corrected.requires_grad

    batch[1] = dataclasses.replace(batch[1], sampling_logprob=None)
    with pytest.raises(ValueError, match="gfn.importance_correction: trajectories of \\['p"):
        build_objective(cfg, policy, hidden_size=HIDDEN).trajectory_losses(batch)


@pytest.mark.parametrize(
    "override, key",
    [
        ("gfn.importance_clip_low=1.5", "gfn.importance_clip_low"),
        ("gfn.importance_clip_high=0.9", "gfn.importance_clip_high"),
    ],
)
def test_an_importance_clip_that_excludes_one_is_refused_at_config_load_naming_the_key(override, key):
    from pipeline.config.loader import ConfigError, load_config

    with pytest.raises(ConfigError, match=key.replace(".", "\\.")):
        load_config(overrides=[override])


def test_a_subtb_update_logs_the_shares_of_its_residuals_from_the_same_forward(tmp_path):
    from pipeline.finetune.subtb_residuals import RESIDUAL_SHARES, RESIDUAL_TERMS

    cfg = GFNConfig(
        loss="subtb", num_train_steps=2, questions_per_step=1, samples_per_question=8, temperature=1.0, save_every=0
    )
    trainer = make_trainer(cfg, TabularPolicy(), tmp_path)
    calls = []
    logprobs = trainer.objective.policy.logprobs
    trainer.objective.policy.logprobs = lambda *a, **k: calls.append(1) or logprobs(*a, **k)
    record = trainer.train_step()
    assert len(calls) == 1  # one micro-batch, one forward: the decomposition reads its tensors
    shares = {name: record[f"residual_{name}"] for name in RESIDUAL_SHARES}
    assert all(math.isfinite(v) for v in shares.values()), shares
    assert sum(shares[f"{name}_term_share"] for name in RESIDUAL_TERMS) == pytest.approx(1.0)
    assert 0.0 <= shares["question_mean_share"] <= shares["trajectory_mean_share"] <= 1.0
    # every step states the answer here: only s_0 is unanswered, so the penalty is in every pair (0, j)
    assert shares["unfinished_pair_share"] > 0.0
    logged = json.loads((tmp_path / "metrics.jsonl").read_text().splitlines()[-1])
    assert logged["residual_stop_term_share"] == pytest.approx(shares["stop_term_share"])


def test_subtb_with_a_learned_log_flow_trains_its_head_on_the_policys_states(tmp_path):
    """gfn.log_flow=learned: a flow head on the policy's hidden state, read from the one teacher-forced
    forward, trained and saved with the objective; the default reads no hidden state and has no head."""
    cfg = GFNConfig(
        loss="subtb",
        log_flow="learned",
        num_train_steps=3,
        questions_per_step=1,
        samples_per_question=8,
        temperature=1.0,
        save_every=0,
    )
    trainer = make_trainer(cfg, TabularPolicy(), tmp_path)
    objective = trainer.objective
    assert objective.reads_hidden and set(objective.state_dict()) >= {"flow_head.weight", "flow_head.bias"}
    asked = []
    logprobs = objective.policy.logprobs
    objective.policy.logprobs = lambda *a, **k: asked.append(k.get("return_hidden")) or logprobs(*a, **k)
    records = [trainer.train_step() for _ in range(3)]
    assert asked and all(asked)
    assert objective.flow_head.weight.abs().sum() > 0 and objective.flow_head.bias.item() != 0.0
    assert all(math.isfinite(r["log_flow_s0"]) for r in records)
    # the head starts at 0, so its part of the residual is 0 until it has moved
    assert records[0]["residual_flow_term_share"] == 0.0 and records[-1]["residual_flow_term_share"] != 0.0
    # the head's log F(s_0) is the amortised log Z: it moves toward the log-rewards the trajectories reach
    assert records[-1]["log_flow_s0"] != records[0]["log_flow_s0"]
    plain = make_trainer(dataclasses.replace(cfg, log_flow="stop"), TabularPolicy(), tmp_path / "plain")
    assert plain.objective.flow_head is None and not plain.objective.reads_hidden
    assert "log_flow_s0" not in plain.train_step()


def test_an_unknown_log_flow_is_refused_at_config_load_naming_the_key():
    from pipeline.config.loader import ConfigError, load_config

    with pytest.raises(ConfigError, match=r"gfn\.log_flow"):
        load_config(overrides=["gfn.log_flow=value"])


@pytest.mark.slow
def test_on_the_enumerable_world_subtb_with_a_learned_log_flow_ends_nearer_its_target_than_tb_vargrad():
    """The LM's conditions on an enumerable world (perf/subtb_enumerable.py: shared low-rank logits,
    every unanswered state penalised): within TB-VarGrad's budget (200 updates of 16, lr 0.03),
    SubTB with a learned log-flow ends nearer R/Z than TB-VarGrad does and than SubTB with the stop
    identity (measured on seeds 0-2: 0.148 / 0.234 / 0.103 against 0.250 / 0.339 / 0.283 and
    0.295 / 0.496 / 0.410; docs/results/gflownet.md)."""
    from perf.subtb_enumerable import measure

    learned = measure("subtb", 0, lr=0.03, log_flow="learned")
    stop = measure("subtb", 0, lr=0.03, log_flow="stop")
    vargrad = measure("tb_vargrad", 0, lr=0.03)
    assert learned["tv_after"] < vargrad["tv_after"] < learned["tv_before"]
    assert learned["tv_after"] < stop["tv_after"]
