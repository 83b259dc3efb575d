"""The decomposition of SubTB(lambda)'s residuals against a float64 double loop written the obvious way."""

from __future__ import annotations

import pytest
import torch

from pipeline.finetune.losses import subtb_loss
from pipeline.finetune.subtb_residuals import RESIDUAL_TERMS, subtb_residual_shares, subtb_residual_terms
from tests.test_losses import GROUPS, LAMBDAS, LENGTHS, brute_residual, make_batch

PENALTY = -10.0


def make_unanswered(lengths=LENGTHS, seed=1, padding=True):
    """s_0 unanswered, the last state answered, the states between at random; padding holds `padding`."""
    generator = torch.Generator().manual_seed(seed)
    steps = max(lengths)
    unanswered = torch.rand(len(lengths), steps + 1, generator=generator) < 0.6
    unanswered[:, 0] = True
    for b, n in enumerate(lengths):
        unanswered[b, n] = False
        unanswered[b, n + 1 :] = padding
    return unanswered


def brute_shares(log_pf, log_pterm, log_r, mask, unanswered, lam, groups, log_flow=None, learned=None):
    """Every pair of every trajectory visited once; shares of the batch's summed loss. A state whose
    flow is learned contributes log_flow to the flow part and nothing to reward, penalty or stop."""
    pf, pt, lr = (x.double().tolist() for x in (log_pf, log_pterm, log_r))
    un = unanswered.tolist()
    use = learned.tolist() if learned is not None else [[False] * len(row) for row in un]
    lf = log_flow.double().tolist() if log_flow is not None else None
    total = unfinished_pairs = 0.0
    term = dict.fromkeys(RESIDUAL_TERMS, 0.0)
    means = []
    for b, n in enumerate(mask.sum(1).tolist()):
        pairs = [(i, j) for i in range(n + 1) for j in range(i + 1, n + 1)]
        raw = [((1.0 if j - i == 1 else 0.0) if lam == 0 else lam ** (j - i)) for i, j in pairs]
        mean = 0.0
        for (i, j), w in zip(pairs, raw):
            w /= sum(raw)
            forward = sum(pf[b][k - 1] for k in range(i + 1, j + 1))

            def part(k, name):  # state k's share of log F(s_k) in part `name`
                if use[b][k]:
                    return lf[b][k] if name == "flow" else 0.0
                penalty = PENALTY * un[b][k]
                return {"reward": lr[b][k] - penalty, "unfinished": penalty, "stop": -pt[b][k], "flow": 0.0}[name]

            flow_i = lf[b][i] if use[b][i] else lr[b][i] - pt[b][i]
            flow_j = lf[b][j] if use[b][j] else lr[b][j] - pt[b][j]
            res = flow_i + forward - flow_j
            if not use[b][i] and not use[b][j]:
                assert res == pytest.approx(brute_residual(pf, pt, lr, b, i, j), abs=1e-9)
            parts = {name: part(i, name) - part(j, name) for name in ("reward", "unfinished", "stop", "flow")}
            parts["forward"] = forward
            total += w * res**2
            mean += w * res
            unfinished_pairs += w * res**2 if un[b][i] != un[b][j] else 0.0
            for name, value in parts.items():
                term[name] += w * res * value
        means.append(mean)
    question = 0.0
    for g in set(groups):
        members = [means[b] for b in range(len(means)) if groups[b] == g]
        question += len(members) * (sum(members) / len(members)) ** 2
    return {
        "question_mean_share": question / total,
        "trajectory_mean_share": sum(m**2 for m in means) / total,
        "unfinished_pair_share": unfinished_pairs / total,
        **{f"{name}_term_share": value / total for name, value in term.items()},
    }


@pytest.mark.parametrize("lam", LAMBDAS)
def test_residual_shares_match_a_double_loop_and_the_terms_add_up_to_the_loss(lam):
    log_pf, log_pterm, log_r, mask = make_batch()
    unanswered = make_unanswered()
    log_r = log_r + PENALTY * unanswered.double()  # the penalty is part of log R, as on the LM path
    terms = subtb_residual_terms(log_pf, log_pterm, log_r, mask, unanswered, PENALTY, lam=lam)
    assert terms["loss"].tolist() == pytest.approx(subtb_loss(log_pf, log_pterm, log_r, mask, lam=lam).tolist())
    parts = sum(terms[f"term_{name}"] for name in RESIDUAL_TERMS)
    assert parts.tolist() == pytest.approx(terms["loss"].tolist(), rel=1e-9)
    shares = subtb_residual_shares(terms, GROUPS)
    expected = brute_shares(log_pf, log_pterm, log_r, mask, unanswered, lam, GROUPS)
    assert shares == pytest.approx(expected, rel=1e-9, abs=1e-12)
    assert 0.0 <= shares["question_mean_share"] <= shares["trajectory_mean_share"] <= 1.0


@pytest.mark.parametrize("lam", [0.5, 1.0])
def test_with_learned_flows_the_five_terms_add_up_to_the_loss_and_match_the_double_loop(lam):
    from tests.test_losses import random_learned_flows

    log_pf, log_pterm, log_r, mask = make_batch()
    log_flow, learned, unanswered = random_learned_flows()
    log_r = log_r + PENALTY * unanswered.double()
    flows = {"log_flow": log_flow, "learned": learned}
    terms = subtb_residual_terms(log_pf, log_pterm, log_r, mask, unanswered, PENALTY, lam=lam, **flows)
    assert terms["loss"].tolist() == pytest.approx(
        subtb_loss(log_pf, log_pterm, log_r, mask, lam=lam, **flows).tolist()
    )
    assert sum(terms[f"term_{name}"] for name in RESIDUAL_TERMS).tolist() == pytest.approx(terms["loss"].tolist())
    shares = subtb_residual_shares(terms, GROUPS)
    expected = brute_shares(log_pf, log_pterm, log_r, mask, unanswered, lam, GROUPS, log_flow, learned)
    assert shares == pytest.approx(expected, rel=1e-9, abs=1e-12)
    assert shares["flow_term_share"] != 0.0
    plain = subtb_residual_shares(subtb_residual_terms(log_pf, log_pterm, log_r, mask, unanswered, PENALTY), GROUPS)
    assert plain["flow_term_share"] == 0.0


def test_padding_and_the_padded_unanswered_flags_never_reach_the_shares():
    log_pf, log_pterm, log_r, mask = make_batch(padding=1e6)
    clean = make_batch(padding=0.0)
    one = subtb_residual_shares(
        subtb_residual_terms(log_pf, log_pterm, log_r, mask, make_unanswered(), PENALTY), GROUPS
    )
    other = subtb_residual_shares(
        subtb_residual_terms(*clean[:3], mask, make_unanswered(padding=False), PENALTY), GROUPS
    )
    assert one == pytest.approx(other, rel=1e-9)


def test_a_residual_constant_per_question_is_all_question_mean():
    # one-step trajectories, balanced, then log pi(s_f|s_0) shifted by c_g per question: each
    # trajectory's one pair (0, 1) has residual -c_g, a per-question constant
    log_pf, log_pterm, log_r, mask = make_batch(lengths=[1, 1, 1, 1])
    log_r = log_r.clone()
    log_r[:, 1] = log_r[:, 0] - log_pterm[:, 0] + log_pf[:, 0] + log_pterm[:, 1]  # balanced: every residual 0
    shifted = log_pterm.clone()
    shifted[:, 0] += torch.tensor([1.0, 1.0, -2.0, -2.0], dtype=torch.float64)
    unanswered = torch.tensor([[True, False]] * 4)
    terms = subtb_residual_terms(log_pf, shifted, log_r, mask, unanswered, PENALTY)
    shares = subtb_residual_shares(terms, [0, 0, 1, 1])
    assert shares["question_mean_share"] == pytest.approx(1.0)
    assert shares["trajectory_mean_share"] == pytest.approx(1.0)
    assert shares["unfinished_pair_share"] == pytest.approx(1.0)  # s_0 unanswered, s_1 answered
    shares = subtb_residual_shares(terms, [0, 1, 2, 3])
    assert shares["question_mean_share"] == pytest.approx(1.0)
    mixed = subtb_residual_shares(terms, [0, 1, 0, 1])  # each question: +1 and -2, mean -1/2
    assert mixed["question_mean_share"] == pytest.approx(4 * 0.25 / (2 * 1.0 + 2 * 4.0))


def test_bad_unanswered_flags_are_refused_naming_the_argument():
    log_pf, log_pterm, log_r, mask = make_batch()
    with pytest.raises(ValueError, match="unanswered"):
        subtb_residual_terms(log_pf, log_pterm, log_r, mask, make_unanswered()[:, :-1], PENALTY)
    with pytest.raises(ValueError, match="unanswered"):
        subtb_residual_terms(log_pf, log_pterm, log_r, mask, make_unanswered().double(), PENALTY)
