"""make bootstrap: the tiny world's problems, tokenizer and from-scratch base policy.

Reads:  nothing (everything is generated from config.tinyworld and config.bootstrap)
Writes: runs/<run>/bootstrap/problems_{train,val,test,rl}.jsonl   (the problems contract; the model trains on
        problems_train.jsonl only, rl is what the stages after it read: data.train_path)
        runs/<run>/bootstrap/model/        weights (safetensors) + config + tokenizer
        runs/<run>/bootstrap/metrics.json  size, training, and quick checks of the policy
        runs/<run>/bootstrap/config.yaml   the resolved config

Library: pipeline.tinyworld.bootstrap.build_base_policy (problems, tokenizer, training on the
training base), then eval.policy_checks and ``strategy_checks`` (per-family accuracy, the
strategy entropy of correct samples) on the saved model, reloaded through the one generation
interface as every later stage will load it. A finished bootstrap with the same
tinyworld/bootstrap/format settings (recorded in the model's manifest) is not redone unless
bootstrap.retrain=true.
"""

from __future__ import annotations

import dataclasses
import json
import time
from collections import defaultdict
from pathlib import Path

from eval.diversity import strategy_entropy
from eval.policy_checks import policy_checks
from eval.sampling import GREEDY_SAMPLE_IDX, generate_samples, problem_kind
from pipeline.config.loader import save_config
from pipeline.config.schema import Config
from pipeline.generation import build_generator
from pipeline.records import Problem, Sample
from pipeline.storage.files import read_json, write_json_atomic
from pipeline.storage.model_folders import FolderError, verify_manifest
from pipeline.tinyworld.bootstrap import build_base_policy
from pipeline.tinyworld.checker import strategy_names, strategy_of
from stages.cli import cli, log, parse_args, set_threads, timed
from stages.run_folders import stage_dir

# The config sections that determine what bootstrap writes.
INPUT_SECTIONS = ("tinyworld", "bootstrap", "format")


def main(argv: list[str] | None = None) -> dict:
    config = parse_args("bootstrap", argv)
    set_threads(config, "bootstrap")
    out = stage_dir(config, "bootstrap", save=False)  # locked; config.yaml is compared before it is replaced
    if is_done(out, config) and not config.bootstrap.retrain:
        log.info(
            "bootstrap: finished: %s already holds a model trained with this config; bootstrap.retrain=true trains it again",
            out,
        )
        return read_json(out / "metrics.json", "bootstrap metrics")
    (out / "metrics.json").unlink(missing_ok=True)  # it described an earlier model
    save_config(config, out / "config.yaml")
    with timed("bootstrap"):
        metrics, splits = build_base_policy(config, out, settings=input_settings(config))
        generator = build_generator(config, str(out / "model"))  # loaded back exactly as a later stage loads it
        held_out = splits["test"][: config.bootstrap.eval_problems]
        metrics.update(policy_checks(generator, held_out, config))
        metrics.update(strategy_checks(generator, held_out, config))
    write_json_atomic(out / "metrics.json", metrics)
    log.info("bootstrap: %s", {k: v for k, v in metrics.items() if k not in ("examples", "loss_curve")})
    return metrics


def strategy_checks(generator, problems: list[Problem], config: Config) -> dict:
    """Which strategies the policy uses, on held-out problems: the greedy and sampled accuracy
    of each problem family, the share of correct greedy solutions per strategy, and the strategy
    entropy (bits, eval.diversity.strategy_entropy of the strategy names of a problem's correct
    samples) averaged over the problems with more than one strategy. The samples are drawn as
    eval.policy_checks draws them (bootstrap.eval_samples at bootstrap.sample_temperature, seed
    bootstrap.seed + 1, plus the greedy one)."""
    if not problems:
        return {}
    boot = config.bootstrap
    settings = dataclasses.replace(
        config,
        eval=dataclasses.replace(
            config.eval, k=boot.eval_samples, temperature=boot.sample_temperature, seed=boot.seed + 1, greedy=True
        ),
    )
    start = time.monotonic()
    records = generate_samples(generator, problems, problem_kind, settings, model="bootstrap")
    return strategy_metrics(problems, records) | {"strategy_seconds": round(time.monotonic() - start, 1)}


def strategy_metrics(problems: list[Problem], records: list[Sample]) -> dict:
    """strategy_checks' figures from the samples records of ``problems`` (sample_idx -1: greedy)."""
    by_problem: dict[str, list[Sample]] = defaultdict(list)
    for record in records:
        by_problem[record.problem_id].append(record)
    families: dict[str, dict[str, list[float]]] = defaultdict(lambda: defaultdict(list))
    counts: dict[str, int] = defaultdict(int)
    entropies: dict[str, list[float]] = defaultdict(list)
    greedy_strategies: dict[str, int] = defaultdict(int)
    for problem in problems:
        family = str(problem.meta.get("family", "unnamed"))
        counts[family] += 1
        greedy = [r for r in by_problem[problem.problem_id] if r.sample_idx == GREEDY_SAMPLE_IDX]
        sampled = [r for r in by_problem[problem.problem_id] if r.sample_idx != GREEDY_SAMPLE_IDX]
        families[family]["greedy"] += [float(r.correct) for r in greedy]
        families[family]["sampled"] += [float(r.correct) for r in sampled]
        for r in greedy:
            if r.correct:
                greedy_strategies[strategy_of(problem, r.steps) or "none"] += 1
        if len(strategy_names(problem)) > 1:
            names = [strategy_of(problem, r.steps) for r in sampled if r.correct]
            entropy = strategy_entropy([n for n in names if n is not None])
            entropies[family].append(entropy)
            entropies["all"].append(entropy)

    def mean(values: list[float]) -> float | None:
        return round(sum(values) / len(values), 4) if values else None

    return {
        "family_accuracy": {
            family: {"problems": counts[family], "greedy": mean(acc["greedy"]), "sampled": mean(acc["sampled"])}
            for family, acc in sorted(families.items())
        },
        "greedy_strategy_counts": dict(sorted(greedy_strategies.items())),
        "strategy_entropy_multi": mean(entropies.pop("all", [])),
        "strategy_entropy_problems": sum(len(v) for v in entropies.values()),
        "family_strategy_entropy": {family: mean(values) for family, values in sorted(entropies.items())},
    }


def input_settings(config: Config) -> dict:
    """The config sections that determine what bootstrap writes (bootstrap.retrain aside)."""
    settings = {section: getattr(config, section) for section in INPUT_SECTIONS}
    return {
        section: {k: v for k, v in dataclasses.asdict(value).items() if k != "retrain"}
        for section, value in settings.items()
    }


def is_done(out: Path, config: Config) -> bool:
    """metrics.json exists and model/ was committed whole (its manifest checks out) by a run with
    the same input sections of the config (recorded in the manifest, so a run killed while
    training a new model never passes for the old one)."""
    if not ((out / "metrics.json").is_file() and (out / "model").is_dir()):
        return False
    try:
        manifest = verify_manifest(out / "model")
    except FolderError as error:
        log.warning("bootstrap: %s", error)
        return False
    return manifest.get("settings") == json.loads(json.dumps(input_settings(config)))


if __name__ == "__main__":
    cli(main)
