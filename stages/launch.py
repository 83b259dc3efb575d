"""make mcts on every local GPU: one worker per device, each on its own shard (pipeline/launcher.py).

    python -m stages.launch mcts --config configs/paper/llama3.2-3b.yaml run=llama3b
    python -m stages.launch mcts --workers 2 --config configs/tiny.yaml        # CPU: 2 workers, no device

The devices are CUDA_VISIBLE_DEVICES when set, else every GPU torch sees; each worker gets one.
Writes what the stage writes (runs/<run>/mcts/shards/part-*, stats.json: over every shard).
"""

from __future__ import annotations

import argparse
import sys

from pipeline.io import write_json_atomic
from pipeline.launcher import SHARDED_STAGES, run_workers, shard_workers, visible_devices
from stages.common import parse_args
from stages.mcts import mcts_stats


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m stages.launch", description="one stage worker per local GPU")
    parser.add_argument("stage", choices=sorted(SHARDED_STAGES))
    parser.add_argument("--workers", type=int, default=None, help="workers without a GPU each (CPU); default: one per GPU")
    args, rest = parser.parse_known_args(argv)
    config = parse_args("launch", rest)  # checked before any worker starts
    devices = None if args.workers else visible_devices()
    run_workers(shard_workers(args.stage, rest, devices, args.workers))
    # each worker wrote stats.json when it finished, over the shards committed by then: the last
    # word is over all of them
    write_json_atomic(config.stage_dir("mcts") / "stats.json", mcts_stats(config.stage_dir("mcts") / "shards"))


if __name__ == "__main__":
    main(sys.argv[1:])
