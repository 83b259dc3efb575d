"""make prm: train the process reward model on the augmented step labels, then validate it.

Reads:  runs/<run>/augment/prm_train.jsonl, prm_val.jsonl (prm.train_path / prm.val_path: our records, or PRM800K-format
        human labels, prm/prm800k.py); the backbone (config.model.prm_backbone);
        for the exact check and the slip pairs, the policy (config.model.policy) and held-out problems (data.validation*)
Writes: runs/<run>/prm/model/ (the PRM), metrics.jsonl, validation.json, calibration.png,
        config.yaml; checkpoints/step-<n>/ every prm.save_every steps (a rerun resumes from the newest good one)
With prm.eval_only=true: validates the PRM at config.model.prm, trains nothing.
Started again once finished (model/ committed whole, summary.json written) it says so and returns;
prm.retrain=true trains afresh. An empty prm_train.jsonl or prm_val.jsonl is an error.
Multi-GPU: ``accelerate launch --config_file configs/accelerate/ddp.yaml -m stages.train_prm ...``
"""

from __future__ import annotations

import dataclasses
import functools
import os

from pipeline.storage.files import read_json, write_json_atomic
from pipeline.training.threads import training_threads
from prm.formats import load_scorer
from prm.prm800k import read_training_records
from prm.scorer import PRMScorer
from prm.train import train_prm
from prm.validation import validate_prm, write_validation
from stages.cli import cli, log, parse_args, set_threads, timed
from stages.inputs import exact_check_samples, require, require_prm, require_records, training_problems
from stages.run_folders import finished_model, require_finished, stage_dir


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
    set_threads(config, "prm")
    require_finished(config, "augment")
    cfg = config.prm
    # our records (make augment) or PRM800K-format human labels, whichever each file holds
    read = functools.partial(read_training_records, neutral_label=cfg.prm800k_neutral_label)
    # the inputs before the run folder is made: a stage that cannot start writes nothing
    val_records = require_records(config.resolve(cfg.val_path), read, "augment")
    if cfg.eval_only:
        model_dir = require_prm(config.resolve(config.model.prm))
    else:
        require(config.resolve(cfg.train_path), "augment")
    out = stage_dir(config, "prm")
    with timed("prm"):
        result: dict = {}
        if not cfg.eval_only:
            model_dir = out / "model"
            settings = dataclasses.asdict(cfg)
            finished = None if cfg.retrain else finished_model(out, "prm", False, settings)
            if finished is not None and (out / "summary.json").is_file():
                return read_json(out / "summary.json", "PRM summary")  # trained and validated: nothing left to do
            if finished is None:
                train_records = require_records(config.resolve(cfg.train_path), read, "augment")
                if cfg.retrain:
                    finished_model(out, "prm", True, settings)  # the old model goes once the inputs are known good
                (out / "summary.json").unlink(missing_ok=True)  # it described an earlier model
                with training_threads(cfg.torch_threads, "prm"):
                    result["train"] = train_prm(config, train_records, val_records, out, kind=prm_kind(config))
        if int(os.environ.get("RANK", "0")) != 0:
            return result  # under accelerate launch, validation runs once, on the main process
        # eval_only: ours or another format (model.prm_format); after training: the PRM just trained
        scorer = load_scorer(model_dir, config) if cfg.eval_only else PRMScorer.from_pretrained(model_dir, config)
        report = validate_prm(
            scorer,
            val_records,
            bins=config.prm.calibration_bins,
            corrupt_examples=config.prm.corrupt_examples,
            prm800k_path=config.resolve(config.prm.prm800k_path),
            seed=config.prm.seed,
            merge_prefixes=config.prm.merge_prefixes,
            policy_samples=exact_check_samples(config, scorer.kind or prm_kind(config)),
        )
        write_validation(report, out)
        result["validation"] = {k: v for k, v in report.items() if k not in ("reliability",)}
        write_json_atomic(out / "summary.json", result)
        figure = lambda value: "n/a" if value is None else f"{value:.4f}"  # noqa: E731
        log.info(
            "prm: val bce %s MC-label auc %s ece %s brier %s exact auc %s slip-pair auc %s",
            figure(report.get("bce")),
            figure(report.get("auc")),
            figure(report.get("ece")),
            figure(report.get("brier")),
            figure((report.get("exact") or {}).get("auc")),
            figure((report.get("slip_pair") or {}).get("auc")),
        )
    return result


if __name__ == "__main__":
    cli(main)
