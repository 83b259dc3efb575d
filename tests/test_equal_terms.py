"""The GFlowNet and PPO on equal terms: each section's regularised target, and configs/tiny.yaml's two sections."""

import math
from pathlib import Path

import pytest
import torch

from pipeline.config.loader import load_config
from pipeline.config.schema import GFNConfig, PPOConfig
from pipeline.finetune.gflownet import GFlowNetObjective
from pipeline.finetune.losses import _vargrad_target
from pipeline.finetune.objectives import RegularizedTarget, regularized_target
from pipeline.finetune.rewards import CORRECT_ANSWER, NO_ANSWER, WRONG_ANSWER, shaped_log_rewards

REPO = Path(__file__).resolve().parents[1]


def test_tiny_yaml_gives_the_judged_learners_one_likelihood_and_budget_and_their_declared_targets():
    """The paper's comparison: one likelihood L = prod U, two learners. Both see log U per step and the
    same penalty for an unanswered solution, on the same problems, batches, updates and sampling; the
    GFlowNet samples in proportion to pi_ref x L, PPO maximises E[log L] (the paper's clip, value and
    entropy coefficients, no KL term, at least two epochs per batch)."""
    config = load_config(REPO / "configs" / "tiny.yaml", [])
    gfn, ppo = config.gfn, config.ppo
    # one likelihood: log U per step, untempered, the same unfinished-state penalty, no outcome term
    assert ppo.step_reward == "log_score" and gfn.reward_temperature == 1.0 and gfn.outcome_coef == 0.0
    assert ppo.unfinished_reward == gfn.unfinished_log_reward
    # one budget: the same problems, trajectories per update, updates, schedule and sampling; each
    # learner's learning rate (and PPO's epochs) its own equal-effort choice among six configurations
    assert (gfn.questions_per_step, gfn.samples_per_question) == (ppo.questions_per_step, ppo.samples_per_question)
    assert gfn.num_train_steps == ppo.num_train_steps and gfn.snapshot_every == ppo.snapshot_every
    assert (gfn.lr, ppo.lr, ppo.ppo_epochs) == (1.0e-4, 3.0e-4, 4)
    assert (gfn.scheduler, gfn.warmup_steps, gfn.temperature, gfn.seed) == (
        ppo.scheduler,
        ppo.warmup_steps,
        ppo.temperature,
        ppo.seed,
    )
    # two targets, as declared: the GFlowNet's pi_ref x L; PPO's pure maximisation of log L with an
    # entropy bonus (temperature 0.01, no prior: kl_coef 0), which puts its mass on the likeliest solutions
    assert regularized_target(gfn) == RegularizedTarget("log_score", 1.0, 1.0, gfn.unfinished_log_reward)
    assert regularized_target(ppo) == RegularizedTarget("log_score", 0.01, 0.0, gfn.unfinished_log_reward)
    assert (ppo.kl_coef, ppo.entropy_coef, ppo.clip, ppo.value_coef) == (0.0, 0.01, 0.2, 0.5)
    assert ppo.ppo_epochs >= 2 and GFlowNetObjective.updates_per_rollout == 1


def test_ppo_at_kl_coef_1_is_the_reported_row_with_the_gflownets_own_optimum():
    """The row reported beside the judged pair, "PPO at the GFlowNet's target": kl_coef 1 and no
    entropy bonus give PPO the optimum pi_ref x L, so it tests which learner gets there."""
    config = load_config(REPO / "configs" / "tiny.yaml", ["ppo.kl_coef=1", "ppo.entropy_coef=0"])
    assert regularized_target(config.ppo) == regularized_target(config.gfn)


def test_ppo_target_is_the_optimum_of_reward_minus_kl_plus_entropy():
    """Maximise E_pi[G] - kl KL(pi || ref) + ent H(pi) over a distribution on six trajectories by
    gradient ascent; it lands on ref^prior x exp(G / temperature), normalised."""
    g = torch.tensor([-1.0, -2.5, -0.3, -4.0, -1.2, -0.8], dtype=torch.float64)
    log_ref = torch.log_softmax(torch.tensor([0.5, 1.5, -1.0, 0.0, 2.0, -0.5], dtype=torch.float64), 0)
    for kl, ent in [(0.25, 0.0), (0.25, 0.05), (1.0, 0.5)]:
        target = regularized_target(PPOConfig(step_reward="log_score", kl_coef=kl, entropy_coef=ent))
        logits = torch.zeros(6, dtype=torch.float64, requires_grad=True)
        optimizer = torch.optim.LBFGS(
            [logits], max_iter=500, tolerance_grad=1e-12, tolerance_change=1e-14, line_search_fn="strong_wolfe"
        )

        def closure():
            optimizer.zero_grad()
            log_pi = torch.log_softmax(logits, 0)
            pi = log_pi.exp()
            loss = -((pi * g).sum() - kl * (pi * (log_pi - log_ref)).sum() - ent * (pi * log_pi).sum())
            loss.backward()
            return loss

        optimizer.step(closure)
        predicted = torch.softmax(target.prior * log_ref + g / target.temperature, 0)
        assert torch.allclose(torch.softmax(logits.detach(), 0), predicted, atol=1e-6), (kl, ent)
    assert regularized_target(PPOConfig(kl_coef=0.0, entropy_coef=0.0)).temperature == 0  # pure maximisation
    assert regularized_target(PPOConfig()).reward == "score"


@pytest.mark.parametrize("loss,kl_coef", [("tb_vargrad", 0.0), ("tb_vargrad", 0.5), ("subtb", 0.5)])
def test_gflownet_target_is_what_its_loss_samples_in_proportion_to(loss, kl_coef):
    """log of the target density the losses use (the shaped terminal log R, and TB-VarGrad's
    pi_ref x R^(1/beta)) equals prior x log pi_ref + G / temperature, G the unshaped return."""
    cfg = GFNConfig(
        loss=loss,
        kl_coef=kl_coef,
        reward_temperature=0.25,
        reference_prior_coef=0.7,
        outcome_coef=1.0,
        outcome_floor=0.1,
        unfinished_log_reward=-10.0,
    )
    target = regularized_target(cfg)
    scores = torch.tensor([[-1.0, -0.5, -0.2], [-2.0, -0.1, 0.0], [-0.3, 0.0, 0.0]], dtype=torch.float64)
    flags = torch.tensor(
        [
            [NO_ANSWER, NO_ANSWER, CORRECT_ANSWER],
            [NO_ANSWER, WRONG_ANSWER, NO_ANSWER],
            [NO_ANSWER, NO_ANSWER, NO_ANSWER],
        ]
    )
    mask = torch.tensor([[True, True, True], [True, True, False], [True, False, False]])
    ref = torch.tensor([[-0.4, -1.1, -0.2], [-0.9, -0.3, 0.0], [-2.0, 0.0, 0.0]], dtype=torch.float64)
    log_r = shaped_log_rewards(
        scores,
        flags,
        mask,
        reward_temperature=cfg.reward_temperature,
        unfinished_log_reward=cfg.unfinished_log_reward,
        outcome_coef=cfg.outcome_coef,
        outcome_floor=cfg.outcome_floor,
        ref_step_logprobs=ref,
        reference_prior_coef=cfg.reference_prior_coef,
    )
    log_ref = (ref * mask).sum(1)
    lengths = mask.sum(1)
    beta = kl_coef if loss == "tb_vargrad" else 0.0
    used = _vargrad_target(log_r, lengths, log_ref if beta else None, beta)
    g = (scores * mask).sum(1) + torch.tensor(
        [0.0, math.log(0.1), -10.0], dtype=torch.float64
    )  # answered right, wrong, unanswered
    assert torch.allclose(used, target.prior * log_ref + g / target.temperature)
    assert (target.unfinished, target.outcome) == (-10.0, pytest.approx(math.log(0.1)))
