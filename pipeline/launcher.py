"""One worker per local GPU for a stage that splits its problems into shards (mcts, eval, search).

Worker i of n runs ``python -m stages.<module> ... <key>=i/n`` with CUDA_VISIBLE_DEVICES set to
its own device, so ``model.device: auto`` puts it on that GPU alone. The shards are the stage's
own (``mcts.shard``, ``eval.shard``, ``search.shard``: the problems with index % n == i): each
worker commits its own part of the stage's shard folder, and the merged outputs are those one
process writes (per-problem random streams make a problem's samples independent of the others;
tests/test_launcher.py compares them). eval and search then run once more without a shard
(``merge_worker``, on the first device): that run finds every problem committed, merges, and
computes what depends on all problems (intervals, diversity, paired differences) once. A worker
that fails stops the others; a rerun resumes every shard where it stopped.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from dataclasses import dataclass

import torch

SHARDED_STAGES = {"mcts": "mcts.shard", "eval": "eval.shard", "search": "search.shard"}  # stage -> its shard key
STAGE_MODULES = {"mcts": "stages.mcts", "eval": "stages.evaluate", "search": "stages.search"}
MERGED_STAGES = ("eval", "search")  # a run without a shard merges the workers' shards and writes the results


class WorkerFailed(RuntimeError):
    """A worker of a launch exited with an error (or the workers ran past their time): the others
    were stopped; every shard resumes when the same command runs again."""


@dataclass(frozen=True)
class Worker:
    argv: list[str]
    env: dict[str, str]  # set on top of this process's environment
    shard: str


def visible_devices(environ: dict[str, str] | None = None) -> list[str]:
    """The GPUs this process may use: CUDA_VISIBLE_DEVICES when set, else every device torch sees."""
    environ = os.environ if environ is None else environ
    listed = environ.get("CUDA_VISIBLE_DEVICES")
    if listed is not None:
        return [device.strip() for device in listed.split(",") if device.strip()]
    return [str(i) for i in range(torch.cuda.device_count())]


def shard_workers(stage: str, argv: list[str], devices: list[str] | None, workers: int | None = None) -> list[Worker]:
    """One Worker per device (``devices``), or ``workers`` workers without a device each (CPU)."""
    if stage not in SHARDED_STAGES:
        raise ValueError(
            f"stage {stage!r} has no shards to spread over devices; sharded stages: {', '.join(SHARDED_STAGES)}"
        )
    key = SHARDED_STAGES[stage]
    if any(arg.startswith(f"{key}=") for arg in argv):
        raise ValueError(f"{key} is set by the launcher (one shard per worker); remove it from the arguments")
    count = len(devices) if devices else (workers or 0)
    if count < 1:
        raise ValueError("no devices to launch on: set CUDA_VISIBLE_DEVICES or give the number of workers")
    return [
        Worker(
            [sys.executable, "-m", STAGE_MODULES[stage], *argv, f"{key}={i}/{count}"],
            {"CUDA_VISIBLE_DEVICES": devices[i]} if devices else {},
            f"{i}/{count}",
        )
        for i in range(count)
    ]


def merge_worker(stage: str, argv: list[str], devices: list[str] | None) -> Worker:
    """The stage run without a shard after the workers (eval, search): it finds every problem
    committed, merges the shards and writes the files one process writes (on the first device:
    the PRM and the embedder score there)."""
    if stage not in MERGED_STAGES:
        raise ValueError(f"stage {stage!r} has no merge run; stages with one: {', '.join(MERGED_STAGES)}")
    return Worker(
        [sys.executable, "-m", STAGE_MODULES[stage], *argv],
        {"CUDA_VISIBLE_DEVICES": devices[0]} if devices else {},
        "merge",
    )


def run_workers(workers: list[Worker], timeout: float | None = None, poll_seconds: float = 0.2) -> None:
    """Start every worker, wait for all; when one fails (or ``timeout`` passes), terminate the
    others and raise WorkerFailed naming the shard and its exit status."""
    processes = [subprocess.Popen(w.argv, env={**os.environ, **w.env}) for w in workers]
    deadline = None if timeout is None else time.monotonic() + timeout
    failure = None
    try:
        while any(p.poll() is None for p in processes):
            failed = [(w, p) for w, p in zip(workers, processes) if p.returncode not in (None, 0)]
            if failed:
                failure = f"shard {failed[0][0].shard} exited with status {failed[0][1].returncode}"
                break
            if deadline is not None and time.monotonic() > deadline:
                failure = f"the workers ran past {timeout:g} s"
                break
            time.sleep(poll_seconds)
    finally:
        for process in processes:
            if process.poll() is None:
                process.terminate()
        for process in processes:
            try:
                process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()
    if failure is None:
        failed = [(w, p) for w, p in zip(workers, processes) if p.returncode != 0]
        if failed:
            failure = f"shard {failed[0][0].shard} exited with status {failed[0][1].returncode}"
    if failure is not None:
        raise WorkerFailed(
            f"launch: {failure}; the other workers were stopped. Run the same command again: every shard "
            "resumes where it stopped"
        )
