"""The demo's claims: read from hand-made stage outputs, each verdict as the issue defines it."""

from __future__ import annotations

import json
import re
from pathlib import Path

import numpy as np
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
    pool_measured,
    pooled_claims,
    threshold_verdict,
    within_verdict,
)
from pipeline.config.claims import ClaimsConfig
from pipeline.config.loader import ConfigError, load_config
from pipeline.stats import bootstrap_ci, pool_intervals

REPO = Path(__file__).resolve().parents[1]


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
    plain_entropy=diff(-0.1, -0.2, 0.0),
    distance=(0.02, 0.01, 0.04),
    log_likelihood=diff(-0.03, -0.08, 0.02),
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
    pair = {"similarity": similarity, "strategy_entropy": plain_entropy, "pass@1": pass1}
    matched = {  # eval.matched.matched_difference's fields
        "matched": True,
        "reason": None,
        "anchor": "b",
        "reward": -3.5,
        "a": 0.5 + strategies["mean"],
        "b": 0.5,
        "resamples": 2000,
        "resamples_matched": 2000,
        **strategies,
    }
    target = {
        "gfn": {
            "share_distance": {"estimate": distance[0], "lo": distance[1], "hi": distance[2]},
            "log_likelihood": {
                "target": -3.5,
                "sampler": -3.5 + log_likelihood["mean"],
                "difference": log_likelihood["mean"],
                "lo": log_likelihood["lo"],
                "hi": log_likelihood["hi"],
            },
        },
        "base": {
            "share_distance": {"estimate": 0.15, "lo": 0.12, "hi": 0.18},
            "log_likelihood": {"target": -3.5, "sampler": -3.84, "difference": -0.34, "lo": -0.42, "hi": -0.27},
        },
    }
    results = {
        "curves": {"tiny_test": {"curves": {}, "matched": {"gfn_vs_ppo": matched}}},
        "target": {"tiny_test": {"models": target}},
        "comparisons": {
            "reference": "base",
            "models": {
                "gfn": {"tiny_test": {"prm_reward": reward, "greedy_pass@1": greedy, "pass@1": diff(0.01, -0.01, 0.03)}}
            },
            "pairs": {"gfn_vs_ppo": {"tiny_test": pair}},
        },
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
        # the final models' plain entropy difference is shown, not judged: the matched one is
        ({"plain_entropy": diff(-0.5, -0.7, -0.3)}, "gfn_more_diverse_than_ppo", "holds"),
        ({"distance": (0.04, 0.02, 0.06)}, "gfn_matches_target", "inconclusive"),  # across the 0.05 margin
        ({"distance": (0.12, 0.09, 0.15)}, "gfn_matches_target", "fails"),  # the base's distance: not reached
        ({"log_likelihood": diff(0.05, 0.0, 0.11)}, "gfn_matches_target", "inconclusive"),
        ({"log_likelihood": diff(0.2, 0.15, 0.25)}, "gfn_matches_target", "fails"),  # overshoots the likelihood
        ({"log_likelihood": diff(-0.34, -0.42, -0.27)}, "gfn_matches_target", "fails"),  # falls short of it
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
    assert within_verdict(-0.1, 0.1, -0.1, 0.1) == "holds"  # an interval at the bounds holds
    assert within_verdict(-0.11, 0.0, -0.1, 0.1) == "inconclusive"
    assert within_verdict(0.1, 0.2, -0.1, 0.1) == "inconclusive"  # touching the bound does not fail
    assert within_verdict(0.11, 0.2, -0.1, 0.1) == "fails" and within_verdict(-0.3, -0.2, -0.1, 0.1) == "fails"
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
        ("claims.target_share_margin=1.5", "claims.target_share_margin"),
        ("claims.target_log_likelihood_margin=-0.1", "claims.target_log_likelihood_margin"),
        ("experiment.seeds=[]", "experiment.seeds"),
        ("experiment.seeds=[10,10]", "experiment.seeds"),
        ("experiment.seeds=[-1]", "experiment.seeds"),
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


def test_gfn_more_diverse_than_ppo_reads_strategy_entropy_at_the_log_likelihood_both_reach():
    def claim(pair, matched=None):
        results = {"comparisons": {"reference": "base", "models": {}, "pairs": {"gfn_vs_ppo": {"tiny_test": pair}}}}
        if matched is not None:
            results["curves"] = {"tiny_test": {"curves": {}, "matched": {"gfn_vs_ppo": matched}}}
        return {c.id: c for c in finetuning_claims(results, "tiny_test", ClaimsConfig())}["gfn_more_diverse_than_ppo"]

    higher, flat = diff(0.25, 0.1, 0.4), diff(0.0, -0.01, 0.01)
    reached = {"matched": True, "reason": None, **higher}
    plain = {"pass@1": flat, "strategy_entropy": diff(-0.1, -0.2, -0.05), "similarity": diff(0.02, 0.01, 0.03)}
    holds = claim(plain, reached)
    assert holds.verdict == "holds" and holds.value == 0.25 and holds.interval == (0.1, 0.4)
    assert "entropy of correct solutions at the held-out log L both reach +0.25 [+0.1, +0.4] higher bits" in (
        holds.comparison
    )
    # the final models' entropy and the similarity are shown beside it, whichever way they moved, and judge nothing
    assert "the final models' entropy -0.1 [-0.2, -0.05] lower" in holds.comparison
    assert "whole-text similarity +0.02 [+0.01, +0.03] higher (shown, not judged)" in holds.comparison
    assert claim({"pass@1": flat}, reached).verdict == "holds"  # no embedder: the claim stands
    assert claim({}, reached).verdict == "fails"  # pass@1 not measured
    never = {"matched": False, "reason": "the other curve never reaches that reward", "mean": None, "lo": None}
    unmatched = claim(plain, never)
    assert unmatched.verdict == "inconclusive" and unmatched.value is None
    assert "(not matched: the other curve never reaches that reward)" in unmatched.comparison
    # without curves the final models' difference does not stand in for the matched one
    missing = claim({"pass@1": flat, "strategy_entropy": higher})
    assert missing.verdict == "fails" and missing.value is None
    assert "at the held-out log L both reach n/a" in missing.comparison


def test_gfn_matches_target_is_two_sided_with_the_base_as_its_control(tmp_path):
    claim = {c.id: c for c in evaluate_claims(*write_run(tmp_path))}["gfn_matches_target"]
    assert claim.verdict == "holds" and claim.value == 0.02 and claim.interval == (0.01, 0.04)
    assert "strategy share distance +0.02 [+0.01, +0.04]" in claim.comparison
    assert "the base policy (control): distance +0.15 [+0.12, +0.18] higher, log L -0.34 [-0.42, -0.27] lower" in (
        claim.comparison
    )
    results = json.loads((tmp_path / "reports" / "r" / "results.json").read_text())
    results.pop("target")  # eval.target_samples 0: nothing to judge the GFlowNet against
    (tmp_path / "reports" / "r" / "results.json").write_text(json.dumps(results))
    unmeasured = {c.id: c for c in evaluate_claims(tmp_path / "runs" / "r", tmp_path / "reports" / "r")}
    assert unmeasured["gfn_matches_target"].verdict == "fails"
    assert "eval.target_samples is 0" in unmeasured["gfn_matches_target"].comparison
    results["target"] = {
        "tiny_test": {"models": {"gfn": {"share_distance": {"estimate": None, "lo": None, "hi": None}}}}
    }
    (tmp_path / "reports" / "r" / "results.json").write_text(json.dumps(results))  # no question names a strategy
    blank = {c.id: c for c in evaluate_claims(tmp_path / "runs" / "r", tmp_path / "reports" / "r")}
    assert blank["gfn_matches_target"].verdict == "fails" and blank["gfn_matches_target"].value is None
    assert "strategy share distance n/a" in blank["gfn_matches_target"].comparison
    looser = ClaimsConfig(target_log_likelihood_margin=0.5, target_share_margin=0.2)
    far = write_run(tmp_path / "far", distance=(0.12, 0.09, 0.15), log_likelihood=diff(-0.34, -0.42, -0.27))
    assert verdicts(evaluate_claims(*far))["gfn_matches_target"] == "fails"
    assert verdicts(evaluate_claims(*far, settings=looser))["gfn_matches_target"] == "holds"


def test_pooled_claims_judge_the_mean_of_the_seeds_on_the_pooled_interval(tmp_path):
    # two seeds' rewards, each inconclusive alone (interval across 0), pooled: the mean 0.004 with a
    # half-width sqrt(2 x 0.0051^2) / 2 = 0.0036 (each seed's se = its half-width / 1.96)
    seeds = []
    for seed, mean in ((10, 0.003), (11, 0.005)):
        seeds.append(write_run(tmp_path / str(seed), reward=diff(mean, mean - 0.0051, mean + 0.0051)))
    alone = [verdicts(evaluate_claims(*run))["gfn_reward_higher"] for run in seeds]
    assert alone == ["inconclusive", "inconclusive"]
    claims, measured = pooled_claims(seeds, [10, 11])
    reward = {c.id: c for c in claims}["gfn_reward_higher"]
    assert reward.verdict == "holds" and reward.value == pytest.approx(0.004)
    assert reward.interval == pytest.approx((0.004 - 0.0051 / 2**0.5, 0.004 + 0.0051 / 2**0.5))
    assert "pooled over seeds 10, 11" in reward.comparison
    assert measured.parts["reward"]["per_seed"] == pytest.approx([0.003, 0.005])
    assert "(240 pairs)" in {c.id: c for c in claims}["prm_slip_pair_auc"].comparison  # 120 on each seed
    assert [c.id for c in claims] == list(CLAIM_IDS)


def test_a_part_missing_on_one_seed_is_missing_pooled_and_names_the_seed(tmp_path):
    first, second = write_run(tmp_path / "a"), write_run(tmp_path / "b")
    results = json.loads((second[1] / "results.json").read_text())
    results["curves"]["tiny_test"]["matched"]["gfn_vs_ppo"] = {
        "matched": False,
        "reason": "the other curve never reaches that reward",
        "mean": None,
    }
    (second[1] / "results.json").write_text(json.dumps(results))
    claims, measured = pooled_claims([first, second], [10, 11])
    assert measured.parts["matched_entropy"] is None and "seed 11" in measured.notes["missing matched_entropy"]
    diverse = {c.id: c for c in claims}["gfn_more_diverse_than_ppo"]
    assert diverse.verdict == "inconclusive"
    assert "not matched: seed 11: the other curve never reaches that reward" in diverse.comparison
    with pytest.raises(ValueError, match="one run per seed"):
        pool_measured([], [])


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


def test_pool_intervals_is_the_stratified_bootstrap_of_the_pooled_mean():
    """Float64 brute force: three seeds of 120 problems each; each seed's percentile bootstrap interval,
    pooled, against the percentile interval of the mean of the seeds' means when every seed's problems
    are resampled within it."""
    rng = np.random.default_rng(3)
    seeds = [rng.normal(loc, 0.3, size=120) for loc in (0.05, 0.1, 0.0)]
    estimates = []
    for values in seeds:
        mean, lo, hi = bootstrap_ci(values, n_resamples=4000, seed=1)
        estimates.append({"mean": mean, "lo": lo, "hi": hi})
    pooled = pool_intervals(estimates)
    draws = np.mean(
        [values[rng.integers(0, values.size, size=(4000, values.size))].mean(axis=1) for values in seeds], axis=0
    )
    lo, hi = np.quantile(draws, [0.025, 0.975])
    assert pooled["mean"] == pytest.approx(np.mean([v.mean() for v in seeds]), abs=1e-12)
    assert pooled["lo"] == pytest.approx(lo, abs=0.004) and pooled["hi"] == pytest.approx(hi, abs=0.004)
    assert pooled["seeds"] == 3 and pooled["sd"] == pytest.approx(np.std([v.mean() for v in seeds], ddof=1))
    one = pool_intervals(estimates[:1])
    assert (one["lo"], one["hi"]) == pytest.approx((estimates[0]["lo"], estimates[0]["hi"]), abs=0.005)
    assert one["sd"] is None
    with pytest.raises(ValueError, match="no estimates"):
        pool_intervals([])
    with pytest.raises(ValueError, match="finite"):
        pool_intervals([{"mean": 0.1, "lo": None, "hi": 0.2}])


def test_make_experiment_pools_the_seeds_runs_into_one_report(tmp_path, monkeypatch):
    from stages.experiment import main

    monkeypatch.chdir(tmp_path)
    for seed, mean in ((10, 0.003), (11, 0.005)):
        run, reports = write_run(tmp_path / "x", reward=diff(mean, mean - 0.0051, mean + 0.0051))
        (tmp_path / "runs").mkdir(exist_ok=True)
        (tmp_path / "reports").mkdir(exist_ok=True)
        run.rename(tmp_path / "runs" / f"exp-s{seed}")
        results = json.loads((reports / "results.json").read_text())
        results["timings"] = {"stages": {"bootstrap": 200.0}, "wall": 700.0 + seed}
        (reports / "results.json").write_text(json.dumps(results))
        kl = {"mean": 0.1 * (seed - 9), "lo": 0.1 * (seed - 9) - 0.05, "hi": 0.1 * (seed - 9) + 0.05}
        (reports / "policy_kl.json").write_text(json.dumps({"tiny_test": {"reference": "base", "models": {"gfn": kl}}}))
        reports.rename(tmp_path / "reports" / f"exp-s{seed}")
    path = main(
        [
            "--config",
            str(REPO / "configs" / "experiment.yaml"),
            "run=exp",
            "runs_root=runs",
            "experiment.seeds=[10,11]",
            "experiment.run_stages=false",
        ]
    )
    report = path.read_text()
    assert path == Path("reports") / "exp" / "report.md"
    assert "- gfn_reward_higher: holds: +0.004 [" in report and "pooled over seeds 10, 11" in report
    assert "| gfn_reward_higher | inconclusive: +0.003 [" in report  # each seed alone, beside
    assert "| 10 | 710.0 | bootstrap 200.0 |" in report and "add up to 1421.0 s" in report
    results = json.loads((tmp_path / "reports" / "exp" / "results.json").read_text())
    assert results["claims"]["gfn_reward_higher"]["verdict"] == "holds"
    assert results["per_seed"]["11"]["gfn_reward_higher"]["verdict"] == "inconclusive"
    assert results["parts"]["reward"]["per_seed"] == pytest.approx([0.003, 0.005])
    # each learner's KL to the base (make policy-kl), pooled as the claims are and reported beside them
    assert "| tiny_test | gfn | 0.15 [" in report and "| 0.1, 0.2 |" in report
    assert results["kl_to_reference"]["tiny_test/gfn"]["mean"] == pytest.approx(0.15)


def test_the_preregistered_settings_are_the_configs():
    """docs/demo.md's pre-registration table against configs/experiment.yaml (tiny.yaml overlaid): a
    change to a margin, minimal effect, threshold or seed after the freeze shows here."""
    text = (REPO / "docs" / "demo.md").read_text(encoding="utf-8")
    section = text.split("## Pre-registration", 1)[1].split("\n## ", 1)[0]
    rows = dict(re.findall(r"^\| `((?:claims|experiment)\.[a-z_]+)` \| (.+?) \|$", section, flags=re.M))
    config = load_config(REPO / "configs" / "experiment.yaml", [])
    settings = {f"claims.{k}": v for k, v in vars(config.claims).items()}
    settings["experiment.seeds"] = config.experiment.seeds
    assert set(rows) == set(settings)
    for key, written in rows.items():
        assert json.loads(written) == pytest.approx(settings[key]), key
    assert f"`prm_auc` >= {AUC_THRESHOLD}, `prm_slip_pair_auc` >= {SLIP_PAIR_THRESHOLD}" in section
    assert "the seven of eval/claims.py `CLAIM_IDS`" in section and len(CLAIM_IDS) == 7
