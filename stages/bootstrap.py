"""make bootstrap: the tiny world's problems, tokenizer and from-scratch base policy.

Reads:  nothing (everything is generated from config.tinyworld and config.bootstrap)
Writes: runs/<run>/bootstrap/problems_{train,val,test,rl}.jsonl   (the problems contract; the model trains on
        problems_train.jsonl only, rl is what the stages after it read: data.train_path)
        runs/<run>/bootstrap/model/        weights (safetensors) + config + tokenizer
        runs/<run>/bootstrap/metrics.json  size, training, and quick checks of the policy
        runs/<run>/bootstrap/config.yaml   the resolved config

Library: pipeline.tinyworld.bootstrap.build_base_policy (problems, tokenizer, training on the
training base), then eval.policy_checks on the saved model, reloaded through the one generation
interface as every later stage will load it. A finished bootstrap with the same
tinyworld/bootstrap/format settings (recorded in the model's manifest) is not redone unless
bootstrap.retrain=true.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

from eval.policy_checks import policy_checks
from pipeline.config import Config, save_config
from pipeline.generation import build_generator
from pipeline.io import FolderError, read_json, verify_manifest, write_json_atomic
from pipeline.tinyworld.bootstrap import build_base_policy
from stages.common import cli, log, parse_args, set_threads, stage_dir, timed

# The config sections that determine what bootstrap writes.
INPUT_SECTIONS = ("tinyworld", "bootstrap", "format")


def main(argv: list[str] | None = None) -> dict:
    config = parse_args("bootstrap", argv)
    set_threads(config, "bootstrap")
    out = stage_dir(config, "bootstrap", save=False)  # locked; config.yaml is compared before it is replaced
    if is_done(out, config) and not config.bootstrap.retrain:
        log.info("bootstrap: finished: %s already holds a model trained with this config; bootstrap.retrain=true trains it again", out)
        return read_json(out / "metrics.json", "bootstrap metrics")
    (out / "metrics.json").unlink(missing_ok=True)  # it described an earlier model
    save_config(config, out / "config.yaml")
    with timed("bootstrap"):
        metrics, splits = build_base_policy(config, out, settings=input_settings(config))
        generator = build_generator(config, str(out / "model"))  # loaded back exactly as a later stage loads it
        metrics.update(policy_checks(generator, splits["test"][: config.bootstrap.eval_problems], config))
    write_json_atomic(out / "metrics.json", metrics)
    log.info("bootstrap: %s", {k: v for k, v in metrics.items() if k not in ("examples", "loss_curve")})
    return metrics


def input_settings(config: Config) -> dict:
    """The config sections that determine what bootstrap writes (bootstrap.retrain aside)."""
    settings = {section: getattr(config, section) for section in INPUT_SECTIONS}
    return {section: {k: v for k, v in dataclasses.asdict(value).items() if k != "retrain"} for section, value in settings.items()}


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
