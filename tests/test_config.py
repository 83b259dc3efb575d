from pathlib import Path

import pytest

from pipeline.config import Config, ConfigError, load_config, save_config

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


def test_override_without_equals_is_an_error():
    with pytest.raises(ConfigError, match="key=value"):
        load_config(None, ["mcts.k"])


# configs/accelerate/*.yaml are accelerate's launch configs, not ours.
@pytest.mark.parametrize("path", sorted(p for p in (REPO / "configs").rglob("*.yaml") if "accelerate" not in p.parts), ids=lambda p: p.name)
def test_shipped_configs_load(path):
    assert isinstance(load_config(path), Config)


def test_paper_settings():
    config = load_config(REPO / "configs" / "paper" / "llama3.2-3b.yaml")
    assert (config.mcts.k, config.mcts.temperature) == (96, 0.6)
    assert config.augment.similarity_threshold == 0.85
    assert (config.prm.lr, config.prm.batch_size, config.prm.weight_decay, config.prm.epochs) == (8e-6, 144, 0.01, 1.0)
    gfn = config.gfn
    assert (gfn.lr, gfn.scheduler, gfn.grad_clip, gfn.lam, gfn.buffer_size, gfn.temperature) == (5e-6, "cosine", 1.0, 1.0, 1000, 0.6)
    assert gfn.questions_per_step * gfn.samples_per_question == 144
    ppo = config.ppo
    assert (ppo.lr, ppo.clip, ppo.value_coef, ppo.entropy_coef) == (5e-6, 0.2, 0.5, 0.01)
    assert ppo.questions_per_step * ppo.samples_per_question == 144
    assert config.model.prm_backbone == "Qwen/Qwen2.5-Math-7B"
    assert config.model.policy == "meta-llama/Llama-3.2-3B-Instruct"
    assert load_config(REPO / "configs" / "paper" / "llama3.1-8b.yaml").model.policy == "meta-llama/Llama-3.1-8B-Instruct"


def test_saved_config_round_trips(tmp_path):
    config = load_config(None, ["mcts.k=5", "format.separator=\"\\n\""])
    save_config(config, tmp_path / "config.yaml")
    again = load_config(tmp_path / "config.yaml")
    assert again.to_dict() == config.to_dict()


def test_the_top_level_seed_seeds_every_section_unless_one_sets_its_own(tmp_path):
    config = load_config(None, ["seed=3", "gfn.seed=11"])
    seeded = {name: getattr(config, name).seed for name in ("tinyworld", "bootstrap", "augment", "prm", "gfn", "ppo", "eval", "search")}
    assert seeded == {"tinyworld": 3, "bootstrap": 3, "augment": 3, "prm": 3, "gfn": 11, "ppo": 3, "eval": 3, "search": 3}
    path = tmp_path / "c.yaml"
    path.write_text("seed: 2\nprm:\n  seed: 0\n")
    config = load_config(path)
    assert (config.prm.seed, config.bootstrap.seed) == (0, 2)  # a section's own seed, even 0, is kept
    assert load_config(None).bootstrap.seed == 0
