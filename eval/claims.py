"""The paper's claims at the tiny world's scale, read from the files the stages wrote (make demo),
and pooled over the seeds of make experiment.

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
- gfn_matches_target:     the GFlowNet's own draw at temperature 1 against its target pi_base x L
                          (eval.target_samples; reports/<run>/results.json "target"): the strategy
                          share distance at most claims.target_share_margin, and its mean log L
                          minus the target's within +- claims.target_log_likelihood_margin (two-sided:
                          a sampler that overshoots the likelihood misses the target as one that
                          stays short does); the base policy's figures beside it, a control
- gfn_reward_higher:      the GFlowNet's held-out mean PRM reward above the base policy's (paired;
                          paper Table 2 in miniature)
- gfn_accuracy_not_lower: neither its greedy accuracy nor its pass@1 lower than the base's (paired,
                          with a margin)
- gfn_more_diverse_than_ppo: against PPO, a higher strategy entropy of the correct solutions at the
                          held-out log L both reach (eval.curves: results.json "curves" ... "matched",
                          eval/matched.py), at a pass@1 not lower (with the same margin); the plain
                          paired entropy difference of the final models and the whole-text
                          similarity difference shown beside it (paper Table 4, appendix D)

The rules, [lo, hi] the 95% interval:

- a threshold claim holds when lo >= the threshold, fails when hi < it, and is inconclusive otherwise;
- an effect claim (a paired difference that must be higher) holds when lo > 0 and the estimate
  reaches its minimal effect (claims.*_min_effect*), fails when hi < 0, and is inconclusive otherwise;
- a "not lower" claim (a paired accuracy difference in points) holds when lo >= the margin
  (claims.accuracy_margin_points, -3), fails when hi < the margin, and is inconclusive otherwise;
- a "within" claim (a distance to a target) holds when [lo, hi] lies inside the allowed range,
  fails when it lies wholly outside, and is inconclusive otherwise.

A claim of several parts (every search strategy; greedy and pass@1; entropy and pass@1; distance and
log L) holds when every part holds and fails when any part fails. The thresholds are the issue's,
fixed before the runs they judge; the minimal effects and margins are the config's
(pipeline.config.claims.ClaimsConfig). A claim whose inputs are missing fails and says so; a
diversity comparison whose two curves never reach one reward is inconclusive and says why. The
MC-label AUC (validation.json "auc": steps with MC label > 0.5 against the rest) is reported
beside the claims, not judged: it counts correct steps of hard problems as negatives.

How: measure_run reads one run's figures, every part of every claim as {mean, lo, hi} (Measured);
pool_measured pools the parts of several seeds (pipeline.stats.pool_intervals); judge turns parts
into claims. evaluate_claims is judge(measure_run(...)), pooled_claims judge(pool_measured(...)).
"""

from __future__ import annotations

import math
import typing
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

from pipeline.config.claims import ClaimsConfig
from pipeline.stats import pool_intervals
from pipeline.storage.files import read_json_if_exists
from prm.search.summary import paired_difference

AUC_THRESHOLD = 0.8  # prm_auc: exact labels, first wrong steps against correct steps after a correct prefix
SLIP_PAIR_THRESHOLD = 0.9  # prm_slip_pair_auc: slips against their correct counterparts
SEARCH_STRATEGIES = ("step_best_of_k", "beam", "weighted_vote")
CLAIM_IDS = (
    "prm_auc",
    "prm_slip_pair_auc",
    "search_rises_with_k",
    "gfn_matches_target",
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


def within_verdict(lo: float, hi: float, low: float, high: float) -> Verdict:
    """A figure that must lie in [low, high] (an equivalence test): holds when the interval [lo, hi]
    lies inside it, fails when the interval lies wholly outside it, inconclusive otherwise."""
    return "holds" if low <= lo and hi <= high else "fails" if hi < low or lo > high else "inconclusive"


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

    def figure(self) -> str:
        """``<figure> [<lo>, <hi>]``: signed for a paired difference; n/a when not measured."""
        lo, hi = self.interval
        figure = (
            "n/a"
            if self.value is None
            else f"{self.value:+.4g}"
            if self.comparison.startswith("paired")
            else f"{self.value:.4g}"
        )
        interval = f" [{lo:.4g}, {hi:.4g}]" if lo is not None and hi is not None else ""
        return figure + interval

    def markdown(self) -> str:
        """``- <id>: holds|inconclusive|fails: <figure> [<lo>, <hi>] (<comparison>)``"""
        return f"- {self.id}: {self.verdict}: {self.figure()} ({self.comparison})"

    def to_json(self) -> dict:
        return {
            "verdict": self.verdict,
            "value": self.value,
            "interval": list(self.interval),
            "comparison": self.comparison,
        }


# The parts every claim is judged on, as measure_run names them: each {"mean", "lo", "hi"} (lo and
# hi None: no interval) or None (not measured). Accuracy parts are fractions; search parts are
# f"search {strategy} k={k}".
PRM_PARTS = ("prm_auc", "prm_slip_pair_auc")
TARGET_PARTS = ("target_share_distance", "target_log_likelihood")  # the GFlowNet's; "base_" + each: the control
FINETUNE_PARTS = ("reward", "greedy", "pass@1")  # GFlowNet minus base
DIVERSITY_PARTS = ("matched_entropy", "ppo_pass@1", "plain_entropy", "similarity")  # GFlowNet minus PPO


def search_part(strategy: str, k: int) -> str:
    return f"search {strategy} k={k}"


@dataclass
class Measured:
    """What one run (or several, pooled) measured for the claims.

    parts: part name -> {"mean", "lo", "hi"} or None (above); notes: what the text of a claim says
    beside its figures ("slip_pairs": the pairs counted; "matched": why the diversity curves were
    not matched; "target": why the target was not measured); seeds: the seeds pooled (one run: [])."""

    parts: dict[str, dict | None]
    notes: dict[str, str] = field(default_factory=dict)
    seeds: list[int] = field(default_factory=list)


def _interval_part(value, interval) -> dict | None:
    if value is None:
        return None
    lo, hi = interval or (None, None)
    return {"mean": value, "lo": lo, "hi": hi}


def _difference(block: dict | None, key: str) -> dict | None:
    found = (block or {}).get(key)
    return {"mean": found["mean"], "lo": found["lo"], "hi": found["hi"]} if found else None


def measure_prm(validation: dict | None) -> Measured:
    """prm_auc and prm_slip_pair_auc from prm/validation.json's "exact" and "slip_pair" blocks."""
    validation = validation or {}
    exact, pair = validation.get("exact") or {}, validation.get("slip_pair") or {}
    return Measured(
        {
            "prm_auc": _interval_part(exact.get("auc"), exact.get("interval")),
            "prm_slip_pair_auc": _interval_part(pair.get("auc"), pair.get("interval")),
        },
        {"slip_pairs": str(pair.get("n_pairs", 0))},
    )


def measure_search(search: dict | None, ks: Sequence[int], n_resamples: int = 2000, seed: int = 0) -> Measured:
    """Accuracy at each k of ``ks`` minus k = 1, paired per problem, for every strategy of
    SEARCH_STRATEGIES (search/results.json rows; prm.search.summary.paired_difference)."""
    rows = (search or {}).get("rows", [])
    parts = {}
    for strategy in SEARCH_STRATEGIES:
        for k in ks:
            difference = paired_difference(rows, (strategy, k), (strategy, 1), n_resamples=n_resamples, seed=seed)
            parts[search_part(strategy, k)] = difference and {key: difference[key] for key in ("mean", "lo", "hi")}
    return Measured(parts)


def measure_finetuning(results: dict | None, benchmark: str) -> Measured:
    """The GFlowNet's parts from make eval's results.json: "comparisons" (paired against the base,
    and GFlowNet minus PPO), "curves" ... "matched" (gfn_vs_ppo at the log L both reach) and
    "target" (each model's draw at temperature 1 against the GFlowNet's target)."""
    results = results or {}
    comparisons = results.get("comparisons") or {}
    gfn = (
        (comparisons.get("models") or {}).get("gfn", {}).get(benchmark)
        if comparisons.get("reference") == "base"
        else None
    )
    pair = ((comparisons.get("pairs") or {}).get("gfn_vs_ppo") or {}).get(benchmark)
    parts = {
        "reward": _difference(gfn, "prm_reward"),
        "greedy": _difference(gfn, "greedy_pass@1"),
        "pass@1": _difference(gfn, "pass@1"),
        "ppo_pass@1": _difference(pair, "pass@1"),
        "plain_entropy": _difference(pair, "strategy_entropy"),
        "similarity": _difference(pair, "similarity"),
    }
    notes = {}
    matched = ((((results.get("curves") or {}).get(benchmark) or {}).get("matched")) or {}).get("gfn_vs_ppo")
    if matched and matched.get("mean") is not None:
        parts["matched_entropy"] = {"mean": matched["mean"], "lo": matched.get("lo"), "hi": matched.get("hi")}
    else:
        parts["matched_entropy"] = None
        if matched:
            notes["matched"] = matched.get("reason") or matched.get("note") or "not matched"
    models = ((results.get("target") or {}).get(benchmark) or {}).get("models") or {}
    for prefix, model in (("", "gfn"), ("base_", "base")):
        found = models.get(model) or {}
        # a figure without an estimate (no question where both name a strategy) is not measured
        distance, likelihood = found.get("share_distance") or {}, found.get("log_likelihood") or {}
        parts[prefix + "target_share_distance"] = _interval_part(
            distance.get("estimate"), (distance.get("lo"), distance.get("hi"))
        )
        parts[prefix + "target_log_likelihood"] = _interval_part(
            likelihood.get("difference"), (likelihood.get("lo"), likelihood.get("hi"))
        )
    if not models:
        notes["target"] = "not measured (eval.target_samples is 0 or eval.prm is unset)"
    return Measured(parts, notes)


def measure_run(
    run_dir: Path, reports_dir: Path, benchmark: str = "tiny_test", seed: int = 0, settings: ClaimsConfig | None = None
) -> Measured:
    """Every part of every claim of CLAIM_IDS from a finished run's files."""
    run_dir, reports_dir = Path(run_dir), Path(reports_dir)
    settings = settings or ClaimsConfig()
    measured = [
        measure_prm(read_json_if_exists(run_dir / "prm" / "validation.json", "PRM validation")),
        measure_search(
            read_json_if_exists(run_dir / "search" / "results.json", "search results"), settings.search_ks, seed=seed
        ),
        measure_finetuning(read_json_if_exists(reports_dir / "results.json", "evaluation results"), benchmark),
    ]
    return Measured(
        {k: v for m in measured for k, v in m.parts.items()}, {k: v for m in measured for k, v in m.notes.items()}
    )


def pool_measured(runs: Sequence[Measured], seeds: Sequence[int]) -> Measured:
    """The parts of several seeds' runs pooled (pipeline.stats.pool_intervals: the mean of the seeds'
    estimates, the normal interval of that mean from their intervals). A part missing, or without
    an interval, on any seed is missing pooled, and its note names the seeds."""
    if len(runs) != len(seeds) or not runs:
        raise ValueError(f"pool_measured: {len(runs)} runs and {len(seeds)} seeds; expected one run per seed, >= 1")
    parts, notes = {}, {}
    for name in runs[0].parts:
        found = [run.parts.get(name) for run in runs]
        lacking = [s for s, part in zip(seeds, found) if not part or part.get("lo") is None or part.get("hi") is None]
        parts[name] = None if lacking else pool_intervals(found)
        if lacking:
            notes[f"missing {name}"] = f"not measured, or without an interval, on seed {', '.join(map(str, lacking))}"
    notes["slip_pairs"] = str(sum(int(run.notes.get("slip_pairs", 0)) for run in runs))
    for key in ("matched", "target"):
        reasons = [f"seed {s}: {run.notes[key]}" for s, run in zip(seeds, runs) if key in run.notes]
        if reasons:
            notes[key] = "; ".join(reasons)
    return Measured(parts, notes, list(seeds))


def _direction(part: dict | None) -> str:
    if not part or part.get("lo") is None:
        return "missing" if not part else "no interval"
    return "higher" if part["lo"] > 0 else "lower" if part["hi"] < 0 else "no clear change"


def _fmt(part: dict | None, scale: float = 1.0) -> str:
    if not part:
        return "n/a"
    if part.get("lo") is None or part.get("hi") is None:
        return f"{scale * part['mean']:+.3g} (no interval)"
    return f"{scale * part['mean']:+.3g} [{scale * part['lo']:+.3g}, {scale * part['hi']:+.3g}] {_direction(part)}"


def _has_interval(part: dict | None) -> bool:
    return bool(part) and part.get("lo") is not None and part.get("hi") is not None


def _effect(part: dict | None, min_effect: float, scale: float = 1.0) -> Verdict:
    """effect_verdict of a paired difference in ``scale`` x its units; missing: fails; no interval:
    inconclusive."""
    if not part:
        return "fails"
    if not _has_interval(part):
        return "inconclusive"
    return effect_verdict(scale * part["mean"], scale * part["lo"], scale * part["hi"], min_effect)


def _not_lower(part: dict | None, margin_points: float) -> Verdict:
    """not_lower_verdict of a paired accuracy difference (fractions) against a margin in points;
    missing: fails; no interval: inconclusive."""
    if not part:
        return "fails"
    if not _has_interval(part):
        return "inconclusive"
    return not_lower_verdict(100 * part["lo"], 100 * part["hi"], margin_points)


def _within(part: dict | None, low: float, high: float) -> Verdict:
    if not part:
        return "fails"
    if not _has_interval(part):
        return "inconclusive"
    return within_verdict(part["lo"], part["hi"], low, high)


def _claim(claim_id: str, verdict: Verdict, part: dict | None, comparison: str, scale: float = 1.0) -> Claim:
    if not part:
        return Claim(claim_id, verdict, None, (None, None), comparison)
    lo, hi = (part.get("lo"), part.get("hi")) if _has_interval(part) else (None, None)
    return Claim(
        claim_id,
        verdict,
        scale * part["mean"],
        (None if lo is None else scale * lo, None if hi is None else scale * hi),
        comparison,
    )


def _threshold_claim(claim_id: str, part: dict | None, what: str, threshold: float) -> Claim:
    if part is None:
        return Claim(claim_id, "fails", None, (None, None), f"{what}: not measured")
    if not _has_interval(part):
        return Claim(claim_id, "inconclusive", part["mean"], (None, None), f"{what} >= {threshold}: no interval")
    return _claim(claim_id, threshold_verdict(part["lo"], part["hi"], threshold), part, f"{what} >= {threshold}")


def judge(measured: Measured, settings: ClaimsConfig | None = None) -> list[Claim]:
    """Every claim of CLAIM_IDS, in that order, from the parts ``measured`` holds, judged with
    ``settings`` (the config's claims section; None: its defaults)."""
    settings = settings or ClaimsConfig()
    parts, notes = measured.parts, measured.notes
    pooled = f"; pooled over seeds {', '.join(map(str, measured.seeds))}" if measured.seeds else ""
    margin = settings.accuracy_margin_points
    claims = [
        _threshold_claim(
            "prm_auc",
            parts.get("prm_auc"),
            "AUC of first wrong steps vs correct steps after a correct prefix, exact labels, the policy's own "
            f"held-out samples{pooled}",
            AUC_THRESHOLD,
        ),
        _threshold_claim(
            "prm_slip_pair_auc",
            parts.get("prm_slip_pair_auc"),
            f"share of the policy's slips scored below their correct counterpart, same prefix "
            f"({notes.get('slip_pairs', '0')} pairs){pooled}",
            SLIP_PAIR_THRESHOLD,
        ),
    ]
    ks = settings.search_ks
    search = {(s, k): parts.get(search_part(s, k)) for s in SEARCH_STRATEGIES for k in ks}
    missing = [f"{s} k={k} vs 1" for (s, k), part in search.items() if not part]
    if missing:
        claims.append(
            Claim(
                "search_rises_with_k",
                "fails",
                None,
                (None, None),
                f"paired accuracy difference: no rows for {', '.join(missing)}{pooled}",
            )
        )
    else:
        weakest = min(search, key=lambda key: search[key]["mean"])
        detail = "; ".join(f"{s} k={k} vs 1: {_fmt(d, 100)} pts" for (s, k), d in search.items())
        at = " and ".join(f"k={k}" for k in ks)
        claims.append(
            _claim(
                "search_rises_with_k",
                combined_verdict([_effect(d, settings.search_min_effect_points, scale=100) for d in search.values()]),
                search[weakest],
                f"paired accuracy at {at}, each minus k=1, each above 0 and >= {settings.search_min_effect_points:g} "
                f"pts; {detail}{pooled}",
            )
        )
    share_margin, likelihood_margin = settings.target_share_margin, settings.target_log_likelihood_margin
    distance, likelihood = parts.get("target_share_distance"), parts.get("target_log_likelihood")
    control = (
        f"the base policy (control): distance {_fmt(parts.get('base_target_share_distance'))}, log L "
        f"{_fmt(parts.get('base_target_log_likelihood'))}"
    )
    target_note = f" ({notes['target']})" if "target" in notes and not distance else ""
    claims.append(
        _claim(
            "gfn_matches_target",
            combined_verdict(
                [_within(distance, -math.inf, share_margin), _within(likelihood, -likelihood_margin, likelihood_margin)]
            ),
            distance,
            f"the GFlowNet's draw at temperature 1 against its target pi_base x L{target_note}: strategy share "
            f"distance {_fmt(distance)} (at most {share_margin:g}), mean log L minus the target's "
            f"{_fmt(likelihood)} (within +-{likelihood_margin:g}); {control}{pooled}",
        )
    )
    reward = parts.get("reward")
    claims.append(
        _claim(
            "gfn_reward_higher",
            _effect(reward, settings.reward_min_effect),
            reward,
            f"paired held-out mean PRM reward, GFlowNet minus base: {_direction(reward)}; above 0 and "
            f">= {settings.reward_min_effect:g}{pooled}",
        )
    )
    accuracy = [parts.get("greedy"), parts.get("pass@1")]
    worst = min((d for d in accuracy if d), key=lambda d: d["mean"], default=None)
    claims.append(
        _claim(
            "gfn_accuracy_not_lower",
            combined_verdict([_not_lower(d, margin) for d in accuracy]),
            worst,
            f"paired accuracy in points, GFlowNet minus base, neither lower than {margin:g} pts: greedy "
            f"{_fmt(accuracy[0], 100)}, pass@1 {_fmt(accuracy[1], 100)}{pooled}",
            scale=100,
        )
    )
    entropy, pass1 = parts.get("matched_entropy"), parts.get("ppo_pass@1")
    unmatched = not entropy and "matched" in notes
    entropy_verdict: Verdict = "inconclusive" if unmatched else _effect(entropy, settings.diversity_min_effect_bits)
    why = f" (not matched: {notes['matched']})" if unmatched else ""
    claims.append(
        _claim(
            "gfn_more_diverse_than_ppo",
            combined_verdict([entropy_verdict, _not_lower(pass1, margin)]),
            entropy,
            f"paired, GFlowNet minus PPO: strategy entropy of correct solutions at the held-out log L both reach "
            f"{_fmt(entropy)} bits{why} (above 0 and >= {settings.diversity_min_effect_bits:g}), pass@1 "
            f"{_fmt(pass1, 100)} pts (not lower than {margin:g}); the final models' entropy "
            f"{_fmt(parts.get('plain_entropy'))} and whole-text similarity {_fmt(parts.get('similarity'))} (shown, "
            f"not judged){pooled}",
        )
    )
    return claims


def finetuning_claims(results: dict | None, benchmark: str, settings: ClaimsConfig) -> list[Claim]:
    """gfn_matches_target, gfn_reward_higher, gfn_accuracy_not_lower and gfn_more_diverse_than_ppo from
    make eval's results.json alone."""
    finetuning = set(CLAIM_IDS[3:])
    return [claim for claim in judge(measure_finetuning(results, benchmark), settings) if claim.id in finetuning]


def evaluate_claims(
    run_dir: Path,
    reports_dir: Path,
    benchmark: str = "tiny_test",
    seed: int = 0,
    settings: ClaimsConfig | None = None,
) -> list[Claim]:
    """Every claim of CLAIM_IDS, in that order, from a finished run's files, judged with ``settings``
    (the config's claims section; None: its defaults)."""
    return judge(measure_run(run_dir, reports_dir, benchmark, seed, settings), settings)


def pooled_claims(
    runs: Sequence[tuple[Path, Path]],
    seeds: Sequence[int],
    benchmark: str = "tiny_test",
    eval_seed: int = 0,
    settings: ClaimsConfig | None = None,
) -> tuple[list[Claim], Measured]:
    """Every claim judged on the parts of several seeds' runs ((run dir, reports dir) per seed),
    pooled (pool_measured); also the pooled parts, for the report's figures."""
    measured = pool_measured(
        [measure_run(run, reports, benchmark, eval_seed, settings) for run, reports in runs], seeds
    )
    return judge(measured, settings), measured
