"""One process of tests/test_training_collective.py: two gloo processes broadcast texts through
pipeline.training.distributed.Collective and each writes what it received.

    python tests/collective_ranks.py <rank> <init file> <out folder>
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from types import SimpleNamespace

import torch

from pipeline.training.distributed import Collective


def main(rank: int, init_file: str, out: Path) -> None:
    torch.set_num_threads(1)
    torch.distributed.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=2)
    try:
        # only what broadcast_text reads of an Accelerator: the process's index, their number, the device
        collective = Collective(SimpleNamespace(process_index=rank, num_processes=2, device=torch.device("cpu")))
        sent = ["", "héllo ∑", "", "x" * 70_000]
        received = [collective.broadcast_text(text if rank == 0 else None) for text in sent]
        (out / f"rank{rank}.json").write_text(json.dumps(received))
    finally:
        torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main(int(sys.argv[1]), sys.argv[2], Path(sys.argv[3]))
