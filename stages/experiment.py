"""make experiment: the judged learners and the base on the verdict seeds, pooled.

Each seed of ``experiment.seeds`` (configs/experiment.yaml: 10, 11, 12) is one whole ``make demo``
run, with the config and overrides given here and ``seed=<s> run=<run>-s<s>``, one after the other
(each demo uses the cores itself: docs/demo.md, "How the demo uses the cores"). Then the claims are
judged on the seeds' pooled figures (eval.claims.pooled_claims: the mean of the seeds' estimates,
the normal interval of that mean from each seed's problem-resampled interval), and
reports/<run>/report.md and results.json say the pooled verdicts, each seed's verdict and figure
beside them, and each seed's wall clock and stage times. ``experiment.run_stages=false`` pools
the seeds' finished runs again without running a stage.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

from eval.claims import judge, measure_run, pool_measured
from eval.evaluate import reports_dir
from pipeline.config.schema import Config
from pipeline.stats import pool_intervals
from pipeline.storage.files import read_json_if_exists, write_json_atomic
from stages import demo
from stages.cli import cli, log, parse_args


def seed_overrides(config: Config, seed: int) -> list[str]:
    """The overrides that make one seed's demo run of the experiment: its seed and its own run name."""
    return [f"seed={seed}", f"run={config.run}-s{seed}"]


def pooled_kls(kls: dict[int, dict | None]) -> dict[tuple[str, str], dict]:
    """{(benchmark, model): pool_intervals of its KL over the seeds} for the (benchmark, model) pairs
    every seed's policy_kl.json estimates; {} when a seed has none."""
    if not kls or any(not block for block in kls.values()):
        return {}
    first = next(iter(kls.values()))
    out = {}
    for bench, block in first.items():
        for model in block.get("models", {}):
            found = [((kl.get(bench) or {}).get("models") or {}).get(model) for kl in kls.values()]
            if all(f and "mean" in f for f in found):
                out[bench, model] = pool_intervals(found)
    return out


def _span(lo, hi, scale=1.0) -> str:
    return "" if lo is None or hi is None else f" [{scale * lo:+.4g}, {scale * hi:+.4g}]"


def write_experiment_report(config: Config, seed_configs: dict[int, Config], walls: dict[int, float | None]) -> Path:
    """reports/<run>/report.md and results.json from the seeds' finished runs."""
    settings = config.claims
    measured = {
        seed: measure_run(c.run_dir, reports_dir(c), c.search.benchmark, c.eval.seed, settings)
        for seed, c in seed_configs.items()
    }
    seeds = list(seed_configs)
    per_seed = {seed: {claim.id: claim for claim in judge(m, settings)} for seed, m in measured.items()}
    pooled = pool_measured(list(measured.values()), seeds)
    claims = judge(pooled, settings)
    timings = {
        seed: (read_json_if_exists(reports_dir(c) / "results.json") or {}).get("timings") or {}
        for seed, c in seed_configs.items()
    }
    out = reports_dir(config)
    out.mkdir(parents=True, exist_ok=True)
    lines = [
        f"# stepflow experiment report (run `{config.run}`, seeds {', '.join(map(str, seeds))})",
        "",
        "Each seed is one make demo run (runs/<run>-s<seed>/, reports/<run>-s<seed>/); every number below is read "
        "from the files those runs wrote. The claims are judged on the seeds' pooled figures: the mean of the "
        "seeds' estimates, with the normal interval of that mean from each seed's own interval (problems "
        "resampled); the spread between seeds is shown beside, not in the interval (eval/claims.py, "
        'pipeline.stats.pool_intervals; docs/demo.md, "The experiment").',
        "",
        "## Claims, pooled",
        "",
    ]
    lines += [claim.markdown() for claim in claims] + [""]
    lines += ["## Each seed's verdict", "", "| claim | " + " | ".join(f"seed {s}" for s in seeds) + " |"]
    lines += ["|---|" + "---|" * len(seeds)]
    for claim in claims:
        cells = [f"{per_seed[seed][claim.id].verdict}: {per_seed[seed][claim.id].figure()}" for seed in seeds]
        lines.append(f"| {claim.id} | " + " | ".join(cells) + " |")
    lines += [
        "",
        "## Pooled parts",
        "",
        "| part | pooled mean [95%] | per seed | sd between seeds |",
        "|---|---|---|---|",
    ]
    for name, part in pooled.parts.items():
        if part:
            sd = "" if part["sd"] is None else f"{part['sd']:.4g}"
            each = ", ".join(f"{m:+.4g}" for m in part["per_seed"])
            lines.append(f"| {name} | {part['mean']:+.4g}{_span(part['lo'], part['hi'])} | {each} | {sd} |")
        else:
            lines.append(f"| {name} | n/a ({pooled.notes.get(f'missing {name}', 'not measured')}) | | |")
    kls = {seed: read_json_if_exists(reports_dir(c) / "policy_kl.json") for seed, c in seed_configs.items()}
    pooled_kl = pooled_kls(kls)
    if pooled_kl:
        lines += [
            "",
            "## KL to the base (reported, not judged)",
            "",
            "Each learner's KL(pi || pi_base) in nats per solution, from its own draw at temperature 1 (make "
            "policy-kl; eval/policy_kl.py), pooled as the claims are:",
            "",
            "| benchmark | model | pooled [95%] | per seed |",
            "|---|---|---|---|",
        ]
        for (bench, model), part in pooled_kl.items():
            each = ", ".join(f"{m:.4g}" for m in part["per_seed"])
            lines.append(f"| {bench} | {model} | {part['mean']:.4g}{_span(part['lo'], part['hi'])} | {each} |")
    lines += ["", "## Wall clock", "", "| seed | wall seconds | " + "stage seconds |", "|---|---|---|"]
    for seed in seeds:
        stages = (timings[seed] or {}).get("stages") or {}
        wall = walls.get(seed) or (timings[seed] or {}).get("wall")
        detail = ", ".join(f"{name} {secs}" for name, secs in stages.items())
        lines.append(f"| {seed} | {'n/a' if wall is None else wall} | {detail} |")
    total = [w for w in ((walls.get(s) or (timings[s] or {}).get("wall")) for s in seeds) if w is not None]
    lines += ["", f"Seeds' wall clocks add up to {round(sum(total), 1)} s.", ""]
    path = out / "report.md"
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    results = {
        "seeds": seeds,
        "claims": {claim.id: claim.to_json() for claim in claims},
        "per_seed": {str(s): {cid: c.to_json() for cid, c in per_seed[s].items()} for s in seeds},
        "parts": pooled.parts,
        "notes": pooled.notes,
        "kl_to_reference": {f"{bench}/{model}": part for (bench, model), part in pooled_kl.items()},
        "timings": {str(s): timings[s] for s in seeds},
        "walls": {str(s): walls.get(s) for s in seeds},
    }
    write_json_atomic(out / "results.json", json.loads(json.dumps(results)))
    return path


def main(argv: list[str] | None = None) -> Path:
    argv = list(sys.argv[1:] if argv is None else argv)
    config = parse_args("experiment", argv)
    seed_configs = {
        seed: parse_args("experiment", argv + seed_overrides(config, seed)) for seed in config.experiment.seeds
    }
    walls: dict[int, float | None] = {}
    if config.experiment.run_stages:
        for seed in config.experiment.seeds:
            log.info("experiment: seed %d as run %s", seed, seed_configs[seed].run)
            start = time.monotonic()
            demo.main(argv + seed_overrides(config, seed))
            walls[seed] = round(time.monotonic() - start, 1)
    path = write_experiment_report(config, seed_configs, walls)
    log.info("experiment: report written to %s", path)
    return path


if __name__ == "__main__":
    cli(main)
