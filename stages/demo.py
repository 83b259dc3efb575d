"""make demo: the whole pipeline on the tiny world, then one honest report.

Runs bootstrap, mcts, augment, prm, gfn, ppo, eval, search and prm_bench in order with the
same config and overrides (prm_bench last: it reads the PRM and the base policy and changes
neither), times each stage, checks every stage's outputs against the DESIGN.md
contracts, and writes reports/<run>/report.md from the files the stages wrote (no number in
it is typed by hand).
"""

from __future__ import annotations

import json
import shutil
import sys
import time
from pathlib import Path

from eval.claims import evaluate_claims
from eval.evaluate import reports_dir
from pipeline.config import Config
from pipeline.contracts import check_run
from pipeline.files import read_json_if_exists, write_json_atomic
from pipeline.training.metrics import MetricsLog
from stages import augment, bootstrap, evaluate, mcts, prm_bench, search, train_gfn, train_ppo, train_prm
from stages.common import cli, log, parse_args

STAGES = [
    ("bootstrap", bootstrap.main),
    ("mcts", mcts.main),
    ("augment", augment.main),
    ("prm", train_prm.main),
    ("gfn", train_gfn.main),
    ("ppo", train_ppo.main),
    ("eval", evaluate.main),
    ("search", search.main),
    ("prm_bench", prm_bench.main),
]


def run_stages(argv: list[str], only: list[str] | None = None) -> dict[str, float]:
    """Run each stage's main(argv) in this process; returns seconds per stage."""
    seconds = {}
    for name, stage_main in STAGES:
        if only is not None and name not in only:
            continue
        start = time.monotonic()
        log.info("demo: ---- %s ----", name)
        stage_main(list(argv))
        seconds[name] = round(time.monotonic() - start, 1)
        log.info("demo: %s took %.1f s", name, seconds[name])
    return seconds


def _stopped_by_time(stage_dir: Path) -> bool:
    """Whether a training stage's wall-clock safety net fired (it says so in its metrics)."""
    if any(record.get("stopped_by_time") for record in MetricsLog(stage_dir / "metrics.jsonl").read()):
        return True
    summary = read_json_if_exists(stage_dir / "metrics.json") or {}
    return bool(summary.get("stopped_by_time"))


def _fmt(value, digits=3):
    if value is None:
        return "n/a"
    if isinstance(value, float):
        return f"{value:.{digits}f}"
    return str(value)


def _span(interval) -> str:
    """``[lo, hi]`` of a 95% interval, "" where it is missing."""
    lo, hi = interval or (None, None)
    return "" if lo is None or hi is None else f"[{lo:.3f}, {hi:.3f}]"


def processbench_lines(bench: dict) -> list[str]:
    """The report's lines for make prm-bench's results.json ({set name: result})."""
    lines = []
    for name, result in bench.items():
        n_err, n_ok = result["n_erroneous"], result["n_correct"]
        if result["f1"] is None:
            missing = (
                "no scored case"
                if not n_err + n_ok
                else "no solution with a wrong step"
                if not n_err
                else "no solution without a wrong step"
            )
            figure = f"F1 n/a ({missing})"
        else:
            lo, hi = result["interval"]
            figure = f"F1 {_fmt(result['f1'])} [{_fmt(lo)}, {_fmt(hi)}]"
        if result["threshold_from"] == "given":
            chosen = f"threshold {result['threshold']:.2f} (given; no case set aside)"
        elif not result["n_held_out"]:
            chosen = f"threshold {result['threshold']:.2f} (no case was set aside to choose one)"
        elif result["held_out_f1"] is None:
            chosen = (
                f"threshold {result['threshold']:.2f}, the best accuracy on {result['n_held_out']} other cases set aside to "
                "choose it (of one kind only: no F1 there)"
            )
        else:
            chosen = (
                f"threshold {result['threshold']:.2f}, the best F1 on {result['n_held_out']} other cases set aside to choose "
                f"it (F1 there {_fmt(result['held_out_f1'])})"
            )
        lines += [
            f"- {name}: {figure} on {n_err + n_ok} scored cases ({n_err} with a wrong step, {n_ok} without); accuracy "
            f"{_fmt(result['accuracy_erroneous'])} on those with one (the first wrong step found exactly), "
            f"{_fmt(result['accuracy_correct'])} on those without (no step flagged); {chosen}. Cases: "
            f"{result.get('source', 'n/a')}."
        ]
    return lines


def write_report(config: Config, seconds: dict[str, float], contract_problems: list[str]) -> Path:
    """reports/<run>/report.md from the stages' own output files."""
    run_dir = config.run_dir
    reports = reports_dir(config)
    reports.mkdir(parents=True, exist_ok=True)
    lines = [f"# stepflow demo report (run `{config.run}`, seed {config.seed})", ""]
    lines += [
        "Every number below is read from the files the stages wrote under "
        f"`{run_dir}/` and `{reports}/`; rerun `make demo` to regenerate it.",
        "",
    ]
    claims = evaluate_claims(run_dir, reports, config.search.benchmark, seed=config.eval.seed)
    lines += [
        "## Claims",
        "",
        "The paper's claims at the tiny world's scale, each with a 95% interval (eval/claims.py says how "
        "each is read):",
        "",
    ]
    lines += [claim.markdown() for claim in claims] + [""]
    bench = read_json_if_exists(run_dir / "prm_bench" / "results.json")
    results_path = reports / "results.json"
    results = read_json_if_exists(results_path)
    if results is not None:
        results["claims"] = {claim.id: claim.to_json() for claim in claims}
        if bench is not None:  # the figures without the per-case predictions (those stay in prm_bench/results.json)
            results["prm_bench"] = {
                name: {k: v for k, v in result.items() if k != "cases"} for name, result in bench.items()
            }
        write_json_atomic(results_path, results)
    stopped = [stage for stage in ("bootstrap", "prm", "gfn", "ppo") if _stopped_by_time(run_dir / stage)]
    if stopped:
        lines += [
            f"**WARNING: the wall-clock safety net stopped {', '.join(stopped)} before its step count: these results "
            "depend on the machine's speed. Rerun on an idle machine, or raise the time limit.**",
            "",
        ]
    lines += ["## Stage timings", "", "| stage | seconds |", "|---|---|"]
    lines += [f"| {name} | {secs} |" for name, secs in seconds.items()]
    lines += [f"| total | {round(sum(seconds.values()), 1)} |", ""]
    boot = read_json_if_exists(run_dir / "bootstrap" / "metrics.json") or {}
    lines += ["## Base policy (bootstrap)", ""]
    lines += [f"- {k}: {_fmt(v)}" for k, v in boot.items() if not isinstance(v, (dict, list))]
    mcts = read_json_if_exists(run_dir / "mcts" / "stats.json") or {}
    aug = read_json_if_exists(run_dir / "augment" / "stats.json") or {}
    lines += ["", "## MCTS and augmentation", ""]
    lines += [f"- mcts {k}: {_fmt(v)}" for k, v in mcts.items() if not isinstance(v, (dict, list))]
    lines += [f"- augment {k}: {_fmt(v)}" for k, v in aug.items() if not isinstance(v, (dict, list))]
    val = read_json_if_exists(run_dir / "prm" / "validation.json") or {}
    lines += ["", "## PRM validation", ""]
    if "auc" in val:
        lines += [
            f"- MC-label AUC (held-out PRM records, MC label > 0.5 positive): {_fmt(val['auc'])} {_span(val.get('auc_interval'))}"
        ]
    lines += [f"- {k}: {_fmt(v)}" for k, v in val.items() if not isinstance(v, (dict, list)) and k != "auc"]
    exact, pair = val.get("exact"), val.get("slip_pair")
    if exact:
        lines += [
            f"- exact labels (the policy's own samples of held-out problems, {exact['n_solutions']} solutions): AUC "
            f"{_fmt(exact['auc'])} {_span(exact['interval'])} of {exact['n_correct']} correct steps after a correct prefix "
            f"against {exact['n_wrong']} first wrong steps (mean score {_fmt(exact['mean_correct'])} vs {_fmt(exact['mean_wrong'])})"
        ]
    if pair:
        lines += [
            f"- slip pairs (a first wrong step with a wrong result against the same step with the right result, same "
            f"prefix): {pair['n_pairs']} pairs, counterpart above the slip in a share {_fmt(pair['auc'])} {_span(pair['interval'])} "
            f"(mean score {_fmt(pair['mean_counterpart'])} vs {_fmt(pair['mean_slip'])})"
        ]
    for key, what in (("corruption", "+1..9"), ("corruption_pm1", "+-1")):
        corruption = val.get(key) or {}
        if corruption.get("n"):
            lines += [
                f"- corrupted steps (E.4: a correct step's calculation result altered by {what}): {corruption['n']} steps, mean score "
                f"{_fmt(corruption['mean_original'])} -> {_fmt(corruption['mean_corrupted'])} "
                f"(mean drop {_fmt(corruption['mean_drop'], 4)}; "
                f"scored lower in a share {_fmt(corruption['share_lower'])} of them)"
            ]
        elif key in val:
            lines += [
                f"- corrupted steps (E.4, {what}): none to corrupt (no validation step labelled correct holds a calculation)"
            ]
    if val.get("prm800k"):
        lines += [
            "- PRM800K-format first-error check: "
            + ", ".join(f"{k} {_fmt(v)}" for k, v in val["prm800k"].items() if not isinstance(v, (dict, list)))
        ]
    for png in ("calibration.png",):
        if (run_dir / "prm" / png).exists():
            shutil.copy(run_dir / "prm" / png, reports / f"prm_{png}")
            lines += ["", f"![PRM calibration](prm_{png})"]
    if bench is not None:
        lines += [
            "",
            "## PRM on ProcessBench's protocol (make prm-bench)",
            "",
            "A reported figure, not a claim. The PRM predicts a solution's first wrong step as its first step scored below a "
            "threshold (none: no wrong step); F1 is the harmonic mean of its accuracy on solutions with a wrong step and on "
            'solutions without one, with a 95% bootstrap interval over cases (docs/prm.md, "ProcessBench"):',
            "",
        ]
        lines += processbench_lines(bench)
    lines += ["", "## GFlowNet and PPO training", ""]
    for stage in ("gfn", "ppo"):
        metrics = run_dir / stage / "metrics.jsonl"
        if metrics.exists():
            rows = [json.loads(line) for line in metrics.read_text().splitlines() if line.strip()]
            first, last = rows[: max(1, len(rows) // 5)], rows[-max(1, len(rows) // 5) :]

            def mean(rs, k):
                return sum(r[k] for r in rs if k in r) / max(1, sum(k in r for r in rs))

            lines += [
                f"- {stage}: average PRM reward {mean(first, 'avg_reward'):.3f} (first fifth of training) -> "
                f"{mean(last, 'avg_reward'):.3f} (last fifth); sampled accuracy {mean(first, 'accuracy'):.3f} -> "
                f"{mean(last, 'accuracy'):.3f}"
            ]
            if (run_dir / stage / "training_curves.png").exists():
                shutil.copy(run_dir / stage / "training_curves.png", reports / f"{stage}_training_curves.png")
                lines += ["", f"![{stage} training curves]({stage}_training_curves.png)", ""]
    evaluation = reports / "evaluation.md"
    if evaluation.exists():
        lines += ["", "## Accuracy and diversity (make eval)", "", evaluation.read_text()]
    search = run_dir / "search" / "table.md"
    if search.exists():
        lines += ["", "## PRM-guided search (make search)", "", search.read_text()]
        if (run_dir / "search" / "accuracy_vs_k.png").exists():
            shutil.copy(run_dir / "search" / "accuracy_vs_k.png", reports / "search_accuracy_vs_k.png")
            lines += ["", "![search accuracy vs k](search_accuracy_vs_k.png)"]
    lines += ["", "## Contract checks", ""]
    lines += [f"- FAILED: {p}" for p in contract_problems] or [
        "- every stage's outputs satisfy the DESIGN.md contracts"
    ]
    path = reports / "report.md"
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return path


def set_aside_previous_run(config: Config) -> list[Path]:
    """The demo runs every stage from scratch: an earlier run's folders are renamed
    (<folder>.<UTC time>), never deleted, so its resumable stages (MCTS shards, checkpoints) can
    neither be mixed into this run nor refuse it."""
    stamp = time.strftime("%Y%m%d-%H%M%S", time.gmtime())
    moved = []
    for folder in (config.run_dir, reports_dir(config)):
        if folder.exists() and any(folder.iterdir()):
            target = folder.with_name(f"{folder.name}.{stamp}")
            folder.rename(target)
            log.info("demo: an earlier run was in %s; moved to %s", folder, target)
            moved.append(target)
    return moved


def main(argv: list[str] | None = None) -> Path:
    argv = list(sys.argv[1:] if argv is None else argv)
    config = parse_args("demo", argv)
    set_aside_previous_run(config)
    seconds = run_stages(argv)
    eval_report = reports_dir(config) / "report.md"
    if eval_report.exists():
        eval_report.replace(reports_dir(config) / "evaluation.md")
    problems = check_run(config.run_dir, reports_dir(config))
    path = write_report(config, seconds, problems)
    log.info("demo: report written to %s (total %.0f s)", path, sum(seconds.values()))
    if problems:
        raise SystemExit("demo: contract checks failed:\n" + "\n".join(problems))
    return path


if __name__ == "__main__":
    cli(main)
