"""One MCTS worker per device: each on its own shard and GPU, merged as one process writes."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from pipeline.io import read_stream
from pipeline.launcher import shard_workers, visible_devices
from pipeline.records import MCTSRecord, MCTSSummary

REPO = Path(__file__).resolve().parents[1]


def test_one_worker_per_visible_device_each_on_its_own_shard():
    devices = visible_devices({"CUDA_VISIBLE_DEVICES": "3,5"})
    workers = shard_workers("mcts", ["--config", "c.yaml", "run=r"], devices)
    assert [w.env for w in workers] == [{"CUDA_VISIBLE_DEVICES": "3"}, {"CUDA_VISIBLE_DEVICES": "5"}]
    assert [w.argv[2:] for w in workers] == [["stages.mcts", "--config", "c.yaml", "run=r", "mcts.shard=0/2"],
                                             ["stages.mcts", "--config", "c.yaml", "run=r", "mcts.shard=1/2"]]
    with pytest.raises(ValueError, match="mcts.shard is set by the launcher"):
        shard_workers("mcts", ["mcts.shard=0/4"], devices)
    with pytest.raises(ValueError, match="stage 'evaluate' has no shards"):
        shard_workers("evaluate", [], devices)
    with pytest.raises(ValueError, match="no devices to launch on"):
        shard_workers("mcts", [], visible_devices({"CUDA_VISIBLE_DEVICES": ""}))


@pytest.mark.slow
def test_two_cpu_workers_write_the_records_one_process_writes(random_tiny_world, tmp_path):
    world = random_tiny_world
    common = ["--config", str(REPO / "configs" / "tiny.yaml"), f"runs_root={tmp_path / 'runs'}", f"model.policy={world / 'policy'}",
              f"data.train_path={world / 'problems_train.jsonl'}", "generation.max_new_tokens=32", "mcts.k=4", "mcts.max_problems=6",
              "mcts.max_iterations=1", "mcts.max_rollouts=8", "mcts.search_trivial=true"]
    env = {**os.environ, "PYTHONPATH": str(REPO), "TQDM_DISABLE": "1"}
    quiet = {"env": env, "cwd": tmp_path, "check": True, "stdout": subprocess.DEVNULL, "stderr": subprocess.DEVNULL, "timeout": 240}
    subprocess.run([sys.executable, "-m", "stages.mcts", *common, "run=one"], **quiet)
    subprocess.run([sys.executable, "-m", "stages.launch", "mcts", "--workers", "2", *common, "run=two"], **quiet)
    two = tmp_path / "runs" / "two" / "mcts"
    assert sorted(p.name for p in (two / "shards").glob("part-*")) and len(list((two / "shards").glob("part-*"))) >= 2

    def merged(run, stream, record_type):
        rows = [r.to_json() for r in read_stream(tmp_path / "runs" / run / "mcts" / "shards", stream, record_type)]
        return sorted(rows, key=lambda r: json.dumps(r, sort_keys=True))

    assert merged("two", "records", MCTSRecord) == merged("one", "records", MCTSRecord) != []
    assert merged("two", "summaries", MCTSSummary) == merged("one", "summaries", MCTSSummary)
    assert json.loads((two / "stats.json").read_text()) == json.loads((tmp_path / "runs" / "one" / "mcts" / "stats.json").read_text())
