"""What every stage CLI shares: argument parsing, config loading, run folders, timing."""

from __future__ import annotations

import argparse
import logging
import os
import time
from contextlib import contextmanager
from pathlib import Path

import torch

from pipeline.config import Config, load_config, save_config
from pipeline.problems import load_benchmark
from prm.formats import is_hub_id

log = logging.getLogger("stepflow")


def parse_args(stage: str, argv: list[str] | None = None) -> Config:
    """``--config FILE key=value ...`` -> the resolved Config."""
    parser = argparse.ArgumentParser(prog=f"python -m stages.{stage}", description=f"stepflow stage: {stage}")
    parser.add_argument("--config", default="configs/tiny.yaml", help="YAML config (default: configs/tiny.yaml)")
    parser.add_argument("overrides", nargs="*", help="key=value overrides, e.g. mcts.k=8 run=demo")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s", datefmt="%H:%M:%S")
    return load_config(args.config, args.overrides)


def stage_dir(config: Config, stage: str) -> Path:
    """runs/<run>/<stage>/, created, with the resolved config saved in it."""
    path = config.stage_dir(stage)
    path.mkdir(parents=True, exist_ok=True)
    save_config(config, path / "config.yaml")
    return path


def set_threads(config: Config) -> None:
    if config.model.torch_threads > 0:
        torch.set_num_threads(config.model.torch_threads)
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


def require(path: Path, produced_by: str) -> Path:
    """A stage's input, with an error that says which target makes it."""
    if not Path(path).exists():
        raise SystemExit(f"missing input {path}: run `make {produced_by}` first (same CONFIG and RUN)")
    return Path(path)


def require_prm(path: str | Path) -> str:
    """The PRM a stage scores with: a hub id as it is (prm.formats.load_scorer fetches it), a
    local folder only when it exists (else: which target makes it)."""
    path = str(path)
    if not is_hub_id(path):
        require(Path(path), "prm")
    return path


@contextmanager
def timed(stage: str):
    start = time.monotonic()
    log.info("%s: started", stage)
    try:
        yield
    finally:
        log.info("%s: finished in %.1f s", stage, time.monotonic() - start)


def training_problems(config: Config):
    """The problems the training stages draw from (config.data.train*)."""
    return _problems(config.data.train, config.resolve(config.data.train_path), config.data.train_limit, config)


def validation_problems(config: Config):
    """Held-out problems of the training distribution (config.data.validation*)."""
    return _problems(config.data.validation, config.resolve(config.data.validation_path), config.data.validation_limit, config)


def _problems(name: str, path: str | None, limit: int | None, config: Config):
    kwargs = {"path": path, "limit": limit}
    if config.data.problem_sources:
        kwargs["problem_sources"] = config.data.problem_sources
    return load_benchmark(name, **kwargs)
