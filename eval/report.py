"""The evaluation report: results.json -> report.md (paper Tables 2 and 4 with 95% CIs) and plots.

``write_report(results, out_dir)`` writes report.md, accuracy.png (accuracy with CI error bars,
per benchmark and model) and similarity.png (mean pairwise similarity per model and benchmark).
It reads nothing but the results object of eval.evaluate.run_evaluation, so a report can be
rebuilt from a saved results.json with ``write_report(load_results(path), folder)``.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
from matplotlib.figure import Figure

ACCURACY_COLUMNS = (  # (results key, column title; "k" is replaced by the number of samples)
    ("greedy_pass@1", "greedy pass@1"),
    ("pass@1", "pass@1"),
    ("maj@k", "maj@k"),
    ("pass@k", "pass@k"),
)


def load_results(path: str | Path) -> dict:
    return json.loads(Path(path).read_text(encoding="utf-8"))


def _rows(results: dict) -> list[tuple[str, str, dict]]:
    """(model, benchmark, metrics) in config order."""
    return [
        (model, bench, metrics)
        for model, per_bench in results["results"].items()
        for bench, metrics in per_bench.items()
    ]


def _percent(interval: dict | None) -> str:
    if not interval or interval.get("mean") is None:
        return "n/a"
    return f"{100 * interval['mean']:.1f} [{100 * interval['lo']:.1f}, {100 * interval['hi']:.1f}]"


def _number(value, digits: int = 3) -> str:
    return "n/a" if value is None else f"{value:.{digits}f}"


def _interval(interval: dict | None, digits: int = 3) -> str:
    if not interval or interval.get("mean") is None:
        return "n/a"
    return f"{interval['mean']:.{digits}f} [{interval['lo']:.{digits}f}, {interval['hi']:.{digits}f}]"


def _bounds(interval: dict, digits: int = 3) -> str:
    """ "[lo, hi]" of an interval, or "" when it has none (too few questions to resample)."""
    if interval.get("lo") is None:
        return ""
    return f"[{interval['lo']:.{digits}f}, {interval['hi']:.{digits}f}]"


def direction(interval: dict) -> str:
    """higher / lower when a difference's interval excludes 0, else no clear change."""
    if interval["lo"] > 0:
        return "higher"
    if interval["hi"] < 0:
        return "lower"
    return "no clear change"


def _difference(interval: dict | None, scale: float = 100, digits: int = 1) -> str:
    if not interval:
        return "n/a"
    mean, lo, hi = (scale * interval[key] for key in ("mean", "lo", "hi"))
    return f"{mean:+.{digits}f} [{lo:+.{digits}f}, {hi:+.{digits}f}] *{direction(interval)}*"


def _counted(diversity: dict) -> str:
    """``counted / multi-strategy`` problems of the strategy figures; n/a where no problem knows its strategies."""
    multi = diversity.get("multi_strategy_problems")
    if multi is None:
        return "n/a"
    return f"{diversity['strategy_entropy']['n_scored']} / {multi}"


def _table(header: list[str], rows: list[list[str]]) -> list[str]:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(row) + " |" for row in rows]
    return lines


def _pivot(results: dict, cell) -> list[str]:
    """Paper layout: one row per model, one column per benchmark."""
    benchmarks = list(results["benchmarks"])
    rows = []
    for model, per_bench in results["results"].items():
        rows.append([model] + [cell(per_bench[b]) if b in per_bench else "n/a" for b in benchmarks])
    return _table(["model"] + benchmarks, rows)


def render_markdown(results: dict, plots: dict[str, str] | None = None) -> str:
    """report.md text: settings, benchmarks, Table 2 (accuracy) and Table 4 (diversity), skipped models."""
    settings = results["settings"]
    k = settings["k"]
    greedy = settings.get("greedy", True)
    lines = [f"# Evaluation: run `{results['run']}`", ""]
    lines += [
        f"{k} samples per problem at temperature {settings['temperature']} (top-p {settings['top_p']})"
        + (", plus one greedy (temperature 0) solution" if greedy else "")
        + f"; at most {settings['max_new_tokens']} new tokens. Accuracies in %, with 95% percentile-bootstrap "
        f"confidence intervals over problems ({settings['bootstrap_resamples']} resamples, seed {settings['seed']}) "
        "in brackets. Similarity: mean pairwise cosine of the embeddings of whole solution texts "
        f"({settings['embedder']}); lower = more diverse. Formulas: docs/metrics.md.",
        "",
        "## Benchmarks",
        "",
    ]
    lines += _table(
        ["benchmark", "problems", "grading kind", "source"],
        [
            [
                name,
                str(b["n_problems"]),
                ", ".join(b["kinds"]),
                f"`{b['path']}`" if b["path"] else f"hub ({b['loader']})",
            ]
            for name, b in results["benchmarks"].items()
        ],
    )
    rows = _rows(results)
    if rows:
        shown = [
            (key, title.replace("@k", f"@{k}")) for key, title in ACCURACY_COLUMNS if greedy or key != "greedy_pass@1"
        ]
        lines += ["", "## Accuracy (Table 2)", ""]
        main_key = "greedy_pass@1" if greedy else "pass@1"
        lines += [f"{dict(shown)[main_key]}, by model and benchmark:", ""]
        lines += _pivot(results, lambda m: _percent(m["accuracy"].get(main_key)))
        lines += ["", "Every metric:", ""]
        lines += _table(
            ["model", "benchmark", "problems"] + [title for _, title in shown] + ["answered"],
            [
                [model, bench, str(m["n_problems"])]
                + [_percent(m["accuracy"].get(key)) for key, _ in shown]
                + [f"{100 * m['answered']:.1f}"]
                for model, bench, m in rows
            ],
        )
        if any("prm_reward" in m for _, _, m in rows):
            lines += [
                "",
                f"Mean PRM reward R = prod U of the sampled solutions (`{settings.get('prm')}`; the GFlowNet's "
                "target is proportional to it), mean over problems with a 95% bootstrap interval:",
                "",
            ]
            lines += _pivot(results, lambda m: _interval(m.get("prm_reward"), 4))
            lines += [
                "",
                "Can fine-tuning toward R help? Within-problem AUC: how well R ranks a problem's correct samples "
                "above its wrong ones (mean over problems with both; 0.5 = not at all). Reweighted: the samples "
                "weighted in proportion to R within each problem, an estimate of what a policy sampling in "
                "proportion to pi * R would reach:",
                "",
            ]
            lines += _table(
                [
                    "model",
                    "benchmark",
                    "within-problem AUC (problems)",
                    "accuracy",
                    "R-reweighted accuracy",
                    "R-reweighted mean R",
                ],
                [
                    [
                        model,
                        bench,
                        f"{_number(m['prm_reward'].get('within_problem_auc'))} ({m['prm_reward'].get('n_mixed', 0)})",
                        f"{100 * m['accuracy']['pass@1']['mean']:.1f}",
                        f"{100 * m['prm_reward']['reweighted_accuracy']:.1f}",
                        _number(m["prm_reward"]["reweighted_reward"], 4),
                    ]
                    for model, bench, m in rows
                    if "prm_reward" in m
                ],
            )
        lines += ["", "## Diversity of reasoning (Table 4)", ""]
        lines += [
            "Mean pairwise similarity of the sampled solutions, each embedded whole with its steps in order, by "
            "model and benchmark (lower = more diverse):",
            "",
        ]
        lines += _pivot(results, lambda m: _interval(m["diversity"]["similarity"]))
        if any(m["diversity"].get("strategy_entropy", {}).get("mean") is not None for _, _, m in rows):
            lines += [
                "",
                "Strategy entropy of the correct solutions, in bits (per problem the entropy of the strategy names "
                "its correct samples carry out, mean over the problems counted: more than one valid strategy and "
                "at least one correct sample with one; higher = more diverse; n/a where problems do not know "
                "their strategies):",
                "",
            ]
            lines += _pivot(results, lambda m: _interval(m["diversity"].get("strategy_entropy")))
        lines += [
            "",
            "Every measure (distinct-n over whitespace tokens; distinct strategies: strategy names among a "
            "problem's correct samples, mean over the problems the entropy counts; problems counted / "
            "multi-strategy: how many it counts, of those with more than one valid strategy; correct texts: "
            "distinct step sequences among a problem's correct samples, mean over all problems / over solved "
            "ones):",
            "",
        ]
        lines += _table(
            [
                "model",
                "benchmark",
                "similarity",
                "Vendi",
                "distinct-1",
                "distinct-2",
                "distinct-3",
                "strategy entropy (bits)",
                "distinct strategies",
                "problems counted / multi-strategy",
                "correct texts",
                "per solved problem",
                "steps per solution",
            ],
            [
                [
                    model,
                    bench,
                    _interval(m["diversity"]["similarity"]),
                    _number(m["diversity"]["vendi"], 2),
                    _number(m["diversity"]["distinct_1"]),
                    _number(m["diversity"]["distinct_2"]),
                    _number(m["diversity"]["distinct_3"]),
                    _interval(m["diversity"].get("strategy_entropy")),
                    _number(m["diversity"].get("distinct_strategies"), 2),
                    _counted(m["diversity"]),
                    _number(m["diversity"].get("correct_texts"), 2),
                    _number(m["diversity"].get("correct_texts_solved"), 2),
                    _number(m["mean_steps"], 1),
                ]
                for model, bench, m in rows
            ],
        )
    else:
        lines += ["", "No model was evaluated."]
    comparisons = results.get("comparisons") or {}
    shown = [(key, title.replace("@k", f"@{k}")) for key, title in ACCURACY_COLUMNS if greedy or key != "greedy_pass@1"]
    if comparisons.get("models"):
        reference = comparisons["reference"]
        lines += ["", f"## Against `{reference}` (paired)", ""]
        lines += [
            f"Accuracy of each model minus `{reference}`'s on the same problems, in points, with a paired "
            "95% bootstrap interval (problems resampled once for both models). *higher* / *lower*: the "
            "interval excludes 0; *no clear change* otherwise.",
            "",
        ]
        lines += _differences_table(comparisons["models"], shown)
    if comparisons.get("pairs"):
        lines += ["", "## Model against model (paired)", ""]
        lines += [
            "The first model minus the second (eval.pairs), as above; similarity: mean pairwise cosine of "
            "a problem's whole solution texts (lower = more diverse); strategy entropy: bits per problem, over "
            "the problems counted for both models (higher = more diverse).",
            "",
        ]
        lines += _differences_table(
            {pair.replace("_vs_", " - "): per_bench for pair, per_bench in comparisons["pairs"].items()}, shown
        )
    if results.get("target"):
        lines += ["", "## The GFlowNet's target (draw at temperature 1)", ""]
        lines += [
            "The target pi_base x R^(1/T), estimated by weighting the reference's samples by R^(1/T) within each "
            "question; each model's own samples against it: the total variation of the per-family strategy "
            "shares (0 = the target's mix) and its mean log L minus the target's, with 95% bootstrap intervals "
            "over questions.",
            "",
        ]
        for bench, target in results["target"].items():
            ess = target["effective_samples"]
            lines += [
                f"**{bench}** ({target['reference']}'s draw): effective samples per question mean {ess['mean']:.2f}, "
                f"median {ess['median']:.2f}, min {ess['min']:.2f}.",
                "",
            ]
            rows = []
            for model, compared in target["models"].items():
                distance, log_l = compared["share_distance"], compared["log_likelihood"]
                rows.append(
                    [
                        model,
                        "n/a" if distance["estimate"] is None else f"{distance['estimate']:.3f} {_bounds(distance)}",
                        _number(log_l["sampler"]),
                        _number(log_l["target"]),
                        "n/a" if log_l["difference"] is None else f"{log_l['difference']:+.3f} {_bounds(log_l)}",
                    ]
                )
            lines += _table(["model", "strategy-share TV", "mean log L", "target's", "difference"], rows)
            lines += [""]
    lines += curves_lines(results)
    if results["skipped"]:
        lines += ["", "## Skipped models", ""]
        lines += [
            f"- **{s['model']}**: {s['reason']} (run the stage that trains it, or fix `eval.models.{s['model']}`)"
            for s in results["skipped"]
        ]
    if plots:
        lines += ["", "## Plots", ""]
        lines += [f"![{name}]({file})" for name, file in plots.items()]
    return "\n".join(lines) + "\n"


def matched_line(name: str, matched: dict) -> str:
    """One line of a matched comparison (eval.matched.matched_difference) in bits."""
    a, _, b = name.partition("_vs_")
    if "note" in matched:
        return f"- {a} - {b} at matched log L: not measured ({matched['note']})"
    anchor, other = (a, b) if matched.get("anchor", "a") == "a" else (b, a)
    if not matched["matched"]:
        if matched.get("reason", "").startswith("a checkpoint"):
            return f"- {a} - {b} at matched log L: not measured: {matched['reason']}"
        return (
            f"- {a} - {b} at matched log L: not matched: {other}'s curve never reaches {anchor}'s final mean log L "
            f"{matched['reward']:.3f}"
        )
    interval = "" if matched["lo"] is None else f" [{matched['lo']:+.3f}, {matched['hi']:+.3f}]"
    return (
        f"- {a} - {b} at matched log L ({anchor}'s final, {matched['reward']:.3f}, the log L both reach): strategy "
        f"entropy {matched['mean']:+.3f}{interval} bits ({a} {matched['a']:.3f}, {b} {matched['b']:.3f}; {other}'s "
        f"interpolated on its curve; {matched['resamples_matched']} of {matched['resamples']} resamples matched)"
    )


def curves_lines(results: dict) -> list[str]:
    """The report's section of eval.curves: each checkpoint's mean log L and equal-count strategy
    entropy per benchmark, and the matched comparisons (eval.evaluate.diversity_curves)."""
    if not results.get("curves"):
        return []
    lines = [
        "",
        "## Diversity against reward along training (eval.curves)",
        "",
        "Each checkpoint of a fine-tuned model (the base as step 0, its snapshots, the model itself): the mean "
        "held-out log L (sum of log U, -10 when unanswered: the judged learners' shared return) and the strategy "
        "entropy at an equal count of right samples; then one model's entropy minus another's where their log L "
        "match (eval/matched.py; reported, not judged).",
        "",
    ]
    for bench, block in results["curves"].items():
        rows = [
            [
                model,
                bench,
                f"{point['model']} ({point['step']})",
                _number(point["log_likelihood"]),
                _number(point["strategy_entropy"]),
            ]
            for model, points in block["curves"].items()
            for point in points
        ]
        lines += _table(["curve", "benchmark", "checkpoint (step)", "mean log L", "strategy entropy (bits)"], rows)
        lines += [""] + [matched_line(name, matched) for name, matched in block["matched"].items()]
    return lines


def _differences_table(compared: dict, shown: list[tuple[str, str]]) -> list[str]:
    """One row per (compared model(s), benchmark): accuracy differences in points, then the PRM
    reward, strategy entropy and similarity differences where any row has them."""
    extras = [
        ("prm_reward", "mean PRM reward (not in points)", 4),
        ("strategy_entropy", "strategy entropy (bits)", 3),
        ("similarity", "similarity", 3),
    ]
    present = [
        (key, title, digits)
        for key, title, digits in extras
        if any(key in diffs for per_bench in compared.values() for diffs in per_bench.values())
    ]
    rows = [
        [name, bench]
        + [_difference(diffs.get(key)) for key, _ in shown]
        + [_difference(diffs.get(key), scale=1, digits=digits) for key, _, digits in present]
        for name, per_bench in compared.items()
        for bench, diffs in per_bench.items()
    ]
    return _table(["model", "benchmark"] + [title for _, title in shown] + [title for _, title, _ in present], rows)


def _grouped_bars(axis, results: dict, value_of, title: str, ylabel: str, scale: float = 1.0) -> None:
    """One group of bars per benchmark, one bar per model, asymmetric CI error bars."""
    benchmarks = list(results["benchmarks"])
    models = list(results["results"])
    width = 0.8 / max(1, len(models))
    x = np.arange(len(benchmarks))
    for i, model in enumerate(models):
        means, errors = [], [[], []]
        for bench in benchmarks:
            interval = value_of(results["results"][model].get(bench))
            if interval is None or interval.get("mean") is None:
                means.append(np.nan)
                errors[0].append(0.0)
                errors[1].append(0.0)
                continue
            means.append(scale * interval["mean"])
            errors[0].append(scale * (interval["mean"] - interval["lo"]))
            errors[1].append(scale * (interval["hi"] - interval["mean"]))
        axis.bar(x - 0.4 + width * (i + 0.5), means, width, yerr=errors, capsize=3, label=model)
    tilted = len(benchmarks) > 2  # long names like agieval_sat_math would overlap
    axis.set_xticks(x, benchmarks, rotation=25 if tilted else 0, ha="right" if tilted else "center")
    axis.set_title(title)
    axis.set_ylabel(ylabel)
    axis.grid(axis="y", alpha=0.3)


def _empty_figure(path: Path, message: str) -> None:
    figure = Figure(figsize=(5, 2))
    axis = figure.subplots()
    axis.axis("off")
    axis.text(0.5, 0.5, message, ha="center", va="center")
    figure.savefig(path, dpi=100)


def plot_accuracy(results: dict, path: str | Path) -> Path:
    """accuracy.png: one panel per accuracy metric, bars per benchmark and model, 95% CI error bars."""
    path = Path(path)
    if not results["results"]:
        _empty_figure(path, "no model was evaluated")
        return path
    k = results["settings"]["k"]
    metrics = [
        (key, title.replace("@k", f"@{k}"))
        for key, title in ACCURACY_COLUMNS
        if results["settings"].get("greedy", True) or key != "greedy_pass@1"
    ]
    figure = Figure(figsize=(3.2 * len(metrics) + 1, 3.6))
    axes = figure.subplots(1, len(metrics), sharey=True, squeeze=False)
    for axis, (key, title) in zip(axes[0], metrics):
        _grouped_bars(axis, results, lambda m, key=key: m and m["accuracy"].get(key), title, "accuracy (%)", scale=100)
        axis.set_ylim(0, 100)
    axes[0][-1].legend(fontsize="small", loc="upper left", bbox_to_anchor=(1.02, 1.0))
    figure.suptitle(f"Accuracy with 95% bootstrap CIs (run {results['run']})")
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    return path


def plot_similarity(results: dict, path: str | Path) -> Path:
    """similarity.png: mean pairwise similarity of solutions per model and benchmark, 95% CIs."""
    path = Path(path)
    if not results["results"]:
        _empty_figure(path, "no model was evaluated")
        return path
    figure = Figure(figsize=(1.6 * len(results["benchmarks"]) + 3, 3.6))
    axis = figure.subplots()
    _grouped_bars(
        axis,
        results,
        lambda m: m and m["diversity"]["similarity"],
        "Mean pairwise similarity (lower = more diverse)",
        "cosine similarity",
    )
    axis.legend(fontsize="small", loc="upper left", bbox_to_anchor=(1.02, 1.0))
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    return path


def write_report(results: dict, out_dir: str | Path) -> dict[str, Path]:
    """report.md, accuracy.png and similarity.png in ``out_dir``; returns their paths."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    paths = {
        "accuracy": plot_accuracy(results, out / "accuracy.png"),
        "similarity": plot_similarity(results, out / "similarity.png"),
    }
    plots = {"Accuracy": "accuracy.png", "Mean pairwise similarity": "similarity.png"} if results["results"] else None
    paths["report"] = out / "report.md"
    paths["report"].write_text(render_markdown(results, plots), encoding="utf-8")
    return paths
