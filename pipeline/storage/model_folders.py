"""Model and checkpoint folders committed whole, with a manifest.

A stage that writes a model builds it in ``staging_folder(final)`` and ``commit_folder`` makes it
visible: every file fsynced, then ``manifest.json`` (each file's relative path, bytes and
file_digest, plus what the caller adds: steps, settings), then one rename. ``final`` is at every
moment absent or whole, so a killed retrain leaves the model it was replacing.

``check_model_folder`` runs before a folder is loaded: against its manifest where it has one,
else (a hub download) every safetensors header against the file size and every JSON file parsed;
a damaged file raises FolderError naming it. Training checkpoints (pipeline.training.checkpoint_io)
are such folders too.

A folder holding ``model.safetensors`` and ``config.json`` gets this manifest::

    {"format_version": 1, "steps": 3,
     "files": {"config.json": {"bytes": 8, "sha256": "..."}, "model.safetensors": {"bytes": 16472, "sha256": "..."}}}
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Any

from pipeline.records import RecordError
from pipeline.storage.files import file_digest, fsync_path, read_json, read_json_if_exists, write_json_atomic

FOLDER_MANIFEST = "manifest.json"
FOLDER_MANIFEST_FORMAT = 1
STAGING_PREFIX = ".staging-"


class FolderError(ValueError):
    """A model or checkpoint folder whose files are missing, damaged or unreadable (names the file)."""


def write_manifest(directory: Path, **extra: Any) -> dict:
    """fsync every file under ``directory`` and write ``manifest.json`` (each file's relative path,
    bytes and file_digest, plus ``extra``) last, atomically."""
    directory = Path(directory)
    files = {}
    for path in sorted(p for p in directory.rglob("*") if p.is_file() and p.name != FOLDER_MANIFEST):
        fsync_path(path)
        files[path.relative_to(directory).as_posix()] = {"bytes": path.stat().st_size, "sha256": file_digest(path)}
    manifest = {"format_version": FOLDER_MANIFEST_FORMAT, **extra, "files": files}
    write_json_atomic(directory / FOLDER_MANIFEST, manifest)
    for folder in {p.parent for p in directory.rglob("*")} - {directory}:  # the atomic write synced directory itself
        fsync_path(folder)
    return manifest


def read_manifest(directory: str | Path) -> dict:
    """A folder's manifest.json as written, unverified ({} when it has none or it is not a mapping):
    its recorded fields (steps, training_steps, settings) for a reader that does not load the files."""
    manifest = read_json_if_exists(Path(directory) / FOLDER_MANIFEST)
    return manifest if isinstance(manifest, dict) else {}


def verify_manifest(directory: Path) -> dict:
    """The manifest of a folder after checking every file it lists (size and sha256); raises
    FolderError naming the folder and the first file that does not match."""
    directory = Path(directory)
    try:
        manifest = read_json(directory / FOLDER_MANIFEST, "manifest")
    except RecordError as error:
        raise FolderError(f"{directory}: no readable {FOLDER_MANIFEST} ({str(error).split(': ', 1)[1]})") from None
    if (
        not isinstance(manifest, dict)
        or manifest.get("format_version") != FOLDER_MANIFEST_FORMAT
        or not isinstance(manifest.get("files"), dict)
    ):
        version = manifest.get("format_version") if isinstance(manifest, dict) else None
        raise FolderError(f"{directory}: {FOLDER_MANIFEST} has format {version!r}, expected {FOLDER_MANIFEST_FORMAT}")
    for name, expected in manifest["files"].items():
        file = directory / name
        if not file.is_file():
            raise FolderError(f"{directory}: {name} is missing")
        if file.stat().st_size != expected["bytes"]:
            raise FolderError(
                f"{directory}: {name} has {file.stat().st_size} bytes, the manifest says {expected['bytes']}"
            )
        if file_digest(file) != expected["sha256"]:
            raise FolderError(f"{directory}: {name} does not match its sha256 in the manifest")
    return manifest


def staging_folder(final: Path) -> Path:
    """A fresh, empty staging folder beside ``final`` (what commit_folder renames into place)."""
    final = Path(final)
    staging = final.parent / f"{STAGING_PREFIX}{final.name}"
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir(parents=True)
    return staging


def commit_folder(staging: Path, final: Path, **extra: Any) -> Path:
    """Write the manifest of ``staging`` and rename it to ``final`` (one atomic rename). A folder
    already at ``final`` (a retrained model) is renamed aside first and removed after, so ``final``
    is at every moment either absent or whole."""
    staging, final = Path(staging), Path(final)
    write_manifest(staging, **extra)
    aside = final.parent / f"{STAGING_PREFIX}replaced-{final.name}"
    shutil.rmtree(aside, ignore_errors=True)
    if final.exists():
        os.rename(final, aside)
    os.rename(staging, final)
    fsync_path(final.parent)
    shutil.rmtree(aside, ignore_errors=True)
    return final


def is_committed_folder(path: str | Path) -> bool:
    """Whether ``path`` is a folder committed by commit_folder whose files all match its manifest."""
    try:
        verify_manifest(Path(path))
        return True
    except FolderError:
        return False


def check_safetensors(path: Path) -> None:
    """A safetensors file's header is readable and its tensors fit in the file (a truncated or
    damaged file raises FolderError naming it, instead of safetensors' bare "invalid header length")."""
    size = path.stat().st_size
    with path.open("rb") as handle:
        head = handle.read(8)
        length = int.from_bytes(head, "little") if len(head) == 8 else -1
        if length < 2 or 8 + length > size:
            raise FolderError(
                f"{path}: not a complete safetensors file ({size} bytes; header length {length}): truncated or damaged"
            )
        try:
            header = json.loads(handle.read(length).decode("utf-8"))
        except (UnicodeDecodeError, ValueError, RecursionError):
            raise FolderError(f"{path}: its safetensors header is not valid JSON: damaged") from None
    ends = [
        entry["data_offsets"][1]
        for key, entry in header.items()
        if key != "__metadata__"
        and isinstance(entry, dict)
        and isinstance(entry.get("data_offsets"), list)
        and len(entry["data_offsets"]) == 2
    ]
    if 8 + length + max(ends, default=0) != size:
        raise FolderError(
            f"{path}: its header describes {8 + length + max(ends, default=0)} bytes but the file has {size}: "
            "truncated or damaged"
        )


def check_model_folder(path: str | Path) -> None:
    """Before a model folder is loaded: with a manifest, every file matches it; without one (a
    hub download, an older run), every safetensors file is whole and every JSON file parses.
    Raises FolderError naming the file. A hub id (no such folder) is left to the loader."""
    directory = Path(path)
    if not directory.is_dir():
        return
    if (directory / FOLDER_MANIFEST).exists():
        verify_manifest(directory)
        return
    for file in sorted(directory.rglob("*.safetensors")):
        check_safetensors(file)
    for file in sorted(directory.rglob("*.json")):
        try:
            read_json(file, "model file")
        except RecordError as error:
            raise FolderError(str(error)) from None


SNAPSHOTS = "snapshots"  # <stage>/snapshots/step-<n>/: a fine-tuned policy along training (snapshot_every)


def snapshot_folder(stage_dir: Path, step: int) -> Path:
    """Where the policy of training step ``step`` is kept: <stage_dir>/snapshots/step-<step>/."""
    return Path(stage_dir) / SNAPSHOTS / f"step-{step}"


def snapshot_step(folder: Path) -> int:
    """The training step of a snapshot folder (step-<n>)."""
    return int(Path(folder).name.removeprefix("step-"))


def snapshot_folders(stage_dir: Path) -> list[Path]:
    """<stage_dir>/snapshots/step-<n>/ folders by n (staging folders and other names left out)."""
    root = Path(stage_dir) / SNAPSHOTS
    if not root.is_dir():
        return []
    found = [f for f in root.iterdir() if f.is_dir() and f.name.startswith("step-") and f.name[5:].isdigit()]
    return sorted(found, key=snapshot_step)
