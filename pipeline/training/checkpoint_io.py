"""Crash-safe training checkpoints: safetensors for tensors, JSON for everything else, no pickle.

A checkpoint is a folder ``<root>/step-<step>/``. It is written under a staging name
(``<root>/.staging-step-<step>/``), every file fsynced, then ``manifest.json`` (each file's size
and sha256) is written last and the folder is committed by ONE atomic rename. A reader takes the
newest committed folder whose manifest checks out; a folder that is incomplete, damaged or
unreadable is reported in the log and skipped, so a kill at any moment leaves either the new
checkpoint or the previous one, never a crash loop. Nothing is ever unpickled: arbitrary nested
state (an optimizer's state_dict, RNG states) is split by ``flatten_state`` into a JSON skeleton
and a flat dict of tensors.

A sharded model's weights and optimizer state (FSDP2) go into ``sharded/`` through
torch.distributed.checkpoint: every process writes its own shards in parallel, as safetensors
files whose JSON headers record each shard's offsets (its Hugging Face storage writer; the
default writer's ``.metadata`` is a pickle and is not used), and loading reshards them to any
number of processes, one included. The skeleton of the optimizer state stays JSON beside it.

A DeepSpeed ZeRO run's weights and optimizer moments go into ``full/`` as whole tensors, one per
parameter and moment (``write_full``; gathered one parameter at a time by
``pipeline.training.zero_state``), in safetensors files of about ``FULL_BUCKET_BYTES`` each with
``index.json`` beside them. Whole tensors carry no sharding: such a checkpoint loads under any
number of processes. A sound checkpoint of another model, layout or config is refused with
``CheckpointMismatch`` naming both (it is not skipped as damaged, so it is never overwritten).

What a trainer writes into a checkpoint and how it resumes from one: ``pipeline.training.checkpoint_state``.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file
from torch.distributed.checkpoint import load as dcp_load
from torch.distributed.checkpoint import save as dcp_save
from torch.distributed.checkpoint.hf_storage import HuggingFaceStorageReader, HuggingFaceStorageWriter

from pipeline.storage.files import fsync_path
from pipeline.storage.model_folders import STAGING_PREFIX, FolderError, staging_folder, verify_manifest, write_manifest

log = logging.getLogger("stepflow.checkpoint")

CHECKPOINTS = "checkpoints"  # a run's checkpoint folders: <out_dir>/checkpoints/step-<step>/
PREFIX = "step-"
STAGING = STAGING_PREFIX


class CheckpointError(RuntimeError):
    """A checkpoint that cannot be used (names the folder and what is wrong)."""


class CheckpointMismatch(RuntimeError):
    """A sound checkpoint written by another model, config or layout than this run's: refused
    (never skipped as damaged, which would let a fresh run overwrite it), naming both."""


# ----------------------------------------------------------------------------- nested state


def flatten_state(obj: Any, prefix: str = "", to_cpu: bool = True) -> tuple[Any, dict[str, torch.Tensor]]:
    """(JSON skeleton, {key: tensor}) of nested dicts / lists / tuples of tensors, numpy arrays,
    numbers, strings, bools and None. Dict keys keep their type (int or str); tuples stay tuples.
    ``to_cpu=False``: the tensors as they are (sharded ones stay sharded, for write_sharded)."""
    tensors: dict[str, torch.Tensor] = {}

    def walk(value: Any, path: str) -> Any:
        if isinstance(value, torch.Tensor):
            tensors[path] = value.detach().to("cpu").contiguous() if to_cpu else value.detach()
            return {"__tensor__": path}
        if isinstance(value, np.ndarray):
            tensors[path] = torch.from_numpy(np.ascontiguousarray(value))
            return {"__ndarray__": path}
        if isinstance(value, np.generic):
            return value.item()
        if isinstance(value, dict):
            items = []
            for key, item in value.items():
                if not isinstance(key, (str, int)) or isinstance(key, bool):
                    raise TypeError(
                        f"checkpoint state {path or '<root>'}: key {key!r} is neither a string nor an integer"
                    )
                items.append([key, walk(item, f"{path}.{key}" if path else str(key))])
            return {"__dict__": items}
        if isinstance(value, (list, tuple)):
            items = [walk(item, f"{path}.{i}" if path else str(i)) for i, item in enumerate(value)]
            return {"__tuple__": items} if isinstance(value, tuple) else items
        if value is None or isinstance(value, (bool, int, float, str)):
            return value
        raise TypeError(
            f"checkpoint state {path or '<root>'}: cannot store a {type(value).__name__} without pickling it"
        )

    return walk(obj, prefix), tensors


def unflatten_state(skeleton: Any, tensors: dict[str, torch.Tensor]) -> Any:
    """The inverse of ``flatten_state``."""
    if isinstance(skeleton, dict):
        if "__tensor__" in skeleton:
            return tensors[skeleton["__tensor__"]]
        if "__ndarray__" in skeleton:
            return tensors[skeleton["__ndarray__"]].numpy()
        if "__dict__" in skeleton:
            return {key: unflatten_state(value, tensors) for key, value in skeleton["__dict__"]}
        if "__tuple__" in skeleton:
            return tuple(unflatten_state(value, tensors) for value in skeleton["__tuple__"])
        raise CheckpointError(f"checkpoint state: unknown node {sorted(skeleton)}")
    if isinstance(skeleton, list):
        return [unflatten_state(value, tensors) for value in skeleton]
    return skeleton


def tensor_paths(skeleton: Any) -> set[str]:
    """The tensor keys a ``flatten_state`` skeleton refers to."""
    if isinstance(skeleton, dict):
        if "__tensor__" in skeleton:
            return {skeleton["__tensor__"]}
        if "__ndarray__" in skeleton:
            return {skeleton["__ndarray__"]}
        items = skeleton.get("__dict__") or [[None, v] for v in skeleton.get("__tuple__", [])]
        return set().union(*(tensor_paths(value) for _, value in items)) if items else set()
    if isinstance(skeleton, list):
        return set().union(*(tensor_paths(value) for value in skeleton)) if skeleton else set()
    return set()


# ----------------------------------------------------------------------------- files


def write_json(path: Path, obj: Any) -> None:
    with path.open("w", encoding="utf-8") as handle:
        json.dump(obj, handle, ensure_ascii=False, allow_nan=True)
        handle.flush()
        os.fsync(handle.fileno())


def write_tensors(path: Path, tensors: dict[str, torch.Tensor]) -> None:
    """safetensors file of detached, contiguous CPU tensors (an empty dict writes an empty file)."""
    save_file({k: v.detach().to("cpu").contiguous() for k, v in tensors.items()}, str(path))
    fsync_path(path)


def write_state(directory: Path, name: str, state: Any) -> None:
    """``<name>.json`` (skeleton) and ``<name>.safetensors`` (its tensors) in ``directory``."""
    skeleton, tensors = flatten_state(state)
    write_tensors(directory / f"{name}.safetensors", tensors)
    write_json(directory / f"{name}.json", skeleton)


def read_tensors(path: Path) -> dict[str, torch.Tensor]:
    """A safetensors file of a checkpoint; a missing, truncated or corrupt one raises CheckpointError naming it."""
    try:
        return load_file(str(path))
    except (OSError, ValueError, RuntimeError) as error:  # safetensors' own errors do not name the file
        raise CheckpointError(f"{path.parent}: cannot read {path.name} ({error})") from error


def read_state(directory: Path, name: str) -> Any:
    try:
        skeleton = json.loads((directory / f"{name}.json").read_text(encoding="utf-8"))
    except (OSError, ValueError) as error:  # missing, truncated or corrupt
        raise CheckpointError(f"{directory}: cannot read {name} ({error})") from error
    return unflatten_state(skeleton, read_tensors(directory / f"{name}.safetensors"))


def has_state(directory: Path, name: str) -> bool:
    return (directory / f"{name}.json").is_file()


SHARDED = "sharded"  # a checkpoint's torch.distributed.checkpoint shards


def is_sharded(directory: Path) -> bool:
    return (Path(directory) / SHARDED).is_dir()


def write_sharded(directory: Path, tensors: dict[str, torch.Tensor]) -> None:
    """Every process's shards of ``tensors`` (DTensors, or plain tensors equal on every process,
    written once) into ``directory/sharded/``; every process calls this (a collective)."""
    dcp_save(tensors, storage_writer=HuggingFaceStorageWriter(str(Path(directory) / SHARDED), save_distributed=True))


def read_sharded(directory: Path, targets: dict[str, torch.Tensor]) -> None:
    """Load ``directory/sharded/`` into ``targets`` in place, resharded to their layout (DTensors
    of any number of processes, or whole tensors in one process). Reads safetensors files and
    their JSON headers only. Every process calls this; a missing or unreadable shard raises
    CheckpointError naming the folder."""
    try:
        dcp_load(targets, storage_reader=HuggingFaceStorageReader(str(Path(directory) / SHARDED)))
    except Exception as error:  # DCP wraps every rank's failure in its own exception types
        raise CheckpointError(f"{directory}: cannot read its sharded state ({str(error)[:300]})") from error


FULL = "full"  # a DeepSpeed run's whole tensors, one per parameter and optimizer moment
FULL_INDEX = "index.json"
FULL_BUCKET_BYTES = 1 << 30  # the most the writing process holds on its CPU before writing a file


def is_full(directory: Path) -> bool:
    return (Path(directory) / FULL).is_dir()


def write_full(
    directory: Path,
    items: Iterable[tuple[str, torch.Tensor]],
    meta: dict,
    write: bool,
    bucket_bytes: int = FULL_BUCKET_BYTES,
) -> None:
    """Whole tensors into ``directory/full/``: part-<n>.safetensors files of about ``bucket_bytes``
    each and index.json (``meta`` plus each key's file, shape and dtype). Every process drives
    ``items`` to its end, in step (under ZeRO each item is gathered by a collective); only the
    process with ``write`` keeps them, one bucket at a time on its CPU, and writes."""
    folder = Path(directory) / FULL
    index: dict[str, dict] = {}
    bucket: dict[str, torch.Tensor] = {}
    size = files = 0

    def flush() -> None:
        nonlocal bucket, size, files
        if not bucket:
            return
        files += 1
        name = f"part-{files:05d}.safetensors"
        write_tensors(folder / name, bucket)
        for key, tensor in bucket.items():
            index[key] = {"file": name, "shape": list(tensor.shape), "dtype": str(tensor.dtype).removeprefix("torch.")}
        bucket, size = {}, 0

    if write:
        folder.mkdir(parents=True, exist_ok=True)
    for key, tensor in items:
        if not write:
            continue
        if key in bucket or key in index:
            raise ValueError(f"{folder}: tensor {key!r} given twice")
        bucket[key] = tensor.detach().to("cpu", copy=True).contiguous()
        size += bucket[key].numel() * bucket[key].element_size()
        if size >= bucket_bytes:
            flush()
    if write:
        flush()
        write_json(folder / FULL_INDEX, {**meta, "tensors": index})


def read_full_index(directory: Path, expected: dict[str, tuple[int, ...]], describe: str) -> dict:
    """``full/index.json`` of a checkpoint, checked against the tensors this run expects (key ->
    shape). An unreadable index raises CheckpointError; a missing, unexpected or reshaped tensor
    raises CheckpointMismatch naming the folder, the key, the checkpoint's shape and this run's
    (``describe``: this run, e.g. "DeepSpeed ZeRO-2, 1 process")."""
    directory = Path(directory)
    try:
        index = json.loads((directory / FULL / FULL_INDEX).read_text(encoding="utf-8"))
        tensors = {key: tuple(int(n) for n in entry["shape"]) for key, entry in index["tensors"].items()}
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as error:
        raise CheckpointError(f"{directory}: cannot read {FULL}/{FULL_INDEX} ({error})") from error
    written = f"written by {index.get('processes')} process(es) under {index.get('written_under')}"
    missing, unexpected = sorted(set(expected) - set(tensors)), sorted(set(tensors) - set(expected))
    if missing or unexpected:
        raise CheckpointMismatch(
            f"{directory}: its tensors ({written}) do not match this run's ({describe}): missing {missing[:3]}, "
            f"unexpected {unexpected[:3]}; it was written by another model or config: move it away to train afresh"
        )
    for key, shape in expected.items():
        if tensors[key] != tuple(shape):
            raise CheckpointMismatch(
                f"{directory}: {key} has shape {list(tensors[key])} in the checkpoint ({written}) and "
                f"{list(shape)} in this run ({describe}); it was written by another model or config: "
                "move it away to train afresh"
            )
    return index


def iter_full(directory: Path, index: dict, keys: Iterable[str]) -> Iterator[tuple[str, torch.Tensor]]:
    """(key, tensor) of a ``full/`` checkpoint in the order of ``keys``, one tensor at a time on the
    CPU (safetensors: no code is run); an unreadable file raises CheckpointError naming it."""
    folder = Path(directory) / FULL
    handles: dict[str, Any] = {}
    try:
        for key in keys:
            name = index["tensors"][key]["file"]
            try:
                if name not in handles:
                    handles[name] = safe_open(str(folder / name), framework="pt", device="cpu")
                tensor = handles[name].get_tensor(key)
            except (OSError, ValueError, RuntimeError, KeyError) as error:
                raise CheckpointError(f"{directory}: cannot read {key} from {FULL}/{name} ({error})") from error
            yield key, tensor
    finally:
        handles.clear()


# ----------------------------------------------------------------------------- commit and find


def staging_dir(root: Path, step: int) -> Path:
    """A fresh, empty staging folder for the checkpoint of ``step`` (every rank writes into it)."""
    return staging_folder(Path(root) / f"{PREFIX}{step:08d}")


def commit(staging: Path, step: int, keep: int = 2) -> Path:
    """Write the manifest of every file in ``staging``, rename it to ``step-<step>``, keep the
    newest ``keep`` committed checkpoints. Returns the committed folder."""
    write_manifest(staging, step=step)
    final = staging.parent / f"{PREFIX}{step:08d}"
    if final.exists():
        shutil.rmtree(final)
    os.rename(staging, final)
    fsync_path(staging.parent)
    for old in committed(staging.parent)[:-keep] if keep > 0 else []:
        shutil.rmtree(old, ignore_errors=True)
    return final


def committed(root: Path) -> list[Path]:
    """Committed checkpoint folders (named step-<n>), oldest first."""
    root = Path(root)
    if not root.is_dir():
        return []
    found = [p for p in root.iterdir() if p.is_dir() and p.name.startswith(PREFIX) and p.name[len(PREFIX) :].isdigit()]
    return sorted(found, key=lambda p: int(p.name[len(PREFIX) :]))


def verify(directory: Path) -> dict:
    """The manifest of a committed checkpoint, after checking every file it lists; raises
    CheckpointError naming the folder and the first problem."""
    try:
        return verify_manifest(directory)
    except FolderError as error:
        raise CheckpointError(str(error)) from None


def newest(root: Path, read: Callable[[Path], Any] = lambda directory: None, desc: str = "") -> tuple[Path, Any] | None:
    """(directory, read(directory)) of the newest committed checkpoint that verifies and reads
    (``read`` raising CheckpointError counts as damaged); damaged ones are reported and skipped."""
    for directory in reversed(committed(root)):
        try:
            verify(directory)
            return directory, read(directory)
        except CheckpointError as error:
            log.warning("%scheckpoint skipped: %s", f"{desc}: " if desc else "", error)
    return None


def latest(root: Path) -> Path | None:
    """The newest committed checkpoint that verifies; damaged ones are reported and skipped."""
    found = newest(root)
    return found[0] if found is not None else None


def remove_all(root: Path) -> None:
    """Every checkpoint and staging folder under ``root`` (once the final model is written)."""
    shutil.rmtree(root, ignore_errors=True)


def remove_staging(root: Path) -> None:
    """Staging folders a killed run left behind."""
    root = Path(root)
    if root.is_dir():
        for path in root.iterdir():
            if path.name.startswith(STAGING):
                shutil.rmtree(path, ignore_errors=True)
