import functools
import re
import typing
from pathlib import Path

import pytest

from pipeline.config.loader import ConfigError, load_config, save_config
from pipeline.config.schema import Config

REPO = Path(__file__).resolve().parents[1]


def test_defaults_and_overrides():
    config = load_config(None, ["mcts.k=8", "run=x", "gfn.lam=0.5"])
    assert config.mcts.k == 8 and config.run == "x" and config.gfn.lam == 0.5
    assert config.resolve("{run_dir}/bootstrap/model") == str(Path("runs/x/bootstrap/model"))


def test_int_widens_to_float_but_not_the_reverse():
    assert load_config(None, ["gfn.lr=1"]).gfn.lr == 1.0
    with pytest.raises(ConfigError, match="mcts.k expects int"):
        load_config(None, ["mcts.k=1.5"])


def test_exponent_floats_without_a_dot_are_floats(tmp_path):
    # YAML 1.1 (PyYAML) reads 1e-4 as a string
    assert load_config(None, ["gfn.lr=1e-4"]).gfn.lr == 1e-4
    path = tmp_path / "c.yaml"
    path.write_text("prm:\n  lr: 8e-6\n")
    assert load_config(path).prm.lr == 8e-6
    with pytest.raises(ConfigError, match="gfn.lr expects float"):
        load_config(None, ["gfn.lr=fast"])
    assert load_config(None, ["run=1e3"]).run == "1e3", "a str field keeps the text"


def test_unknown_key_names_key_and_file(tmp_path):
    path = tmp_path / "bad.yaml"
    path.write_text("mcts:\n  kk: 3\n")
    with pytest.raises(ConfigError) as info:
        load_config(path)
    assert "mcts.kk" in str(info.value) and str(path) in str(info.value)


def test_wrong_type_names_key_and_file(tmp_path):
    path = tmp_path / "bad.yaml"
    path.write_text("prm:\n  lora: maybe\n")
    with pytest.raises(ConfigError) as info:
        load_config(path)
    assert "prm.lora" in str(info.value) and str(path) in str(info.value)


def test_section_must_be_mapping(tmp_path):
    path = tmp_path / "bad.yaml"
    path.write_text("mcts: 3\n")
    with pytest.raises(ConfigError, match="mcts expects a mapping"):
        load_config(path)


def test_lists_and_optionals_are_checked():
    config = load_config(None, ["search.ks=[1, 2]", "mcts.max_problems=null"])
    assert config.search.ks == [1, 2] and config.mcts.max_problems is None
    with pytest.raises(ConfigError, match=r"search.ks\[1\]"):
        load_config(None, ["search.ks=[1, x]"])


def test_an_override_of_one_mapping_entry_changes_that_entry_only(tmp_path):
    paper = REPO / "configs" / "paper" / "llama3.2-3b.yaml"
    default = load_config(paper).eval
    config = load_config(
        paper, ["eval.models.base=/models/llama", "eval.models.sft=/models/sft", "eval.benchmark_paths.gsm8k=g.jsonl"]
    )
    assert config.eval.models == {**default.models, "base": "/models/llama", "sft": "/models/sft"}
    assert config.eval.benchmark_paths == {**default.benchmark_paths, "gsm8k": "g.jsonl"}
    assert load_config(paper, ["eval.models={base: /models/llama}"]).eval.models == {
        "base": "/models/llama"
    }  # the field: whole
    path = tmp_path / "c.yaml"
    path.write_text("eval:\n  models:\n    gfn: /models/gfn\n")
    assert load_config(path).eval.models == {"gfn": "/models/gfn"}  # a YAML mapping replaces the default whole
    with pytest.raises(ConfigError, match=r"eval.models.base.path: eval.models maps names to values"):
        load_config(paper, ["eval.models.base.path=x"])
    with pytest.raises(ConfigError, match=r"eval.models.base expects str"):
        load_config(paper, ["eval.models.base=[a, b]"])
    with pytest.raises(ConfigError, match=r"unknown key 'eval.modles'"):
        load_config(paper, ["eval.modles.base=x"])
    with pytest.raises(ConfigError, match=r"unknown key 'mcts.k.x'"):
        load_config(paper, ["mcts.k.x=1"])
    path.write_text("mcts:\n  kk: 3\n")  # in a file: the key quoted once, as on the command line
    with pytest.raises(ConfigError, match=rf"^{re.escape(str(path))}: unknown key 'mcts.kk' \(known: "):
        load_config(path)


def test_a_problem_filter_that_data_train_cannot_apply_is_refused_at_load():
    paper = REPO / "configs" / "paper" / "llama3.2-3b.yaml"
    assert load_config(paper).data.problem_sources == ["augmented_math"]
    with pytest.raises(
        ConfigError,
        match=r"data.problem_sources = \['augmented_math'\] filters openmathinstruct2 problems only, "
        r"but data.train is 'math'",
    ):
        load_config(paper, ["data.train=math", "data.train_path=math_test.jsonl"])
    assert load_config(paper, ["data.train=math", "data.problem_sources=[]"]).data.train == "math"


def test_the_loaders_that_take_a_problem_filter_are_the_ones_the_config_allows_it_for():
    import inspect

    from pipeline.config.schema import SOURCE_FILTERED_DATA
    from pipeline.datasets.loaders import BENCHMARK_LOADERS

    takes = {
        name for name, loader in BENCHMARK_LOADERS.items() if "problem_sources" in inspect.signature(loader).parameters
    }
    assert takes == set(SOURCE_FILTERED_DATA)


def test_override_without_equals_is_an_error():
    with pytest.raises(ConfigError, match="key=value"):
        load_config(None, ["mcts.k"])


# configs/accelerate/*.yaml are accelerate's launch configs, not ours.
@pytest.mark.parametrize(
    "path", sorted(p for p in (REPO / "configs").rglob("*.yaml") if "accelerate" not in p.parts), ids=lambda p: p.name
)
def test_shipped_configs_load(path):
    assert isinstance(load_config(path), Config)


def test_paper_settings():
    config = load_config(REPO / "configs" / "paper" / "llama3.2-3b.yaml")
    assert (config.mcts.k, config.mcts.temperature) == (96, 0.6)
    assert config.augment.similarity_threshold == 0.85
    assert (config.prm.lr, config.prm.batch_size, config.prm.weight_decay, config.prm.epochs) == (8e-6, 144, 0.01, 1.0)
    gfn = config.gfn
    assert (gfn.lr, gfn.scheduler, gfn.grad_clip, gfn.lam, gfn.buffer_size, gfn.temperature) == (
        5e-6,
        "cosine",
        1.0,
        1.0,
        1000,
        0.6,
    )
    assert gfn.questions_per_step * gfn.samples_per_question == 144
    ppo = config.ppo
    assert (ppo.lr, ppo.clip, ppo.value_coef, ppo.entropy_coef) == (5e-6, 0.2, 0.5, 0.01)
    assert ppo.questions_per_step * ppo.samples_per_question == 144
    assert config.model.prm_backbone == "Qwen/Qwen2.5-Math-7B"
    assert config.model.policy == "meta-llama/Llama-3.2-3B-Instruct"
    assert (
        load_config(REPO / "configs" / "paper" / "llama3.1-8b.yaml").model.policy == "meta-llama/Llama-3.1-8B-Instruct"
    )


def test_saved_config_round_trips(tmp_path):
    config = load_config(None, ["mcts.k=5", 'format.separator="\\n"'])
    save_config(config, tmp_path / "config.yaml")
    again = load_config(tmp_path / "config.yaml")
    assert again.to_dict() == config.to_dict()


def test_the_top_level_seed_seeds_every_section_unless_one_sets_its_own(tmp_path):
    config = load_config(None, ["seed=3", "gfn.seed=11"])
    seeded = {
        name: getattr(config, name).seed
        for name in ("tinyworld", "bootstrap", "augment", "prm", "gfn", "ppo", "eval", "search")
    }
    assert seeded == {
        "tinyworld": 3,
        "bootstrap": 3,
        "augment": 3,
        "prm": 3,
        "gfn": 11,
        "ppo": 3,
        "eval": 3,
        "search": 3,
    }
    path = tmp_path / "c.yaml"
    path.write_text("seed: 2\nprm:\n  seed: 0\n")
    config = load_config(path)
    assert (config.prm.seed, config.bootstrap.seed) == (0, 2)  # a section's own seed, even 0, is kept
    assert load_config(None).bootstrap.seed == 0


# ----------------------------------------------------------------------------- hostile configs


def alias_bomb(levels: int = 8, width: int = 9) -> str:
    """A 'billion laughs' YAML value: level i lists level i-1 `width` times, each level defined
    inside the first item of the next (so the first item is already huge): 9^9 strings in
    360 bytes. Before the fix, as a section it hung config loading past 35 s, as one value it
    returned a 312 MB error message after 4 s (measured; docs/reliability.md)."""
    if levels == 0:
        return "&a0 [" + ",".join(["lol"] * width) + "]"
    return f"&a{levels} [" + alias_bomb(levels - 1, width) + f",*a{levels - 1}" * (width - 1) + "]"


@pytest.mark.parametrize("where", ["file", "section", "value", "override"])
def test_a_yaml_alias_bomb_is_refused_at_its_first_alias_with_a_short_message(tmp_path, where):
    bomb = alias_bomb()
    text = {
        "file": f"{bomb}\n",
        "section": f"search: {bomb}\n",
        "value": f"search:\n  ks: {bomb}\n",
        "override": "run: x\n",
    }[where]
    assert len(text.encode()) < 400
    path = tmp_path / "bomb.yaml"
    path.write_text(text)
    with pytest.raises(ConfigError) as info:
        load_config(path, [f"search.ks={bomb}"] if where == "override" else [])
    # *a0 is the first alias of the text: refused where it is read, before anything is expanded
    assert "alias *a0 is not allowed" in str(info.value) and len(str(info.value)) < 800
    assert (str(path) if where != "override" else "command line") in str(info.value)


def test_error_messages_cut_huge_values(tmp_path):
    path = tmp_path / "big.yaml"
    path.write_text(
        "mcts:\n  k: [" + ", ".join(["[1, 2, 3, 4, 5, 6, 7, 8, 9, 10]"] * 100_000) + "]\n"
    )  # 3.4 MB of nested lists
    with pytest.raises(ConfigError, match=r"big\.yaml: 3\d{6} bytes; a config file may hold at most 65536"):
        load_config(path)  # over the size limit: refused before parsing
    with pytest.raises(ConfigError, match="characters; at most 16384"):
        load_config(None, ["mcts.k=" + "[" + ", ".join(["[1, 2, 3]"] * 5000) + "]"])
    with pytest.raises(ConfigError) as info:
        load_config(None, ["mcts.k=" + "[" + ", ".join(["[1, 2, 3]"] * 1000) + "]"])
    assert "mcts.k expects int" in str(info.value) and len(str(info.value)) < 300
    with pytest.raises(ConfigError) as info:
        load_config(None, ["mcts.shard=" + "x" * 10_000])
    assert len(str(info.value)) < 400


def test_deep_nesting_is_an_error_naming_the_file(tmp_path):
    path = tmp_path / "deep.yaml"
    path.write_text("mcts: " + "[" * 20_000 + "]" * 20_000 + "\n")
    with pytest.raises(ConfigError, match="deep.yaml"):
        load_config(path)


@pytest.mark.parametrize(
    "override,key,expected",
    [
        ("mcts.max_problems=-5", "mcts.max_problems", ">= 1"),
        ("prm.epochs=0", "prm.epochs", "> 0"),
        ("prm.epochs=-1", "prm.epochs", "> 0"),
        ("prm.batch_size=0", "prm.batch_size", ">= 1"),
        ("augment.val_fraction=1.5", "augment.val_fraction", "> 0 and < 1"),
        ("mcts.k=0", "mcts.k", ">= 1"),
        ("prm.micro_batch_size=0", "prm.micro_batch_size", ">= 1"),
        ("gfn.num_train_steps=-3", "gfn.num_train_steps", ">= 1"),
        ("generation.top_p=.nan", "generation.top_p", "> 0 and <= 1"),
        ("gfn.lr=.inf", "gfn.lr", "> 0"),
        ("search.ks=[1, 0]", "search.ks", ">= 1"),
        ("seed=-1", "seed", ">= 0 and <= 4294967295"),
        ("eval.target_samples=-1", "eval.target_samples", ">= 0 and <= 4096"),
        ("eval.target_problems=0", "eval.target_problems", ">= 1"),
        ("eval.entropy_samples=0", "eval.entropy_samples", ">= 1 and <= 1024"),
        ("eval.pass_at_k_max=5000", "eval.pass_at_k_max", ">= 1 and <= 4096"),
    ],
)
def test_values_out_of_range_name_key_value_range_and_source(tmp_path, override, key, expected):
    with pytest.raises(ConfigError) as info:
        load_config(None, [override])
    message = str(info.value)
    assert message.startswith("command line: ") and key in message and f"expected {expected}" in message, message
    path = tmp_path / "c.yaml"
    section, name = (key.split(".") + [None])[:2]
    value = override.split("=", 1)[1]
    path.write_text(f"{section}:\n  {name}: {value}\n" if name else f"{section}: {value}\n")
    with pytest.raises(ConfigError, match=f"^{path}: {key}"):
        load_config(path)


def test_every_numeric_field_declares_a_range_and_every_default_is_in_it():
    import dataclasses
    import typing

    from pipeline.config.loader import check_ranges

    def walk(obj, prefix):
        for spec in dataclasses.fields(obj):
            value = getattr(obj, spec.name)
            if dataclasses.is_dataclass(value):
                yield from walk(value, f"{prefix}{spec.name}.")
                continue
            hint = typing.get_type_hints(type(obj))[spec.name]
            names = str(hint)
            choice = typing.get_origin(hint) is typing.Literal  # names like "float32" are no numbers
            if any(t in names for t in ("int", "float")) and "str" not in names and not choice:
                yield f"{prefix}{spec.name}", spec.metadata.get("range")

    fields = dict(walk(Config(), ""))
    assert len(fields) > 90
    assert [key for key, declared in fields.items() if declared is None] == []
    check_ranges(Config())  # the defaults are valid
    for path in sorted(p for p in (REPO / "configs").rglob("*.yaml") if "accelerate" not in p.parts):
        load_config(path)  # and so are the shipped configs (load_config checks ranges)


def test_min_ops_above_max_ops_and_bad_shards_are_errors():
    with pytest.raises(ConfigError, match="tinyworld.max_ops"):
        load_config(None, ["tinyworld.min_ops=5", "tinyworld.max_ops=3"])
    for shard in ("3/2", "a/b", "1"):
        with pytest.raises(ConfigError, match="mcts.shard"):
            load_config(None, [f"mcts.shard={shard}"])


@pytest.mark.parametrize(
    "overrides,key,expected",
    [
        (["mcts.temperature=0"], "mcts.temperature", "expected > 0 and <= 2"),
        (["bootstrap.sample_temperature=0"], "bootstrap.sample_temperature", "draws the Monte Carlo rollouts"),
        (["prm.exact_check_temperature=0"], "prm.exact_check_temperature", "draws the 4 labelled samples"),
        (["prm_bench.temperature=0"], "prm_bench.temperature", "draws the 4 labelled samples"),
        (["rollout_temperature.temperatures=[0.6, 0]"], "rollout_temperature.temperatures", "expected > 0"),
    ],
)
def test_a_temperature_that_draws_rollouts_or_labelled_samples_must_be_positive(tmp_path, overrides, key, expected):
    with pytest.raises(ConfigError) as info:
        load_config(None, overrides)
    message = str(info.value)
    assert message.startswith(f"command line: {key} ") and expected in message, message
    section, name = key.split(".")
    path = tmp_path / "c.yaml"
    path.write_text(f"{section}:\n  {name}: {overrides[0].split('=', 1)[1]}\n")
    with pytest.raises(ConfigError, match=f"^{re.escape(str(path))}: {key} "):
        load_config(path)


def test_greedy_stays_legal_where_nothing_is_drawn_twice():
    greedy = ["eval.temperature=0", "search.temperature=0"]
    assert load_config(None, greedy).eval.temperature == 0
    # no Monte Carlo rollouts, one sample per problem: the temperature draws nothing twice
    assert load_config(None, ["bootstrap.sample_temperature=0", "bootstrap.mc_rollouts=0"])
    assert load_config(None, ["bootstrap.sample_temperature=0", "bootstrap.mc_problems=0"])
    assert load_config(None, ["prm.exact_check_temperature=0", "prm.exact_check_samples=1"])
    assert load_config(None, ["prm.exact_check_temperature=0", "prm.exact_check_problems=0"])
    assert load_config(None, ["prm_bench.temperature=0", "prm_bench.policy_samples=1"])


@pytest.mark.parametrize(
    "override",
    [
        "run=/abs/path",
        "run=../../x",
        "run=a/b",
        "run=..",
        "run=.hidden",
        "run=",
        "runs_root=../elsewhere",
        "runs_root=runs/../../x",
        "runs_root=",
    ],
)
def test_run_and_runs_root_cannot_escape_the_runs_folder(override):
    with pytest.raises(ConfigError, match=override.split("=")[0]):
        load_config(None, [override])


def test_an_absolute_runs_root_is_the_users_explicit_choice(tmp_path):
    config = load_config(None, [f"runs_root={tmp_path}", "run=r"])
    assert config.run_dir == tmp_path / "r"


def test_a_stage_writes_nothing_when_the_run_escapes(tmp_path, monkeypatch):
    from stages.cli import parse_args

    monkeypatch.chdir(tmp_path)
    (tmp_path / "work").mkdir()
    monkeypatch.chdir(tmp_path / "work")
    with pytest.raises(ConfigError):
        parse_args("augment", ["--config", str(REPO / "configs" / "tiny.yaml"), "run=../../x"])
    assert sorted(p.name for p in tmp_path.rglob("*")) == ["work"]


def test_a_stage_runs_with_the_configured_thread_count_and_logs_it(caplog):
    """The thread count changes the weights, so tiny.yaml pins it (docs/demo.md, "Threads"); every
    stage applies it and says which count it runs with (the autouse fixture restores torch's)."""
    import torch

    from stages.cli import set_threads

    pinned = load_config(REPO / "configs" / "tiny.yaml").model.torch_threads
    assert pinned == 1
    with caplog.at_level("INFO", logger="stepflow"):
        assert set_threads(load_config(None, ["model.torch_threads=3"]), "mcts") == 3
    assert torch.get_num_threads() == 3
    assert "mcts: torch threads: 3 (model.torch_threads=3," in caplog.text


def choice_fields(obj=None, prefix=""):
    """(key, choices, is_list) of every Literal field of the config, found from the annotations."""
    import dataclasses
    import typing

    from pipeline.config.rules import choices_of

    obj = Config() if obj is None else obj
    hints = typing.get_type_hints(type(obj))
    for spec in dataclasses.fields(obj):
        value, key, tp = getattr(obj, spec.name), f"{prefix}{spec.name}", hints[spec.name]
        if dataclasses.is_dataclass(value):
            yield from choice_fields(value, f"{key}.")
            continue
        is_list = typing.get_origin(tp) is list
        choices = choices_of(typing.get_args(tp)[0] if is_list else tp)
        if choices is not None:
            yield key, choices, is_list


def test_every_choice_field_refuses_a_value_outside_its_literal_naming_key_value_choices_and_source(tmp_path):
    fields = list(choice_fields())
    keys = {key for key, _, _ in fields}
    assert {
        "report_to",
        "model.prm_format",
        "gfn.mode",
        "ppo.mode",
        "gfn.loss",
        "gfn.weight_transport",
        "gfn.async_priority",
        "search.strategies",
        "search.aggregation",
        "model.dtype",
        "generation.backend",
        "prm.scheduler",
        "gfn.scheduler",
        "ppo.scheduler",
        "gfn.buffer_priority",
        "gfn.buffer_scope",
        "gfn.buffer_key",
        "plan.gpu",
    } <= keys
    for key, choices, is_list in fields:
        good = [choices[-1]] if is_list else choices[-1]
        assert functools.reduce(getattr, key.split("."), load_config(None, [f"{key}={good}"])) == good
        bad = "[not_a_choice]" if is_list else "not_a_choice"
        shown_key = f"{key}[0]" if is_list else key
        expected = f"{shown_key} must be one of {', '.join(choices)}, got 'not_a_choice'"
        with pytest.raises(ConfigError) as info:
            load_config(None, [f"{key}={bad}"])
        assert str(info.value) == f"command line: {expected}"
        path = tmp_path / "choice.yaml"
        section, _, name = key.rpartition(".")
        path.write_text(f"{section}:\n  {name}: {bad}\n" if section else f"{name}: {bad}\n")
        with pytest.raises(ConfigError) as info:
            load_config(path)
        assert str(info.value) == f"{path}: {expected}"


def test_help_lists_the_choices_of_a_choice_field():
    from pipeline.config.loader import describe_fields

    lines = [line.strip() for line in describe_fields()]  # a section's fields are indented under it
    assert 'gfn.loss: str = "subtb"  (one of subtb, tb, tb_vargrad)' in lines
    assert any(
        line.startswith("search.strategies: list = ")
        and line.endswith("(one of step_best_of_k, beam, best_of_n, weighted_vote, majority)")
        for line in lines
    )


def test_the_libraries_take_their_names_from_the_choice_fields():
    from pipeline.config.schema import BufferPriority, GenerationBackend, GPUType, ModelDtype, Schedule
    from pipeline.generation import BACKENDS
    from pipeline.modeling import DTYPES
    from pipeline.training.schedule import SCHEDULES
    from planner.plan import GPUS

    assert tuple(GPUS) == typing.get_args(GPUType)
    assert BACKENDS == typing.get_args(GenerationBackend)
    assert SCHEDULES == typing.get_args(Schedule)
    assert ("auto", *DTYPES) == typing.get_args(ModelDtype)
    assert typing.get_args(BufferPriority) == ("softmax", "proportional")  # pipeline.finetune.replay_buffer's


@pytest.mark.parametrize("device", ["auto", "cpu", "cuda", "cuda:0", "cuda:12"])
def test_model_device_takes_auto_cpu_cuda_or_cuda_n(device):
    assert load_config(None, [f"model.device={device}"]).model.device == device


@pytest.mark.parametrize("device", ["tpu", "cuda:-1", "cuda:x", "gpu", "CPU", "cuda:0,1"])
def test_another_model_device_is_refused_at_load_naming_the_file_and_the_choices(tmp_path, device):
    with pytest.raises(ConfigError) as info:
        load_config(None, [f"model.device={device}"])
    assert str(info.value) == f"command line: model.device must be one of auto, cpu, cuda, cuda:<N>, got {device!r}"
    path = tmp_path / "device.yaml"
    path.write_text(f"model:\n  device: '{device}'\n")
    with pytest.raises(ConfigError, match=f"^{path}: model.device must be one of"):
        load_config(path)


def test_a_section_or_key_given_twice_is_an_error_naming_the_file_and_both_lines(tmp_path):
    path = tmp_path / "twice.yaml"
    path.write_text("run: a\ngfn:\n  lr: 1.0e-4\nmcts:\n  k: 4\ngfn:\n  loss: tb\n")
    with pytest.raises(ConfigError) as info:
        load_config(path)
    assert str(info.value) == f"{path}:6: 'gfn' is given twice (first on line 2); give each key once"
    path.write_text("mcts:\n  k: 4\n  temperature: 0.5\n  k: 8\n")
    with pytest.raises(ConfigError, match=rf"^{path}:4: 'k' is given twice \(first on line 2\)"):
        load_config(path)
    path.write_text("eval:\n  models: {a: x, b: y, a: z}\n")
    with pytest.raises(ConfigError, match=rf"^{path}:2: 'a' is given twice"):
        load_config(path)
    with pytest.raises(ConfigError, match=r"^command line: eval.models: 'a' is given twice"):
        load_config(None, ["eval.models={a: x, a: y}"])


def test_the_replay_settings_default_to_the_one_global_buffer_with_replacement_ranked_by_the_trained_reward():
    gfn = load_config("configs/tiny.yaml").gfn
    assert (gfn.buffer_scope, gfn.buffer_key, gfn.buffer_replacement) == ("global", "log_reward", True)
    chosen = load_config(
        None, ["gfn.buffer_scope=per_question", "gfn.buffer_key=log_u", "gfn.buffer_replacement=false"]
    )
    assert (chosen.gfn.buffer_scope, chosen.gfn.buffer_key, chosen.gfn.buffer_replacement) == (
        "per_question",
        "log_u",
        False,
    )
    with pytest.raises(ConfigError, match="command line: gfn.buffer_replacement expects bool, got 'sometimes'"):
        load_config(None, ["gfn.buffer_replacement=sometimes"])


@pytest.mark.parametrize(
    "override,shown", [("gfn.buffer_scope=per_question", "'per_question'"), ("gfn.buffer_replacement=false", "False")]
)
def test_the_asynchronous_mode_refuses_the_synchronous_replay_settings_at_load_naming_the_key(
    tmp_path, override, shown
):
    key = override.split("=")[0]
    with pytest.raises(ConfigError) as info:
        load_config("configs/tiny-async.yaml", [override])
    assert str(info.value).startswith(
        f"command line: {key} = {shown} is a setting of the synchronous mode: gfn.mode=async"
    )
    path = tmp_path / "async.yaml"
    name, value = override.removeprefix("gfn.").split("=")
    path.write_text(f"gfn:\n  mode: async\n  {name}: {value}\n")
    with pytest.raises(ConfigError, match=f"^{re.escape(str(path))}: {key} = "):
        load_config(path)
    assert load_config("configs/tiny-async.yaml", ["gfn.buffer_key=log_u"]).gfn.buffer_key == "log_u"  # applied there
