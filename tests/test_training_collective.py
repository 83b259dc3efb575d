"""pipeline.training.distributed.Collective.broadcast_text between two real gloo processes: rank 0's
text, the empty one included, reaches the other (the asynchronous trainer broadcasts "" for "no
stall" at every wait; torch.frombuffer refuses an empty buffer, which crashed rank 0 and left rank 1
waiting for ever)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

TESTS = Path(__file__).resolve().parent
REPO = TESTS.parent


def test_rank_zeros_texts_the_empty_one_included_reach_every_process(tmp_path):
    env = {
        **os.environ,
        "OMP_NUM_THREADS": "1",
        "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]),
    }
    init = tmp_path / "init"
    ranks = [
        subprocess.Popen(
            [sys.executable, str(TESTS / "collective_ranks.py"), str(rank), str(init), str(tmp_path)], env=env
        )
        for rank in (0, 1)
    ]
    try:
        codes = [rank.wait(timeout=120) for rank in ranks]
    finally:
        for rank in ranks:
            rank.kill()
    assert codes == [0, 0]
    expected = ["", "héllo ∑", "", "x" * 70_000]
    assert [json.loads((tmp_path / f"rank{rank}.json").read_text()) for rank in (0, 1)] == [expected, expected]
