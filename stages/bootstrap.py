"""make bootstrap: the tiny world's problems, tokenizer and from-scratch base policy.

Reads:  nothing (everything is generated from config.tinyworld and config.bootstrap)
Writes: runs/<run>/bootstrap/problems_{train,val,test}.jsonl   (the problems contract)
        runs/<run>/bootstrap/model/        weights (safetensors) + config + tokenizer
        runs/<run>/bootstrap/metrics.json  size, training, and quick checks of the policy
        runs/<run>/bootstrap/config.yaml   the resolved config

Library: pipeline.tinyworld.bootstrap.build_base_policy (problems, tokenizer, training on the
training base), then eval.policy_checks on the saved model, reloaded through the one generation
interface as every later stage will load it. A finished bootstrap with the same
tinyworld/bootstrap/format settings is not redone.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import yaml

from eval.policy_checks import policy_checks
from pipeline.config import Config
from pipeline.generation import build_generator
from pipeline.io import write_json_atomic
from pipeline.tinyworld.bootstrap import build_base_policy
from stages.common import log, parse_args, set_threads, stage_dir, timed

# The config sections that determine what bootstrap writes.
INPUT_SECTIONS = ("tinyworld", "bootstrap", "format")


def main(argv: list[str] | None = None) -> dict:
    config = parse_args("bootstrap", argv)
    set_threads(config)
    out = config.stage_dir("bootstrap")
    if is_done(out, config):
        log.info("bootstrap: %s already holds a model trained with this config; delete it to retrain", out)
        return json.loads((out / "metrics.json").read_text(encoding="utf-8"))
    out = stage_dir(config, "bootstrap")
    with timed("bootstrap"):
        metrics, splits = build_base_policy(config, out)
        generator = build_generator(config, str(out / "model"))  # loaded back exactly as a later stage loads it
        metrics.update(policy_checks(generator, splits["test"][: config.bootstrap.eval_problems], config))
    write_json_atomic(out / "metrics.json", metrics)
    log.info("bootstrap: %s", {k: v for k, v in metrics.items() if k not in ("examples", "loss_curve")})
    return metrics


def is_done(out: Path, config: Config) -> bool:
    """metrics.json and model/ exist, written with the same input sections of the config."""
    saved = out / "config.yaml"
    if not ((out / "metrics.json").is_file() and (out / "model").is_dir() and saved.is_file()):
        return False
    previous = yaml.safe_load(saved.read_text(encoding="utf-8")) or {}
    current = config.to_dict()
    return all(previous.get(section) == current[section] for section in INPUT_SECTIONS)


if __name__ == "__main__":
    main(sys.argv[1:])
