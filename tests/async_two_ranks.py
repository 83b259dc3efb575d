"""One process of a 2-process asynchronous trainer (run under torchrun by tests/test_async_ray.py).

    python -m torch.distributed.run --nproc_per_node 2 tests/async_two_ranks.py <ray address> <out folder>

Each process trains the tabular policy of tests/test_gflownet.py for a few steps with two
searchers on the Ray cluster at <ray address>, counting its own calls to ray.init, and writes
<out folder>/rank<r>.json: its process id, those calls, the questions of each step's share of the
batch and the records it returned.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import torch

TESTS = Path(__file__).resolve().parent
sys.path.insert(0, str(TESTS))
torch.set_num_threads(1)

import ray  # noqa: E402

calls: list = []
original_init = ray.init


def counted_init(*args, **kwargs):
    calls.append(kwargs.get("address"))
    return original_init(*args, **kwargs)


ray.init = counted_init

from test_async_ray import tabular_config, tabular_trainer  # noqa: E402


def main(address: str, out: Path) -> None:
    cfg = tabular_config(
        num_train_steps=3,
        questions_per_step=4,
        searchers=2,
        ray_address=address,
        sync_every=1,
        max_staleness=None,
        weight_transport="collective",
    )
    trainer, _ = tabular_trainer(cfg, out / "run", wait_seconds=90)
    rank = trainer.sampler.collective.rank
    shares: list[list[str]] = []
    draw = trainer.draw

    def recorded_draw():
        groups, recent, waited = draw()
        shares.append(sorted({t.problem_id for group in groups for t in group}))
        return groups, recent, waited

    trainer.draw = recorded_draw
    history = trainer.train()
    (out / f"rank{rank}.json").write_text(
        json.dumps(
            {
                "rank": rank,
                "world": trainer.sampler.collective.world,
                "pid": os.getpid(),
                "ray_init_calls": calls,
                "connected_at_end": ray.is_initialized(),
                "shares": shares,
                "records": [{k: v for k, v in h.items() if isinstance(v, (int, float, str))} for h in history],
            }
        )
    )


if __name__ == "__main__":
    main(sys.argv[1], Path(sys.argv[2]))
