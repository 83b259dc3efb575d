"""make augment: similarity-grouped augmentation of the MCTS data (paper 3.2, Figure 1).

Reads:  runs/<run>/mcts/shards/part-*/records.jsonl
Writes: runs/<run>/augment/prm_train.jsonl, prm_val.jsonl (split by problem, in problem-id order), stats.json
Refuses damaged or copied shards (pipeline.storage.shards.verified_shards), shards that hold no records, an
empty split, and shards that make mcts is still writing; a refusal leaves earlier outputs as they are.
"""

from __future__ import annotations

import time

from pipeline.records import MCTSRecord
from pipeline.rollouts.augmentation import augment_records, augmentation_stats, is_validation_problem
from pipeline.storage.files import write_json_atomic, write_records_atomic
from pipeline.storage.shards import committed_shards, read_stream
from stages.cli import cli, log, parse_args, timed
from stages.run_folders import require_finished, stage_dir


def main(argv: list[str] | None = None) -> dict:
    config = parse_args("augment", argv)
    shards = config.stage_dir("mcts") / "shards"
    if not committed_shards(shards):
        raise SystemExit(f"missing input {shards}: run `make mcts` first (same CONFIG and RUN)")
    require_finished(config, "mcts")
    out = stage_dir(config, "augment")  # after the input checks: a stage that cannot start writes nothing
    cfg = config.augment
    with timed("augment"):
        start = time.monotonic()
        # every shard is checked against its manifest first (pipeline.storage.shards.verified_shards); errors
        # name the shard, or the shard file and line
        # in problem order (stable: a problem's records keep their order), so the output depends on
        # the records alone, not on the order problems finished in or how a kill split the run
        records = sorted(read_stream(shards, "records", MCTSRecord), key=lambda record: record.problem_id)
        if not records:
            raise SystemExit(
                f"{shards}: the MCTS shards hold no records; nothing to augment (the outputs in {out} are left as they are)"
            )
        n_mcts, problem_ids = len(records), {record.problem_id for record in records}
        examples = list(augment_records(records, threshold=cfg.similarity_threshold, include_mcts=cfg.include_mcts))
        train = [e for e in examples if not is_validation_problem(e.problem_id, cfg.val_fraction, cfg.seed)]
        val = [e for e in examples if is_validation_problem(e.problem_id, cfg.val_fraction, cfg.seed)]
        problems = len(problem_ids)
        for name, split in (("training", train), ("validation", val)):
            if not split:  # checked before anything is written: a good earlier output is never replaced by an empty one
                raise SystemExit(
                    f"augment: the {name} split is empty ({len(examples)} examples of {problems} problems, "
                    f"augment.val_fraction={cfg.val_fraction}); search more problems (mcts.max_problems) or "
                    f"change augment.val_fraction. The outputs in {out} are left as they are"
                )
        write_records_atomic(out / "prm_train.jsonl", train)
        write_records_atomic(out / "prm_val.jsonl", val)
        stats = augmentation_stats(examples, n_mcts)
        stats.update(
            train_examples=len(train),
            val_examples=len(val),
            train_problems=len({e.problem_id for e in train}),
            val_problems=len({e.problem_id for e in val}),
            seconds=round(time.monotonic() - start, 3),
        )
        write_json_atomic(out / "stats.json", stats)
        log.info(
            "augment: %d MCTS steps -> %d PRM examples (%d train / %d val) in %.1f s",
            n_mcts,
            len(examples),
            len(train),
            len(val),
            stats["seconds"],
        )
    return stats


if __name__ == "__main__":
    cli(main)
