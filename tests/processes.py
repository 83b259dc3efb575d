"""Running a command the way tests must: in its own process group, bounded in time, and the whole
group killed whatever happens (a timeout, a failed assertion, the test interrupted)."""

from __future__ import annotations

import os
import signal
import subprocess
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def run_bounded(command: list[str], *, timeout: float, env: dict | None = None, cwd: Path = REPO) -> tuple[int, str]:
    """(exit status, stdout and stderr together) of ``command``; subprocess.TimeoutExpired after
    ``timeout`` seconds, its process group killed first."""
    process = subprocess.Popen(
        command,
        cwd=cwd,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    try:
        out, _ = process.communicate(timeout=timeout)
    finally:
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait(timeout=30)
    return process.returncode, out
