"""Held-out checks of a PRM (paper 3.3, appendix E.4; formulas in docs/prm.md).

On held-out PRM records: BCE against the soft labels, the MC-label step AUC (MC label > 0.5 is
positive; Mann-Whitney with ties), Brier score, expected calibration error over equal-width bins
and the reliability table behind it, and the MC sibling-pair accuracy (steps under one prefix
ordered as their MC labels are). The paper's E.4 check: alter the result of a calculation in
steps labelled correct (by +1..9, and by +-1, the size of most of the policy's own slips) and
measure how far the score falls. The exact check (prm.exact_check), on the policy's own samples of held-out
problems labelled by their kind's exact labeller (FIRST_ERROR_LABELLERS): the AUC of correct
steps after a correct prefix against first wrong steps, and the slip-pair AUC (a first wrong
step that is an arithmetic slip against the same step with the right result, same prefix). On
PRM800K-format data: how often the PRM's first step scored below 0.5 is the human-labelled first
error (or both say "none").
"""

from __future__ import annotations

import hashlib
import random
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from matplotlib.figure import Figure

from pipeline.records import PRMExample
from pipeline.stats import grouped_bootstrap_auc, grouped_mean_interval
from pipeline.steps import calculation_result_spans
from pipeline.storage.files import write_json_atomic
from prm.data import group_records, sibling_pairs
from prm.exact_check import (
    PolicySample,
    exact_check,
    pair_auc,
)
from prm.prm800k import LabelledSolution, load_prm800k

# ----------------------------------------------------------------------------- metrics


def reliability_table(scores: Sequence[float], labels: Sequence[float], bins: int = 10) -> list[dict]:
    """Equal-width bins of the score on [0, 1] (bin b holds b/bins <= score < (b+1)/bins, the last
    one includes 1): per bin its edges, count, mean score and mean (soft) label."""
    scores = np.asarray(scores, dtype=np.float64)
    labels = np.asarray(labels, dtype=np.float64)
    index = np.clip(np.floor(scores * bins).astype(int), 0, bins - 1)
    table = []
    for b in range(bins):
        inside = index == b
        count = int(inside.sum())
        table.append(
            {
                "lo": b / bins,
                "hi": (b + 1) / bins,
                "count": count,
                "mean_score": float(scores[inside].mean()) if count else None,
                "mean_label": float(labels[inside].mean()) if count else None,
            }
        )
    return table


def expected_calibration_error(scores: Sequence[float], labels: Sequence[float], bins: int = 10) -> float:
    """ECE = sum over bins of (n_b / N) * |mean label_b - mean score_b| (equal-width bins, soft labels)."""
    table = reliability_table(scores, labels, bins)
    total = sum(row["count"] for row in table)
    if total == 0:
        return float("nan")
    return float(
        sum(row["count"] / total * abs(row["mean_label"] - row["mean_score"]) for row in table if row["count"])
    )


def brier_score(scores: Sequence[float], labels: Sequence[float]) -> float:
    """Mean of (score - label)^2 against the soft labels."""
    scores = np.asarray(scores, dtype=np.float64)
    labels = np.asarray(labels, dtype=np.float64)
    return float(np.mean((scores - labels) ** 2)) if len(scores) else float("nan")


# ----------------------------------------------------------------------------- scoring records


def record_logits(scorer, records: Sequence[PRMExample], merge_prefixes: bool = True) -> np.ndarray:
    """The PRM's logit for each record's step, from one forward pass per packed sequence."""
    sequences, slots = group_records(records, merge_prefixes)
    logits = scorer.logits_many([(s.question, s.steps) for s in sequences])
    return np.array([float(logits[seq][step]) for seq, step in slots], dtype=np.float64)


def mc_pair_check(scorer, records: Sequence[PRMExample], merge_prefixes: bool = True) -> dict:
    """How often the PRM orders sibling steps (same prefix, stored labels that differ; prm.data.sibling_pairs)
    as their labels do: the share of pairs whose higher-labelled step scores higher (ties 1/2), and
    that share weighted by the label gap. On MCTS records the labels are MC values, not exact ones.
    Returns {accuracy, interval (95%, problems resampled with all their pairs; pair_auc),
    gap_weighted_accuracy, n_pairs, n_prefixes}; accuracy and its interval None without pairs."""
    sequences, _ = group_records(records, merge_prefixes)
    pairs = sibling_pairs(sequences)
    if not pairs:
        return {
            "accuracy": None,
            "interval": [None, None],
            "gap_weighted_accuracy": None,
            "n_pairs": 0,
            "n_prefixes": 0,
        }
    logits = scorer.logits_many([(s.question, s.steps) for s in sequences])
    better = np.array([float(logits[p.better[0]][p.better[1]]) for p in pairs])
    worse = np.array([float(logits[p.worse[0]][p.worse[1]]) for p in pairs])
    gap = np.array([p.gap for p in pairs])
    wins = (better > worse) + 0.5 * (better == worse)
    problems = [sequences[p.better[0]].problem_id for p in pairs]
    accuracy, lo, hi = pair_auc(worse, better, problems)
    prefixes = {(problem, tuple(sequences[p.better[0]].steps[: p.better[1]])) for problem, p in zip(problems, pairs)}
    return {
        "accuracy": accuracy,
        "interval": [lo, hi],
        "gap_weighted_accuracy": float((wins * gap).sum() / gap.sum()),
        "n_pairs": len(pairs),
        "n_prefixes": len(prefixes),
    }


# ----------------------------------------------------------------------------- E.4 corruption


CORRUPTIONS = {
    "1to9": "the result increased by 1..9",
    "pm1": "the result moved by +1 or -1",
    "pm1to9": "the result moved by 1..9 up or down (up where down would go below 0)",
}


def corrupt_step(step: str, seed: int = 0, corruption: str = "1to9") -> str | None:
    """The step with the result of its last calculation changed, or None if it has none.

    The result is the number right after its last '=' that no operator follows
    (pipeline.steps.calculation_result_spans). ``corruption``:
    "1to9" adds 1..9 (the paper's E.4 check as first built here), "pm1" adds +1 or -1 (the size of
    most of the policy's own slips), "pm1to9" adds or subtracts 1..9 with equal odds, adding where
    subtracting would make the result negative (no direction to learn instead of the arithmetic).
    The change is chosen from sha256(seed, step), so the same step is always corrupted the same way.
    """
    if corruption not in CORRUPTIONS:
        raise ValueError(f"corruption must be one of {sorted(CORRUPTIONS)}, got {corruption!r}")
    spans = calculation_result_spans(step)
    if not spans:
        return None
    start, end = spans[-1]
    text = step[start:end]
    draw = int.from_bytes(hashlib.sha256(f"{seed}:{step}".encode()).digest()[:4], "big")
    if corruption == "pm1":
        delta = 1 if draw % 2 else -1
    else:
        delta = 1 + draw % 9
        if corruption == "pm1to9" and (draw >> 8) % 2 and float(text) - delta >= 0:
            delta = -delta
    if "." in text:
        decimals = len(text.split(".")[1])
        new = f"{float(text) + delta:.{decimals}f}"
    else:
        new = str(int(text) + delta)
    return step[:start] + new + step[end:]


def corruption_check(
    scorer,
    records: Sequence[PRMExample],
    max_examples: int = 200,
    seed: int = 0,
    min_label: float = 0.9,
    corruption: str = "1to9",
) -> dict:
    """Mean score drop when a correct step's result is altered (paper E.4).

    Steps with label >= min_label that have a result to alter; at most max_examples of them,
    drawn with Random(seed). drop = U(original) - U(corrupted), each scored after its own prefix.
    ``intervals``: {drop, original, corrupted} -> [lo, hi], 95%, problems resampled
    (pipeline.stats.grouped_mean_interval); [None, None] with fewer than two problems.
    """
    candidates = [
        (r, c)
        for r in records
        if r.label >= min_label
        for c in [corrupt_step(r.step, seed, corruption)]
        if c is not None
    ]
    if len(candidates) > max_examples:
        candidates = random.Random(seed).sample(candidates, max_examples)
    if not candidates:
        return {
            "n": 0,
            "corruption": corruption,
            "mean_drop": None,
            "share_lower": None,
            "mean_original": None,
            "mean_corrupted": None,
        }
    solutions = []
    for record, corrupted in candidates:
        solutions.append((record.question, [*record.prefix_steps, record.step]))
        solutions.append((record.question, [*record.prefix_steps, corrupted]))
    scores = [row[-1] for row in scorer.score_many(solutions)]
    original = np.array(scores[0::2])
    corrupted = np.array(scores[1::2])
    drop = original - corrupted
    groups = [record.problem_id for record, _ in candidates]
    intervals = {
        name: list(grouped_mean_interval(values, groups, seed=seed)[1:])
        for name, values in (("drop", drop), ("original", original), ("corrupted", corrupted))
    }
    return {
        "n": len(candidates),
        "corruption": corruption,
        "mean_drop": float(drop.mean()),
        "share_lower": float((drop > 0).mean()),
        "mean_original": float(original.mean()),
        "mean_corrupted": float(corrupted.mean()),
        # 95% percentile-bootstrap intervals of the three means, problems resampled with all their steps
        "intervals": intervals,
        "examples": [
            {"step": r.step, "corrupted": c, "drop": float(d)} for (r, c), d in list(zip(candidates, drop))[:5]
        ],
    }


# ----------------------------------------------------------------------------- PRM800K first errors


def first_error_accuracy(scorer, solutions: Sequence[LabelledSolution], threshold: float = 0.5) -> dict:
    """Share of solutions whose predicted first error (first step with U < threshold, or none)
    is the labelled one (first step rated -1, or none)."""
    usable = [s for s in solutions if s.steps]
    if not usable:
        return {"n": 0, "accuracy": None}
    scores = scorer.score_many([(s.question, s.steps) for s in usable])
    agree, agree_with_error, n_with_error, details = 0, 0, 0, []
    for solution, row in zip(usable, scores):
        predicted = next((k for k, u in enumerate(row) if u < threshold), None)
        hit = predicted == solution.first_error
        agree += hit
        if solution.first_error is not None:
            n_with_error += 1
            agree_with_error += hit
        details.append(
            {
                "line": solution.source_line,
                "n_steps": len(solution.steps),
                "first_error": solution.first_error,
                "predicted": predicted,
            }
        )
    return {
        "n": len(usable),
        "accuracy": agree / len(usable),
        "n_with_error": n_with_error,
        "accuracy_with_error": agree_with_error / n_with_error if n_with_error else None,
        "threshold": threshold,
        "solutions": details,
    }


# ----------------------------------------------------------------------------- the report


def validate_prm(
    scorer,
    records: Sequence[PRMExample],
    *,
    bins: int = 10,
    corrupt_examples: int = 200,
    prm800k_path: str | Path | None = None,
    seed: int = 0,
    merge_prefixes: bool = True,
    policy_samples: Sequence[PolicySample] | None = None,
) -> dict:
    """Every held-out check of a PRM scorer on PRM records (+ PRM800K when a path is given; +
    the exact check and the slip pairs on the policy's own held-out samples when given)."""
    labels = np.array([r.label for r in records], dtype=np.float64)
    report: dict[str, Any] = {"n_records": len(records)}
    if len(records):
        logits = record_logits(scorer, records, merge_prefixes)
        scores = 1.0 / (1.0 + np.exp(-logits))
        bce = F.binary_cross_entropy_with_logits(torch.from_numpy(logits), torch.from_numpy(labels)).item()
        positive = labels > 0.5
        table = reliability_table(scores, labels, bins)
        auc, auc_lo, auc_hi = grouped_bootstrap_auc(scores, positive, [r.problem_id for r in records])
        report.update(
            {
                "bce": bce,
                "auc": auc,
                "auc_interval": [auc_lo, auc_hi],
                "n_positive": int(positive.sum()),
                "n_negative": int((~positive).sum()),
                "brier": brier_score(scores, labels),
                "ece": expected_calibration_error(scores, labels, bins),
                "mean_score": float(scores.mean()),
                "mean_label": float(labels.mean()),
                "reliability": table,
            }
        )
        report["mc_pair"] = mc_pair_check(scorer, records, merge_prefixes)
        for key, corruption in (("corruption", "1to9"), ("corruption_pm1", "pm1")):
            report[key] = (
                corruption_check(scorer, records, corrupt_examples, seed, corruption=corruption)
                if corrupt_examples > 0
                else None
            )
    exact = exact_check(scorer, policy_samples, seed=seed) if policy_samples else None
    if exact is not None:
        report.update(exact)
    if prm800k_path:
        report["prm800k"] = first_error_accuracy(scorer, load_prm800k(prm800k_path))
    return report


def plot_reliability(table: Sequence[dict], path: str | Path, title: str = "PRM calibration") -> Path:
    """Reliability diagram (mean label against mean score per bin) with the bin counts below."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    filled = [row for row in table if row["count"]]
    fig = Figure(figsize=(5, 6))
    top, bottom = fig.subplots(2, 1, sharex=True, gridspec_kw={"height_ratios": [3, 1]})
    top.plot([0, 1], [0, 1], linestyle="--", color="grey", label="perfect calibration")
    top.plot([r["mean_score"] for r in filled], [r["mean_label"] for r in filled], marker="o", label="PRM")
    top.set_ylabel("mean label")
    top.set_xlim(0, 1)
    top.set_ylim(0, 1)
    top.legend(loc="upper left")
    top.set_title(title)
    width = table[0]["hi"] - table[0]["lo"] if table else 0.1
    bottom.bar([r["lo"] for r in table], [r["count"] for r in table], width=width, align="edge", edgecolor="black")
    bottom.set_xlabel("predicted step score U")
    bottom.set_ylabel("steps")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    return path


def write_validation(report: dict, directory: str | Path) -> None:
    """validation.json and calibration.png in ``directory``."""
    directory = Path(directory)
    write_json_atomic(directory / "validation.json", report)
    if report.get("reliability"):
        plot_reliability(report["reliability"], directory / "calibration.png")
