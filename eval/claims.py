"""The paper's claims at the tiny world's scale, read from the files the stages wrote (make demo).

Each claim is a figure with a 95% interval and a verdict, holds / inconclusive / fails, judged on
the interval (docs/demo.md, "Verdicts"):

- prm_auc:                the PRM's AUC of first wrong steps against correct steps after a correct
                          prefix, by exact labels, on the policy's own samples of held-out problems
                          >= 0.8 (prm/validation.json "exact"; interval: problems resampled)
- prm_slip_pair_auc:      the share of the policy's arithmetic slips (first wrong steps) scored
                          below their correct counterpart, the same step with the right result
                          under the same prefix, >= 0.9 (the same file, "slip_pair"): a PRM that
                          reads the result a step writes, as the paper's E.4 check shows one
- search_rises_with_k:    PRM-guided accuracy at k = 4 and at k = 16 (claims.search_ks) each above
                          k = 1, paired per problem, for step-level best-of-k, beam search and
                          PRM-weighted voting, each (search/results.json; paper Figure 2)
- gfn_reward_higher:      the GFlowNet's held-out mean PRM reward above the base policy's (paired;
                          reports/<run>/results.json; paper Table 2 in miniature)
- gfn_accuracy_not_lower: neither its greedy accuracy nor its pass@1 lower than the base's (paired,
                          with a margin)
- gfn_more_diverse_than_ppo: against PPO, a higher strategy entropy of the correct solutions
                          (bits per problem, paired over problems with more than one strategy that
                          both solve), at a pass@1 not lower (with the same margin); the whole-text
                          similarity difference shown beside it (paper Table 4, appendix D)

The three rules, [lo, hi] the 95% interval:

- a threshold claim holds when lo >= the threshold, fails when hi < it, and is inconclusive otherwise;
- an effect claim (a paired difference that must be higher) holds when lo > 0 and the estimate
  reaches its minimal effect (claims.*_min_effect*), fails when hi < 0, and is inconclusive otherwise;
- a "not lower" claim (a paired accuracy difference in points) holds when lo >= the margin
  (claims.accuracy_margin_points, -3), fails when hi < the margin, and is inconclusive otherwise.

A claim of several parts (every search strategy; greedy and pass@1; entropy and pass@1) holds when
every part holds and fails when any part fails. The thresholds are the issue's, fixed before the runs
they judge; the minimal effects and the margin are the config's (pipeline.config.claims.ClaimsConfig).
A claim whose inputs are missing fails and says so. The MC-label AUC (validation.json "auc": steps
with MC label > 0.5 against the rest) is reported beside the claims, not judged: it counts correct
steps of hard problems as negatives.
"""

from __future__ import annotations

import typing
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from pipeline.config.claims import ClaimsConfig
from pipeline.storage.files import read_json_if_exists
from prm.search.summary import paired_difference

AUC_THRESHOLD = 0.8  # prm_auc: exact labels, first wrong steps against correct steps after a correct prefix
SLIP_PAIR_THRESHOLD = 0.9  # prm_slip_pair_auc: slips against their correct counterparts
SEARCH_STRATEGIES = ("step_best_of_k", "beam", "weighted_vote")
CLAIM_IDS = (
    "prm_auc",
    "prm_slip_pair_auc",
    "search_rises_with_k",
    "gfn_reward_higher",
    "gfn_accuracy_not_lower",
    "gfn_more_diverse_than_ppo",
)
Verdict = Literal["holds", "inconclusive", "fails"]
VERDICTS: tuple[Verdict, ...] = typing.get_args(Verdict)


def threshold_verdict(lo: float, hi: float, threshold: float) -> Verdict:
    """holds: the interval's lower bound is at or above the threshold; fails: its upper bound is below."""
    return "holds" if lo >= threshold else "fails" if hi < threshold else "inconclusive"


def effect_verdict(mean: float, lo: float, hi: float, min_effect: float) -> Verdict:
    """A paired difference that must be higher: holds when the interval lies above 0 and the estimate
    reaches ``min_effect`` (same units), fails when the interval lies below 0."""
    return "holds" if lo > 0 and mean >= min_effect else "fails" if hi < 0 else "inconclusive"


def not_lower_verdict(lo: float, hi: float, margin: float) -> Verdict:
    """A paired difference that must not be lower: holds when the lower bound is at or above ``margin``
    (<= 0, same units), fails when the upper bound is below it."""
    return threshold_verdict(lo, hi, margin)


def combined_verdict(parts: list[Verdict]) -> Verdict:
    """Every part holds: holds; any part fails: fails; otherwise inconclusive."""
    return "fails" if "fails" in parts else "holds" if all(part == "holds" for part in parts) else "inconclusive"


@dataclass
class Claim:
    """id, its verdict, its figure with the 95% interval, and what it is compared with."""

    id: str
    verdict: Verdict
    value: float | None
    interval: tuple[float | None, float | None]
    comparison: str

    def markdown(self) -> str:
        """``- <id>: holds|inconclusive|fails: <figure> [<lo>, <hi>] (<comparison>)``"""
        lo, hi = self.interval
        figure = (
            "n/a"
            if self.value is None
            else f"{self.value:+.4g}"
            if self.comparison.startswith("paired")
            else f"{self.value:.4g}"
        )
        interval = f" [{lo:.4g}, {hi:.4g}]" if lo is not None and hi is not None else ""
        return f"- {self.id}: {self.verdict}: {figure}{interval} ({self.comparison})"

    def to_json(self) -> dict:
        return {
            "verdict": self.verdict,
            "value": self.value,
            "interval": list(self.interval),
            "comparison": self.comparison,
        }


def _threshold_claim(claim_id: str, value, interval, what: str, threshold: float) -> Claim:
    if value is None:
        return Claim(claim_id, "fails", None, (None, None), f"{what}: not measured")
    lo, hi = interval or (None, None)
    if lo is None or hi is None:
        return Claim(claim_id, "inconclusive", value, (None, None), f"{what} >= {threshold}: no interval")
    return Claim(claim_id, threshold_verdict(lo, hi, threshold), value, (lo, hi), f"{what} >= {threshold}")


def _direction(diff: dict | None) -> str:
    if not diff:
        return "missing"
    return "higher" if diff["lo"] > 0 else "lower" if diff["hi"] < 0 else "no clear change"


def _fmt(diff: dict | None, scale: float = 1.0) -> str:
    if not diff:
        return "n/a"
    return f"{scale * diff['mean']:+.3g} [{scale * diff['lo']:+.3g}, {scale * diff['hi']:+.3g}] {_direction(diff)}"


def _effect(diff: dict | None, min_effect: float, scale: float = 1.0) -> Verdict:
    """effect_verdict of a paired difference ({mean, lo, hi}) in ``scale`` x its units; missing: fails."""
    if not diff:
        return "fails"
    return effect_verdict(scale * diff["mean"], scale * diff["lo"], scale * diff["hi"], min_effect)


def _not_lower(diff: dict | None, margin_points: float) -> Verdict:
    """not_lower_verdict of a paired accuracy difference (fractions) against a margin in points; missing: fails."""
    if not diff:
        return "fails"
    return not_lower_verdict(100 * diff["lo"], 100 * diff["hi"], margin_points)


def prm_claims(validation: dict | None) -> list[Claim]:
    """prm_auc and prm_slip_pair_auc from prm/validation.json's "exact" and "slip_pair" blocks."""
    validation = validation or {}
    exact, pair = validation.get("exact") or {}, validation.get("slip_pair") or {}
    return [
        _threshold_claim(
            "prm_auc",
            exact.get("auc"),
            exact.get("interval"),
            "AUC of first wrong steps vs correct steps after a correct prefix, exact labels, the policy's own "
            "held-out samples",
            AUC_THRESHOLD,
        ),
        _threshold_claim(
            "prm_slip_pair_auc",
            pair.get("auc"),
            pair.get("interval"),
            f"share of the policy's slips scored below their correct counterpart, same prefix "
            f"({pair.get('n_pairs', 0)} pairs)",
            SLIP_PAIR_THRESHOLD,
        ),
    ]


def search_claim(
    search: dict | None, min_effect_points: float, ks: Sequence[int] = (4, 16), n_resamples: int = 2000, seed: int = 0
) -> Claim:
    """Accuracy at each k of ``ks`` minus k = 1, paired per problem, for every strategy of
    SEARCH_STRATEGIES: each part an effect claim with ``min_effect_points``; the figure is the smallest
    gain (the claim holds when every part does). ks: the config's claims.search_ks."""
    rows = (search or {}).get("rows", [])
    diffs, missing = {}, []
    for strategy in SEARCH_STRATEGIES:
        for k in ks:
            difference = paired_difference(rows, (strategy, k), (strategy, 1), n_resamples=n_resamples, seed=seed)
            if difference is None:
                missing.append(f"{strategy} k={k} vs 1")
            else:
                diffs[(strategy, k)] = difference
    if missing:
        return Claim(
            "search_rises_with_k",
            "fails",
            None,
            (None, None),
            f"paired accuracy difference: no rows for {', '.join(missing)}",
        )
    weakest = min(diffs, key=lambda part: diffs[part]["mean"])
    detail = "; ".join(f"{s} k={k} vs 1: {_fmt(d, 100)} pts" for (s, k), d in diffs.items())
    at = " and ".join(f"k={k}" for k in ks)
    return Claim(
        "search_rises_with_k",
        combined_verdict([_effect(d, min_effect_points, scale=100) for d in diffs.values()]),
        diffs[weakest]["mean"],
        (diffs[weakest]["lo"], diffs[weakest]["hi"]),
        f"paired accuracy at {at}, each minus k=1, each above 0 and >= {min_effect_points:g} pts; {detail}",
    )


def finetuning_claims(results: dict | None, benchmark: str, settings: ClaimsConfig) -> list[Claim]:
    """gfn_reward_higher, gfn_accuracy_not_lower and gfn_more_diverse_than_ppo from make eval's
    results.json ("comparisons": paired differences against the base, and GFlowNet minus PPO)."""
    comparisons = (results or {}).get("comparisons") or {}
    gfn = (
        (comparisons.get("models") or {}).get("gfn", {}).get(benchmark)
        if comparisons.get("reference") == "base"
        else None
    )
    pair = ((comparisons.get("pairs") or {}).get("gfn_vs_ppo") or {}).get(benchmark)
    margin = settings.accuracy_margin_points
    claims = []
    reward = (gfn or {}).get("prm_reward")
    claims.append(
        Claim(
            "gfn_reward_higher",
            _effect(reward, settings.reward_min_effect),
            reward and reward["mean"],
            (reward and reward["lo"], reward and reward["hi"]),
            f"paired held-out mean PRM reward, GFlowNet minus base: {_direction(reward)}; above 0 and "
            f">= {settings.reward_min_effect:g}",
        )
    )
    accuracy = [(gfn or {}).get(key) for key in ("greedy_pass@1", "pass@1")]
    worst = min((d for d in accuracy if d), key=lambda d: d["mean"], default=None)
    claims.append(
        Claim(
            "gfn_accuracy_not_lower",
            combined_verdict([_not_lower(d, margin) for d in accuracy]),
            worst and 100 * worst["mean"],
            (worst and 100 * worst["lo"], worst and 100 * worst["hi"]),
            f"paired accuracy in points, GFlowNet minus base, neither lower than {margin:g} pts: greedy "
            f"{_fmt(accuracy[0], 100)}, pass@1 {_fmt(accuracy[1], 100)}",
        )
    )
    entropy, pass1, similarity = ((pair or {}).get(key) for key in ("strategy_entropy", "pass@1", "similarity"))
    claims.append(
        Claim(
            "gfn_more_diverse_than_ppo",
            combined_verdict([_effect(entropy, settings.diversity_min_effect_bits), _not_lower(pass1, margin)]),
            entropy and entropy["mean"],
            (entropy and entropy["lo"], entropy and entropy["hi"]),
            f"paired, GFlowNet minus PPO: strategy entropy of correct solutions {_fmt(entropy)} bits (above 0 and "
            f">= {settings.diversity_min_effect_bits:g}), pass@1 {_fmt(pass1, 100)} pts (not lower than {margin:g}); "
            f"whole-text similarity {_fmt(similarity)} (shown, not judged)",
        )
    )
    return claims


def evaluate_claims(
    run_dir: Path,
    reports_dir: Path,
    benchmark: str = "tiny_test",
    seed: int = 0,
    settings: ClaimsConfig | None = None,
) -> list[Claim]:
    """Every claim of CLAIM_IDS, in that order, from a finished run's files, judged with ``settings``
    (the config's claims section; None: its defaults)."""
    run_dir, reports_dir = Path(run_dir), Path(reports_dir)
    settings = settings or ClaimsConfig()
    return [
        *prm_claims(read_json_if_exists(run_dir / "prm" / "validation.json", "PRM validation")),
        search_claim(
            read_json_if_exists(run_dir / "search" / "results.json", "search results"),
            settings.search_min_effect_points,
            settings.search_ks,
            seed=seed,
        ),
        *finetuning_claims(
            read_json_if_exists(reports_dir / "results.json", "evaluation results"), benchmark, settings
        ),
    ]
