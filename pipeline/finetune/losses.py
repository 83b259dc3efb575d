"""Losses for step-level GFlowNet fine-tuning, and the PPO baseline: pure functions of tensors.

Conventions shared by every GFlowNet loss here (B trajectories, T = the longest one's steps):

    log_pf:    (B, T)   log pi(s_k | s_{k-1}) for step k = 1..T (summed token log-probs of step k)
    log_pterm: (B, T+1) log pi(s_f | s_k) for k = 0..T (end-of-solution token after step k;
                        index 0 is the boundary right after the prompt)
    log_r:     (B, T+1) log R(s_k) for k = 0..T (log R(s_0) is the caller's choice, usually 0)
    mask:      (B, T)   True where step k exists; a prefix of Trues, n_b = mask.sum(1) >= 1

Entries beyond a trajectory's end (log_pf[k > n_b], log_pterm/log_r[k > n_b]) are padding: they
never reach the result or its gradient, whatever their value. Half-precision inputs are computed
in float32 (cumulative sums of log-probs lose too much in 8 mantissa bits) and the result is
float32; float32/float64 inputs are computed and returned in their own dtype (TB-VarGrad computes
in float64 throughout: see `tb_vargrad_loss`). Every formula is written out, with the decisions behind it, in docs/losses.md.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence

import torch
from torch import Tensor

__all__ = [
    "subtb_pair_residuals",
    "learned_flow_states",
    "subtb_loss",
    "trajectory_logprob",
    "trajectory_balance_loss",
    "vargrad_log_z",
    "tb_vargrad_loss",
    "clipped_importance_ratio",
    "importance_weighted_losses",
    "gae",
    "ppo_loss",
]


# ----------------------------------------------------------------------------- helpers


def _working_dtype(*tensors: Tensor) -> torch.dtype:
    dtype = torch.float32
    for tensor in tensors:
        if tensor.is_floating_point():
            dtype = torch.promote_types(dtype, tensor.dtype)
    return dtype


def _check_shape(name: str, tensor: Tensor, shape: tuple[int, ...], meaning: str) -> None:
    if tuple(tensor.shape) != shape:
        raise ValueError(f"{name}: expected shape {meaning}={shape}, got {tuple(tensor.shape)}")


def _lengths(mask: Tensor) -> Tensor:
    """Validate a (B, T) step mask (bool, rows are prefixes of Trues, n_b >= 1); return n_b, (B,)."""
    if mask.dim() != 2 or mask.dtype != torch.bool:
        raise ValueError(f"mask: expected a (B, T) torch.bool tensor, got {mask.dtype} {tuple(mask.shape)}")
    lengths = mask.sum(dim=1)
    prefix = torch.arange(mask.shape[1], device=mask.device) < lengths[:, None]
    if not torch.equal(mask, prefix):
        raise ValueError("mask: every row must be a prefix of Trues (trajectories left-aligned)")
    if mask.shape[0] and int(lengths.min()) < 1:
        raise ValueError("mask: every trajectory needs at least one step (mask.sum(1) >= 1)")
    return lengths


def _check_trajectory_batch(log_pf: Tensor, log_pterm: Tensor, log_r: Tensor | None, mask: Tensor) -> Tensor:
    """Validate the shapes and the mask of a trajectory batch; return the lengths n_b, (B,) long."""
    if log_pf.dim() != 2:
        raise ValueError(f"log_pf: expected shape (B, T), got {tuple(log_pf.shape)}")
    batch, steps = log_pf.shape
    _check_shape("log_pterm", log_pterm, (batch, steps + 1), "(B, T+1)")
    if log_r is not None:
        _check_shape("log_r", log_r, (batch, steps + 1), "(B, T+1)")
    _check_shape("mask", mask, (batch, steps), "(B, T)")
    return _lengths(mask)


def _at_length(values: Tensor, lengths: Tensor) -> Tensor:
    """values[b, lengths[b]] for a (B, T+1) tensor: the quantity at each trajectory's last state."""
    return values.gather(1, lengths[:, None]).squeeze(1)


def _masked_step_sum(log_pf: Tensor, mask: Tensor) -> Tensor:
    # where, not multiply: padding may hold inf and must not turn the sum into nan.
    return torch.where(mask, log_pf, torch.zeros((), dtype=log_pf.dtype, device=log_pf.device)).sum(1)


def _group_index(group_ids: Tensor | Sequence[Hashable], batch: int, device: torch.device) -> Tensor:
    """Map group labels (an integer tensor, or any hashable labels such as problem ids) to 0..G-1."""
    if isinstance(group_ids, Tensor):
        if tuple(group_ids.shape) != (batch,):
            raise ValueError(f"group_ids: expected shape (B,)={(batch,)}, got {tuple(group_ids.shape)}")
        if group_ids.is_floating_point():
            raise ValueError("group_ids: expected an integer tensor or a sequence of labels, got floats")
        return torch.unique(group_ids, return_inverse=True)[1].to(device)
    labels = list(group_ids)
    if len(labels) != batch:
        raise ValueError(f"group_ids: expected {batch} labels (one per trajectory), got {len(labels)}")
    index: dict[Hashable, int] = {}
    return torch.tensor([index.setdefault(label, len(index)) for label in labels], device=device)


# ----------------------------------------------------------------------------- SubTB(lambda)


def subtb_pair_residuals(
    log_pf: Tensor,
    log_pterm: Tensor,
    log_r: Tensor,
    mask: Tensor,
    log_flow: Tensor | None = None,
    learned: Tensor | None = None,
) -> Tensor:
    """Sub-trajectory balance residual of every pair of states (i, j) of every trajectory.

    log_pf: (B, T); log_pterm: (B, T+1); log_r: (B, T+1); mask: (B, T) bool  (module conventions)
    log_flow, learned: (B, T+1) float and bool, given together or not at all: at the states where
             ``learned`` is True log F(s_k) is log_flow[b, k] (a learned log-flow) instead of the
             stop identity log R(s_k) - log pi(s_f|s_k) (`learned_flow_states` says which)
    returns: (B, T+1, T+1) res[b, i, j] = log F(s_i) + sum_{k=i+1..j} log pi(s_k|s_{k-1})
             - log F(s_j) for 0 <= i < j <= n_b, 0 elsewhere; without learned flows
             log F(s) = log R(s) - log pi(s_f|s), so res = log R(s_i) + sum log pi + log pi(s_f|s_j)
             - log R(s_j) - log pi(s_f|s_i).
    """
    lengths = _check_trajectory_batch(log_pf, log_pterm, log_r, mask)
    _check_learned_flow(log_flow, learned, tuple(log_pterm.shape))
    return _pair_residuals(log_pf, log_pterm, log_r, mask, lengths, log_flow, learned)


def learned_flow_states(unanswered: Tensor, mask: Tensor) -> Tensor:
    """Where SubTB with a learned log-flow (gfn.log_flow=learned) uses it: the states that state no
    final answer, except each trajectory's last (its stop action ends the trajectory and carries
    its reward, so log F(s_n) = log R(s_n) - log pi(s_f|s_n) holds there as the terminal condition).

    unanswered: (B, T+1) bool, True where s_k states no final answer (s_0 included; padding ignored)
    mask:       (B, T) bool step mask (module conventions)
    returns:    (B, T+1) bool: unanswered[b, k] and k < n_b
    """
    lengths = _lengths(mask)
    _check_shape("unanswered", unanswered, (mask.shape[0], mask.shape[1] + 1), "(B, T+1)")
    if unanswered.dtype != torch.bool:
        raise ValueError(f"unanswered: expected a torch.bool tensor, got {unanswered.dtype}")
    index = torch.arange(mask.shape[1] + 1, device=mask.device)
    return unanswered & (index[None, :] < lengths[:, None])


def _check_learned_flow(log_flow: Tensor | None, learned: Tensor | None, shape: tuple[int, ...]) -> None:
    if (log_flow is None) != (learned is None):
        raise ValueError("log_flow and learned: give both (a learned log-flow and where it is used) or neither")
    if log_flow is None:
        return
    _check_shape("log_flow", log_flow, shape, "(B, T+1)")
    _check_shape("learned", learned, shape, "(B, T+1)")
    if learned.dtype != torch.bool:
        raise ValueError(f"learned: expected a torch.bool tensor, got {learned.dtype}")


def _state_log_flow(
    log_pterm: Tensor, log_r: Tensor, log_flow: Tensor | None, learned: Tensor | None, dtype: torch.dtype
) -> Tensor:
    """(B, T+1) log F(s_k): the learned log-flow where ``learned``, else log R(s_k) - log pi(s_f|s_k)."""
    stop_identity = log_r.to(dtype) - log_pterm.to(dtype)
    if log_flow is None:
        return stop_identity
    return torch.where(learned, log_flow.to(dtype), stop_identity)


def _pair_residuals(
    log_pf: Tensor,
    log_pterm: Tensor,
    log_r: Tensor,
    mask: Tensor,
    lengths: Tensor,
    log_flow: Tensor | None = None,
    learned: Tensor | None = None,
) -> Tensor:
    dtype = _working_dtype(log_pf, log_pterm, log_r, *(() if log_flow is None else (log_flow,)))
    log_pf = log_pf.to(dtype)
    steps = log_pf.shape[1]
    # With C_k = sum_{m<=k} log pi(s_m|s_{m-1}), res(i, j) = (log F(s_i) - C_i) - (log F(s_j) - C_j):
    # one subtraction per pair.
    zero = torch.zeros((), dtype=dtype, device=log_pf.device)
    cumulative = torch.cat([torch.zeros_like(log_pf[:, :1]), torch.where(mask, log_pf, zero).cumsum(1)], dim=1)
    state_index = torch.arange(steps + 1, device=log_pf.device)
    state_valid = state_index[None, :] <= lengths[:, None]  # (B, T+1): s_0..s_n exist
    flow = _state_log_flow(log_pterm, log_r, log_flow, learned, dtype)
    potential = torch.where(state_valid, flow - cumulative, zero)
    residual = potential[:, :, None] - potential[:, None, :]
    return torch.where(_pair_mask(lengths, steps), residual, zero)


def _pair_mask(lengths: Tensor, steps: int) -> Tensor:
    """(B, T+1, T+1) bool: True for the pairs 0 <= i < j <= n_b."""
    index = torch.arange(steps + 1, device=lengths.device)
    upper = index[:, None] < index[None, :]
    return upper[None] & (index[None, None, :] <= lengths[:, None, None])


def _subtb_weights(lengths: Tensor, steps: int, lam: float, dtype: torch.dtype) -> Tensor:
    """lambda^(j-i) on valid pairs, rescaled per trajectory so that the largest weight is 1.

    The loss divides by the weights' sum, so a per-trajectory factor changes nothing but keeps
    lambda^(j-i) from overflowing (lambda > 1) or vanishing entirely (lambda < 1). lambda = 0 is
    the limit lambda -> 0+: exponent j-i-1 gives 0^0 = 1 on one-step pairs and 0 on the others.
    """
    index = torch.arange(steps + 1, device=lengths.device)
    distance = (index[None, :] - index[:, None])[None].to(dtype)  # (1, T+1, T+1): j - i
    if lam < 1.0:
        exponent = distance - 1.0
    else:  # lam >= 1: the longest pair (0, n_b) has the largest weight
        exponent = distance - lengths[:, None, None].to(dtype)
    base = torch.tensor(lam, dtype=dtype, device=lengths.device)
    pairs = _pair_mask(lengths, steps)
    # Clamp only matters off the valid pairs (there exponent can be negative and 0^-1 = inf).
    weights = torch.pow(base, exponent.clamp(min=0.0) if lam < 1.0 else exponent.clamp(max=0.0))
    return torch.where(pairs, weights, torch.zeros((), dtype=dtype, device=lengths.device))


def subtb_loss(
    log_pf: Tensor,
    log_pterm: Tensor,
    log_r: Tensor,
    mask: Tensor,
    lam: float = 1.0,
    log_flow: Tensor | None = None,
    learned: Tensor | None = None,
) -> Tensor:
    """SubTB(lambda) of a batch of step-level trajectories (Step-level GFlowNet, eq. 1).

    log_pf:    (B, T)   log pi(s_k | s_{k-1}) for step k = 1..T
    log_pterm: (B, T+1) log pi(s_f | s_k) for k = 0..T
    log_r:     (B, T+1) log R(s_k) for k = 0..T
    mask:      (B, T)   True where step k exists (prefix of Trues, n_b >= 1)
    lam:       lambda >= 0; lambda = 0 means the limit lambda -> 0+ (one-step pairs only)
    log_flow, learned: (B, T+1) a learned log F(s_k) and where it replaces the stop identity
               (`subtb_pair_residuals`); None: the paper's log F(s) = log R(s) - log pi(s_f|s) everywhere
    returns:   (B,) sum_{0<=i<j<=n_b} lambda^(j-i) res(i,j)^2 / sum_{0<=i<j<=n_b} lambda^(j-i),
               res as in `subtb_pair_residuals`.
    """
    lam = float(lam)
    if not lam >= 0.0 or lam == float("inf"):
        raise ValueError(f"lam: expected a finite lambda >= 0, got {lam}")
    lengths = _check_trajectory_batch(log_pf, log_pterm, log_r, mask)
    _check_learned_flow(log_flow, learned, tuple(log_pterm.shape))
    residual = _pair_residuals(log_pf, log_pterm, log_r, mask, lengths, log_flow, learned)
    weights = _subtb_weights(lengths, log_pf.shape[1], lam, residual.dtype)
    return (weights * residual.square()).sum(dim=(1, 2)) / weights.sum(dim=(1, 2))


# ----------------------------------------------------------------------------- TB and TB-VarGrad


def trajectory_logprob(log_pf: Tensor, log_pterm: Tensor, mask: Tensor) -> Tensor:
    """log pi(tau) of each whole trajectory, stop action included.

    log_pf: (B, T); log_pterm: (B, T+1); mask: (B, T) bool  (module conventions)
    returns: (B,) sum_{k=1..n_b} log pi(s_k|s_{k-1}) + log pi(s_f|s_{n_b})
    """
    lengths = _check_trajectory_batch(log_pf, log_pterm, None, mask)
    return _trajectory_logprob(log_pf, log_pterm, mask, lengths)


def _trajectory_logprob(log_pf: Tensor, log_pterm: Tensor, mask: Tensor, lengths: Tensor) -> Tensor:
    dtype = _working_dtype(log_pf, log_pterm)
    return _masked_step_sum(log_pf.to(dtype), mask) + _at_length(log_pterm.to(dtype), lengths)


def trajectory_balance_loss(log_pf: Tensor, log_pterm: Tensor, log_r: Tensor, mask: Tensor, log_z: Tensor) -> Tensor:
    """Trajectory balance of each trajectory, terminating at its last state s_n.

    log_pf: (B, T); log_pterm: (B, T+1); log_r: (B, T+1); mask: (B, T) bool  (module conventions)
    log_z:  (B,) or one value (scalar or (1,)), log Z (a learned parameter, or an estimate such as `vargrad_log_z`)
    returns: (B,) (log Z + sum_{k=1..n} log pi(s_k|s_{k-1}) + log pi(s_f|s_n) - log R(s_n))^2
    """
    lengths = _check_trajectory_batch(log_pf, log_pterm, log_r, mask)
    log_z = torch.as_tensor(log_z, device=log_pf.device)
    if log_z.numel() != 1 and tuple(log_z.shape) != (log_pf.shape[0],):
        raise ValueError(f"log_z: expected shape (B,)={(log_pf.shape[0],)} or one value, got {tuple(log_z.shape)}")
    log_z = log_z.reshape(-1) if log_z.numel() != 1 else log_z.reshape(())
    dtype = _working_dtype(log_pf, log_pterm, log_r, log_z)
    residual = (
        log_z.to(dtype)
        + _trajectory_logprob(log_pf.to(dtype), log_pterm.to(dtype), mask, lengths)
        - _at_length(log_r.to(dtype), lengths)
    )
    return residual.square()


def _vargrad_target(log_r: Tensor, lengths: Tensor, log_ref: Tensor | None, kl_coef: float) -> Tensor:
    """log of the unnormalised target density of a whole trajectory (see `tb_vargrad_loss`)."""
    kl_coef = float(kl_coef)
    if not kl_coef >= 0.0 or kl_coef == float("inf"):
        raise ValueError(f"kl_coef: expected a finite beta >= 0, got {kl_coef}")
    if (kl_coef > 0.0) != (log_ref is not None):
        raise ValueError(
            "log_ref and kl_coef go together: pass log_ref (B,) with kl_coef > 0, "
            f"or neither (got log_ref={'a tensor' if log_ref is not None else None}, "
            f"kl_coef={kl_coef})"
        )
    terminal = _at_length(log_r, lengths)
    if log_ref is None:
        return terminal
    if tuple(log_ref.shape) != tuple(terminal.shape):
        raise ValueError(f"log_ref: expected shape (B,)={tuple(terminal.shape)}, got {tuple(log_ref.shape)}")
    return terminal / kl_coef + log_ref.to(terminal.dtype)


def vargrad_log_z(
    log_pf: Tensor,
    log_pterm: Tensor,
    log_r: Tensor,
    mask: Tensor,
    group_ids: Tensor | Sequence[Hashable],
    log_ref: Tensor | None = None,
    kl_coef: float = 0.0,
) -> Tensor:
    """VarGrad estimate of log Z per question, detached, broadcast to each of its trajectories.

    log_pf: (B, T); log_pterm: (B, T+1); log_r: (B, T+1); mask: (B, T) bool  (module conventions)
    group_ids: (B,) integer tensor, or B hashable labels (e.g. problem ids): same label = same question
    log_ref, kl_coef: optional reference prior, as in `tb_vargrad_loss`
    returns: (B,) stop-gradient mean over the trajectories of b's question of
             (target(tau) - log pi(tau)), target = log R(s_n) [or log R(s_n)/beta + log pi_ref(tau)]
    """
    lengths = _check_trajectory_batch(log_pf, log_pterm, log_r, mask)
    log_z = _vargrad_log_z(log_pf, log_pterm, log_r, mask, lengths, group_ids, log_ref, kl_coef)
    return log_z.to(_working_dtype(log_pf, log_pterm, log_r))


def _vargrad_log_z(
    log_pf: Tensor,
    log_pterm: Tensor,
    log_r: Tensor,
    mask: Tensor,
    lengths: Tensor,
    group_ids: Tensor | Sequence[Hashable],
    log_ref: Tensor | None,
    kl_coef: float,
) -> Tensor:
    """log Z_hat in float64 (see `tb_vargrad_loss` for why), without gradient."""
    with torch.no_grad():
        f64 = torch.float64
        log_pf, log_pterm, log_r = log_pf.detach().to(f64), log_pterm.detach().to(f64), log_r.detach().to(f64)
        target = _vargrad_target(log_r, lengths, None if log_ref is None else log_ref.detach(), kl_coef)
        estimate = target - _trajectory_logprob(log_pf, log_pterm, mask, lengths)
        group = _group_index(group_ids, log_pf.shape[0], log_pf.device)
        count = torch.bincount(group).to(f64)
        total = torch.zeros(count.shape[0], dtype=f64, device=log_pf.device).index_add_(0, group, estimate)
        return (total / count)[group]


def tb_vargrad_loss(
    log_pf: Tensor,
    log_pterm: Tensor,
    log_r: Tensor,
    mask: Tensor,
    group_ids: Tensor | Sequence[Hashable],
    log_ref: Tensor | None = None,
    kl_coef: float = 0.0,
) -> Tensor:
    """Trajectory balance with the VarGrad log Z (TBA, Bartoldson et al. 2025, eq. 5).

    log_pf: (B, T); log_pterm: (B, T+1); log_r: (B, T+1); mask: (B, T) bool  (module conventions)
    group_ids: (B,) question of each trajectory (K samples per question; K = 1 gives zero loss)
    log_ref: (B,) log pi_ref(tau) of the reference policy, steps + termination (as `trajectory_logprob`)
    kl_coef: beta > 0 with log_ref (target pi_ref(tau) R(s_n)^(1/beta)); 0 without (target R(s_n))
    returns: (B,) (log Z_hat + log pi(tau) - target(tau))^2, log Z_hat = `vargrad_log_z` (no gradient);
             computed in float64 whatever the input dtype, returned in the module's working dtype
    """
    lengths = _check_trajectory_batch(log_pf, log_pterm, log_r, mask)
    # The residuals of a question sum to zero, so nothing that shifts log pi of all its
    # trajectories equally gets a gradient (e.g. the stop probability at s_0). Computed in
    # float32, the group mean is off by ~1e-7 in a systematic direction, which Adam would
    # normalise into full-size steps along that direction; float64 keeps the sum at ~1e-16.
    f64 = torch.float64
    log_z = _vargrad_log_z(log_pf, log_pterm, log_r, mask, lengths, group_ids, log_ref, kl_coef)
    target = _vargrad_target(log_r.to(f64), lengths, log_ref, kl_coef)
    residual = log_z + _trajectory_logprob(log_pf.to(f64), log_pterm.to(f64), mask, lengths) - target
    return residual.square().to(_working_dtype(log_pf, log_pterm, log_r))


# ----------------------------------------------------------------------------- off-policy correction (TBA, appendix D)


def clipped_importance_ratio(log_pi: Tensor, log_pi_sampled: Tensor, clip_low: float, clip_high: float) -> Tensor:
    """The importance ratio of the trained policy to the one that sampled each trajectory, clipped, without gradient.

    log_pi:         (B,) log pi_theta(tau) under the policy being trained (`trajectory_logprob`)
    log_pi_sampled: (B,) log pi_old(tau) under the weights that sampled tau, steps + termination
    clip_low, clip_high: 0 <= clip_low <= 1 <= clip_high (TBA, Table 4: 0 and 8)
    returns: (B,) float64, sg(clip(exp(log_pi - log_pi_sampled), clip_low, clip_high))
    """
    if tuple(log_pi_sampled.shape) != tuple(log_pi.shape) or log_pi.dim() != 1:
        raise ValueError(
            f"log_pi, log_pi_sampled: expected two (B,) tensors, got {tuple(log_pi.shape)} and {tuple(log_pi_sampled.shape)}"
        )
    if not 0.0 <= clip_low <= 1.0 <= clip_high:
        raise ValueError(f"clip_low, clip_high: expected 0 <= clip_low <= 1 <= clip_high, got {clip_low}, {clip_high}")
    with torch.no_grad():
        # float64: a trajectory's log-ratio is a sum over hundreds of tokens; exp overflows to inf, which the clip bounds
        ratio = torch.exp(log_pi.detach().to(torch.float64) - log_pi_sampled.detach().to(torch.float64))
        return ratio.clamp(min=clip_low, max=clip_high)


def importance_weighted_losses(
    losses: Tensor, log_pi: Tensor, log_pi_sampled: Tensor, clip_low: float = 0.0, clip_high: float = 8.0
) -> Tensor:
    """Each trajectory's loss weighted by its clipped importance ratio, CISPO-style: the ratio is a
    stop-gradient weight, so the gradient is the loss term's own, scaled (TBA, appendix D).

    losses:         (B,) per-trajectory loss (`tb_vargrad_loss`, `trajectory_balance_loss`, `subtb_loss`)
    log_pi:         (B,) log pi_theta(tau) under the policy being trained (its gradient is not used)
    log_pi_sampled: (B,) log pi_old(tau) under the weights that sampled tau
    clip_low, clip_high: as `clipped_importance_ratio`
    returns: (B,) sg(clip(pi_theta(tau) / pi_old(tau), clip_low, clip_high)) * losses, in losses' dtype
    """
    if tuple(losses.shape) != tuple(log_pi.shape):
        raise ValueError(f"losses: expected shape (B,)={tuple(log_pi.shape)}, got {tuple(losses.shape)}")
    ratio = clipped_importance_ratio(log_pi, log_pi_sampled, clip_low, clip_high)
    return losses * ratio.to(device=losses.device, dtype=losses.dtype)


# ----------------------------------------------------------------------------- PPO baseline


def gae(
    rewards: Tensor,
    values: Tensor,
    mask: Tensor,
    gamma: float = 1.0,
    lam: float = 0.95,
    terminated: Tensor | None = None,
) -> tuple[Tensor, Tensor]:
    """Generalised advantage estimates of step-level actions (one action = one whole step).

    rewards:    (B, T)   r_k, the reward for taking step k (s_{k-1} -> s_k)
    values:     (B, T+1) V(s_k) for k = 0..T
    mask:       (B, T)   True where step k exists (prefix of Trues)
    terminated: (B,) bool, default all True: s_n is terminal, so V after the last step is 0;
                False (cut off at a step limit) bootstraps with V(s_n) = values[b, n]
    returns:    advantages (B, T) A_k = sum_{l>=0} (gamma lam)^l delta_{k+l},
                delta_k = r_k + gamma V(s_k) [0 after a terminal s_n] - V(s_{k-1});
                returns (B, T) = A_k + V(s_{k-1}). Both detached, 0 on padding.
    """
    if rewards.dim() != 2:
        raise ValueError(f"rewards: expected shape (B, T), got {tuple(rewards.shape)}")
    _check_shape("values", values, (rewards.shape[0], rewards.shape[1] + 1), "(B, T+1)")
    _check_shape("mask", mask, tuple(rewards.shape), "(B, T)")
    lengths = _lengths(mask)
    batch, steps = rewards.shape
    dtype = _working_dtype(rewards, values)
    rewards, values = rewards.detach().to(dtype), values.detach().to(dtype)
    zero = torch.zeros((), dtype=dtype, device=rewards.device)
    if terminated is None:
        terminated = torch.ones(batch, dtype=torch.bool, device=rewards.device)
    elif tuple(terminated.shape) != (batch,) or terminated.dtype != torch.bool:
        raise ValueError(
            f"terminated: expected a bool tensor of shape (B,)={(batch,)}, "
            f"got {terminated.dtype} {tuple(terminated.shape)}"
        )
    step = torch.arange(1, steps + 1, device=rewards.device)[None, :]  # step k = 1..T
    next_value = torch.where(step < lengths[:, None], values[:, 1:], zero)
    bootstrap = torch.where(terminated, zero, _at_length(values, lengths))
    next_value = torch.where(step == lengths[:, None], bootstrap[:, None], next_value)
    delta = torch.where(mask, rewards + gamma * next_value - values[:, :-1], zero)
    advantages = torch.zeros_like(delta)
    running = torch.zeros(batch, dtype=dtype, device=rewards.device)
    for k in reversed(range(steps)):  # delta is 0 past the end, so the recursion needs no mask
        running = delta[:, k] + gamma * lam * running
        advantages[:, k] = running
    returns = torch.where(mask, advantages + values[:, :-1], zero)
    return advantages, returns


def _masked_mean(values: Tensor, mask: Tensor) -> Tensor:
    return torch.where(mask, values, torch.zeros((), dtype=values.dtype, device=values.device)).sum() / mask.sum()


def ppo_loss(
    new_logp: Tensor,
    old_logp: Tensor,
    advantages: Tensor,
    returns: Tensor,
    new_values: Tensor,
    old_values: Tensor,
    entropy: Tensor,
    mask: Tensor,
    clip: float = 0.2,
    value_coef: float = 0.5,
    entropy_coef: float = 0.01,
    value_clip: float | None = None,
) -> tuple[Tensor, dict[str, Tensor]]:
    """PPO clipped objective at the step level; every mean is over all valid steps of the batch.

    new_logp, old_logp: (B, T) log pi(s_k|s_{k-1}) under the current / the sampling policy
    advantages, returns: (B, T) from `gae` (whiten them first if wanted; not done here)
    new_values, old_values: (B, T) V(s_{k-1}) under the current / the sampling value head
    entropy: (B, T) policy entropy at step k;  mask: (B, T) True where step k exists
    returns: (loss, stats) loss = -mean min(rho A, clip(rho, 1-eps, 1+eps) A)
             + value_coef * 0.5 mean (V - R)^2 [clipped: max with (V_old + clip(V - V_old) - R)^2]
             - entropy_coef * mean H, rho = exp(new_logp - old_logp); stats (detached 0-dim):
             policy_loss, value_loss, entropy, approx_kl = mean(rho - 1 - log rho),
             clip_fraction = mean(|rho - 1| > eps)
    """
    shape = tuple(mask.shape)
    for name, tensor in (
        ("new_logp", new_logp),
        ("old_logp", old_logp),
        ("advantages", advantages),
        ("returns", returns),
        ("new_values", new_values),
        ("old_values", old_values),
        ("entropy", entropy),
    ):
        if tuple(tensor.shape) != shape:
            raise ValueError(f"{name}: expected shape (B, T)={shape} like mask, got {tuple(tensor.shape)}")
    if mask.dtype != torch.bool or not bool(mask.any()):
        raise ValueError("mask: expected a bool tensor with at least one valid step")
    zero = torch.zeros((), dtype=new_logp.dtype, device=new_logp.device)
    # Padding may hold anything: zero it before exp so that no inf/nan enters the graph.
    log_ratio = torch.where(mask, new_logp - old_logp.detach(), zero)
    ratio = log_ratio.exp()
    advantages = advantages.detach()
    surrogate = torch.minimum(ratio * advantages, ratio.clamp(1.0 - clip, 1.0 + clip) * advantages)
    policy_loss = -_masked_mean(surrogate, mask)

    returns = returns.detach()
    value_error = (new_values - returns).square()
    if value_clip is not None:
        old_values = old_values.detach()
        clipped = old_values + (new_values - old_values).clamp(-value_clip, value_clip)
        value_error = torch.maximum(value_error, (clipped - returns).square())
    value_loss = 0.5 * _masked_mean(value_error, mask)

    mean_entropy = _masked_mean(entropy, mask)
    loss = policy_loss + value_coef * value_loss - entropy_coef * mean_entropy
    with torch.no_grad():
        stats = {
            "policy_loss": policy_loss.detach(),
            "value_loss": value_loss.detach(),
            "entropy": mean_entropy.detach(),
            "approx_kl": _masked_mean((ratio - 1.0) - log_ratio, mask),
            "clip_fraction": _masked_mean(((ratio - 1.0).abs() > clip).to(ratio.dtype), mask),
        }
    return loss, stats
