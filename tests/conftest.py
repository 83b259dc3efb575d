"""Shared fixtures: the real benchmark files and the offline environment."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from pipeline.io import release_stage_locks as release_held_locks

REPO = Path(__file__).resolve().parents[1]

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


def find_benchmarks_dir() -> Path:
    """../shared/data/benchmarks beside the repo, or $STEPFLOW_BENCHMARKS."""
    env = os.environ.get("STEPFLOW_BENCHMARKS")
    path = Path(env) if env else REPO.parent / "shared" / "data" / "benchmarks"
    if not path.is_dir():
        raise FileNotFoundError(f"benchmark files not found at {path}; set STEPFLOW_BENCHMARKS")
    return path


@pytest.fixture(scope="session")
def benchmarks_dir() -> Path:
    return find_benchmarks_dir()


@pytest.fixture(autouse=True)
def release_stage_locks():
    """A stage main called in-process keeps its run folder's lock until the process ends (the demo
    runs every stage in one process); between tests, let them go."""
    yield
    release_held_locks()
