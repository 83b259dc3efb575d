"""make export-trl: the PRM data of `make augment` as TRL's stepwise-supervision dataset.

Reads:  runs/<run>/augment/prm_train.jsonl, prm_val.jsonl (or the files at prm.train_path /
        prm.val_path: our PRM records or PRM800K-format human labels)
Writes: runs/<run>/export/trl/prm_train.jsonl, prm_val.jsonl ({prompt, completions, labels,
        soft_labels, problem_id} per line), stats.json

    datasets.load_dataset("json", data_files={"train": ".../prm_train.jsonl", "test": ".../prm_val.jsonl"})

gives what TRL's PRMTrainer takes (trl.experimental.prm.PRMTrainer in trl 1.0-1.13, the dev extra's
trl; step_separator = format.separator). Library: prm.trl_export.
"""

from __future__ import annotations

from pipeline.storage.files import write_json_atomic
from prm.prm800k import read_training_records
from prm.trl_export import write_stepwise_dataset
from stages.cli import cli, log, parse_args, timed
from stages.inputs import require
from stages.run_folders import stage_dir


def main(argv: list[str] | None = None) -> dict:
    config = parse_args("export_trl", argv)
    stats = {}
    with timed("export_trl"):
        # both inputs read before the run folder is made: a stage that cannot start writes nothing
        inputs = {
            name: read_training_records(require(config.resolve(source), "augment"), config.prm.prm800k_neutral_label)
            for name, source in (("prm_train", config.prm.train_path), ("prm_val", config.prm.val_path))
        }
        out = stage_dir(config, "export") / "trl"
        for name, records in inputs.items():
            stats[name] = write_stepwise_dataset(records, out / f"{name}.jsonl", config.format.separator)
        write_json_atomic(out / "stats.json", stats)
        log.info("export_trl: %s -> %s", stats, out)
    return stats


if __name__ == "__main__":
    cli(main)
