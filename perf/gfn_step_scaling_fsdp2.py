"""gfn_step_scaling_fsdp2: gfn_step_scaling with the policy sharded by FSDP2 over the 2 processes
(a gathered HF copy for sampling); the same ratio: the trajectories/s of 2 processes over 1."""

from __future__ import annotations

from pathlib import Path

from perf.gfn_step_scaling import GOAL, step_scaling
from perf.rows import ratio_row
from perf.world import tiny_world

NAME = "gfn_step_scaling_fsdp2"
REFERENCE = "the same with the policy sharded by FSDP2 over the 2 processes (gathered HF copy for sampling)"


def run(cfg, out_dir: Path) -> dict:
    world = tiny_world(cfg, out_dir)
    return {
        **ratio_row(NAME, goal=GOAL, reference=REFERENCE, **step_scaling(cfg, world.scaling_world(), fsdp=True)),
        "model": world.note,
    }
