"""Resolving what a config names, loading nothing: each model (a local folder, a hub id, or the
output of a stage of this run) and its shape, each data file or benchmark and its problem count."""

from __future__ import annotations

import inspect
from pathlib import Path

from huggingface_hub.utils import HFValidationError, validate_repo_id

from eval.benchmark_sources import resolve_benchmark
from eval.model_specs import parse_model_spec
from pipeline.config.schema import Config
from pipeline.datasets.copies import NeedsHub, hub_forbidden
from pipeline.datasets.loaders import BENCHMARK_LOADERS, load_benchmark
from pipeline.sizing.shapes import ModelShape, model_shape
from planner.plan import Data, Model, Plan
from prm.formats import is_hub_id


def _made_by(config: Config, raw: str) -> str | None:
    """The stage whose output a ``{run_dir}/<stage>/...`` path names, when it does not exist yet."""
    if "{run_dir}" not in raw or Path(config.resolve(raw)).exists():
        return None
    rest = raw.split("{run_dir}", 1)[1].strip("/").split("/")
    return rest[0] if rest and rest[0] else "?"


def _bootstrap_shape(config: Config) -> ModelShape:
    b = config.bootstrap
    return ModelShape(
        "llama",
        b.hidden_size,
        b.num_layers,
        b.num_heads,
        b.num_heads,
        b.hidden_size // b.num_heads,
        b.intermediate_size,
        b.vocab_size,
        True,
        False,
    )


def resolve_model(config: Config, key: str, raw: str, derived_from: Model | None = None) -> Model:
    """A model path or hub id: local folder, hub id, or the output of a stage (its shape is that of
    ``derived_from``: the policy a fine-tuned model starts from, the PRM's backbone)."""
    value = config.resolve(raw)
    stage = _made_by(config, raw)
    if stage is not None:
        if stage == "bootstrap":
            return Model(key, value, "made by make bootstrap", _bootstrap_shape(config), "the bootstrap section")
        if derived_from is not None:
            return Model(key, value, f"made by make {stage}", derived_from.shape, f"that of {derived_from.key}")
        return Model(key, value, f"made by make {stage}", None, "unknown until it is made")
    spec = parse_model_spec(config, key, raw)
    if spec.path_is_local and not Path(spec.path).exists():
        return Model(key, spec.path, "local", None, "missing")
    shape, source = model_shape(spec.path)
    return Model(key, spec.path, "local" if spec.path_is_local else "hub", shape, source)


def unresolvable_model(config: Config, key: str, raw: str, missing_ok: bool = False) -> str | None:
    """Why the model ``raw`` names (config key ``key``) cannot be loaded, in one line naming the
    key, or None: a local path (eval.model_specs.parse_model_spec's rule) that is not a folder, or a
    hub id that is not of the hub's form owner/name (huggingface_hub's validate_repo_id). A hub id
    of that form passes unlooked-up (nothing is downloaded); a path a stage of this run makes
    ({run_dir}/<stage>/...) is left to the stage that reads it (stages.inputs.require names the
    target that makes it). ``missing_ok``: a local path that does not exist at all passes too (make
    eval skips such a model with a note)."""
    if _made_by(config, raw) is not None:
        return None
    spec = parse_model_spec(config, key, raw)
    path = Path(spec.path).expanduser()
    if spec.path_is_local:
        if path.is_dir() or (missing_ok and not path.exists()):
            return None
    elif is_hub_id(spec.path):
        try:
            validate_repo_id(spec.path)
            return None
        except HFValidationError:
            pass
    return f"{key}: {spec.path} is neither a local folder nor a hub id (owner/name)"


def _check_model(plan: Plan, model: Model) -> None:
    problem = (
        unresolvable_model(plan.config, model.key, model.value) if not model.status.startswith("made by") else None
    )
    if problem is not None:
        plan.error(model.key, problem.split(": ", 1)[1])
    elif model.shape is None and not model.status.startswith("made by"):
        plan.warn(model.key, f"shape unknown ({model.source}): its memory and cost are not estimated")


def resolve_models(plan: Plan) -> dict[str, Model]:
    config = plan.config
    policy = resolve_model(config, "model.policy", config.model.policy)
    backbone = resolve_model(config, "model.prm_backbone", config.model.prm_backbone)
    models = {
        "policy": policy,
        "prm_backbone": backbone,
        "prm": resolve_model(config, "model.prm", config.model.prm, backbone),
    }
    for name, raw in config.eval.models.items():
        derived = policy if _made_by(config, raw) in ("gfn", "ppo") else None
        models[f"eval.{name}"] = resolve_model(config, f"eval.models.{name}", raw.split("::")[0], derived)
    if config.eval.prm:
        models["eval.prm"] = resolve_model(config, "eval.prm", config.eval.prm, backbone)
    for model in models.values():
        _check_model(plan, model)
    plan.models = list(models.values())
    return models


KNOWN_SIZES = {
    "math500": 500,
    "gsm8k": 1319,
    "math": 5000,
    "math_level5": 1324,
    "agieval_sat_math": 220,
    "sat_math_32": 32,
}


def resolve_data(plan: Plan, key: str, loader: str, raw_path: str | None, limit: int | None, **kwargs) -> Data:
    """A benchmark or problems file: loaded when local (checked, counted), else which stage makes
    it or which hub dataset it needs (counted from its published size and the limit)."""
    config = plan.config
    path = config.resolve(raw_path) if raw_path is not None else None
    stage = _made_by(config, raw_path) if raw_path is not None else None
    if stage is not None:
        return Data(key, loader, f"made by make {stage}", limit)
    if path is not None and not Path(path).exists():
        plan.error(key, f"{loader}: file {path} not found")
        return Data(key, loader, f"missing {path}", None)
    try:
        with hub_forbidden():
            problems = load_benchmark(loader, path=path, limit=limit, lenient=config.data.lenient, **kwargs)
    except NeedsHub as hub:
        known = KNOWN_SIZES.get(loader)
        count = min(x for x in (known, limit) if x is not None) if (known or limit) else None
        return Data(key, loader, f"needs the hub ({hub.hub_id})", count)
    except (OSError, ValueError) as error:  # RecordError is a ValueError
        plan.error(key, f"{loader}: {error}")
        return Data(key, loader, "unresolvable", None)
    return Data(key, loader, f"local {path}" if path else "local (the repository's copy)", len(problems))


def resolve_all_data(plan: Plan) -> dict[str, Data]:
    config = plan.config
    data = {}
    for split in ("train", "validation"):
        loader = getattr(config.data, split)
        sources = {}
        if config.data.problem_sources:
            if "problem_sources" in inspect.signature(BENCHMARK_LOADERS.get(loader, load_benchmark)).parameters:
                sources = {"problem_sources": config.data.problem_sources}
            else:
                plan.warn(
                    "data.problem_sources",
                    f"filters OpenMathInstruct-2 problems only: not applied to data.{split} ({loader})",
                )
        data[split] = resolve_data(
            plan,
            f"data.{split}",
            loader,
            getattr(config.data, f"{split}_path"),
            getattr(config.data, f"{split}_limit"),
            **sources,
        )
    for index, name in enumerate(config.eval.benchmarks):
        source = resolve_benchmark(config, name)
        raw = config.eval.benchmark_paths.get(name) or (
            source.path and source.path.replace(str(config.run_dir), "{run_dir}")
        )
        data[f"eval.{name}"] = resolve_data(
            plan, f"eval.benchmarks[{index}] ({name})", source.loader, raw, config.eval.max_problems
        )
    name = config.search.benchmark
    if config.search.benchmark_path is not None:
        loader, raw = ("problems" if name == "tiny_test" else name), config.search.benchmark_path
    else:
        source = resolve_benchmark(config, name)
        loader = source.loader
        raw = config.eval.benchmark_paths.get(name) or (
            source.path and source.path.replace(str(config.run_dir), "{run_dir}")
        )
    data["search"] = resolve_data(plan, "search.benchmark", loader, raw, config.search.max_problems)
    plan.data = list(data.values())
    return data
