"""CPU time from /proc (Linux): each process's, the machine's, and a split by role (searchers, store,
weights, trainer, other)."""

from __future__ import annotations

import os
from pathlib import Path


def process_cpu_seconds() -> dict[int, tuple[str, float]]:
    """Every process's CPU seconds so far (user + system, all its threads), from /proc (Linux):
    pid -> (name, seconds)."""
    tick = os.sysconf("SC_CLK_TCK")
    seconds = {}
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        try:
            text = Path(entry.path, "stat").read_text()
        except OSError:  # ended meanwhile
            continue
        name, fields = text[text.index("(") + 1 : text.rindex(")")], text[text.rindex(")") + 2 :].split()
        seconds[int(entry.name)] = (name, (int(fields[11]) + int(fields[12])) / tick)
    return seconds


def machine_cpu_ticks() -> tuple[int, int]:
    """(busy, all) clock ticks of every core so far (/proc/stat; idle and iowait are not busy)."""
    values = [int(v) for v in Path("/proc/stat").read_text().splitlines()[0].split()[1:]]
    return sum(values) - values[3] - values[4], sum(values)


def cpu_split(before: dict, after: dict, roles: dict[str, set[int]]) -> dict:
    """CPU seconds spent between two ``process_cpu_seconds`` readings by the processes of each role
    (pids), the rest as "other", with the three busiest other process names."""
    spent = {role: 0.0 for role in roles} | {"other": 0.0}
    others: dict[str, float] = {}
    for pid, (name, seconds) in after.items():
        used = seconds - before.get(pid, (name, 0.0))[1]
        role = next((r for r, pids in roles.items() if pid in pids), "other")
        spent[role] += used
        if role == "other":
            others[name] = others.get(name, 0.0) + used
    spent["other_busiest"] = dict(sorted(others.items(), key=lambda item: -item[1])[:3])
    return spent
