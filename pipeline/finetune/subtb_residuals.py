"""What a SubTB(lambda) loss is made of: its pair residuals decomposed into the reward, the
unfinished-state penalty, the stop identity, the forward steps and the learned flow, with each
part's share of the loss per question and per trajectory (docs/gflownet.md, "SubTB's residuals";
docs/losses.md). A diagnostic beside the loss of pipeline.finetune.losses, from the same tensors
and its own helpers; tested against pair-by-pair float64 loops (tests/test_subtb_residuals.py).
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence

import torch
from torch import Tensor

from pipeline.finetune.losses import (
    _check_learned_flow,
    _check_shape,
    _check_trajectory_batch,
    _group_index,
    _pair_mask,
    _pair_residuals,
    _subtb_weights,
)

__all__ = ["RESIDUAL_TERMS", "RESIDUAL_SHARES", "subtb_residual_terms", "subtb_residual_shares"]


RESIDUAL_TERMS = ("reward", "unfinished", "stop", "forward", "flow")

RESIDUAL_SHARES = (
    "question_mean_share",
    "trajectory_mean_share",
    "unfinished_pair_share",
    *(f"{name}_term_share" for name in RESIDUAL_TERMS),
)


def subtb_residual_terms(
    log_pf: Tensor,
    log_pterm: Tensor,
    log_r: Tensor,
    mask: Tensor,
    unanswered: Tensor,
    unfinished_log_reward: float,
    lam: float = 1.0,
    log_flow: Tensor | None = None,
    learned: Tensor | None = None,
) -> dict[str, Tensor]:
    """Per-trajectory sums that decompose SubTB(lambda)'s loss, without gradient, in float64.

    log_pf, log_pterm, log_r, mask, log_flow, learned: as `subtb_loss` (module conventions)
    unanswered: (B, T+1) bool, True where s_k states no final answer (s_0 included; padding ignored)
    unfinished_log_reward: the penalty's share of log R(s_k) at an unanswered state, as the
             objective trains it (gfn.unfinished_log_reward / reward temperature)
    lam:     lambda, as `subtb_loss`
    returns: {name: (B,)} with w = lambda^(j-i) / sum lambda^(j-i) over the trajectory's pairs:
             loss = sum w res^2 (= `subtb_loss`); mean = sum w res (the trajectory's mean residual);
             unfinished_pairs = sum of w res^2 over the pairs with exactly one unanswered endpoint
             (the only pairs where the penalty does not cancel); and for each c in RESIDUAL_TERMS
             term_c = sum w res c(i, j), res split per state into parts whose differences add up
             to it: reward: the rest of log R(s_i) - log R(s_j); unfinished: the penalty's
             difference; stop: log pi(s_f|s_j) - log pi(s_f|s_i); forward: sum_{k=i+1..j}
             log pi(s_k|s_{k-1}); flow: the learned log F(s_i) - log F(s_j). A state whose flow is
             learned adds to flow only (its reward, penalty and stop parts are 0); without learned
             flows flow is 0. The five terms sum to the loss.
    """
    lengths = _check_trajectory_batch(log_pf, log_pterm, log_r, mask)
    _check_shape("unanswered", unanswered, tuple(log_pterm.shape), "(B, T+1)")
    if unanswered.dtype != torch.bool:
        raise ValueError(f"unanswered: expected a torch.bool tensor, got {unanswered.dtype}")
    _check_learned_flow(log_flow, learned, tuple(log_pterm.shape))
    f64 = torch.float64
    with torch.no_grad():
        log_pf, log_pterm, log_r = (x.detach().to(f64) for x in (log_pf, log_pterm, log_r))
        if log_flow is not None:
            log_flow = log_flow.detach().to(f64)
        steps = log_pf.shape[1]
        residual = _pair_residuals(log_pf, log_pterm, log_r, mask, lengths, log_flow, learned)
        weights = _subtb_weights(lengths, steps, float(lam), f64)
        weights = weights / weights.sum(dim=(1, 2), keepdim=True)
        penalty = unanswered.to(f64) * float(unfinished_log_reward)
        zero = torch.zeros((), dtype=f64, device=log_pf.device)
        cumulative = torch.cat([torch.zeros_like(log_pf[:, :1]), torch.where(mask, log_pf, zero).cumsum(1)], dim=1)
        pairs = _pair_mask(lengths, steps)

        def stop_identity(per_state: Tensor) -> Tensor:  # a part of log R - log pi(s_f|.): 0 where F is learned
            return per_state if learned is None else torch.where(learned, zero, per_state)

        def difference(per_state: Tensor) -> Tensor:  # per_state[i] - per_state[j] on the valid pairs
            return torch.where(pairs, per_state[:, :, None] - per_state[:, None, :], zero)

        terms = {
            "reward": difference(stop_identity(log_r - penalty)),
            "unfinished": difference(stop_identity(penalty)),
            "stop": -difference(stop_identity(log_pterm)),
            "forward": -difference(cumulative),
            "flow": difference(torch.zeros_like(log_r) if learned is None else torch.where(learned, log_flow, zero)),
        }
        one_unanswered = pairs & (unanswered[:, :, None] != unanswered[:, None, :])
        weighted = weights * residual
        out = {
            "loss": (weighted * residual).sum(dim=(1, 2)),
            "mean": weighted.sum(dim=(1, 2)),
            "unfinished_pairs": torch.where(one_unanswered, weighted * residual, zero).sum(dim=(1, 2)),
        }
        out |= {f"term_{name}": (weighted * term).sum(dim=(1, 2)) for name, term in terms.items()}
    return out


def subtb_residual_shares(terms: dict[str, Tensor], group_ids: Tensor | Sequence[Hashable]) -> dict[str, float]:
    """The shares of a batch's SubTB loss, from the per-trajectory sums of `subtb_residual_terms`.

    terms:     {name: (B,)} as `subtb_residual_terms` returns (rows of several micro-batches may be concatenated)
    group_ids: (B,) the question of each trajectory (labels or an integer tensor)
    returns:   with L = sum_b loss_b (the batch's summed loss) and m_g the mean over question g's
               trajectories of their mean residual:
               question_mean_share = sum_g n_g m_g^2 / L (what a per-question constant explains;
               1 - it is the within-question spread), trajectory_mean_share = sum_b mean_b^2 / L,
               unfinished_pair_share = sum_b unfinished_pairs_b / L, and {c}_term_share =
               sum_b term_c_b / L for c in RESIDUAL_TERMS (they sum to 1; a negative share is a
               term that cancels part of the others). NaN when L = 0.
    """
    loss = terms["loss"].to(torch.float64)
    total = float(loss.sum())
    if total == 0.0:
        return {name: float("nan") for name in RESIDUAL_SHARES}
    means = terms["mean"].to(torch.float64)
    group = _group_index(group_ids, loss.shape[0], loss.device)
    count = torch.bincount(group).to(torch.float64)
    question_sum = torch.zeros(count.shape[0], dtype=torch.float64, device=loss.device).index_add_(0, group, means)
    shares = {
        "question_mean_share": float((question_sum.square() / count).sum()) / total,
        "trajectory_mean_share": float(means.square().sum()) / total,
        "unfinished_pair_share": float(terms["unfinished_pairs"].to(torch.float64).sum()) / total,
    }
    return shares | {
        f"{name}_term_share": float(terms[f"term_{name}"].to(torch.float64).sum()) / total for name in RESIDUAL_TERMS
    }
