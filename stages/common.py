"""What every stage CLI shares: argument parsing, config loading, run folders (locked: one writer
per run folder and stage), checked stage inputs, timing."""

from __future__ import annotations

import argparse
import logging
import os
import shutil
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Callable

import torch

from pipeline.config import Config, load_config, save_config
from pipeline.io import FolderError, acquire_stage_lock, held_locks, launch_id, verify_manifest
from pipeline.problems import load_benchmark
from pipeline.training.base import CHECKPOINTS
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


def stage_dir(config: Config, stage: str, lock: str = ".lock", save: bool = True) -> Path:
    """runs/<run>/<stage>/, created and locked for this process (``lock``: the lock file's name in
    it; a second process on the same run and stage stops at once with pipeline.io.LockError), with
    the resolved config saved in it (``save``). The run's location was checked when the config
    loaded, so nothing is written outside the runs folder."""
    path = config.stage_dir(stage)
    path.mkdir(parents=True, exist_ok=True)
    acquire_stage_lock(path / lock, f"make {stage} in {config.run_dir}")
    if save and launch_id()[0] == 0:
        save_config(config, path / "config.yaml")
    return path


def require_finished(config: Config, stage: str) -> None:
    """Refuse to read a stage's outputs while a process is still writing them (its lock is held)."""
    running = held_locks(config.stage_dir(stage), ".lock*")
    if running:
        holder = running[0]
        raise SystemExit(f"make {stage} is still running in {config.run_dir} (process {holder.get('pid', '?')} on "
                         f"{holder.get('host', '?')}): wait for it to finish before reading its outputs")


def require_records(path: Path, read: Callable[[Path], list], produced_by: str) -> list:
    """A stage's input file of records, read by ``read``: it must exist and hold at least one
    record (an empty file is a damaged or failed earlier stage, never something to train or
    validate on)."""
    path = require(path, produced_by)
    records = read(path)
    if not records:
        raise SystemExit(f"{path}: no records (an empty file). Run `make {produced_by}` again (same CONFIG and RUN); "
                         "if it writes an empty file again, its own log says why")
    return records


def finished_model(out: Path, stage: str, retrain: bool, settings: dict) -> dict | None:
    """The manifest of ``out/model`` when the training stage that writes it has finished (the
    folder was committed whole and checks out), unless ``retrain``: then the old model and any
    checkpoints are removed and None is returned (train afresh). Leftover checkpoints of a
    finished run (a kill between the commit and their removal) are removed; a model folder that
    does not check out is moved aside (never deleted) and training starts again. ``settings``: the
    stage's config section now; keys that differ from the ones the model was trained with are
    named in the log."""
    model = out / "model"
    main = launch_id()[0] == 0  # under a launch every process decides alike; only rank 0 removes or moves
    if retrain:
        if main and (model.exists() or (out / CHECKPOINTS).exists()):
            log.info("%s: %s.retrain=true: removing %s and its checkpoints, training afresh", stage, stage, model)
            shutil.rmtree(model, ignore_errors=True)
            shutil.rmtree(out / CHECKPOINTS, ignore_errors=True)
            (out / "metrics.jsonl").unlink(missing_ok=True)
        return None
    if not model.exists():
        return None
    try:
        manifest = verify_manifest(model)
    except FolderError as error:  # damaged, or written before models had a manifest: kept aside, not deleted
        if main:
            aside = model.with_name(f"model.set-aside-{time.strftime('%Y%m%d-%H%M%S')}")
            model.rename(aside)
            log.warning("%s: %s is not a finished model (%s); moved to %s, training again (from its checkpoints if any)", stage,
                        model, error, aside.name)
        return None
    if main and (out / CHECKPOINTS).exists():
        shutil.rmtree(out / CHECKPOINTS, ignore_errors=True)
    before = manifest.get("settings") or {}
    changed = sorted(k for k in set(before) | set(settings) if k != "retrain" and before.get(k) != settings.get(k))
    log.info("%s: finished: %s holds the trained model (%s steps); %s.retrain=true trains it again%s", stage, model,
             manifest.get("steps", "?"), stage, f" (settings changed since: {', '.join(changed)})" if before and changed else "")
    return manifest


def set_threads(config: Config, stage: str) -> int:
    """Give torch model.torch_threads threads (0: torch's default, one per core) and log the count
    this stage runs with, beside what governs how idle threads wait (docs/demo.md, "Threads").
    The count is part of the result: matrix products split their sums by thread, so another count
    gives other rounding, hence other weights; a config that pins it gives the same weights on any
    machine."""
    if config.model.torch_threads > 0:
        torch.set_num_threads(config.model.torch_threads)
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    threads = torch.get_num_threads()
    log.info("%s: torch threads: %d (model.torch_threads=%d, %d CPUs; OMP_WAIT_POLICY=%s, GOMP_SPINCOUNT=%s)", stage, threads,
             config.model.torch_threads, os.cpu_count() or 0, os.environ.get("OMP_WAIT_POLICY", "unset"),
             os.environ.get("GOMP_SPINCOUNT", "unset"))
    return threads


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
    """Log the stage's start, and its end: "finished" only when it did, "failed" with the error's type otherwise."""
    start = time.monotonic()
    log.info("%s: started", stage)
    try:
        yield
    except BaseException as error:
        log.error("%s: failed after %.1f s (%s)", stage, time.monotonic() - start, type(error).__name__)
        raise
    log.info("%s: finished in %.1f s", stage, time.monotonic() - start)


def training_problems(config: Config):
    """The problems the training stages draw from (config.data.train*)."""
    return _problems(config.data.train, config.resolve(config.data.train_path), config.data.train_limit, config)


def validation_problems(config: Config):
    """Held-out problems of the training distribution (config.data.validation*)."""
    return _problems(config.data.validation, config.resolve(config.data.validation_path), config.data.validation_limit, config)


def _problems(name: str, path: str | None, limit: int | None, config: Config):
    kwargs = {"path": path, "limit": limit, "lenient": config.data.lenient}
    if config.data.problem_sources:
        kwargs["problem_sources"] = config.data.problem_sources
    return load_benchmark(name, **kwargs)
