"""make prm: train the process reward model on the augmented step labels, then validate it.

Reads:  runs/<run>/augment/prm_train.jsonl, prm_val.jsonl; the backbone (config.model.prm_backbone)
Writes: runs/<run>/prm/model/ (the PRM), metrics.jsonl, validation.json, calibration.png,
        config.yaml; checkpoints/step-<n>/ every prm.save_every steps (a rerun resumes from the newest good one)
With prm.eval_only=true: validates the PRM at config.model.prm, trains nothing.
Multi-GPU: ``accelerate launch --config_file configs/accelerate/ddp.yaml -m stages.train_prm ...``
"""

from __future__ import annotations

import os
import sys

from pipeline.io import read_records, write_json_atomic
from pipeline.records import PRMExample
from prm.scorer import PRMScorer
from prm.train import train_prm
from prm.validation import validate_prm, write_validation
from stages.common import log, parse_args, require, set_threads, stage_dir, timed, training_problems


def prm_kind(config) -> str:
    """The prompt kind: prm.kind, else the one kind of the training problems."""
    if config.prm.kind:
        return config.prm.kind
    kinds = {problem.kind for problem in training_problems(config)}
    if len(kinds) != 1:
        raise SystemExit(f"prm: training problems mix prompt kinds {sorted(kinds)}; set prm.kind")
    return kinds.pop()


def main(argv: list[str] | None = None) -> dict:
    config = parse_args("train_prm", argv)
    set_threads(config)
    out = stage_dir(config, "prm")
    augment = config.stage_dir("augment")
    with timed("prm"):
        val_records = list(read_records(require(augment / "prm_val.jsonl", "augment"), PRMExample))
        result: dict = {}
        if config.prm.eval_only:
            model_dir = config.resolve(config.model.prm)
            require(model_dir, "prm")
        else:
            train_records = list(read_records(require(augment / "prm_train.jsonl", "augment"), PRMExample))
            result["train"] = train_prm(config, train_records, val_records, out, kind=prm_kind(config))
            model_dir = out / "model"
        if int(os.environ.get("RANK", "0")) != 0:
            return result  # under accelerate launch, validation runs once, on the main process
        scorer = PRMScorer.from_pretrained(model_dir, config)
        report = validate_prm(
            scorer, val_records, bins=config.prm.calibration_bins, corrupt_examples=config.prm.corrupt_examples,
            prm800k_path=config.resolve(config.prm.prm800k_path), seed=config.prm.seed, merge_prefixes=config.prm.merge_prefixes,
        )
        write_validation(report, out)
        result["validation"] = {k: v for k, v in report.items() if k not in ("reliability",)}
        write_json_atomic(out / "summary.json", result)
        log.info("prm: val bce %.4f auc %.4f ece %.4f brier %.4f", report.get("bce", float("nan")), report.get("auc", float("nan")),
                 report.get("ece", float("nan")), report.get("brier", float("nan")))
    return result


if __name__ == "__main__":
    main(sys.argv[1:])
