"""One resolver for every fine-tuning choice (pipeline.finetune.setup.resolve): its decisions and its
refusals, each filed under the key that fixes it, on small configs and launches; nothing is loaded."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from pipeline.config.loader import ConfigError, load_config
from pipeline.finetune.setup import FinetuneLaunch, SetupError, resolve

REPO = Path(__file__).resolve().parents[1]

FSDP2 = {"ACCELERATE_USE_FSDP": "true", "FSDP_VERSION": "2"}
ZERO2 = {"ACCELERATE_USE_DEEPSPEED": "true", "ACCELERATE_DEEPSPEED_ZERO_STAGE": "2"}
ZERO3 = {"ACCELERATE_USE_DEEPSPEED": "true", "ACCELERATE_DEEPSPEED_ZERO_STAGE": "3"}


def tiny(*overrides: str):
    """configs/tiny.yaml (gfn: TB-VarGrad with the reference prior, ceiling_questions 32; ppo: kl_coef 0),
    questions_per_step 8 in both sections."""
    return load_config(REPO / "configs" / "tiny.yaml", list(overrides))


@pytest.mark.parametrize(
    "stage, overrides, processes, environ, expected",
    [
        # one process: the trained model samples itself, whatever the accelerate config says of sharding
        ("gfn", [], 1, {}, dict(sampler="policy", sharding="none", reference="objective", start_weights=False)),
        ("gfn", [], 1, FSDP2, dict(sampler="policy", sharding="none")),
        ("ppo", ["ppo.kl_coef=1"], 2, {}, dict(sampler="policy", sharding="ddp", reference="sampler", value_head=True)),
        ("gfn", [], 2, ZERO2, dict(sampler="policy", sharding="deepspeed")),
        # FSDP2 and HF sampling: an HF copy given the gathered weights from the first step
        ("gfn", [], 2, FSDP2, dict(sampler="hf_copy", sharding="fsdp", start_weights=True)),
        ("ppo", [], 4, FSDP2, dict(sampler="hf_copy", sharding="fsdp", start_weights=True)),
        # vLLM: a colocated engine, given the trained weights first only when it loaded model.policy without its adapter
        ("gfn", ["generation.backend=vllm"], 2, ZERO3, dict(sampler="vllm", sharding="zero3", start_weights=False)),
        ("gfn", ["generation.backend=vllm", "model.policy_adapter=some/adapter"], 1, {}, dict(start_weights=True)),
        # the reference is loaded only when the objective uses it
        ("gfn", ["gfn.reference_prior_coef=0", "gfn.kl_coef=0"], 1, {}, dict(reference="none")),
        ("ppo", [], 1, {}, dict(reference="none", objective="ppo")),  # tiny.yaml's PPO has no KL term
        ("gfn", ["gfn.ceiling_questions=0", "gfn.loss=subtb"], 1, {}, dict(ceiling=False, objective="subtb")),
        ("gfn", [], 1, {}, dict(ceiling=True, objective="tb_vargrad", value_head=False, publish_dtype=None)),
        # asynchronous: the searchers sample; the trainer publishes in the dtype a searcher holds
        ("gfn", ["gfn.mode=async"], 1, {}, dict(sampler="searchers", mode="async", publish_dtype=torch.float32)),
        (
            "gfn",
            ["gfn.mode=async", "model.device=auto", "model.dtype=bfloat16", "gfn.searcher_gpus=1"],
            1,
            {},
            dict(sampler="searchers", publish_dtype=torch.bfloat16),
        ),
        (
            "gfn",
            ["gfn.mode=async", "gfn.questions_per_step=2", "gfn.ray_address=auto"],
            2,
            ZERO3,  # ZeRO-3 gathers the weights it publishes: HF searchers are fine
            dict(sampler="searchers", sharding="zero3", processes=2),
        ),
    ],
)
def test_resolve_decides_sampler_sharding_reference_and_publication(stage, overrides, processes, environ, expected):
    setup = resolve(tiny(*overrides), stage, FinetuneLaunch(processes, environ))
    assert setup.stage == stage
    assert {name: getattr(setup, name) for name in expected} == expected


def test_a_launch_keeps_only_the_accelerate_variables_it_reads():
    launch = FinetuneLaunch(8, {**FSDP2, "HOME": "/root", "WANDB_API_KEY": "secret", "WORLD_SIZE": "8"})
    assert launch.environ == FSDP2 and (launch.fsdp_version, launch.zero_stage) == ("2", None)
    assert FinetuneLaunch(2, {"ACCELERATE_USE_FSDP": "true"}).fsdp_version == "1"  # accelerate's default
    assert FinetuneLaunch(2, {"ACCELERATE_USE_DEEPSPEED": "true"}).zero_stage == "2"
    assert FinetuneLaunch(2, {"ACCELERATE_USE_FSDP": "false", "FSDP_VERSION": "2"}).sharding == "ddp"


@pytest.mark.parametrize(
    "stage, overrides, processes, environ, key, message",
    [
        ("ppo", ["ppo.mode=async"], 1, {}, "ppo.mode", r"^ppo\.mode=async: PPO is on-policy"),
        (
            "gfn",
            ["gfn.mode=async", "gfn.questions_per_step=2"],
            2,
            {},
            "gfn.ray_address",
            r"^gfn\.mode=async under 2 trainer processes needs gfn\.ray_address: .*`ray start --head`",
        ),
        (
            "gfn",
            ["gfn.mode=async", "gfn.async_samples_used=9"],
            1,
            {},
            "gfn",  # the asynchronous settings' own check names its key
            r"^gfn\.async_samples_used = 9 exceeds gfn\.samples_per_question = 8",
        ),
        (
            "gfn",
            [],
            3,
            {},
            "gfn.questions_per_step",
            r"^gfn\.questions_per_step=8 must be a positive multiple of the number of processes \(3\)",
        ),
        ("ppo", [], 2, ZERO3, None, r"^DeepSpeed ZeRO-3 with generation\.backend=hf: .*policy_fsdp\.yaml"),
        ("gfn", [], 2, {"ACCELERATE_USE_FSDP": "true"}, None, r"^the accelerate config asks for FSDP version 1"),
        (
            "gfn",
            ["gfn.save_every=5"],
            2,
            {**ZERO2, "ACCELERATE_DEEPSPEED_ZERO_STAGE": "0"},
            None,
            r"^gfn\.save_every=5 under DeepSpeed ZeRO stage 0",
        ),
        (
            "gfn",
            ["generation.backend=vllm", "generation.vllm_tensor_parallel_size=2"],
            1,
            {},
            "generation.vllm_tensor_parallel_size",
            r"^generation\.vllm_tensor_parallel_size=2: a fine-tuning sampler's weights are replaced",
        ),
    ],
)
def test_resolve_refuses_what_cannot_work_naming_the_key(stage, overrides, processes, environ, key, message):
    with pytest.raises(SetupError, match=message) as refused:
        resolve(tiny(*overrides), stage, FinetuneLaunch(processes, environ))
    assert refused.value.key == key and isinstance(refused.value, ConfigError)


def test_settings_a_config_built_in_code_may_hold_are_refused_naming_their_key():
    config = tiny("gfn.mode=async")
    config.gfn.weight_transport = "carrier_pigeon"
    with pytest.raises(SetupError, match=r"gfn\.weight_transport must be one of") as refused:
        resolve(config, "gfn", FinetuneLaunch())
    assert refused.value.key == "gfn.weight_transport"
    config = tiny()
    config.generation.backend = "tgi"
    with pytest.raises(SetupError, match=r"^generation\.backend is 'tgi'; expected one of hf, vllm") as refused:
        resolve(config, "gfn", FinetuneLaunch())
    assert refused.value.key == "generation.backend"
    with pytest.raises(ValueError, match=r"fine-tuning stage must be one of \('gfn', 'ppo'\), got 'prm'"):
        resolve(config, "prm", FinetuneLaunch())


def test_resolve_reads_no_file():
    """The policy, its adapter and the PRM need not exist: the setup is made from the config alone."""
    config = tiny("model.policy=/nowhere/policy", "model.policy_adapter=/nowhere/adapter", "generation.backend=vllm")
    assert resolve(config, "gfn", FinetuneLaunch()).sampler == "vllm"


def test_the_stage_preflight_refuses_with_the_resolvers_message(monkeypatch):
    from pipeline.finetune import setup

    monkeypatch.setattr(setup, "process_count", lambda model_config: 2)  # as under accelerate launch
    config = tiny("gfn.mode=async", "gfn.questions_per_step=2")
    with pytest.raises(SetupError) as resolved:
        resolve(config, "gfn", FinetuneLaunch(2))
    with pytest.raises(ConfigError) as stage:
        setup.preflight(config, "gfn")
    assert str(stage.value) == str(resolved.value)
    assert setup.preflight(tiny(), "ppo") == resolve(tiny(), "ppo", FinetuneLaunch(2))
