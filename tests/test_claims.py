"""The demo's claims: read from hand-made stage outputs, each verdict as the issue defines it."""

from __future__ import annotations

import json
import re

import pytest

from eval.claims import (
    AUC_THRESHOLD,
    CLAIM_IDS,
    SLIP_PAIR_THRESHOLD,
    VERDICTS,
    combined_verdict,
    effect_verdict,
    evaluate_claims,
    finetuning_claims,
    not_lower_verdict,
    threshold_verdict,
)
from pipeline.config.claims import ClaimsConfig
from pipeline.config.loader import ConfigError, load_config


def diff(mean, lo, hi):
    return {"mean": mean, "lo": lo, "hi": hi}


def write_run(
    tmp_path,
    *,
    auc=(0.85, 0.82, 0.88),
    slip=(0.95, 0.91, 0.99),
    search_gain=1,
    search_gain_4=None,
    search_ks=(1, 4, 16),
    reward=diff(0.01, 0.003, 0.02),
    greedy=diff(0.0, -0.02, 0.02),
    pass1=diff(0.01, -0.02, 0.04),
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
                "exact": {"auc": auc[0], "interval": list(auc[1:])},
                "slip_pair": {"auc": slip[0], "interval": list(slip[1:]), "n_pairs": 120},
            }
        )
    )
    rows = []
    gains = {1: 0, 4: search_gain if search_gain_4 is None else search_gain_4, 16: search_gain}
    for strategy in ("majority", "step_best_of_k", "beam", "weighted_vote"):
        for k in search_ks:
            correct = [i < 40 + gains[k] * 20 for i in range(100)]  # k = 4 and 16 solve 20 more problems each
            rows.append({"strategy": strategy, "k": k, "correct": correct})
    (run / "search" / "results.json").write_text(json.dumps({"rows": rows}))
    pair = {"similarity": similarity, "strategy_entropy": strategies, "pass@1": pass1}
    results = {
        "comparisons": {
            "reference": "base",
            "models": {
                "gfn": {"tiny_test": {"prm_reward": reward, "greedy_pass@1": greedy, "pass@1": diff(0.01, -0.01, 0.03)}}
            },
            "pairs": {"gfn_vs_ppo": {"tiny_test": pair}},
        }
    }
    (reports / "results.json").write_text(json.dumps(results))
    return run, reports


def verdicts(claims):
    return {c.id: c.verdict for c in claims}


def test_every_claim_holds_on_outputs_that_show_it(tmp_path):
    claims = evaluate_claims(*write_run(tmp_path))
    assert [c.id for c in claims] == list(CLAIM_IDS)
    assert all(c.verdict == "holds" for c in claims), [c.markdown() for c in claims]
    line = re.compile(r"^- [a-z_]+: (holds|inconclusive|fails): [+-]?[0-9.e+-]+( \[[-+0-9.e]+, [-+0-9.e]+\])? \(.+\)$")
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
            "- prm_slip_pair_auc: holds: 0.95 [0.91, 0.99] (share of the policy's slips scored below "
            "their correct counterpart, same prefix (120 pairs) >= 0.9"
        )
    )
    assert claims[2].to_json()["verdict"] == "holds" and claims[2].value == pytest.approx(0.2)


@pytest.mark.parametrize(
    "change,claim_id,expected",
    [
        ({"auc": (0.81, 0.78, 0.84)}, "prm_auc", "inconclusive"),  # the point above 0.8, the interval across it
        ({"auc": (0.79, 0.76, 0.82)}, "prm_auc", "inconclusive"),
        ({"auc": (0.75, 0.72, 0.79)}, "prm_auc", "fails"),
        ({"slip": (0.93, 0.89, 0.97)}, "prm_slip_pair_auc", "inconclusive"),
        ({"slip": (0.8, 0.7, 0.88)}, "prm_slip_pair_auc", "fails"),
        ({"search_gain": 0}, "search_rises_with_k", "inconclusive"),
        ({"search_gain": -1}, "search_rises_with_k", "fails"),
        ({"search_gain_4": 0}, "search_rises_with_k", "inconclusive"),  # k = 16 rises, k = 4 does not
        ({"search_gain_4": -1}, "search_rises_with_k", "fails"),  # k = 4 falls: one failing part fails the claim
        ({"search_ks": (1, 16)}, "search_rises_with_k", "fails"),  # no k = 4 rows to judge
        ({"reward": diff(0.01, -0.001, 0.02)}, "gfn_reward_higher", "inconclusive"),
        ({"reward": diff(0.0015, 0.001, 0.002)}, "gfn_reward_higher", "inconclusive"),  # above 0, below the effect
        ({"reward": diff(-0.01, -0.02, -0.001)}, "gfn_reward_higher", "fails"),
        ({"greedy": diff(-0.01, -0.025, 0.005)}, "gfn_accuracy_not_lower", "holds"),  # within the -3 point margin
        ({"greedy": diff(-0.08, -0.15, -0.01)}, "gfn_accuracy_not_lower", "inconclusive"),
        ({"greedy": diff(-0.08, -0.12, -0.04)}, "gfn_accuracy_not_lower", "fails"),
        ({"strategies": diff(0.1, -0.02, 0.2)}, "gfn_more_diverse_than_ppo", "inconclusive"),
        ({"strategies": diff(0.03, 0.01, 0.05)}, "gfn_more_diverse_than_ppo", "inconclusive"),  # below 0.05 bits
        ({"strategies": diff(-0.3, -0.5, -0.1)}, "gfn_more_diverse_than_ppo", "fails"),
        ({"pass1": diff(-0.05, -0.08, -0.04)}, "gfn_more_diverse_than_ppo", "fails"),  # accuracy bought it
        ({"pass1": diff(-0.03, -0.06, 0.0)}, "gfn_more_diverse_than_ppo", "inconclusive"),
    ],
)
def test_each_claim_is_judged_on_its_interval(tmp_path, change, claim_id, expected):
    judged = verdicts(evaluate_claims(*write_run(tmp_path, **change)))
    assert judged[claim_id] == expected
    assert all(v == "holds" for other, v in judged.items() if other != claim_id)


def test_the_three_rules_at_their_bounds():
    assert VERDICTS == ("holds", "inconclusive", "fails")
    assert threshold_verdict(0.8, 0.9, 0.8) == "holds"  # a lower bound at the threshold holds
    assert threshold_verdict(0.7, 0.8, 0.8) == "inconclusive"  # an upper bound at it does not fail
    assert threshold_verdict(0.7, 0.79, 0.8) == "fails"
    assert effect_verdict(0.05, 0.01, 0.09, 0.05) == "holds"  # the estimate at the minimal effect holds
    assert effect_verdict(0.05, 0.0, 0.09, 0.05) == "inconclusive"  # the interval must lie above 0
    assert effect_verdict(0.049, 0.01, 0.09, 0.05) == "inconclusive"
    assert effect_verdict(-0.05, -0.09, 0.0, 0.05) == "inconclusive"
    assert effect_verdict(-0.05, -0.09, -0.01, 0.05) == "fails"
    assert not_lower_verdict(-3.0, 2.0, -3.0) == "holds"
    assert not_lower_verdict(-3.5, 2.0, -3.0) == "inconclusive"
    assert not_lower_verdict(-6.0, -3.5, -3.0) == "fails"
    assert combined_verdict(["holds", "holds"]) == "holds"
    assert combined_verdict(["holds", "inconclusive"]) == "inconclusive"
    assert combined_verdict(["inconclusive", "fails"]) == "fails"


def test_the_minimal_effects_and_the_margin_are_the_configs(tmp_path):
    run = write_run(tmp_path, reward=diff(0.004, 0.003, 0.005), greedy=diff(-0.02, -0.04, 0.0))
    assert verdicts(evaluate_claims(*run))["gfn_accuracy_not_lower"] == "inconclusive"
    strict = ClaimsConfig(reward_min_effect=0.005, accuracy_margin_points=-5.0, search_min_effect_points=25.0)
    judged = verdicts(evaluate_claims(*run, settings=strict))
    assert judged["gfn_reward_higher"] == "inconclusive"  # +0.004 < 0.005
    assert judged["gfn_accuracy_not_lower"] == "holds"  # -4 points >= -5
    assert judged["search_rises_with_k"] == "inconclusive"  # +20 points < 25
    loose = ClaimsConfig(diversity_min_effect_bits=0.0)
    assert (
        verdicts(evaluate_claims(*write_run(tmp_path / "d", strategies=diff(0.03, 0.01, 0.05)), settings=loose))[
            "gfn_more_diverse_than_ppo"
        ]
        == "holds"
    )


@pytest.mark.parametrize(
    "override,key",
    [
        ("claims.reward_min_effect=-0.001", "claims.reward_min_effect"),
        ("claims.search_min_effect_points=101", "claims.search_min_effect_points"),
        ("claims.diversity_min_effect_bits=-1", "claims.diversity_min_effect_bits"),
        ("claims.accuracy_margin_points=1", "claims.accuracy_margin_points"),
        ("claims.accuracy_margin_points=.nan", "claims.accuracy_margin_points"),
        ("claims.search_ks=[1,16]", "claims.search_ks"),
        ("claims.search_ks=[]", "claims.search_ks"),
    ],
)
def test_a_minimal_effect_or_margin_out_of_range_is_refused_naming_the_key(override, key):
    with pytest.raises(ConfigError, match=f"command line: {re.escape(key)}"):
        load_config(None, [override])


def test_the_thresholds_are_fixed_and_the_prm_claims_come_first():
    assert CLAIM_IDS[:3] == ("prm_auc", "prm_slip_pair_auc", "search_rises_with_k")
    assert (AUC_THRESHOLD, SLIP_PAIR_THRESHOLD) == (0.8, 0.9)


def test_the_search_claim_judges_each_k_of_claims_search_ks_against_k_1(tmp_path):
    run = write_run(tmp_path, search_gain_4=0)
    claim = next(c for c in evaluate_claims(*run) if c.id == "search_rises_with_k")
    assert claim.verdict == "inconclusive" and claim.value == 0.0  # the weakest part: k = 4, +0 points
    assert "step_best_of_k k=4 vs 1: +0" in claim.comparison and "weighted_vote k=16 vs 1: +20" in claim.comparison
    only_16 = ClaimsConfig(search_ks=[16])
    claim = next(c for c in evaluate_claims(*run, settings=only_16) if c.id == "search_rises_with_k")
    assert claim.verdict == "holds" and "k=4" not in claim.comparison
    missing = write_run(tmp_path / "m", search_ks=(1, 16))
    claim = next(c for c in evaluate_claims(*missing) if c.id == "search_rises_with_k")
    assert "no rows for step_best_of_k k=4 vs 1, beam k=4 vs 1, weighted_vote k=4 vs 1" in claim.comparison


def test_the_demo_refuses_claims_search_ks_that_search_ks_lacks_before_any_stage_runs(tmp_path):
    import stages.demo as demo

    for override, absent in (("search.ks=[1,4,8]", "16"), ("search.ks=[4,16]", "1"), ("claims.search_ks=[32]", "32")):
        with pytest.raises(ConfigError, match=rf"claims.search_ks = .* has no k = {absent}: add it to search.ks"):
            demo.main(["--config", "configs/tiny.yaml", f"runs_root={tmp_path}", "run=r", override])
    assert not (tmp_path / "r").exists()  # nothing ran, nothing was written


def test_missing_stage_outputs_make_every_claim_fail_and_say_so(tmp_path):
    claims = evaluate_claims(tmp_path / "none", tmp_path / "none")
    assert [c.verdict for c in claims] == ["fails"] * len(CLAIM_IDS)
    assert "not measured" in claims[0].comparison and "no rows" in claims[2].comparison


def test_a_figure_without_an_interval_is_inconclusive(tmp_path):
    run, reports = write_run(tmp_path)
    validation = json.loads((run / "prm" / "validation.json").read_text())
    validation["exact"].pop("interval")
    (run / "prm" / "validation.json").write_text(json.dumps(validation))
    claim = evaluate_claims(run, reports)[0]
    assert claim.verdict == "inconclusive" and "no interval" in claim.comparison


def test_gfn_more_diverse_than_ppo_reads_paired_strategy_entropy_at_pass1_not_lower():
    def claim(pair):
        results = {"comparisons": {"reference": "base", "models": {}, "pairs": {"gfn_vs_ppo": {"tiny_test": pair}}}}
        return {c.id: c for c in finetuning_claims(results, "tiny_test", ClaimsConfig())}["gfn_more_diverse_than_ppo"]

    higher, flat = diff(0.25, 0.1, 0.4), diff(0.0, -0.01, 0.01)
    holds = claim({"strategy_entropy": higher, "pass@1": flat, "similarity": diff(0.02, 0.01, 0.03)})
    assert holds.verdict == "holds" and holds.value == 0.25 and holds.interval == (0.1, 0.4)
    # the similarity is shown beside the entropy, whichever way it moved, and judges nothing
    assert "strategy entropy of correct solutions +0.25 [+0.1, +0.4] higher bits" in holds.comparison
    assert "whole-text similarity +0.02 [+0.01, +0.03] higher (shown, not judged)" in holds.comparison
    assert claim({"strategy_entropy": higher, "pass@1": flat}).verdict == "holds"  # no embedder: the claim stands
    assert claim({"strategy_entropy": higher}).verdict == "fails"  # pass@1 not measured
    assert (
        claim(
            {"strategy_entropy": diff(0.05, -0.01, 0.11), "pass@1": flat, "similarity": diff(-0.5, -0.6, -0.4)}
        ).verdict
        == "inconclusive"
    )
    missing = claim({"pass@1": flat, "similarity": diff(-0.5, -0.6, -0.4)})  # no problem knows its strategies
    assert (
        missing.verdict == "fails"
        and missing.value is None
        and "strategy entropy of correct solutions n/a" in missing.comparison
    )


def test_the_demo_report_judges_with_the_configs_claims_section(tmp_path, monkeypatch):
    from stages.demo import write_report

    run, _ = write_run(tmp_path, reward=diff(0.004, 0.003, 0.005))
    (run / "prm" / "validation.json").unlink()  # the report's PRM section reads fields this stand-in lacks
    monkeypatch.chdir(tmp_path)
    for min_effect, expected in ((0.002, "holds"), (0.005, "inconclusive")):
        config = load_config(None, ["run=r", "runs_root=runs", f"claims.reward_min_effect={min_effect}"])
        report = write_report(config, {"bootstrap": 1.0}, []).read_text()
        assert f"- gfn_reward_higher: {expected}: +0.004 [0.003, 0.005]" in report
        results = json.loads((tmp_path / "reports" / "r" / "results.json").read_text())
        assert results["claims"]["gfn_reward_higher"]["verdict"] == expected
