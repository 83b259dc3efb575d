"""A stage's run folder, runs/<run>/<stage>/: created and locked for one writer (``stage_dir``), read
only when its writer has finished (``require_finished``), and the trained model it holds when its
training has finished (``finished_model``)."""

from __future__ import annotations

import logging
import shutil
import time
from pathlib import Path

from pipeline.config.loader import save_config
from pipeline.config.schema import Config
from pipeline.storage.locks import acquire_stage_lock, held_locks, launch_id
from pipeline.storage.model_folders import FolderError, verify_manifest
from pipeline.training.checkpoint_io import CHECKPOINTS

log = logging.getLogger("stepflow")


def stage_dir(config: Config, stage: str, lock: str = ".lock", save: bool = True) -> Path:
    """runs/<run>/<stage>/, created and locked for this process (``lock``: the lock file's name in
    it; a second process on the same run and stage stops at once with pipeline.storage.locks.LockError), with
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
        raise SystemExit(
            f"make {stage} is still running in {config.run_dir} (process {holder.get('pid', '?')} on "
            f"{holder.get('host', '?')}): wait for it to finish before reading its outputs"
        )


def finished_model(out: Path, stage: str, retrain: bool, settings: dict) -> dict | None:
    """The manifest of ``out/model`` when the training stage that writes it has finished (the
    folder was committed whole and checks out), unless ``retrain``: then any checkpoints are
    removed and None is returned (train afresh); the old model stays usable until the new one
    replaces it in one rename (pipeline.storage.model_folders.commit_folder), so a retrain that crashes or is
    killed leaves the model it was meant to replace. Leftover checkpoints of a
    finished run (a kill between the commit and their removal) are removed; a model folder that
    does not check out is moved aside (never deleted) and training starts again. ``settings``: the
    stage's config section now; keys that differ from the ones the model was trained with are
    named in the log."""
    model = out / "model"
    main = launch_id()[0] == 0  # under a launch every process decides alike; only rank 0 removes or moves
    if retrain:
        if main and (out / CHECKPOINTS).exists():
            shutil.rmtree(out / CHECKPOINTS, ignore_errors=True)
        if model.exists():
            log.info(
                "%s: %s.retrain=true: training afresh; %s stays until the new model replaces it", stage, stage, model
            )
        return None
    if not model.exists():
        return None
    try:
        manifest = verify_manifest(model)
    except FolderError as error:  # damaged, or written before models had a manifest: kept aside, not deleted
        if main:
            aside = model.with_name(f"model.set-aside-{time.strftime('%Y%m%d-%H%M%S')}")
            model.rename(aside)
            log.warning(
                "%s: %s is not a finished model (%s); moved to %s, training again (from its checkpoints if any)",
                stage,
                model,
                error,
                aside.name,
            )
        return None
    if main and (out / CHECKPOINTS).exists():
        shutil.rmtree(out / CHECKPOINTS, ignore_errors=True)
    before = manifest.get("settings") or {}
    changed = sorted(k for k in set(before) | set(settings) if k != "retrain" and before.get(k) != settings.get(k))
    log.info(
        "%s: finished: %s holds the trained model (%s steps); %s.retrain=true trains it again%s",
        stage,
        model,
        manifest.get("steps", "?"),
        stage,
        f" (settings changed since: {', '.join(changed)})" if before and changed else "",
    )
    return manifest
