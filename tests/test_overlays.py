"""Config files that overlay another (``overlays: FILE``, pipeline.config.loader.config_files): a
variant holds only its delta, and resolves to its base everywhere else."""

import dataclasses
from pathlib import Path
from typing import Any

import pytest

from pipeline.config.loader import OVERLAYS, ConfigError, config_files, load_config, load_yaml_file
from pipeline.config.schema import Config

REPO = Path(__file__).resolve().parents[1]
SHIPPED = sorted(p for p in (REPO / "configs").rglob("*.yaml") if "accelerate" not in p.parts)
SHIPPED_OVERLAYS = [p for p in SHIPPED if OVERLAYS in (load_yaml_file(p) or {})]


def fields_of(obj: Any, prefix: str = "") -> dict[str, Any]:
    """Every field of a resolved config by dotted key; a section is walked, a field's value (a
    mapping field such as eval.models too) is one entry."""
    fields = {}
    for spec in dataclasses.fields(obj):
        value, key = getattr(obj, spec.name), prefix + spec.name
        fields.update(fields_of(value, key + ".") if dataclasses.is_dataclass(value) else {key: value})
    return fields


def keys_set(data: dict, obj: Any = None, prefix: str = "") -> set[str]:
    """The dotted keys a config file's mapping sets, walked along the schema as the loader walks it.
    The top-level seed is every section's seed that the file does not set on its own."""
    obj = Config() if obj is None else obj
    keys = set()
    for name, value in data.items():
        current = getattr(obj, name)
        keys |= keys_set(value, current, f"{prefix}{name}.") if dataclasses.is_dataclass(current) else {prefix + name}
    if not prefix and "seed" in keys:
        keys |= {key for key in fields_of(obj) if key.endswith(".seed")}
    return keys


def test_the_shipped_variants_are_overlays():
    assert {p.relative_to(REPO).as_posix() for p in SHIPPED_OVERLAYS} >= {
        "configs/tiny-async.yaml",
        "configs/paper/llama3.2-3b-async.yaml",
    }


@pytest.mark.parametrize("path", SHIPPED_OVERLAYS, ids=lambda p: p.name)
def test_an_overlay_resolves_to_its_base_outside_the_keys_it_sets(path):
    (base, _), (_, delta) = config_files(path)[-2:]
    merged, reference = fields_of(load_config(path)), fields_of(load_config(base))
    assert set(merged) == set(reference)
    delta_keys = keys_set(delta)
    assert delta_keys, f"{path} sets nothing of its own"
    assert {key: merged[key] for key in merged if key not in delta_keys} == {
        key: reference[key] for key in reference if key not in delta_keys
    }
    assert all(merged[key] == value for key, value in fields_of(load_config(None, [])).items() if key not in merged)


def test_the_async_variants_differ_from_their_bases_in_the_gfn_section_only():
    tiny, tiny_async = load_config(REPO / "configs" / "tiny.yaml"), load_config(REPO / "configs" / "tiny-async.yaml")
    differing = {key for key, value in fields_of(tiny_async).items() if fields_of(tiny)[key] != value}
    assert differing and all(key.startswith("gfn.") for key in differing)
    assert tiny_async.gfn.mode == "async" and tiny.gfn.mode == "sync"
    # what tiny.yaml sets and its overlay does not write again: the overlay reads it
    assert (tiny_async.prm.epochs, tiny_async.mcts.max_problems, tiny_async.ppo.kl_coef) == (
        tiny.prm.epochs,
        tiny.mcts.max_problems,
        tiny.ppo.kl_coef,
    )
    paper = REPO / "configs" / "paper"
    base, variant = (
        fields_of(load_config(paper / "llama3.2-3b.yaml")),
        fields_of(load_config(paper / "llama3.2-3b-async.yaml")),
    )
    assert {key for key in base if base[key] != variant[key]} - {"run"} <= {
        key for key in base if key.startswith("gfn.")
    }


def test_an_overlay_merges_as_the_command_line_merges_a_section(tmp_path):
    (tmp_path / "base.yaml").write_text(
        "run: base\n"
        "gfn:\n  lr: 0.5\n  num_train_steps: 7\n"
        "search:\n  ks: [1, 2, 4]\n"
        "eval:\n  models: {base: /m/base, sft: /m/sft}\n"
    )
    (tmp_path / "variant.yaml").write_text(
        "overlays: base.yaml\ngfn:\n  lr: 0.25\nsearch:\n  ks: [8]\neval:\n  models: {gfn: /m/gfn}\n"
    )
    config = load_config(tmp_path / "variant.yaml")
    # a section merges field by field; a list and a mapping field are replaced whole
    assert (config.run, config.gfn.lr, config.gfn.num_train_steps) == ("base", 0.25, 7)
    assert config.search.ks == [8] and config.eval.models == {"gfn": "/m/gfn"}
    overrides = ["gfn={lr: 0.25}", "search={ks: [8]}", "eval={models: {gfn: /m/gfn}}"]
    assert config.to_dict() == load_config(tmp_path / "base.yaml", overrides).to_dict()


def test_a_chain_of_overlays_applies_each_file_over_the_one_it_names(tmp_path):
    (tmp_path / "sub").mkdir()
    (tmp_path / "root.yaml").write_text("run: root\nseed: 3\nmcts:\n  k: 5\n  alpha: 0.25\n")
    (tmp_path / "sub" / "middle.yaml").write_text("overlays: ../root.yaml\nmcts:\n  k: 6\n")  # relative to sub/
    (tmp_path / "sub" / "leaf.yaml").write_text("overlays: middle.yaml\nrun: leaf\n")
    files = config_files(tmp_path / "sub" / "leaf.yaml")
    assert [file.name for file, _ in files] == ["root.yaml", "middle.yaml", "leaf.yaml"]
    assert all(OVERLAYS not in data for _, data in files)
    config = load_config(tmp_path / "sub" / "leaf.yaml", ["mcts.alpha=0.75"])
    assert (config.run, config.seed, config.mcts.k, config.mcts.alpha, config.gfn.seed) == ("leaf", 3, 6, 0.75, 3)
    # an error names the file that set the value, a base as well, by the path its overlay gives
    (tmp_path / "root.yaml").write_text("mcts:\n  beta: 2.0\n")
    with pytest.raises(
        ConfigError, match=rf"^{tmp_path / 'sub' / '..' / 'root.yaml'}: mcts.beta = 2.0 is out of range"
    ):
        load_config(tmp_path / "sub" / "leaf.yaml")


def test_a_cycle_of_overlays_is_an_error_naming_the_file_and_line(tmp_path):
    (tmp_path / "a.yaml").write_text("overlays: b.yaml\n")
    (tmp_path / "b.yaml").write_text("seed: 1\noverlays: a.yaml\n")
    with pytest.raises(ConfigError) as info:
        load_config(tmp_path / "a.yaml")
    a, b = tmp_path / "a.yaml", tmp_path / "b.yaml"
    assert str(info.value) == f"{b}:2: overlays = 'a.yaml' closes a cycle: {a} -> {b} -> {a}"
    (tmp_path / "self.yaml").write_text("run: x\noverlays: ./self.yaml\n")
    with pytest.raises(ConfigError, match=rf"^{tmp_path / 'self.yaml'}:2: overlays = './self.yaml' closes a cycle"):
        load_config(tmp_path / "self.yaml")


def test_a_missing_base_is_an_error_naming_the_file_and_line(tmp_path):
    (tmp_path / "variant.yaml").write_text("# a variant\n\noverlays: tiny.yaml\n")
    with pytest.raises(ConfigError) as info:
        load_config(tmp_path / "variant.yaml")
    assert str(info.value) == (
        f"{tmp_path / 'variant.yaml'}:3: overlays = 'tiny.yaml': file not found: {tmp_path / 'tiny.yaml'} "
        f"(relative to {tmp_path})"
    )


@pytest.mark.parametrize("value", ["3", "[tiny.yaml]", "{file: tiny.yaml}", "null", "''"])
def test_an_overlays_that_is_not_a_path_is_an_error_naming_the_file_and_line(tmp_path, value):
    (tmp_path / "variant.yaml").write_text(f"run: x\noverlays: {value}\n")
    with pytest.raises(ConfigError, match=rf"^{tmp_path / 'variant.yaml'}:2: overlays expects the path of the config"):
        load_config(tmp_path / "variant.yaml")


def test_overlays_is_a_files_top_level_key_only(tmp_path):
    (tmp_path / "nested.yaml").write_text("gfn:\n  overlays: tiny.yaml\n")
    with pytest.raises(ConfigError, match=r"nested.yaml: unknown key .*gfn\.overlays"):
        load_config(tmp_path / "nested.yaml")
    with pytest.raises(ConfigError, match="command line: unknown key 'overlays'"):
        load_config(None, ["overlays=configs/tiny.yaml"])


def test_the_config_a_stage_records_is_the_merged_one_and_loads_alone(tmp_path):
    from stages.run_folders import stage_dir

    path = REPO / "configs" / "tiny-async.yaml"
    config = load_config(path, [f"runs_root={tmp_path}"])
    recorded = stage_dir(config, "gfn") / "config.yaml"
    assert OVERLAYS not in load_yaml_file(recorded)
    assert load_config(recorded).to_dict() == config.to_dict()
    assert config.gfn.mode == "async" and config.prm.epochs == load_config(REPO / "configs" / "tiny.yaml").prm.epochs
