"""gfn_step_scaling: weak scaling of `make gfn` under DDP: 1 process on one core, then 2 (torchrun)
on a core each, one torch thread each, the same work per process (8 questions x 4 samples a step
each). The row states trajectories per second as seconds per trajectory (ours: 2 processes,
reference: 1), so ratio = reference_s / ours_s = the rate of 2 over 1 (ideal 2.0; fraction_of_ideal
= ratio / processes).

Beside the ratio, the row says where the rest of the ideal goes, measured in the 2-process run's
own stage code (pipeline.training.collective_clock, turned on by $STEPFLOW_TIME_COLLECTIVES for
these runs only): per process, the share of its step's wall time spent waiting in collectives
(collective_wait_share) and the collectives' launch-to-completion time (collective_in_flight_share:
DDP's all-reduce overlaps backward), and the slowdown against the 1-process step that collectives
do not explain (other_s: the step seconds minus the wait minus the 1-process step seconds:
memory bandwidth and caches shared by the two processes, ...)."""

from __future__ import annotations

import os
import statistics
import subprocess
import sys
from pathlib import Path

from perf.rows import ratio_row
from perf.world import tiny_world
from pipeline.training.collective_clock import ENV as TIME_COLLECTIVES
from pipeline.training.collective_clock import collective_shares
from pipeline.training.metrics import MetricsLog

NAME = "gfn_step_scaling"
GOAL = 1.8
REFERENCE = (
    "weak scaling of make gfn under DDP: 1 process on 1 core vs 2 processes (torchrun) on a core each "
    "(sched_setaffinity, one torch thread each), 8 questions x 4 samples per process a step; ours/reference "
    "= s per trajectory; ratio = trajectories/s of 2 over 1 (ideal 2.0)"
)


def run(cfg, out_dir: Path) -> dict:
    world = tiny_world(cfg, out_dir)
    return {
        **ratio_row(NAME, goal=GOAL, reference=REFERENCE, **step_scaling(cfg, world.scaling_world())),
        "model": world.note,
    }


def gfn_overrides(world: Path, run: str, steps: int, threads: int) -> list[str]:
    """`make gfn` on the scaling world: TB-VarGrad, 8 questions x 4 samples a step, ``threads``
    torch threads per process; trained afresh (gfn.retrain=true), so that a second `make bench` in
    the same run folder measures its own steps instead of finding the first one's model finished
    and reading its metrics."""
    return [
        f"runs_root={world}",
        f"run={run}",
        "gfn.retrain=true",
        f"model.policy={world / 'policy'}",
        f"model.prm={world / 'prm'}",
        f"data.train_path={world / 'problems_train.jsonl'}",
        "data.disjoint_from=[]",
        "gfn.loss=tb_vargrad",
        f"gfn.num_train_steps={steps}",
        "gfn.questions_per_step=8",
        "gfn.samples_per_question=4",
        "gfn.save_every=0",
        f"model.torch_threads={threads}",
    ]


def step_scaling(config, world: Path, processes: int = 2, steps: int = 6, fsdp: bool = False) -> dict:
    """Trajectories per second of the main process's steps after the first (median) with 1 process,
    then ``processes`` (torchrun, each on its own core: perf.pinned), one torch thread each.
    ``fsdp``: the policy sharded with FSDP2 over the processes. Needs ``processes`` cores.

    returns: {ours_s, reference_s (seconds per trajectory of ``processes`` and of 1), processes,
              fraction_of_ideal (the rate of ``processes`` over ``processes`` x the rate of 1),
              trajectories_per_s, step_s (mean step seconds of each run, the steps after the first),
              collectives (collective_shares of the ``processes`` run against the 1-process step),
              collective_wait_share, collective_in_flight_share, other_share (other_s over the
              1-process step; with wait_s over it, the slowdown of the mean steps, t2 / t1 - 1;
              the ratio itself is of median rates)}
    """
    if len(os.sched_getaffinity(0)) < processes:
        raise ValueError(
            f"gfn_step_scaling pins each of {processes} processes to its own core; this process may use "
            f"{len(os.sched_getaffinity(0))}"
        )
    rates, step_s, records = {}, {}, {}
    for count in (1, processes):
        run = f"run{count}{'_fsdp2' if fsdp else ''}"
        command = [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--nproc_per_node",
            str(count),
            "--master_port",
            str(29400 + os.getpid() % 500 + count),
            "--no-python",
            sys.executable,
            "-m",
            "perf.pinned",
            "stages.train_gfn",
            "--config",
            "configs/tiny.yaml",
            *gfn_overrides(world, run, steps, 1),
            f"gfn.questions_per_step={8 * count}",
            f"model.device={config.model.device}",
        ]
        env = {
            **os.environ,
            "OMP_NUM_THREADS": "1",
            "MKL_NUM_THREADS": "1",
            TIME_COLLECTIVES: "1",
            **({"ACCELERATE_USE_FSDP": "true", "FSDP_VERSION": "2"} if fsdp and count > 1 else {}),
        }
        subprocess.run(command, check=True, timeout=1800, env=env, stdout=subprocess.DEVNULL)
        rows = MetricsLog(world / run / "gfn" / "metrics.jsonl").read()[1:]
        rates[count] = statistics.median(r["sampled"] / r["seconds"] for r in rows)
        step_s[count] = statistics.fmean(r["seconds"] for r in rows)
        records[count] = rows
    shares = collective_shares(records[processes], step_s[1])
    return {
        "ours_s": 1 / rates[processes],
        "reference_s": 1 / rates[1],
        "processes": processes,
        "fraction_of_ideal": rates[processes] / (processes * rates[1]),
        "trajectories_per_s": {str(k): v for k, v in rates.items()},
        "step_s": {str(k): v for k, v in step_s.items()},
        "collectives": shares,
        "collective_wait_share": shares["wait_share"],
        "collective_in_flight_share": shares["in_flight_share"],
        "other_share": shares["other_s"] / step_s[1],
    }
