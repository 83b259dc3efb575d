"""make mcts / eval / search on every local GPU: one worker per device, each on its own share of
the problems (pipeline/launcher.py).

    python -m stages.launch mcts --config configs/paper/llama3.2-3b.yaml run=llama3b
    python -m stages.launch eval --config configs/paper/llama3.2-3b.yaml run=llama3b
    python -m stages.launch search --config configs/paper/llama3.2-3b.yaml run=llama3b
    python -m stages.launch eval --workers 2 --config configs/tiny.yaml        # CPU: 2 workers, no device

The devices are CUDA_VISIBLE_DEVICES when set, else every GPU torch sees; each worker gets one.
Writes what the stage writes in one process: mcts: runs/<run>/mcts/shards/part-*, stats.json
over every shard; eval: reports/<run>/ (results.json, report, samples); search: runs/<run>/search/
(results.json, table.md, the plot, solutions.jsonl). eval and search merge in one more run of the
stage on the first device once the workers finish.
"""

from __future__ import annotations

import argparse

from pipeline.launcher import (
    MERGED_STAGES,
    SHARDED_STAGES,
    STAGE_MODULES,
    merge_worker,
    run_workers,
    shard_workers,
    visible_devices,
)
from pipeline.storage.files import write_json_atomic
from stages.cli import cli, parse_args
from stages.mcts import mcts_stats
from stages.startup_checks import check_models


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m stages.launch", description="one stage worker per local GPU")
    parser.add_argument("stage", choices=sorted(SHARDED_STAGES))
    parser.add_argument(
        "--workers", type=int, default=None, help="workers without a GPU each (CPU); default: one per GPU"
    )
    args, rest = parser.parse_known_args(argv)
    config = parse_args("launch", rest)  # checked before any worker starts
    check_models(config, STAGE_MODULES[args.stage].rpartition(".")[2])
    devices = None if args.workers else visible_devices()
    if devices is not None and not devices:
        raise SystemExit(
            "launch: no GPU is visible to launch on: set CUDA_VISIBLE_DEVICES, or give --workers N for CPU workers"
        )
    run_workers(shard_workers(args.stage, rest, devices, args.workers))
    if args.stage in MERGED_STAGES:
        run_workers([merge_worker(args.stage, rest, devices)])
    else:
        # each worker wrote stats.json when it finished, over the shards committed by then: the
        # last word is over all of them
        write_json_atomic(config.stage_dir("mcts") / "stats.json", mcts_stats(config.stage_dir("mcts") / "shards"))


if __name__ == "__main__":
    cli(main)
