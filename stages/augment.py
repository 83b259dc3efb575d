"""make augment: similarity-grouped augmentation of the MCTS data (paper 3.2, Figure 1).

Reads:  runs/<run>/mcts/shards/part-*/records.jsonl
Writes: runs/<run>/augment/prm_train.jsonl, prm_val.jsonl (split by problem), stats.json
"""

from __future__ import annotations

import sys
import time

from pipeline.io import committed_shards, write_json_atomic, write_jsonl_atomic
from pipeline.rollouts.augmentation import augment_records, augmentation_stats, is_validation_problem, read_mcts_records
from stages.common import log, parse_args, stage_dir, timed


def mcts_records(shards_dir):
    """Validated MCTS records of every committed shard (errors name the shard file and line)."""
    for shard in committed_shards(shards_dir):
        path = shard / "records.jsonl"
        if path.exists():
            yield from read_mcts_records(path)


def main(argv: list[str] | None = None) -> dict:
    config = parse_args("augment", argv)
    out = stage_dir(config, "augment")
    shards = config.stage_dir("mcts") / "shards"
    if not committed_shards(shards):
        raise SystemExit(f"missing input {shards}: run `make mcts` first (same CONFIG and RUN)")
    cfg = config.augment
    with timed("augment"):
        start = time.monotonic()
        n_mcts = 0

        def counted(records):
            nonlocal n_mcts
            for record in records:
                n_mcts += 1
                yield record

        examples = list(augment_records(counted(mcts_records(shards)), threshold=cfg.similarity_threshold, include_mcts=cfg.include_mcts))
        train = [r for r in examples if not is_validation_problem(r["problem_id"], cfg.val_fraction, cfg.seed)]
        val = [r for r in examples if is_validation_problem(r["problem_id"], cfg.val_fraction, cfg.seed)]
        write_jsonl_atomic(out / "prm_train.jsonl", train)
        write_jsonl_atomic(out / "prm_val.jsonl", val)
        stats = augmentation_stats(examples, n_mcts)
        stats.update(
            train_examples=len(train), val_examples=len(val),
            train_problems=len({r["problem_id"] for r in train}), val_problems=len({r["problem_id"] for r in val}),
            seconds=round(time.monotonic() - start, 3),
        )
        write_json_atomic(out / "stats.json", stats)
        log.info("augment: %d MCTS steps -> %d PRM examples (%d train / %d val) in %.1f s", n_mcts, len(examples), len(train), len(val), stats["seconds"])
    return stats


if __name__ == "__main__":
    main(sys.argv[1:])
