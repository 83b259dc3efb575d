"""Loading a config: YAML files and ``key=value`` overrides read into the typed schema
(pipeline.config.schema), every value checked by the shared annotation codec (pipeline.config.codec), every
range and choice checked, every error naming the file (or "command line") and the key.

    load_config("configs/tiny.yaml", ["mcts.k=8", "gfn.lr=1e-4"]).mcts.k    -> 8
    load_config(None, ["mcts.k=1.5"])    -> ConfigError: command line: mcts.k expects int, got 1.5 (float)
    load_config(None, ["gfn.loss=db"])   -> ConfigError: command line: gfn.loss must be one of subtb, tb,
                                            tb_vargrad, got 'db'

Loading is bounded and checked before anything is written (docs/reliability.md):
- YAML aliases (``*name``) are refused where they are read, before any expansion (a few hundred
  bytes of nested aliases expand to gigabytes); files over 64 KiB, overrides over 16 KiB and
  nesting deeper than the parser's stack are refused too (parsing stays under about a second);
  values quoted in errors are cut to a few dozen characters;
- every numeric field declares its range (``bounded`` in pipeline.config.rules); a value outside it is
  an error naming the key, the value, the range and the file (or "command line") that set it;
- ``run`` is one plain folder name and ``runs_root`` a relative path that stays below the
  working folder, unless it is given as an absolute path (the user's explicit choice).

A file may overlay another (``overlays: tiny.yaml``, relative to its own folder): the file it names
is read first and this one's sections merge into it field by field, so a variant holds its
difference only (configs/tiny-async.yaml) and cannot drift from its base (``config_files``).
"""

from __future__ import annotations

import dataclasses
import functools
import json
import re
import reprlib
import types
import typing
from collections.abc import Callable
from pathlib import Path
from typing import Any

import yaml

from pipeline.config.choices import DEVICE_CHOICES, DEVICE_PATTERN
from pipeline.config.codec import FieldError, value_codec
from pipeline.config.rules import choices_of, declared_range
from pipeline.config.schema import SOURCE_FILTERED_DATA, Config
from pipeline.storage.files import write_text_atomic
from pipeline.storage.shards import parse_shard


class ConfigError(ValueError):
    """A config file or override that does not match the typed schema, or settings a check
    before the work refuses (``config_checks``)."""


def config_checks(check: Callable) -> Callable:
    """Marks a function that checks a config before any work starts: what it refuses (ValueError,
    ImportError: a bad setting, a missing optional package) is the user's to fix, so it is raised
    as ConfigError, which a stage's command line prints as one line (stages.cli.cli)."""

    @functools.wraps(check)
    def checked(*args, **kwargs):
        try:
            return check(*args, **kwargs)
        except ConfigError:
            raise
        except (ValueError, ImportError) as error:
            raise ConfigError(str(error)) from None

    return checked


def check_choice(value: Any, tp: Any, key: str, where: str | None = None) -> Any:
    """``value`` when the Literal ``tp`` allows it; else ConfigError "<where>: <key> must be one of
    <choices>, got <value>". The check of library calls that take such a name without a config file
    (``where`` None); the loader checks every Literal field it sets with the same codec and words."""
    try:
        return value_codec(tp, name=key).convert(value, key)
    except FieldError as error:
        raise _config_error(error, where) from None


MAX_CONFIG_BYTES = (
    64 << 10
)  # a config is a few kilobytes (configs/: 2-3 KB); PyYAML parses ~70 KB/s of nested flow lists
MAX_OVERRIDE_CHARS = 16 << 10
_RUN_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*")
_SHOW = reprlib.Repr()  # (3.11's Repr takes no keyword arguments)
_SHOW.maxlevel, _SHOW.maxtuple, _SHOW.maxlist, _SHOW.maxdict, _SHOW.maxset = 2, 4, 4, 4, 4
_SHOW.maxstring, _SHOW.maxlong, _SHOW.maxother = 60, 40, 60


def _show(value: Any) -> str:
    """A value for an error message, at most a few dozen characters whatever its size (reprlib
    stops early: it never formats the whole of a huge nested value)."""
    return _SHOW.repr(value)


class DuplicateKey(yaml.YAMLError):
    """A mapping that gives a key twice (a section written twice): YAML keeps the last silently."""

    def __init__(self, key: Any, line: int, first_line: int):
        super().__init__(f"line {line}: {_show(key)} is given twice (first on line {first_line}); give each key once")
        self.key, self.line, self.first_line = key, line, first_line


class _ConfigYamlLoader(yaml.SafeLoader):
    """yaml.SafeLoader that refuses aliases when it meets one, before anything is expanded: a
    409-byte file of nested aliases ("billion laughs") would otherwise expand to 10^9 values in
    every consumer that walks them (the type check, repr, save_config). A config never needs one.
    A key given twice in one mapping is refused too (DuplicateKey), where PyYAML keeps the last."""

    def compose_node(self, parent, index):
        if self.check_event(yaml.AliasEvent):
            event = self.peek_event()
            raise yaml.composer.ComposerError(
                None,
                None,
                f"the alias *{event.anchor} is not allowed: configs do not use YAML "
                "anchors and aliases (write the value out)",
                event.start_mark,
            )
        return super().compose_node(parent, index)

    def construct_mapping(self, node, deep=False):
        if isinstance(node, yaml.MappingNode):
            first_lines: dict[Any, int] = {}
            for key_node, _ in node.value:
                key = self.construct_object(key_node, deep=True)
                try:
                    if key in first_lines:
                        raise DuplicateKey(key, key_node.start_mark.line + 1, first_lines[key])
                    first_lines[key] = key_node.start_mark.line + 1
                except TypeError:  # an unhashable key: SafeLoader's own error names it
                    break
        return super().construct_mapping(node, deep)


def _yaml_load(text: str) -> Any:
    """yaml.safe_load without aliases or keys given twice; RecursionError (nesting deeper than the
    parser's stack) becomes a YAMLError."""
    try:
        return yaml.load(text, Loader=_ConfigYamlLoader)  # a SafeLoader subclass
    except RecursionError:
        raise yaml.YAMLError("nested too deeply") from None


def load_yaml_file(path: str | Path) -> Any:
    """A YAML file the project reads (a config, an accelerate config), parsed by the config loader's
    rules (no aliases, no key given twice, at most MAX_CONFIG_BYTES); a ConfigError naming the file,
    and the line where the parser knows it, otherwise."""
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"{path}: file not found")
    size = path.stat().st_size
    if size > MAX_CONFIG_BYTES:
        raise ConfigError(f"{path}: {size} bytes; a config file may hold at most {MAX_CONFIG_BYTES}")
    try:
        return _yaml_load(path.read_text(encoding="utf-8"))
    except UnicodeDecodeError as exc:
        raise ConfigError(f"{path}: not UTF-8 text (byte {exc.start})") from None
    except DuplicateKey as exc:
        raise ConfigError(
            f"{path}:{exc.line}: {_show(exc.key)} is given twice (first on line {exc.first_line}); give each key once"
        ) from None
    except yaml.YAMLError as exc:
        raise ConfigError(f"{path}: not valid YAML: {str(exc)[:500]}") from None


def _type_name(tp: Any) -> str:
    if choices_of(tp) is not None:  # a choice reads as its values' type; describe_fields lists the choices
        return type(typing.get_args(tp)[0]).__name__
    return getattr(tp, "__name__", None) or str(tp).replace("typing.", "")


def _coerce(value: Any, tp: Any, key: str, where: str) -> Any:
    """``value`` checked against the annotation ``tp`` by the shared codec (ints widen to floats;
    YAML 1.1's "1e-4" text reads as a float); ConfigError naming where and key otherwise."""
    try:
        return value_codec(tp, name=key, from_yaml=True).convert(value, key)
    except FieldError as error:
        raise _config_error(error, where) from None


def _config_error(error: FieldError, where: str | None) -> ConfigError:
    """The codec's error in the config's words: "<where>: <key> expects int, got 1.5 (float)", or
    "<where>: <key> must be one of a, b, got 'c'" for a choice field."""
    prefix = f"{where}: " if where else ""
    tp, value = error.annotation, error.value
    optional = typing.get_origin(tp) in (typing.Union, types.UnionType)
    choice = next((arg for arg in (typing.get_args(tp) if optional else (tp,)) if choices_of(arg) is not None), None)
    if choice is not None:
        choices = ", ".join(map(str, choices_of(choice)))
        return ConfigError(f"{prefix}{error.field} must be one of {choices}, got {_show(value)}")
    expected = {list: "a list", dict: "a mapping"}.get(typing.get_origin(tp)) or _type_name(tp)
    return ConfigError(f"{prefix}{error.field} expects {expected}, got {_show(value)} ({type(value).__name__})")


def _apply(obj: Any, updates: dict[str, Any], prefix: str, where: str, sources: dict[str, str]) -> None:
    hints = typing.get_type_hints(type(obj))
    names = {f.name for f in dataclasses.fields(obj)}
    for name, value in updates.items():
        key = f"{prefix}{name}"
        if name not in names:
            raise ConfigError(f"{where}: unknown key {_show(key)} (known: {', '.join(sorted(names))})")
        tp = hints[name]
        current = getattr(obj, name)
        if dataclasses.is_dataclass(current):
            if not isinstance(value, dict):
                raise ConfigError(f"{where}: {key} expects a mapping of its fields, got {_show(value)}")
            _apply(current, value, f"{key}.", where, sources)
        else:
            value = _coerce(value, tp, key, where)
            setattr(obj, name, value)
            sources[key] = where


def _apply_override(config: Config, keys: list[str], value: Any, sources: dict[str, str]) -> None:
    """One ``a.b.c=value`` override. A key inside a mapping field changes that entry only
    (``eval.models.base=X`` keeps the other models; a new name adds one); the field itself
    (``eval.models={base: X}``) is replaced whole, as a YAML file (an overlay too) replaces it."""
    where = "command line"
    obj, prefix = config, ""
    for depth, name in enumerate(keys):
        names = {f.name for f in dataclasses.fields(obj)}
        if name not in names:
            raise ConfigError(f"{where}: unknown key {_show(prefix + name)} (known: {', '.join(sorted(names))})")
        current = getattr(obj, name)
        rest = keys[depth + 1 :]
        if dataclasses.is_dataclass(current) and rest:
            obj, prefix = current, f"{prefix}{name}."
            continue
        if rest and isinstance(current, dict):
            if len(rest) > 1:
                raise ConfigError(
                    f"{where}: {prefix}{name}.{'.'.join(rest)}: {prefix}{name} maps names to values; "
                    f"expected {prefix}{name}.<name>=value"
                )
            _, value_type = typing.get_args(typing.get_type_hints(type(obj))[name])
            key = f"{prefix}{name}.{rest[0]}"
            setattr(obj, name, {**current, rest[0]: _coerce(value, value_type, key, where)})
            sources[key] = where
            return
        if rest:
            raise ConfigError(f"{where}: unknown key {_show('.'.join(keys))} ({prefix}{name} has no fields)")
        _apply(obj, {name: value}, prefix, where, sources)
        return


def parse_override(text: str) -> tuple[list[str], Any]:
    """``a.b=value`` -> (["a", "b"], value parsed as a YAML scalar/list)."""
    if "=" not in text:
        raise ConfigError(f"command line: override {_show(text)} is not of the form key=value")
    if len(text) > MAX_OVERRIDE_CHARS:
        raise ConfigError(
            f"command line: override {_show(text)} has {len(text)} characters; at most {MAX_OVERRIDE_CHARS}"
        )
    key, raw = text.split("=", 1)
    key = key.strip()
    if not key:
        raise ConfigError(f"command line: override {_show(text)} has an empty key")
    try:
        value = _yaml_load(raw) if raw.strip() != "" else ""
    except yaml.composer.ComposerError as exc:  # an alias: refused, not read as a string
        raise ConfigError(f"command line: {key}: {exc.problem}") from None
    except DuplicateKey as exc:
        raise ConfigError(f"command line: {key}: {_show(exc.key)} is given twice; give each key once") from None
    except yaml.YAMLError:
        value = raw
    return key.split("."), value


def check_ranges(config: Config, sources: dict[str, str] | None = None) -> None:
    """Every numeric field within its declared range (``bounded``), and the few rules that span
    fields; raises ConfigError "<file>: <key> = <value> is out of range: expected <range>"."""
    sources = sources or {}

    def fail(key: str, message: str) -> None:
        raise ConfigError(f"{sources.get(key, 'default')}: {key} {message}")

    def walk(obj: Any, prefix: str) -> None:
        for spec in dataclasses.fields(obj):
            value, key = getattr(obj, spec.name), f"{prefix}{spec.name}"
            if dataclasses.is_dataclass(value):
                walk(value, f"{key}.")
                continue
            allowed = declared_range(spec)
            if allowed is None or value is None:
                continue
            for index, item in enumerate(value if isinstance(value, list) else [value]):
                if isinstance(item, (int, float)) and not isinstance(item, bool) and not allowed.contains(item):
                    shown = f"[{index}] = {_show(item)}" if isinstance(value, list) else f"= {_show(item)}"
                    fail(key, f"{shown} is out of range: expected {allowed}")

    walk(config, "")
    if not re.fullmatch(DEVICE_PATTERN, config.model.device):
        fail("model.device", f"must be one of {DEVICE_CHOICES}, got {_show(config.model.device)}")
    if config.tinyworld.min_ops > config.tinyworld.max_ops:
        fail(
            "tinyworld.max_ops", f"= {config.tinyworld.max_ops} is below tinyworld.min_ops = {config.tinyworld.min_ops}"
        )
    # The asynchronous buffer (pipeline.finetune.tba.grouped_replay) always draws whole questions, K distinct completions
    # each: whose trajectories and whether a draw repeats one are not its choice (it reads gfn.buffer_key)
    if config.gfn.mode == "async":
        defaults = type(config.gfn)()
        for name in ("buffer_scope", "buffer_replacement"):
            value, default = getattr(config.gfn, name), getattr(defaults, name)
            if value != default:
                fail(
                    f"gfn.{name}",
                    f"= {_show(value)} is a setting of the synchronous mode: gfn.mode=async draws whole questions, "
                    f'K distinct completions each (docs/async.md, "The buffer"); leave gfn.{name} at {_show(default)}',
                )
    if config.data.problem_sources and config.data.train not in SOURCE_FILTERED_DATA:
        fail(
            "data.problem_sources",
            f"= {_show(config.data.problem_sources)} filters {', '.join(SOURCE_FILTERED_DATA)} problems "
            f"only, but data.train is {_show(config.data.train)}: set data.problem_sources=[]",
        )
    # A temperature that draws Monte Carlo rollouts or samples that get labelled must sample: at 0 the draws are copies
    # of one greedy continuation (every MC value 0 or 1, every labelled sample counted n times). Greedy stays legal
    # where nothing is drawn twice (mcts.temperature declares gt=0: it always draws rollouts).
    boot, prm, bench = config.bootstrap, config.prm, config.prm_bench
    for key, temperature, draws, why in (
        (
            "bootstrap.sample_temperature",
            boot.sample_temperature,
            boot.mc_problems > 0 and boot.mc_rollouts > 0,
            f"draws the Monte Carlo rollouts (bootstrap.mc_rollouts = {boot.mc_rollouts} per prefix)",
        ),
        (
            "prm.exact_check_temperature",
            prm.exact_check_temperature,
            prm.exact_check_problems > 0 and prm.exact_check_samples > 1,
            f"draws the {prm.exact_check_samples} labelled samples per problem (prm.exact_check_samples)",
        ),
        (
            "prm_bench.temperature",
            bench.temperature,
            bench.policy_problems > 0 and bench.policy_samples > 1,
            f"draws the {bench.policy_samples} labelled samples per problem (prm_bench.policy_samples)",
        ),
    ):
        if draws and temperature <= 0:
            fail(key, f"= {_show(temperature)} {why}: at 0 they are copies of one greedy sample; expected > 0")
    if not config.claims.search_ks:
        fail("claims.search_ks", "= [] judges search_rises_with_k at no k: give at least one k >= 2 (default [4, 16])")
    seeds = config.experiment.seeds
    if not seeds or len(set(seeds)) != len(seeds):
        fail(
            "experiment.seeds",
            f"= {_show(seeds)}: make experiment pools one run per seed; give at least one seed, each once "
            "(default [10, 11, 12])",
        )
    marked = [name for name in config.eval.models if "@" in name]
    if marked:
        fail(
            "eval.models",
            f"names {_show(marked[0])}: '@' marks a training snapshot (<model>@<step>, eval.curves); rename the model",
        )
    for key, shard in (
        ("mcts.shard", config.mcts.shard),
        ("eval.shard", config.eval.shard),
        ("search.shard", config.search.shard),
    ):
        try:
            parse_shard(shard)  # what the stage reads it with
        except ValueError:
            fail(key, f"= {_show(shard)}: expected i/n with 0 <= i < n (e.g. 0/4)")


def check_run_location(config: Config, sources: dict[str, str] | None = None) -> None:
    """``run`` is one plain folder name; ``runs_root`` is absolute (the user's explicit choice) or
    a relative path without '..' (it stays below the working folder). Checked at load time, so a
    stage writes nothing (not even config.yaml) outside the runs folder."""
    sources = sources or {}
    if not _RUN_NAME.fullmatch(config.run):
        raise ConfigError(
            f"{sources.get('run', 'default')}: run = {_show(config.run)}: expected one folder name "
            "(letters, digits, '.', '_', '-'; not starting with '.'), so the run stays inside runs_root"
        )
    root = Path(config.runs_root)
    if not config.runs_root.strip() or (not root.is_absolute() and ".." in root.parts):
        raise ConfigError(
            f"{sources.get('runs_root', 'default')}: runs_root = {_show(config.runs_root)}: a relative runs_root "
            "may not leave the working folder ('..'); give an absolute path to put runs elsewhere"
        )


OVERLAYS = "overlays"  # the top-level key naming the file a config overlays ("base" names a model here)


def _key_line(path: Path, key: str) -> int:
    """The line of the top-level ``key`` of a config file that has been read without error."""
    document = yaml.compose(path.read_text(encoding="utf-8"), Loader=_ConfigYamlLoader)
    return next(name.start_mark.line + 1 for name, _ in document.value if name.value == key)


def config_files(path: Path) -> list[tuple[Path, dict]]:
    """The config file ``path`` and the files it overlays, each as (file, its mapping without the
    ``overlays`` key), the first base first, in the order load_config applies them:

        config_files(Path("configs/tiny-async.yaml"))
            -> [(configs/tiny.yaml, {"run": "demo", ...}), (configs/tiny-async.yaml, {"gfn": {"mode": "async", ...}})]

    A base may overlay another. ConfigError "<file>:<line>: ..." for an ``overlays`` that is not a
    path, names no file, or closes a cycle."""
    chain: list[tuple[Path, dict]] = []
    while True:
        data = load_yaml_file(path) or {}
        if not isinstance(data, dict):
            raise ConfigError(f"{path}: expected a mapping at the top level")
        chain.append((path, data))
        if OVERLAYS not in data:
            return chain[::-1]
        base, where = data.pop(OVERLAYS), f"{path}:{_key_line(path, OVERLAYS)}"
        if not isinstance(base, str) or not base.strip():
            raise ConfigError(
                f"{where}: {OVERLAYS} expects the path of the config file this one overlays, "
                f"got {_show(base)} ({type(base).__name__})"
            )
        base_path = path.parent / base
        if not base_path.is_file():
            raise ConfigError(
                f"{where}: {OVERLAYS} = {_show(base)}: file not found: {base_path} (relative to {path.parent})"
            )
        if base_path.resolve() in {file.resolve() for file, _ in chain}:
            cycle = " -> ".join(str(file) for file, _ in chain)
            raise ConfigError(f"{where}: {OVERLAYS} = {_show(base)} closes a cycle: {cycle} -> {base_path}")
        path = base_path


def load_config(path: str | Path | None = None, overrides: list[str] | None = None) -> Config:
    """Defaults, then the YAML file (after the files it overlays: config_files), then ``key=value``
    overrides, all type- and range-checked. Each file merges into what came before it as the
    command line's ``section={key: value}`` does: a section field by field, a field's value (a
    number, text, list or a mapping field such as eval.models) replaced whole. A section's ``seed``
    that none sets is the top-level ``seed``: ``seed=3`` reseeds the whole pipeline."""
    config = Config()
    sources: dict[str, str] = {}
    if path is not None:
        path = Path(path)
        if not path.is_file():
            raise ConfigError(f"{path}: config file not found")
        for file, data in config_files(path):
            _apply(config, data, "", str(file), sources)
    for text in overrides or []:
        keys, value = parse_override(text)
        _apply_override(config, keys, value, sources)
    for section in dataclasses.fields(config):
        value = getattr(config, section.name)
        if dataclasses.is_dataclass(value) and hasattr(value, "seed") and f"{section.name}.seed" not in sources:
            value.seed = config.seed
            if "seed" in sources:
                sources[f"{section.name}.seed"] = sources["seed"]
    check_ranges(config, sources)
    check_run_location(config, sources)
    return config


def save_config(config: Config, path: str | Path) -> None:
    """Write the resolved config beside a stage's outputs (atomically: processes of a sharded
    stage write the same folder)."""
    write_text_atomic(path, config_text(config))


def config_text(config: Config) -> str:
    """The resolved config as YAML: what save_config writes and ``print_config=true`` prints."""
    return yaml.safe_dump(config.to_dict(), sort_keys=False, allow_unicode=True)


def describe_fields(config: Any = None, prefix: str = "") -> list[str]:
    """One line per config field, from the schema's dataclasses: ``section.key: type = default``,
    with the declared range or choices. What a stage's ``--help`` lists."""
    config = Config() if config is None else config
    hints = typing.get_type_hints(type(config))
    lines = []
    for item in dataclasses.fields(config):
        key, value = prefix + item.name, getattr(config, item.name)
        if dataclasses.is_dataclass(value):
            lines.append(f"{key}:")
            lines.extend("  " + line for line in describe_fields(value, key + "."))
            continue
        extra = [str(declared_range(item))] if declared_range(item) is not None else []
        tp = hints[item.name]
        choices = choices_of(typing.get_args(tp)[0] if typing.get_origin(tp) is list else tp)
        extra += [f"one of {', '.join(map(str, choices))}"] if choices is not None else []
        shown = json.dumps(value, ensure_ascii=False)  # JSON is YAML: a default reads as it would be written
        lines.append(f"{key}: {_type_name(hints[item.name])} = {shown}" + (f"  ({'; '.join(extra)})" if extra else ""))
    return lines
