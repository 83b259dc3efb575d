"""Pinning a process to cores: the searchers' (gfn.searcher_cores) and, through perf.rows
and perf.pinned, every process a benchmark pins (the library's one pinning function)."""

from __future__ import annotations

import os
from collections.abc import Iterable


def core_for(index: int, cores: Iterable[int] | None = None) -> int:
    """The core process ``index`` (a searcher's index, a torchrun LOCAL_RANK) runs on: the
    index-th of ``cores`` in increasing order (default: those this process may use), wrapping around."""
    ordered = sorted(os.sched_getaffinity(0) if cores is None else set(cores))
    return ordered[index % len(ordered)]


def pin_process(cores: set[int], key: str = "gfn.searcher_cores") -> None:
    """Pin every thread of this process to ``cores`` (os.sched_setaffinity; threads it starts later,
    and processes, inherit the mask). A core the machine lacks is a ValueError naming ``key``."""
    tasks = [int(tid) for tid in os.listdir("/proc/self/task")] if os.path.isdir("/proc/self/task") else [0]
    try:
        for tid in tasks:
            try:
                os.sched_setaffinity(tid, cores)
            except ProcessLookupError:  # a thread that ended meanwhile
                pass
    except OSError as error:
        raise ValueError(f"{key}: cannot pin process {os.getpid()} to cores {sorted(cores)}: {error}") from error
