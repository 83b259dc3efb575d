"""make mc-audit: what the Monte Carlo path can teach a PRM about slips (docs/prm.md, "What the
Monte Carlo path teaches").

Reads:  the policy (model.policy) and held-out problems (data.validation*, the exact check's: the
        first prm.exact_check_problems, sampled as make prm samples them); when make augment has
        run, its records (prm.train_path, prm.val_path), the training problems (data.train*) and
        make mcts's stats.json
Writes: runs/<run>/mc_audit/results.json ({"slip_pairs": one row per temperature, "data": the
        audit of the PRM data or null, "mcts": make mcts's counts or null, "settings"}),
        config.yaml; prints the tables
Library: prm.mc_audit (its docstrings define every field).

The slip pairs are the exact check's (prm.exact_check.exact_paths over the policy's samples at
prm.exact_check_temperature): the pairs prm_slip_pair_auc is judged on. Each pair's slip and
counterpart get mc_audit.k (default mcts.k) rollouts at each of mc_audit.temperatures. Only kinds
with an exact first-wrong-step labeller (the tiny world) can be audited.
"""

from __future__ import annotations

import functools
from pathlib import Path

from pipeline.generation import build_generator
from pipeline.storage.files import read_json_if_exists, write_json_atomic
from prm.exact_check import FIRST_ERROR_LABELLERS, exact_paths
from prm.mc_audit import data_audit, slip_pair_mc
from prm.prm800k import read_training_records
from stages.cli import cli, log, parse_args, set_threads, timed
from stages.inputs import exact_check_samples, training_problems, validation_problems
from stages.run_folders import stage_dir

PAIR_COLUMNS = (
    ("temperature", "T"),
    ("n_pairs", "pairs"),
    ("mean_mc_slip", "MC slip"),
    ("mean_mc_counterpart", "MC counterpart"),
    ("slip_mc_zero", "slip MC=0"),
    ("counterpart_mc_zero", "counterpart MC=0"),
    ("auc", "MC pair AUC"),
)


def _cell(value) -> str:
    if value is None:
        return "-"
    return f"{value:g}" if isinstance(value, float) else str(value)


def pair_table(rows: list[dict]) -> str:
    """The slip-pair rows as a Markdown table (the AUC with its interval)."""
    lines = ["| " + " | ".join(title for _, title in PAIR_COLUMNS) + " |", "|" + "---|" * len(PAIR_COLUMNS)]
    for row in rows:
        cells = [_cell(row[key]) for key, _ in PAIR_COLUMNS]
        lo, hi = row["interval"]
        if lo is not None:
            cells[-1] += f" [{lo:g}, {hi:g}]"
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def data_table(audit: dict) -> str:
    """The data audit by origin as a Markdown table."""
    lines = [
        "| origin | examples | prefix slip | prefix wrong | label after wrong prefix (mean, =1) "
        "| label after clean prefix (mean) | clean pairs | label pair AUC |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for origin, row in audit.items():
        if origin == "unchecked":
            continue
        wrong, clean, pairs = row["labels_after_wrong_prefix"], row["labels_after_clean_prefix"], row["clean_pairs"]
        lines.append(
            f"| {origin} | {row['examples']} | {_cell(row['prefix_arithmetic_slip'])} | {_cell(row['prefix_wrong'])} "
            f"| {_cell(wrong['mean'])}, {_cell(wrong['share_one'])} | {_cell(clean['mean'])} "
            f"| {pairs['n_pairs']} | {_cell(pairs['auc'])} |"
        )
    return "\n".join(lines)


def audit_data(config) -> dict | None:
    """prm.mc_audit.data_audit of make augment's records (train and val), None when they are not
    there; problems of another kind than the labellers' are counted as unchecked."""
    paths = [Path(config.resolve(config.prm.train_path)), Path(config.resolve(config.prm.val_path))]
    if not all(path.is_file() for path in paths):
        log.info("mc_audit: no PRM data at %s: the data audit is skipped (run make augment)", paths[0])
        return None
    read = functools.partial(read_training_records, neutral_label=config.prm.prm800k_neutral_label)
    examples = [example for path in paths for example in read(path)]
    problems = {p.problem_id: p for p in training_problems(config) if p.kind in FIRST_ERROR_LABELLERS}
    kinds = {p.kind for p in problems.values()}
    if len(kinds) != 1:
        log.info("mc_audit: the training problems have no one kind with a labeller: the data audit is skipped")
        return None
    return data_audit(examples, problems, FIRST_ERROR_LABELLERS[kinds.pop()], seed=config.mc_audit.seed)


def main(argv: list[str] | None = None) -> dict:
    config = parse_args("mc_audit", argv)
    set_threads(config, "mc_audit")
    cfg = config.mc_audit
    problems = [p for p in validation_problems(config) if p.kind in FIRST_ERROR_LABELLERS]
    if not problems:
        raise SystemExit(
            "mc_audit: no problem of data.validation "
            f"({config.resolve(config.data.validation_path) or config.data.validation}) has a kind with an exact "
            f"first-wrong-step labeller ({sorted(FIRST_ERROR_LABELLERS)})"
        )
    out = stage_dir(config, "mc_audit")
    k = cfg.k or config.mcts.k
    with timed("mc_audit"):
        rows: list[dict] = []
        if cfg.max_pairs > 0:
            samples = exact_check_samples(config, problems[0].kind) or []
            pairs = exact_paths(samples)[3][: cfg.max_pairs]
            log.info("mc_audit: %d slip pairs from %d policy samples", len(pairs), len(samples))
            rows = slip_pair_mc(build_generator(config), pairs, problems, config, cfg.temperatures, k, cfg.seed)
        audit = audit_data(config)
    mcts = read_json_if_exists(config.resolve("{run_dir}/mcts/stats.json"), "make mcts's stats")
    result = {
        "slip_pairs": rows,
        "data": audit,
        "mcts": None if mcts is None else {key: value for key, value in mcts.items() if key != "mc_histogram"},
        "settings": {
            "policy": config.resolve(config.model.policy),
            "k": k,
            "temperatures": cfg.temperatures,
            "max_pairs": cfg.max_pairs,
            "pair_samples": {
                "problems": config.prm.exact_check_problems,
                "samples": config.prm.exact_check_samples,
                "temperature": config.prm.exact_check_temperature,
                "seed": config.prm.seed,
            },
            "mcts.temperature": config.mcts.temperature,
            "mcts.k": config.mcts.k,
            "seed": cfg.seed,
        },
    }
    write_json_atomic(out / "results.json", result)
    log.info("mc_audit: wrote %s", out / "results.json")
    if rows:
        print(
            f"MC values of the exact check's slip pairs ({k} rollouts each), policy {config.resolve(config.model.policy)}"
        )
        print(pair_table(rows))
    if audit is not None:
        print("PRM data (make augment's records) by origin")
        print(data_table(audit))
    return result


if __name__ == "__main__":
    cli(main)
