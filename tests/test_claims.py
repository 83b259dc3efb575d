"""The demo's claims: read from hand-made stage outputs, each verdict as the issue defines it."""

from __future__ import annotations

import json
import re

import pytest

from eval.claims import AUC_THRESHOLD, CLAIM_IDS, SLIP_PAIR_THRESHOLD, evaluate_claims


def diff(mean, lo, hi):
    return {"mean": mean, "lo": lo, "hi": hi}


def write_run(
    tmp_path,
    *,
    auc=0.85,
    slip=0.93,
    search_gain=1,
    reward=diff(0.01, 0.002, 0.02),
    greedy=diff(0.0, -0.05, 0.05),
    similarity=diff(-0.01, -0.02, -0.005),
    strategies=diff(0.3, 0.1, 0.5),
):
    run, reports = tmp_path / "runs" / "r", tmp_path / "reports" / "r"
    (run / "prm").mkdir(parents=True)
    (run / "search").mkdir()
    reports.mkdir(parents=True)
    (run / "prm" / "validation.json").write_text(
        json.dumps(
            {  # the MC-label AUC (0.6) is reported, not judged
                "auc": 0.6,
                "auc_interval": [0.55, 0.65],
                "exact": {"auc": auc, "interval": [auc - 0.03, auc + 0.03]},
                "slip_pair": {"auc": slip, "interval": [slip - 0.04, slip + 0.04], "n_pairs": 120},
            }
        )
    )
    rows = []
    for strategy in ("majority", "step_best_of_k", "beam", "weighted_vote"):
        for k in (1, 4, 16):
            correct = [
                i < 40 + (search_gain * 20 if k == 16 else 0) for i in range(100)
            ]  # k=16 solves 20 more problems
            rows.append({"strategy": strategy, "k": k, "correct": correct})
    (run / "search" / "results.json").write_text(json.dumps({"rows": rows}))
    pair = {"similarity": similarity, "strategy_entropy": strategies, "pass@1": diff(0.01, -0.02, 0.04)}
    results = {
        "comparisons": {
            "reference": "base",
            "models": {
                "gfn": {"tiny_test": {"prm_reward": reward, "greedy_pass@1": greedy, "pass@1": diff(0.01, -0.03, 0.05)}}
            },
            "pairs": {"gfn_vs_ppo": {"tiny_test": pair}},
        }
    }
    (reports / "results.json").write_text(json.dumps(results))
    return run, reports


def test_every_claim_holds_on_outputs_that_show_it(tmp_path):
    claims = evaluate_claims(*write_run(tmp_path))
    assert [c.id for c in claims] == list(CLAIM_IDS)
    assert all(c.holds for c in claims), [c.markdown() for c in claims]
    line = re.compile(r"^- [a-z_]+: (holds|fails): [+-]?[0-9.e+-]+( \[[-+0-9.e]+, [-+0-9.e]+\])? \(.+\)$")
    assert all(line.match(c.markdown()) for c in claims), [c.markdown() for c in claims]
    assert (
        claims[0]
        .markdown()
        .startswith(
            "- prm_auc: holds: 0.85 [0.82, 0.88] (AUC of first wrong steps vs correct steps after "
            "a correct prefix, exact labels"
        )
    )
    assert (
        claims[1]
        .markdown()
        .startswith(
            "- prm_slip_pair_auc: holds: 0.93 [0.89, 0.97] (share of the policy's slips scored below "
            "their correct counterpart, same prefix (120 pairs) >= 0.9"
        )
    )
    assert claims[2].to_json()["holds"] and claims[2].value == pytest.approx(0.2)


@pytest.mark.parametrize(
    "change,failing",
    [
        ({"auc": 0.79}, "prm_auc"),
        ({"slip": 0.89}, "prm_slip_pair_auc"),
        ({"search_gain": 0}, "search_rises_with_k"),
        ({"reward": diff(0.01, -0.001, 0.02)}, "gfn_reward_higher"),
        ({"greedy": diff(-0.08, -0.15, -0.01)}, "gfn_accuracy_not_lower"),
        ({"strategies": diff(0.1, -0.02, 0.2)}, "gfn_more_diverse_than_ppo"),
        ({"strategies": diff(-0.3, -0.5, -0.1)}, "gfn_more_diverse_than_ppo"),
    ],
)
def test_each_claim_fails_when_its_evidence_does(tmp_path, change, failing):
    claims = {c.id: c for c in evaluate_claims(*write_run(tmp_path, **change))}
    assert not claims[failing].holds
    assert all(c.holds for claim_id, c in claims.items() if claim_id != failing)


def test_the_prm_claims_come_first_with_the_thresholds_fixed_before_the_runs(tmp_path):
    assert CLAIM_IDS[:3] == ("prm_auc", "prm_slip_pair_auc", "search_rises_with_k")
    assert (AUC_THRESHOLD, SLIP_PAIR_THRESHOLD) == (0.8, 0.9)
    at = {c.id: c.holds for c in evaluate_claims(*write_run(tmp_path / "at", auc=0.8, slip=0.9))}
    assert at["prm_auc"] and at["prm_slip_pair_auc"]  # a threshold met holds


def test_missing_stage_outputs_make_every_claim_fail_and_say_so(tmp_path):
    claims = evaluate_claims(tmp_path / "none", tmp_path / "none")
    assert [c.holds for c in claims] == [False] * len(CLAIM_IDS)
    assert "not measured" in claims[0].comparison and "no rows" in claims[2].comparison


def test_gfn_more_diverse_than_ppo_reads_paired_strategy_entropy_at_pass1_not_lower():
    from eval.claims import finetuning_claims

    def claim(pair):
        results = {"comparisons": {"reference": "base", "models": {}, "pairs": {"gfn_vs_ppo": {"tiny_test": pair}}}}
        return {c.id: c for c in finetuning_claims(results, "tiny_test")}["gfn_more_diverse_than_ppo"]

    higher, flat = diff(0.25, 0.1, 0.4), diff(0.0, -0.01, 0.01)
    holds = claim({"strategy_entropy": higher, "pass@1": flat, "similarity": diff(0.02, 0.01, 0.03)})
    assert holds.holds and holds.value == 0.25 and holds.interval == (0.1, 0.4)
    # the similarity is shown beside the entropy, whichever way it moved, and judges nothing
    assert "strategy entropy of correct solutions +0.25 [+0.1, +0.4] higher bits" in holds.comparison
    assert "whole-text similarity +0.02 [+0.01, +0.03] higher (shown, not judged)" in holds.comparison
    assert claim({"strategy_entropy": higher, "pass@1": flat}).holds  # no embedder: no similarity, the claim stands
    assert not claim({"strategy_entropy": higher, "pass@1": diff(-0.05, -0.08, -0.02)}).holds  # accuracy bought it
    assert not claim({"strategy_entropy": higher}).holds  # pass@1 not measured
    assert not claim(
        {"strategy_entropy": diff(0.05, -0.01, 0.11), "pass@1": flat, "similarity": diff(-0.5, -0.6, -0.4)}
    ).holds
    missing = claim({"pass@1": flat, "similarity": diff(-0.5, -0.6, -0.4)})  # no problem knows its strategies
    assert (
        not missing.holds
        and missing.value is None
        and "strategy entropy of correct solutions n/a" in missing.comparison
    )
