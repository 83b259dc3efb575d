"""make demo: the whole pipeline on the tiny world, then one honest report.

Runs bootstrap, mcts, augment, prm, gfn, ppo, eval, search and prm_bench with the same config
and overrides, each as ``python -m stages.<module>`` processes on the graph of what each stage
reads (STAGES), at most ``demo.jobs`` processes at once (pipeline.launcher.run_graph); mcts, eval
and search run as ``demo.jobs`` shard workers, eval and search then merge in one more process, as
``python -m stages.launch`` runs them. Each process's output goes to
runs/<run>/demo/logs/<stage>[-<i>of<n>].log. Times each stage and the whole, checks every stage's
outputs against the DESIGN.md contracts, and writes reports/<run>/report.md from the files the
stages wrote (no number in it is typed by hand).
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import time
from pathlib import Path

from eval.claims import evaluate_claims
from eval.evaluate import reports_dir
from eval.report import matched_line
from pipeline.config.loader import ConfigError
from pipeline.config.schema import Config
from pipeline.contracts import check_run
from pipeline.finetune.ceiling import ceiling_verdict
from pipeline.launcher import (
    MERGED_STAGES,
    SHARDED_STAGES,
    Stage,
    Worker,
    merge_worker,
    run_graph,
    shard_workers,
)
from pipeline.storage.files import read_json_if_exists, write_json_atomic
from pipeline.training.metrics import MetricsLog
from stages.cli import cli, log, parse_args
from stages.mcts import mcts_stats

# (stage, module, the stages whose outputs it reads under configs/tiny.yaml): mcts reads the
# bootstrap's RL split and policy; the PRM augment's data and the bootstrap's model as backbone;
# gfn and ppo the policy and the PRM; eval the base, ppo and gfn models and the PRM (eval.prm);
# search and prm_bench the policy and the PRM. Of the stages that can start, the earlier here
# start first.
STAGES = [
    ("bootstrap", "stages.bootstrap", ()),
    ("mcts", "stages.mcts", ("bootstrap",)),
    ("augment", "stages.augment", ("mcts",)),
    ("prm", "stages.train_prm", ("bootstrap", "augment")),
    ("gfn", "stages.train_gfn", ("bootstrap", "prm")),
    ("ppo", "stages.train_ppo", ("bootstrap", "prm")),
    ("eval", "stages.evaluate", ("bootstrap", "prm", "gfn", "ppo")),
    ("search", "stages.search", ("bootstrap", "prm")),
    ("prm_bench", "stages.prm_bench", ("bootstrap", "prm")),
]


def demo_jobs(config: Config) -> int:
    """demo.jobs, or (0) the number of CPUs this process may use."""
    return config.demo.jobs or len(os.sched_getaffinity(0))


def demo_graph(config: Config, argv: list[str], jobs: int) -> list[Stage]:
    """The demo's stages as run_graph nodes: one process each, or (mcts, eval, search, with
    jobs > 1) ``jobs`` shard workers and, for eval and search, the merge run."""
    graph = []
    for name, module, after in STAGES:
        if name in SHARDED_STAGES and jobs > 1:
            key = SHARDED_STAGES[name]
            if any(arg.startswith(f"{key}=") for arg in argv):
                raise ConfigError(f"{key} is set by make demo (demo.jobs={jobs} shard workers); remove it")
            phases = [shard_workers(name, argv, None, workers=jobs)]
            if name in MERGED_STAGES:
                phases.append([merge_worker(name, argv, None)])
        else:
            phases = [[Worker([sys.executable, "-m", module, *argv], {}, "")]]
        finish = None
        if name == "mcts" and jobs > 1:
            # each worker wrote stats.json over the shards committed when it ended: the last word is
            # over all of them (as python -m stages.launch mcts writes it)
            def finish():
                folder = config.stage_dir("mcts")
                write_json_atomic(folder / "stats.json", mcts_stats(folder / "shards"))

        graph.append(Stage(name, phases, after, finish))
    return graph


def check_claim_inputs(config: Config) -> None:
    """The search rows search_rises_with_k compares exist: k = 1 and every k of claims.search_ks in
    search.ks. Checked before any stage runs, so a demo never searches without the rows its claim compares."""
    wanted = [1, *config.claims.search_ks]
    absent = [k for k in wanted if k not in config.search.ks]
    if absent:
        raise ConfigError(
            f"claims.search_ks = {config.claims.search_ks} compares each k with k = 1, but search.ks = "
            f"{config.search.ks} has no k = {', '.join(map(str, absent))}: add it to search.ks or drop it from claims.search_ks"
        )


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


def write_report(
    config: Config,
    seconds: dict[str, float],
    contract_problems: list[str],
    wall: float | None = None,
    jobs: int = 1,
) -> Path:
    """reports/<run>/report.md from the stages' own output files. ``seconds``: each stage's wall
    seconds; ``wall``: the demo's own wall clock (None: the stages ran one after the other, their sum)."""
    run_dir = config.run_dir
    reports = reports_dir(config)
    reports.mkdir(parents=True, exist_ok=True)
    lines = [f"# stepflow demo report (run `{config.run}`, seed {config.seed})", ""]
    lines += [
        "Every number below is read from the files the stages wrote under "
        f"`{run_dir}/` and `{reports}/`; rerun `make demo` to regenerate it.",
        "",
    ]
    claims = evaluate_claims(run_dir, reports, config.search.benchmark, seed=config.eval.seed, settings=config.claims)
    lines += [
        "## Claims",
        "",
        "The paper's claims at the tiny world's scale, each with a 95% interval and a verdict, holds / "
        "inconclusive / fails, judged on the interval (eval/claims.py says how each is read; the minimal "
        "effects and the margin: the config's claims section):",
        "",
    ]
    lines += [claim.markdown() for claim in claims] + [""]
    bench = read_json_if_exists(run_dir / "prm_bench" / "results.json")
    results_path = reports / "results.json"
    results = read_json_if_exists(results_path)
    matched = (((results or {}).get("curves") or {}).get(config.search.benchmark) or {}).get("matched") or {}
    if matched:
        lines += [
            "The diversity at matched reward gfn_more_diverse_than_ppo is judged on (eval.curves; eval/matched.py):",
            "",
        ]
        lines += [matched_line(name, value) for name, value in matched.items()] + [""]
    if results is not None:
        results["claims"] = {claim.id: claim.to_json() for claim in claims}
        results["timings"] = {"stages": seconds, "wall": wall}
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
    lines += ["## Stage timings", ""]
    if wall is not None:
        lines += [
            f"The stages ran as processes on their dependency graph, up to {jobs} at once (demo.jobs), so their "
            f"times overlap: a stage's seconds run from its first process's start to its last one's end, and the "
            f"total is the demo's wall clock (the stages' seconds add up to {round(sum(seconds.values()), 1)}).",
            "",
        ]
    lines += ["| stage | seconds |", "|---|---|"]
    lines += [f"| {name} | {secs} |" for name, secs in seconds.items()]
    total = round(sum(seconds.values()), 1) if wall is None else wall
    lines += [f"| total{' (wall clock)' if wall is not None else ''} | {total} |", ""]
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
        matched = exact.get("matched")
        if matched:
            lines += [
                f"- exact labels matched in problem and depth (each first wrong step against the correct steps of its "
                f"problem at its depth, {matched['n_pairs']} pairs): AUC {_fmt(matched['auc'])} {_span(matched['interval'])}"
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
            spans = corruption.get("intervals") or {}
            lines += [
                f"- corrupted steps (E.4: a correct step's calculation result altered by {what}): {corruption['n']} steps, mean score "
                f"{_fmt(corruption['mean_original'])} {_span(spans.get('original'))} -> {_fmt(corruption['mean_corrupted'])} "
                f"{_span(spans.get('corrupted'))} (mean drop {_fmt(corruption['mean_drop'], 4)} {_span(spans.get('drop'))}; "
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
    ceiling = read_json_if_exists(run_dir / "gfn" / "ceiling.json")
    if ceiling:
        lines += [
            f"- gfn, before training: {ceiling_verdict(ceiling, ceiling['reward_temperature'])} (gfn/ceiling.json)"
        ]
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
    check_claim_inputs(config)
    jobs = demo_jobs(config)
    graph = demo_graph(config, argv, jobs)
    set_aside_previous_run(config)
    start = time.monotonic()
    log.info("demo: %d stages, at most %d processes at once (demo.jobs)", len(graph), jobs)
    seconds = run_graph(graph, jobs, config.run_dir / "demo" / "logs", label="demo")
    seconds = {name: seconds[name] for name, _, _ in STAGES}  # the report lists them in pipeline order
    wall = round(time.monotonic() - start, 1)
    eval_report = reports_dir(config) / "report.md"
    if eval_report.exists():
        eval_report.replace(reports_dir(config) / "evaluation.md")
    problems = check_run(config.run_dir, reports_dir(config))
    path = write_report(config, seconds, problems, wall=wall, jobs=jobs)
    log.info("demo: report written to %s (wall clock %.0f s)", path, wall)
    if problems:
        raise SystemExit("demo: contract checks failed:\n" + "\n".join(problems))
    return path


if __name__ == "__main__":
    cli(main)
