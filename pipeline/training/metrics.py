"""metrics.jsonl: one JSON object per logged optimizer step, written by the main process only.

A fresh run starts the file empty; a resumed run keeps the lines up to the step of the
checkpoint it resumed from, so the file never holds a step twice.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

from pipeline.storage.files import write_text_atomic


def _step(line: str) -> float:
    """A record's step; a line a kill cut short mid-append has none, and is dropped by trim."""
    try:
        return json.loads(line).get("step", 0)
    except ValueError:
        return math.inf


class MetricsLog:
    def __init__(self, path: str | Path, enabled: bool = True):
        self.path = Path(path)
        self.enabled = enabled

    def trim(self, keep_through_step: int) -> None:
        """Keep the records with step <= keep_through_step (none for a fresh run)."""
        if not self.enabled or not self.path.exists():
            return
        if keep_through_step <= 0:
            self.path.unlink()
            return
        kept = [
            line
            for line in self.path.read_text(encoding="utf-8").splitlines()
            if line.strip() and _step(line) <= keep_through_step
        ]
        # replaced in one rename: a kill while trimming must not leave the file empty or cut
        write_text_atomic(self.path, "".join(line + "\n" for line in kept))

    def write(self, record: dict) -> None:
        if not self.enabled:
            return
        self.path.parent.mkdir(parents=True, exist_ok=True)
        with self.path.open("a", encoding="utf-8") as handle:
            handle.write(json.dumps(record) + "\n")

    def read(self) -> list[dict]:
        if not self.path.exists():
            return []
        return [json.loads(line) for line in self.path.read_text(encoding="utf-8").splitlines() if line.strip()]
