"""The models of eval.models: "path" or "path::adapter", each side a hub id or a local path.

    parse_model_spec(config, "gfn", "{run_dir}/policy::{run_dir}/gfn/adapter")
    -> ModelSpec(name="gfn", path="runs/demo/policy", adapter="runs/demo/gfn/adapter",
                 path_is_local=True, adapter_is_local=True)   ({run_dir} = runs/demo)

The evaluation, the plan and the stages' model checks (stages.startup_checks) read model entries through
parse_model_spec, so a value means the same model everywhere.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from pipeline.config.schema import Config
from pipeline.storage.files import path_fingerprint

ADAPTER_SEPARATOR = "::"  # eval.models value "model::adapter" = a peft adapter on top of a model


@dataclass(frozen=True)
class ModelSpec:
    """One entry of eval.models: a hub id or local path, optionally with a peft adapter."""

    name: str
    path: str
    adapter: str | None = None
    path_is_local: bool = True
    adapter_is_local: bool = True


def _is_local_path(raw: str, resolved: str) -> bool:
    """A value names a local path (not a hub id) when it exists, uses {run_dir}, is absolute,
    starts with "." or "~", or has more than one "/" (hub ids are "name" or "org/name")."""
    return (
        Path(resolved).expanduser().exists()
        or "{run_dir}" in raw
        or Path(resolved).is_absolute()
        or resolved.startswith((".", "~"))
        or resolved.count("/") > 1
    )


def parse_model_spec(config: Config, name: str, value: str) -> ModelSpec:
    """ "path" or "path::adapter_path" (either side a hub id or local path; {run_dir} resolved)."""
    raw_path, _, raw_adapter = value.partition(ADAPTER_SEPARATOR)
    raw_path, raw_adapter = raw_path.strip(), raw_adapter.strip()
    if not raw_path:
        raise ValueError(f"eval.models.{name}: {value!r} has no model path; expected 'path' or 'path::adapter'")
    path = config.resolve(raw_path)
    adapter = config.resolve(raw_adapter) if raw_adapter else None
    return ModelSpec(
        name=name,
        path=str(Path(path).expanduser()) if _is_local_path(raw_path, path) else path,
        adapter=adapter,
        path_is_local=_is_local_path(raw_path, path),
        adapter_is_local=adapter is not None and _is_local_path(raw_adapter, adapter),
    )


def missing_model_reason(spec: ModelSpec) -> str | None:
    """Why a model cannot be evaluated (a local model or adapter path that does not exist), or None."""
    if spec.path_is_local and not Path(spec.path).exists():
        return f"model path {spec.path} does not exist"
    if spec.adapter is not None and spec.adapter_is_local and not Path(spec.adapter).expanduser().exists():
        return f"adapter path {spec.adapter} does not exist"
    return None


def model_fingerprint(path: str | None, is_local: bool) -> str | None:
    """Changes when a local model folder's files change (retrained); a hub id is itself."""
    return path_fingerprint(path) if path is not None and is_local else path
