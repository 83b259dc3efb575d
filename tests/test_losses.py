"""The GFlowNet and PPO losses against slow float64 references written the obvious way."""

from __future__ import annotations

import math

import pytest
import torch

from pipeline.finetune.losses import (
    clipped_importance_ratio,
    gae,
    importance_weighted_losses,
    learned_flow_states,
    ppo_loss,
    subtb_loss,
    subtb_pair_residuals,
    tb_vargrad_loss,
    trajectory_balance_loss,
    trajectory_logprob,
    vargrad_log_z,
)

LAMBDAS = [0.0, 0.5, 0.9, 1.0, 2.0]
LENGTHS = [1, 4, 2, 5, 3, 5, 1]  # varied lengths, T = 5: padding in most rows
GROUPS = [0, 0, 1, 1, 1, 2, 0]  # questions of the rows above (K = 3, 3, 1)


def make_batch(lengths=LENGTHS, seed=0, padding=1e6, dtype=torch.float64):
    """A random trajectory batch whose padded entries all hold `padding`."""
    generator = torch.Generator().manual_seed(seed)
    batch, steps = len(lengths), max(lengths)
    mask = torch.arange(steps)[None, :] < torch.tensor(lengths)[:, None]
    states = torch.arange(steps + 1)[None, :] <= torch.tensor(lengths)[:, None]
    log_pf = -3.0 * torch.rand(batch, steps, generator=generator, dtype=torch.float64)
    log_pterm = -4.0 * torch.rand(batch, steps + 1, generator=generator, dtype=torch.float64)
    log_r = torch.cumsum(-torch.rand(batch, steps + 1, generator=generator, dtype=torch.float64), 1)
    log_pf = torch.where(mask, log_pf, torch.tensor(padding, dtype=torch.float64))
    log_pterm = torch.where(states, log_pterm, torch.tensor(-padding, dtype=torch.float64))
    log_r = torch.where(states, log_r, torch.tensor(padding, dtype=torch.float64))
    return log_pf.to(dtype), log_pterm.to(dtype), log_r.to(dtype), mask


# ----------------------------------------------------------------------------- brute-force references


def brute_residual(log_pf, log_pterm, log_r, b, i, j):
    """Lists of lists in, a float out: no tensor op between the reference and the inputs."""
    return (
        log_r[b][i]
        + sum(log_pf[b][k - 1] for k in range(i + 1, j + 1))
        + log_pterm[b][j]
        - log_r[b][j]
        - log_pterm[b][i]
    )


def brute_subtb(log_pf, log_pterm, log_r, mask, lam):
    log_pf, log_pterm, log_r = (x.double().tolist() for x in (log_pf, log_pterm, log_r))
    out = []
    for b, n in enumerate(mask.sum(1).tolist()):
        numerator = denominator = 0.0
        for i in range(n + 1):
            for j in range(i + 1, n + 1):
                weight = (1.0 if j - i == 1 else 0.0) if lam == 0 else lam ** (j - i)
                numerator += weight * brute_residual(log_pf, log_pterm, log_r, b, i, j) ** 2
                denominator += weight
        out.append(numerator / denominator)
    return torch.tensor(out, dtype=torch.float64)


def brute_log_pi(log_pf, log_pterm, mask):
    log_pf, log_pterm = log_pf.double().tolist(), log_pterm.double().tolist()
    return [sum(log_pf[b][:n]) + log_pterm[b][n] for b, n in enumerate(mask.sum(1).tolist())]


def brute_target(log_r, mask, log_ref, beta):
    out = []
    for b, n in enumerate(mask.sum(1).tolist()):
        out.append(log_r[b, n].item() if beta == 0 else log_r[b, n].item() / beta + log_ref[b].item())
    return out


def brute_vargrad(log_pf, log_pterm, log_r, mask, groups, log_ref=None, beta=0.0):
    log_pi = brute_log_pi(log_pf, log_pterm, mask)
    target = brute_target(log_r, mask, log_ref, beta)
    log_z, loss = [], []
    for b, group in enumerate(groups):
        members = [c for c, other in enumerate(groups) if other == group]
        log_z.append(sum(target[c] - log_pi[c] for c in members) / len(members))
        loss.append((log_z[b] + log_pi[b] - target[b]) ** 2)
    return torch.tensor(log_z, dtype=torch.float64), torch.tensor(loss, dtype=torch.float64)


# ----------------------------------------------------------------------------- SubTB(lambda)


@pytest.mark.parametrize("lam", LAMBDAS)
def test_subtb_matches_brute_force(lam):
    for seed in range(3):
        batch = make_batch(seed=seed)
        expected = brute_subtb(*batch, lam)
        torch.testing.assert_close(subtb_loss(*batch, lam=lam), expected, rtol=1e-10, atol=1e-12)


def test_subtb_pair_residuals_match_brute_force():
    log_pf, log_pterm, log_r, mask = make_batch(seed=1)
    residual = subtb_pair_residuals(log_pf, log_pterm, log_r, mask)
    assert residual.shape == (len(LENGTHS), 6, 6)
    log_pf, log_pterm, log_r = log_pf.tolist(), log_pterm.tolist(), log_r.tolist()
    for b, n in enumerate(LENGTHS):
        for i in range(6):
            for j in range(6):
                expected = brute_residual(log_pf, log_pterm, log_r, b, i, j) if i < j <= n else 0.0
                assert residual[b, i, j].item() == pytest.approx(expected, rel=1e-12, abs=1e-12)


def random_learned_flows(lengths=LENGTHS, seed=5):
    """(log_flow, learned, unanswered): random log-flows, the states that use them by the objective's
    rule (unanswered and not a trajectory's last), the unanswered flags drawn at random."""
    generator = torch.Generator().manual_seed(seed)
    steps = max(lengths)
    log_flow = -5.0 * torch.rand(len(lengths), steps + 1, generator=generator, dtype=torch.float64)
    unanswered = torch.rand(len(lengths), steps + 1, generator=generator) < 0.7
    unanswered[:, 0] = True
    mask = torch.arange(steps)[None, :] < torch.tensor(lengths)[:, None]
    return log_flow, learned_flow_states(unanswered, mask), unanswered


def brute_subtb_learned(log_pf, log_pterm, log_r, mask, lam, log_flow, learned):
    """SubTB with log F(s_k) = log_flow where learned, else log R - log pi(s_f|.): pairs visited one by one."""
    pf, pt, lr, lf = (x.double().tolist() for x in (log_pf, log_pterm, log_r, log_flow))
    use = learned.tolist()
    out = []
    for b, n in enumerate(mask.sum(1).tolist()):
        flow = [lf[b][k] if use[b][k] else lr[b][k] - pt[b][k] for k in range(n + 1)]
        numerator = denominator = 0.0
        for i in range(n + 1):
            for j in range(i + 1, n + 1):
                weight = (1.0 if j - i == 1 else 0.0) if lam == 0 else lam ** (j - i)
                residual = flow[i] + sum(pf[b][k - 1] for k in range(i + 1, j + 1)) - flow[j]
                numerator += weight * residual**2
                denominator += weight
        out.append(numerator / denominator)
    return torch.tensor(out, dtype=torch.float64)


def test_learned_flow_states_are_the_unanswered_ones_before_the_last():
    mask = torch.tensor([[True, True, True], [True, False, False]])
    unanswered = torch.tensor([[True, True, False, True], [True, True, True, True]])
    assert learned_flow_states(unanswered, mask).tolist() == [[True, True, False, False], [True, False, False, False]]
    with pytest.raises(ValueError, match="unanswered"):
        learned_flow_states(unanswered[:, :3], mask)


@pytest.mark.parametrize("lam", LAMBDAS)
def test_subtb_with_learned_flows_matches_brute_force(lam):
    for seed in range(3):
        batch = make_batch(seed=seed)
        log_flow, learned, _ = random_learned_flows(seed=seed + 7)
        expected = brute_subtb_learned(*batch, lam, log_flow, learned)
        got = subtb_loss(*batch, lam=lam, log_flow=log_flow, learned=learned)
        torch.testing.assert_close(got, expected, rtol=1e-10, atol=1e-12)
        # no state learned: the paper's SubTB, whatever log_flow holds
        nowhere = torch.zeros_like(learned)
        torch.testing.assert_close(
            subtb_loss(*batch, lam=lam, log_flow=log_flow, learned=nowhere), subtb_loss(*batch, lam=lam)
        )


def test_a_learned_flow_frees_its_states_stop_log_prob_and_takes_the_gradient():
    log_pf, log_pterm, log_r, mask = make_batch(padding=0.0)
    log_flow, learned, _ = random_learned_flows()
    log_pterm, log_r, log_flow = (x.clone().requires_grad_(True) for x in (log_pterm, log_r, log_flow))
    subtb_loss(log_pf, log_pterm, log_r, mask, lam=0.9, log_flow=log_flow, learned=learned).sum().backward()
    states = torch.arange(mask.shape[1] + 1)[None, :] <= mask.sum(1)[:, None]
    assert (log_pterm.grad[learned] == 0).all() and (log_r.grad[learned] == 0).all()
    assert (log_flow.grad[learned] != 0).all() and (log_flow.grad[~learned] == 0).all()
    assert (log_pterm.grad[states & ~learned] != 0).all()  # every other state keeps its stop identity
    residual = subtb_pair_residuals(log_pf, log_pterm.detach(), log_r.detach(), mask, log_flow.detach(), learned)
    assert residual.shape == (len(LENGTHS), 6, 6)


def test_a_learned_flow_needs_both_tensors_of_the_right_shapes():
    batch = make_batch()
    log_flow, learned, _ = random_learned_flows()
    for kwargs, match in (
        ({"log_flow": log_flow}, "give both"),
        ({"learned": learned}, "give both"),
        ({"log_flow": log_flow[:, :-1], "learned": learned}, "log_flow"),
        ({"log_flow": log_flow, "learned": learned.double()}, "learned"),
    ):
        with pytest.raises(ValueError, match=match):
            subtb_loss(*batch, **kwargs)


def balanced_batch(seed=0):
    """log_pf chosen so that every sub-trajectory balances: log F(s_k) - C_k is the same for all k."""
    log_pf, log_pterm, log_r, mask = make_batch(seed=seed)
    log_flow = log_r - log_pterm  # log F(s_k), with F(s_k) pi(s_f|s_k) = R(s_k)
    balanced = log_flow[:, 1:] - log_flow[:, :-1]
    return torch.where(mask, balanced, log_pf), log_pterm, log_r, mask


@pytest.mark.parametrize("lam", LAMBDAS)
def test_subtb_is_zero_on_a_balanced_flow(lam):
    batch = balanced_batch()
    assert subtb_loss(*batch, lam=lam).abs().max().item() < 1e-10
    log_pf, log_pterm, log_r, mask = batch
    unbalanced = log_pf.clone()
    unbalanced[3, 2] += 0.1  # one step off balance: every pair straddling it pays
    assert subtb_loss(unbalanced, log_pterm, log_r, mask, lam=lam)[3].item() > 1e-4


def test_lambda_zero_is_the_limit_of_small_lambda():
    batch = make_batch(seed=2)
    torch.testing.assert_close(subtb_loss(*batch, lam=0.0), subtb_loss(*batch, lam=1e-9), rtol=1e-7, atol=0)


def test_subtb_large_lambda_and_long_trajectories_stay_finite_in_float32():
    lengths = [120, 7, 60]
    batch64 = make_batch(lengths, seed=3)
    batch32 = make_batch(lengths, seed=3, dtype=torch.float32)
    for lam in (0.01, 3.0):
        loss32 = subtb_loss(*batch32, lam=lam)
        assert loss32.dtype == torch.float32 and torch.isfinite(loss32).all()
        torch.testing.assert_close(loss32.double(), subtb_loss(*batch64, lam=lam), rtol=1e-4, atol=1e-4)


def test_half_precision_inputs_are_computed_in_float32():
    batch64 = make_batch(seed=4, padding=1e3)
    log_pf, log_pterm, log_r, mask = (x.to(torch.bfloat16) if x.is_floating_point() else x for x in batch64)
    loss = subtb_loss(log_pf, log_pterm, log_r, mask, lam=0.9)
    assert loss.dtype == torch.float32
    reference = subtb_loss(log_pf.double(), log_pterm.double(), log_r.double(), mask, lam=0.9)
    torch.testing.assert_close(loss.double(), reference, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("lam", [0.0, 0.9, 2.0])
def test_padding_values_do_not_change_results_or_gradients(lam):
    group = torch.tensor(GROUPS)
    results = []
    for padding in (0.0, 1e6, float("inf")):
        log_pf, log_pterm, log_r, mask = (
            x.requires_grad_() if x.is_floating_point() else x for x in make_batch(seed=5, padding=padding)
        )
        losses = [
            subtb_loss(log_pf, log_pterm, log_r, mask, lam=lam),
            trajectory_balance_loss(log_pf, log_pterm, log_r, mask, torch.tensor(0.3, dtype=torch.float64)),
            tb_vargrad_loss(log_pf, log_pterm, log_r, mask, group),
        ]
        sum(loss.sum() for loss in losses).backward()
        results.append([loss.detach() for loss in losses] + [log_pf.grad, log_pterm.grad, log_r.grad])
        states = torch.arange(6)[None, :] <= mask.sum(1)[:, None]
        assert (log_pf.grad[~mask] == 0).all()
        assert (log_pterm.grad[~states] == 0).all() and (log_r.grad[~states] == 0).all()
    for other in results[1:]:
        for a, b in zip(results[0], other):
            torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_subtb_gradient_flows_to_every_step_and_termination():
    log_pf, log_pterm, log_r, mask = (x.requires_grad_() if x.is_floating_point() else x for x in make_batch(seed=6))
    subtb_loss(log_pf, log_pterm, log_r, mask, lam=0.9).sum().backward()
    states = torch.arange(6)[None, :] <= mask.sum(1)[:, None]
    assert (log_pf.grad[mask] != 0).all()
    assert (log_pterm.grad[states] != 0).all()
    small = tuple(x[:3, :3].detach().clone().requires_grad_() for x in make_batch([1, 2, 2], seed=7)[:3])
    small_mask = torch.tensor([[True, False], [True, True], [True, True]])
    assert torch.autograd.gradcheck(
        lambda a, b, c: subtb_loss(a, b, c, small_mask, lam=0.5), (small[0][:, :2], small[1], small[2])
    )


def test_invalid_inputs_name_the_argument():
    log_pf, log_pterm, log_r, mask = make_batch(seed=8)
    with pytest.raises(ValueError, match="log_pterm"):
        subtb_loss(log_pf, log_pterm[:, :-1], log_r, mask)
    with pytest.raises(ValueError, match="prefix"):
        bad = mask.clone()
        bad[1, 0] = False
        subtb_loss(log_pf, log_pterm, log_r, bad)
    with pytest.raises(ValueError, match="at least one step"):
        empty = mask.clone()
        empty[0] = False
        subtb_loss(log_pf, log_pterm, log_r, empty)
    with pytest.raises(ValueError, match="lam"):
        subtb_loss(log_pf, log_pterm, log_r, mask, lam=-0.5)


# ----------------------------------------------------------------------------- TB and TB-VarGrad


def test_trajectory_balance_matches_brute_force():
    log_pf, log_pterm, log_r, mask = make_batch(seed=9)
    log_z = torch.linspace(-1.0, 2.0, len(LENGTHS), dtype=torch.float64)
    log_pi = brute_log_pi(log_pf, log_pterm, mask)
    expected = torch.tensor(
        [(log_z[b].item() + log_pi[b] - log_r[b, n].item()) ** 2 for b, n in enumerate(LENGTHS)], dtype=torch.float64
    )
    torch.testing.assert_close(
        trajectory_balance_loss(log_pf, log_pterm, log_r, mask, log_z), expected, rtol=1e-12, atol=1e-12
    )
    torch.testing.assert_close(
        trajectory_logprob(log_pf, log_pterm, mask), torch.tensor(log_pi, dtype=torch.float64), rtol=1e-12, atol=1e-12
    )
    scalar = trajectory_balance_loss(log_pf, log_pterm, log_r, mask, torch.tensor([0.5], dtype=torch.float64))
    assert scalar.shape == (len(LENGTHS),)


def test_full_subtrajectory_is_tb_with_log_z_from_the_first_state():
    """res(0, n) = TB residual with log Z := log R(s_0) - log pi(s_f|s_0) = log F(s_0), exactly."""
    log_pf, log_pterm, log_r, mask = make_batch(seed=10)
    residual = subtb_pair_residuals(log_pf, log_pterm, log_r, mask)
    lengths = mask.sum(1)
    full = residual[torch.arange(len(LENGTHS)), 0, lengths]
    log_z = log_r[:, 0] - log_pterm[:, 0]
    tb_residual = log_z + trajectory_logprob(log_pf, log_pterm, mask) - log_r.gather(1, lengths[:, None]).squeeze(1)
    torch.testing.assert_close(full, tb_residual, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(
        full.square(), trajectory_balance_loss(log_pf, log_pterm, log_r, mask, log_z), rtol=1e-12, atol=1e-12
    )


@pytest.mark.parametrize("beta", [0.0, 0.5])
def test_vargrad_matches_brute_force(beta):
    log_pf, log_pterm, log_r, mask = make_batch(seed=11)
    log_ref = None if beta == 0 else -torch.linspace(3.0, 9.0, len(LENGTHS), dtype=torch.float64)
    expected_z, expected_loss = brute_vargrad(log_pf, log_pterm, log_r, mask, GROUPS, log_ref, beta)
    for group_ids in (torch.tensor(GROUPS), [f"problem-{g}" for g in GROUPS]):
        log_z = vargrad_log_z(log_pf, log_pterm, log_r, mask, group_ids, log_ref=log_ref, kl_coef=beta)
        torch.testing.assert_close(log_z, expected_z, rtol=1e-12, atol=1e-12)
        loss = tb_vargrad_loss(log_pf, log_pterm, log_r, mask, group_ids, log_ref=log_ref, kl_coef=beta)
        torch.testing.assert_close(loss, expected_loss, rtol=1e-10, atol=1e-12)
    assert loss[5].item() == 0.0  # a question with one sample: log Z_hat is that sample's own value


def test_vargrad_log_z_carries_no_gradient():
    log_pf, log_pterm, log_r, mask = (x.requires_grad_() if x.is_floating_point() else x for x in make_batch(seed=12))
    group = torch.tensor(GROUPS)
    assert not vargrad_log_z(log_pf, log_pterm, log_r, mask, group).requires_grad
    loss = tb_vargrad_loss(log_pf, log_pterm, log_r, mask, group)
    loss.sum().backward()
    # d/d log_pf[b, k] of sum_c (log Z_hat_c + log pi_c - log R_c)^2 is 2 res_b alone when log Z_hat is
    # a constant; a differentiated mean would add -2/K sum of the group's residuals.
    residual = loss.detach().sqrt() * torch.sign(
        vargrad_log_z(log_pf, log_pterm, log_r, mask, group)
        + trajectory_logprob(log_pf, log_pterm, mask).detach()
        - log_r.detach().gather(1, mask.sum(1)[:, None]).squeeze(1)
    )
    expected = torch.where(mask, 2 * residual[:, None].expand_as(log_pf), torch.zeros((), dtype=torch.float64))
    torch.testing.assert_close(log_pf.grad, expected, rtol=1e-12, atol=1e-12)


def test_reference_prior_needs_both_log_ref_and_kl_coef():
    batch = make_batch(seed=13)
    group = torch.tensor(GROUPS)
    with pytest.raises(ValueError, match="log_ref and kl_coef"):
        tb_vargrad_loss(*batch, group, log_ref=torch.zeros(len(LENGTHS), dtype=torch.float64))
    with pytest.raises(ValueError, match="log_ref and kl_coef"):
        tb_vargrad_loss(*batch, group, kl_coef=0.1)
    with pytest.raises(ValueError, match="group_ids"):
        tb_vargrad_loss(*batch, group[:-1])


# ----------------------------------------------------------------------------- off-policy correction


def brute_importance_weighted(losses, log_pi, log_pi_sampled, low, high):
    """Lists in, floats out: min(max(exp(log pi - log pi_old), low), high) x loss, one trajectory at a time."""
    out = []
    for loss, new, old in zip(losses, log_pi, log_pi_sampled):
        difference = new - old
        ratio = math.inf if difference > 709.0 else math.exp(difference)  # math.exp raises past float64's range
        out.append(min(max(ratio, low), high) * loss)
    return torch.tensor(out, dtype=torch.float64)


@pytest.mark.parametrize("low, high", [(0.0, 8.0), (0.0, 1.0), (1.0, 1.0), (0.5, 2.0), (1.0, 1e9)])
def test_clipped_importance_weights_match_brute_force(low, high):
    """TB-VarGrad's per-trajectory losses on a padded batch, weighted by ratios from far below the
    lower bound to past float64's exp (log-ratios -800 .. +800), at the paper's bounds and the edges."""
    log_pf, log_pterm, log_r, mask = make_batch()
    log_pf.requires_grad_(True)
    losses = tb_vargrad_loss(log_pf, log_pterm, log_r, mask, GROUPS)
    log_pi = trajectory_logprob(log_pf, log_pterm, mask)
    offsets = torch.tensor([-800.0, -3.0, -0.1, 0.0, 0.7, 2.5, 800.0], dtype=torch.float64)
    log_pi_sampled = log_pi.detach() - offsets
    weighted = importance_weighted_losses(losses, log_pi, log_pi_sampled, low, high)
    expected = brute_importance_weighted(
        losses.detach().tolist(), log_pi.detach().tolist(), log_pi_sampled.tolist(), low, high
    )
    torch.testing.assert_close(weighted.detach(), expected, rtol=1e-12, atol=1e-12)
    ratio = clipped_importance_ratio(log_pi, log_pi_sampled, low, high)
    assert not ratio.requires_grad and float(ratio.min()) >= low and float(ratio.max()) <= high
    # a stop-gradient weight: the gradient is the weighted sum of each loss term's own gradient
    (grad,) = torch.autograd.grad(weighted.sum(), log_pf, retain_graph=True)
    (unweighted,) = torch.autograd.grad((losses * ratio.detach()).sum(), log_pf)
    torch.testing.assert_close(grad, unweighted, rtol=1e-12, atol=1e-12)


def test_importance_weights_in_float32_come_back_in_float32_and_refuse_bad_bounds():
    losses = torch.tensor([1.0, 2.0], dtype=torch.float32)
    log_pi = torch.tensor([-5.0, -7.0], dtype=torch.float32)
    weighted = importance_weighted_losses(losses, log_pi, torch.tensor([-5.0, -6.0]))
    assert weighted.dtype == torch.float32
    torch.testing.assert_close(weighted, torch.tensor([1.0, 2.0 * math.exp(-1.0)]))
    for low, high in ((1.5, 8.0), (0.0, 0.5), (-0.1, 8.0)):
        with pytest.raises(ValueError, match="clip_low, clip_high"):
            clipped_importance_ratio(log_pi, log_pi, low, high)
    with pytest.raises(ValueError, match="log_pi_sampled"):
        clipped_importance_ratio(log_pi, log_pi[:1], 0.0, 8.0)


# ----------------------------------------------------------------------------- PPO baseline


def brute_gae(rewards, values, lengths, terminated, gamma, lam):
    advantages = torch.zeros_like(rewards)
    for b, n in enumerate(lengths):

        def next_value(k):  # V after step k (1-based)
            if k < n:
                return values[b, k].item()
            return 0.0 if terminated[b] else values[b, n].item()

        delta = [rewards[b, k - 1].item() + gamma * next_value(k) - values[b, k - 1].item() for k in range(1, n + 1)]
        for k in range(1, n + 1):
            advantages[b, k - 1] = sum((gamma * lam) ** j * delta[k - 1 + j] for j in range(n - k + 1))
    return advantages


@pytest.mark.parametrize("gamma,lam", [(1.0, 0.95), (0.9, 0.8), (1.0, 1.0)])
def test_gae_matches_brute_force(gamma, lam):
    generator = torch.Generator().manual_seed(14)
    lengths = [3, 1, 5, 2]
    mask = torch.arange(5)[None, :] < torch.tensor(lengths)[:, None]
    rewards = torch.where(mask, torch.randn(4, 5, generator=generator, dtype=torch.float64), torch.tensor(1e6))
    values = torch.randn(4, 6, generator=generator, dtype=torch.float64)
    values[0, 4:] = float("inf")  # beyond s_n: never read
    terminated = torch.tensor([True, False, True, False])
    advantages, returns = gae(rewards, values, mask, gamma=gamma, lam=lam, terminated=terminated)
    expected = brute_gae(rewards, values, lengths, terminated.tolist(), gamma, lam)
    torch.testing.assert_close(advantages, expected, rtol=1e-12, atol=1e-12)
    expected_returns = torch.where(mask, expected + values[:, :5], torch.tensor(0.0, dtype=torch.float64))
    torch.testing.assert_close(returns, expected_returns, rtol=1e-12, atol=1e-12)
    if gamma == lam == 1.0:  # Monte Carlo returns: the sum of the rewards still to come
        for b, n in enumerate(lengths):
            tail = rewards[b, :n].flip(0).cumsum(0).flip(0) + (0.0 if terminated[b] else values[b, n])
            torch.testing.assert_close(returns[b, :n], tail)
    default, _ = gae(rewards, values, mask, gamma=gamma, lam=lam)
    torch.testing.assert_close(
        default, brute_gae(rewards, values, lengths, [True] * 4, gamma, lam), rtol=1e-12, atol=1e-12
    )


def ppo_example():
    """Two trajectories, three valid steps ((0,0), (0,1), (1,0)); (1,1) is padding full of garbage."""
    mask = torch.tensor([[True, True], [True, False]])
    ratio = torch.tensor([[1.5, 0.5], [1.1, 1.0]], dtype=torch.float64)
    old_logp = torch.tensor([[-2.0, -1.0], [-3.0, 0.0]], dtype=torch.float64)
    new_logp = (old_logp + ratio.log()).clone()
    new_logp[1, 1] = 100.0  # exp(100 - 0) would dominate any unmasked mean
    advantages = torch.tensor([[2.0, -1.0], [3.0, 7.0]], dtype=torch.float64)
    returns = torch.tensor([[1.0, 0.0], [2.0, 9.0]], dtype=torch.float64)
    new_values = torch.tensor([[1.5, -0.5], [1.0, 50.0]], dtype=torch.float64)
    old_values = torch.tensor([[1.0, 0.0], [0.5, -50.0]], dtype=torch.float64)
    entropy = torch.tensor([[1.0, 2.0], [3.0, 1e3]], dtype=torch.float64)
    return new_logp.requires_grad_(), old_logp, advantages, returns, new_values, old_values, entropy, mask


def test_ppo_loss_matches_a_hand_computed_example():
    args = ppo_example()
    loss, stats = ppo_loss(*args, clip=0.2, value_coef=0.5, entropy_coef=0.01)
    # surrogate min(rho A, clip(rho) A): (0,0) min(3.0, 1.2*2=2.4) = 2.4; (0,1) min(-0.5, 0.8*-1=-0.8) = -0.8;
    # (1,0) min(3.3, 3.3) = 3.3  ->  policy loss -(2.4 - 0.8 + 3.3)/3
    policy = -(2.4 - 0.8 + 3.3) / 3
    # (V - R)^2: 0.25, 0.25, 1.0 -> 0.5 * mean = 0.25
    value = 0.5 * (0.25 + 0.25 + 1.0) / 3
    entropy = (1.0 + 2.0 + 3.0) / 3
    assert stats["policy_loss"].item() == pytest.approx(policy, abs=1e-12)
    assert stats["value_loss"].item() == pytest.approx(value, abs=1e-12)
    assert stats["entropy"].item() == pytest.approx(entropy, abs=1e-12)
    assert loss.item() == pytest.approx(policy + 0.5 * value - 0.01 * entropy, abs=1e-12)
    kl = ((1.5 - 1 - math.log(1.5)) + (0.5 - 1 - math.log(0.5)) + (1.1 - 1 - math.log(1.1))) / 3
    assert stats["approx_kl"].item() == pytest.approx(kl, abs=1e-12)
    assert stats["clip_fraction"].item() == pytest.approx(2 / 3, abs=1e-12)  # |rho - 1| > 0.2: 1.5 and 0.5
    loss.backward()
    # Clipped terms carry no gradient; (1,0) is unclipped: d/dlogp of -(rho A)/3 = -(1.1 * 3)/3 = -1.1
    expected_grad = torch.tensor([[0.0, 0.0], [-1.1, 0.0]], dtype=torch.float64)
    torch.testing.assert_close(args[0].grad, expected_grad, rtol=1e-12, atol=1e-12)


def test_ppo_value_clipping_by_hand():
    loss, stats = ppo_loss(*ppo_example(), clip=0.2, value_clip=0.2)
    # V_clip = V_old + clip(V - V_old, +-0.2): (0,0) 1.2 -> 0.04 < 0.25; (0,1) -0.2 -> 0.04 < 0.25;
    # (1,0) 0.5 + 0.2 = 0.7 -> (0.7 - 2)^2 = 1.69 > 1.0  ->  0.5 * (0.25 + 0.25 + 1.69) / 3
    value = 0.5 * (0.25 + 0.25 + 1.69) / 3
    assert stats["value_loss"].item() == pytest.approx(value, abs=1e-12)
    assert loss.item() == pytest.approx(-(2.4 - 0.8 + 3.3) / 3 + 0.5 * value - 0.01 * 2.0, abs=1e-12)


def test_vargrad_float32_inputs_give_float32_losses_computed_in_float64():
    batch32 = [x.float() if x.is_floating_point() else x for x in make_batch(seed=15)]
    loss = tb_vargrad_loss(*batch32, torch.tensor(GROUPS))
    assert loss.dtype == torch.float32 and vargrad_log_z(*batch32, torch.tensor(GROUPS)).dtype == torch.float32
    _, expected = brute_vargrad(*(x.double() if x.is_floating_point() else x for x in batch32), GROUPS)
    torch.testing.assert_close(loss.double(), expected, rtol=1e-6, atol=1e-6)


def test_ppo_step_rewards_score_and_log_score():
    from pipeline.finetune.rewards import StepRewards
    from pipeline.records import Trajectory

    def traj(us, flags):
        logs = [math.log(u) for u in us]
        return Trajectory("p", "q", "Q", [f"s{i}" for i in range(len(us))], logs, flags, True, sum(logs))

    short = traj([0.5, 0.8], [-1, 1])
    long = traj([0.5, 0.5, 0.5, 0.8], [-1, -1, -1, 1])
    unfinished = traj([0.9], [-1])
    score = StepRewards(unfinished_reward=-1.0)([short, long, unfinished], 4)
    assert torch.allclose(score, torch.tensor([[0.5, 0.8, 0, 0], [0.5, 0.5, 0.5, 0.8], [0.9 - 1.0, 0, 0, 0]]))
    log_score = StepRewards("log_score", unfinished_reward=-1.0)([short, long, unfinished], 4)
    assert log_score[:2].sum(1).tolist() == pytest.approx([short.log_reward, long.log_reward])  # return = log R
    assert log_score[2, 0].item() == pytest.approx(math.log(0.9) - 1.0)
    # the paper's summed scores pay for padding a solution with more steps; log R does not
    assert score[1].sum() > score[0].sum() and log_score[1].sum() < log_score[0].sum()
    with pytest.raises(ValueError, match="ppo.step_reward"):
        StepRewards("sum")
