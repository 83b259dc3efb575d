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

import logging
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

SHARDED_STAGES = {"mcts": "mcts.shard", "eval": "eval.shard", "search": "search.shard"}  # stage -> its shard key
log = logging.getLogger("stepflow")

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


class StageFailed(WorkerFailed):
    """A process of a stage in run_graph exited with an error: names the stage, the shard and its log."""

    def __init__(self, message: str, stage: str, shard: str, returncode: int | None, log: Path | None):
        super().__init__(message)
        self.stage, self.shard, self.returncode, self.log = stage, shard, returncode, log


@dataclass(frozen=True)
class Stage:
    """A node of run_graph: its phases run one after the other, the workers of a phase together,
    each worker in one slot; the stage starts once every stage in ``after`` has ended, and ends
    when its last phase has (then ``finish`` runs in this process, before any stage after it starts)."""

    name: str
    phases: list[list[Worker]]
    after: tuple[str, ...] = ()
    finish: Callable[[], None] | None = None


def check_graph(stages: list[Stage], jobs: int) -> None:
    """ValueError naming the stage: a name given twice, an unknown or own dependency, a cycle, a
    phase without workers or wider than ``jobs`` (it could never start)."""
    if jobs < 1:
        raise ValueError(f"jobs must be at least 1, got {jobs}")
    names = [stage.name for stage in stages]
    for stage in stages:
        if names.count(stage.name) > 1:
            raise ValueError(f"stage {stage.name!r} is given twice")
        for parent in stage.after:
            if parent not in names:
                raise ValueError(f"stage {stage.name!r} depends on {parent!r}, which is not a stage")
        if not stage.phases or any(not phase for phase in stage.phases):
            raise ValueError(f"stage {stage.name!r} has a phase without workers")
        wide = max(len(phase) for phase in stage.phases)
        if wide > jobs:
            raise ValueError(f"stage {stage.name!r} runs {wide} workers together, more than jobs={jobs}")
    parents = {stage.name: set(stage.after) for stage in stages}
    ordered: set[str] = set()
    while len(ordered) < len(parents):
        ready = [name for name, ps in parents.items() if name not in ordered and ps <= ordered]
        if not ready:
            stuck = [name for name in names if name not in ordered]
            raise ValueError(
                f"stage {stuck[0]!r} depends on itself through {', '.join(map(repr, stuck[1:])) or 'itself'} (a cycle)"
            )
        ordered.update(ready)


def _log_path(log_dir: Path | None, stage: str, worker: Worker, phase: list[Worker]) -> Path | None:
    if log_dir is None:
        return None
    if len(phase) == 1 and worker.shard in ("", "0/1"):
        return log_dir / f"{stage}.log"
    return log_dir / f"{stage}-{worker.shard.replace('/', 'of')}.log"


def _signal_group(process: subprocess.Popen, signum: int) -> None:
    try:
        os.killpg(process.pid, signum)  # the group keeps the leader's id while any member lives
    except (ProcessLookupError, PermissionError):
        pass


def _stop(processes: list[subprocess.Popen], grace: float) -> None:
    """SIGTERM to each process's group (what a process started there goes too), then SIGKILL to
    the groups whose process is still there after ``grace`` seconds."""
    for process in processes:
        _signal_group(process, signal.SIGTERM)
    deadline = time.monotonic() + grace
    for process in processes:
        try:
            process.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            _signal_group(process, signal.SIGKILL)
            process.wait()


class _Terminated(BaseException):
    """SIGTERM reached run_graph: unwinds it like Ctrl-C (KeyboardInterrupt), stopping the children."""


def run_graph(
    stages: list[Stage],
    jobs: int,
    log_dir: Path | None = None,
    *,
    label: str = "launch",
    timeout: float | None = None,
    poll_seconds: float = 0.2,
    stop_grace: float = 30.0,
) -> dict[str, float]:
    """Run the stages on their dependency graph, at most ``jobs`` processes at once; returns each
    stage's wall seconds (its first process's start to its last one's end), in the order they ended.

    Each worker runs in its own process group (a new session), with its stdout and stderr in
    ``log_dir/<stage>[-<i>of<n>].log`` (``log_dir`` None: this process's). A stage waits until
    its parents have ended and its phase's workers all fit in the free slots; of the stages that
    can start, the earlier in ``stages`` start first, and a later one that fits may take slots a
    wider one waits for. A process that fails (or ``timeout`` passing, or Ctrl-C or SIGTERM of
    this process) stops every running process's group and raises: StageFailed naming the stage,
    its shard and its log for a failure."""
    check_graph(stages, jobs)
    by_name = {stage.name: stage for stage in stages}
    if log_dir is not None:
        log_dir.mkdir(parents=True, exist_ok=True)
    done: set[str] = set()
    phase_of: dict[str, int] = {}  # stage -> the index of its phase running or waiting for slots
    running: dict[str, list[tuple[Worker, subprocess.Popen, Path | None]]] = {}
    started: dict[str, float] = {}
    seconds: dict[str, float] = {}
    failure: StageFailed | None = None
    deadline = None if timeout is None else time.monotonic() + timeout
    previous_handler = None
    if threading.current_thread() is threading.main_thread():

        def terminated(signum, frame):
            raise _Terminated()

        previous_handler = signal.signal(signal.SIGTERM, terminated)
    try:
        while len(done) < len(stages):
            for name, procs in list(running.items()):
                failed = [(w, p, path) for w, p, path in procs if p.poll() not in (None, 0)]
                if failed:
                    worker, process, path = failed[0]
                    shard = "" if worker.shard in ("", "0/1") else f" (shard {worker.shard})"
                    where = f"; log: {path}" if path is not None else ""
                    failure = StageFailed(
                        f"{label}: stage {name}{shard} exited with status {process.returncode}{where}",
                        name,
                        worker.shard,
                        process.returncode,
                        path,
                    )
                    break
                if all(p.returncode == 0 for _, p, _ in procs):
                    del running[name]
                    phase_of[name] += 1
                    if phase_of[name] == len(by_name[name].phases):
                        if by_name[name].finish is not None:
                            by_name[name].finish()
                        seconds[name] = round(time.monotonic() - started[name], 1)
                        done.add(name)
                        log.info("%s: %s ended (%.1f s)", label, name, seconds[name])
            if failure is not None:
                break
            if deadline is not None and time.monotonic() > deadline:
                raise WorkerFailed(f"{label}: the stages ran past {timeout:g} s; the running ones were stopped")
            free = jobs - sum(len(procs) for procs in running.values())
            for stage in stages:
                name = stage.name
                if name in done or name in running or not set(stage.after) <= done:
                    continue
                phase = stage.phases[phase_of.get(name, 0)]
                if len(phase) > free:
                    continue
                if name not in started:
                    started[name] = time.monotonic()
                    phase_of[name] = 0
                    where = f"; log: {_log_path(log_dir, name, phase[0], phase)}" if log_dir is not None else ""
                    log.info(
                        "%s: %s started (%d process%s%s)",
                        label,
                        name,
                        len(phase),
                        "es" if len(phase) > 1 else "",
                        where,
                    )
                running[name] = []  # filled one by one: a SIGTERM between two starts stops those started
                for worker in phase:
                    running[name].append(_start(worker, _log_path(log_dir, name, worker, phase)))
                free -= len(phase)
            if len(done) < len(stages):
                time.sleep(poll_seconds)
    except _Terminated:
        raise SystemExit(f"{label}: stopped by SIGTERM; the running stages were stopped") from None
    finally:
        if previous_handler is not None:
            signal.signal(signal.SIGTERM, signal.SIG_IGN)  # a second SIGTERM does not cut the stopping short
        _stop([p for procs in running.values() for _, p, _ in procs], stop_grace)
        if previous_handler is not None:
            signal.signal(signal.SIGTERM, previous_handler)
    if failure is not None:
        raise failure
    return seconds


def _start(worker: Worker, log_path: Path | None) -> tuple[Worker, subprocess.Popen, Path | None]:
    """The worker's process, in a session (process group) of its own, writing to ``log_path`` (appended)."""
    if log_path is None:
        process = subprocess.Popen(worker.argv, env={**os.environ, **worker.env}, start_new_session=True)
    else:
        with open(log_path, "ab") as out:  # the child holds its own copy of the descriptor
            process = subprocess.Popen(
                worker.argv,
                env={**os.environ, **worker.env},
                stdout=out,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
    return worker, process, log_path


def run_workers(workers: list[Worker], timeout: float | None = None, poll_seconds: float = 0.2) -> None:
    """Start every worker, wait for all; when one fails (or ``timeout`` passes), stop the others
    and raise WorkerFailed naming the shard and its exit status (run_graph with one stage)."""
    try:
        run_graph([Stage("launch", [workers])], len(workers), timeout=timeout, poll_seconds=poll_seconds)
    except StageFailed as failed:
        raise WorkerFailed(
            f"launch: shard {failed.shard} exited with status {failed.returncode}; the other workers were "
            "stopped. Run the same command again: every shard resumes where it stopped"
        ) from None
    except WorkerFailed:
        raise WorkerFailed(
            f"launch: the workers ran past {timeout:g} s; the other workers were stopped. Run the same command "
            "again: every shard resumes where it stopped"
        ) from None
