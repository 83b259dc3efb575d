"""make plan: models, data and batches checked, memory and work estimated, before any model loads.

The paper configs name hub ids: no test reaches the hub; their shapes come from pipeline.sizing.shapes'
table of published configs (the hub cache is ignored so that a machine with one gives the same
answer)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import transformers
import yaml

from pipeline.batches import gradient_accumulation
from pipeline.config.loader import load_config
from pipeline.finetune.setup import FinetuneLaunch
from pipeline.sizing import activation_memory, shapes
from pipeline.sizing.shapes import lora_parameters, shape_from_config
from planner.launch import launch_from_environment
from planner.make import make_plan
from planner.plan import GIB
from planner.render import render

REPO = Path(__file__).resolve().parents[1]
PAPER = sorted(path.stem for path in (REPO / "configs" / "paper").glob("*.yaml"))  # every paper config

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def tiny(family: str, tied: bool):
    common = dict(
        vocab_size=96,
        hidden_size=32,
        intermediate_size=48,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        tie_word_embeddings=tied,
    )
    config = transformers.Qwen2Config(**common) if family == "qwen2" else transformers.LlamaConfig(**common)
    torch.manual_seed(0)
    return transformers.AutoModelForCausalLM.from_config(config)


def distinct_parameters(module) -> int:
    return sum(p.numel() for p in {id(p): p for p in module.parameters()}.values())


@pytest.mark.parametrize("family", ["llama", "qwen2"])
@pytest.mark.parametrize("tied", [True, False])
def test_parameter_counts_equal_the_built_models(family, tied):
    model = tiny(family, tied)
    shape = shape_from_config(model.config.to_dict(), "test")
    assert shape.parameters() == distinct_parameters(model)
    assert shape.parameters(lm_head=False) == distinct_parameters(model.model)
    assert shape.layer_parameters() == distinct_parameters(model.model.layers[0])
    lora = sum(r * (a + b) for r, (a, b) in [(4, (32, 32)), (4, (32, 16)), (4, (32, 16)), (4, (32, 32))])
    assert lora_parameters(shape, 4, ["q_proj", "k_proj", "v_proj", "o_proj"]) == (2 * lora, [])


def test_kv_cache_bytes_equal_the_cache_a_forward_fills():
    model = tiny("qwen2", True)
    out = model(torch.randint(0, 96, (3, 7)), use_cache=True)
    cache = out.past_key_values
    stored = sum(
        layer.keys.numel() * layer.keys.element_size() + layer.values.numel() * layer.values.element_size()
        for layer in cache.layers
    )
    assert stored == 3 * 7 * shape_from_config(model.config.to_dict(), "test").kv_cache_bytes_per_token(
        bytes_per_value=4
    )


def test_activation_checkpointing_keeps_one_input_per_layer_plus_one_layer():
    shape = shapes.PUBLISHED["meta-llama/Llama-3.2-3B-Instruct"]
    settings = {"lora_modules": ["q_proj", "k_proj", "v_proj", "o_proj"], "lora_rank": 16, "lora_dropout": True}
    terms = activation_memory.activation_terms(shape, 8, 600, **settings)
    per_layer = sum(terms.values()) // 28  # with LoRA the final norm replaces layer 0's input norm
    checkpointed = activation_memory.activation_bytes(shape, 8, 600, checkpointing=True, **settings)
    assert checkpointed == 28 * 3072 * 8 * 600 * 2 + per_layer


def test_the_activation_terms_of_llama_3_2_3b_by_hand():
    """Per layer and token of Llama-3.2-3B with LoRA r=16 on q/k/v/o on a GPU, unpadded: norms
    2 x (4 x 3072 + 4), attention 2 x (2 x 3072 + 2 x 1024) + 4 x 24, MLP 3 x 2 x 8192, LoRA
    3 x (5 x 3072 + 64) + (5 x 3072 + 64)."""
    shape = shapes.PUBLISHED["meta-llama/Llama-3.2-3B-Instruct"]
    n = 8 * 1280
    terms = activation_memory.activation_terms(
        shape,
        8,
        1280,
        lora_modules=["q_proj", "k_proj", "v_proj", "o_proj"],
        lora_rank=16,
        lora_dropout=True,
        padded=False,
        mask_bytes=1,
    )
    assert terms == {
        "RMSNorm float32 inputs": 28 * 2 * (4 * 3072 + 4) * n,
        "attention (sdpa q, k, v, output, log-sum-exp; mask when padded)": 28 * (2 * (2 * 3072 + 2 * 1024) + 96) * n,
        "MLP (gate, SiLU, up)": 28 * 6 * 8192 * n,
        "LoRA inputs (float32, dropout mask, lora_A output)": 28 * 4 * (5 * 3072 + 64) * n,
    }
    assert activation_memory.logits_bytes(shape, 8, 1025) == 20 * 8 * 1025 * 128256


def test_published_shapes_give_the_parameter_counts_of_docs_scale():
    assert round(shapes.PUBLISHED["meta-llama/Llama-3.2-3B-Instruct"].parameters() / 1e7) == 321
    assert round(shapes.PUBLISHED["Qwen/Qwen2.5-Math-7B"].parameters(lm_head=False) / 1e7) == 707


def test_gradient_accumulation_is_exact_or_refused_with_the_arithmetic():
    assert gradient_accumulation(144, 6, 8) == 3
    assert gradient_accumulation(144, 6, 1) == 24
    with pytest.raises(
        ValueError, match=r"prm.batch_size=144 .* 4 x 8 = 32 \(144 / 32 = 4.5\): the effective batch would be 128"
    ):
        gradient_accumulation(144, 4, 8)


def test_prm_training_refuses_a_batch_that_does_not_divide_before_loading_a_model(tmp_path):
    from prm.train import train_prm

    config = load_config(
        REPO / "configs" / "tiny.yaml", ["prm.batch_size=10", "prm.micro_batch_size=4", f"runs_root={tmp_path}"]
    )
    with pytest.raises(ValueError, match=r"prm.batch_size=10 .* 4 x 1 = 4 \(10 / 4 = 2.5\)"):
        train_prm(config, [], None, tmp_path / "prm")  # the backbone does not exist: reached only if the check passed
    assert not (tmp_path / "prm").exists()


def test_tiny_config_plans_every_stage_without_findings(tmp_path):
    config = load_config(REPO / "configs" / "tiny.yaml", [f"runs_root={tmp_path}"])
    plan = make_plan(config, "configs/tiny.yaml")
    assert plan.findings == []
    assert [stage.name for stage in plan.stages] == ["mcts", "augment", "prm", "gfn", "ppo", "eval", "search"]
    policy = plan.models[0]
    assert (policy.status, policy.source, policy.shape.hidden_size) == (
        "made by make bootstrap",
        "the bootstrap section",
        128,
    )
    mcts = plan.stages[0]
    n, k, most = config.mcts.max_problems, config.mcts.k, config.mcts.max_rollouts  # the rl split holds more problems
    assert mcts.work[0].startswith(
        f"{n:,} problems; rollouts (mcts.k={k} to mcts.max_rollouts={most} a problem): {n * k:,} to {n * most:,}"
    )
    assert "No errors or warnings." in render(plan)


def test_a_local_model_folder_is_sized_from_its_config_json(tmp_path):
    tiny("qwen2", True).config.save_pretrained(tmp_path / "policy")
    config = load_config(
        REPO / "configs" / "tiny.yaml", [f"runs_root={tmp_path}", f"model.policy={tmp_path / 'policy'}"]
    )
    policy = make_plan(config).models[0]
    assert (policy.status, policy.source) == ("local", f"local {tmp_path / 'policy' / 'config.json'}")
    assert policy.shape == shape_from_config(tiny("qwen2", True).config.to_dict(), "test")
    missing = load_config(
        REPO / "configs" / "tiny.yaml", [f"runs_root={tmp_path}", f"model.policy={tmp_path / 'nope'}"]
    )
    assert [f.key for f in make_plan(missing).errors] == ["model.policy"]


@pytest.fixture
def paper_world(tmp_path, benchmarks_dir, monkeypatch):
    """Run from a folder like the repository's root, whose data/benchmarks/ holds the benchmark files
    (the configs name that relative path, and configs/accelerate/ by theirs), with no hub cache."""
    (tmp_path / "configs").symlink_to(REPO / "configs")
    (tmp_path / "data").mkdir()
    (tmp_path / "data" / "benchmarks").symlink_to(benchmarks_dir)
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(shapes, "cached_hub_config", lambda hub_id: None)
    return tmp_path


def paper(name: str, *overrides: str):
    return load_config(REPO / "configs" / "paper" / f"{name}.yaml", list(overrides))


@pytest.mark.parametrize("name", PAPER)
def test_paper_configs_pass_make_plan_with_their_hub_models_sized_from_the_table(paper_world, name):
    plan = make_plan(paper(name), name)
    assert plan.errors == [], render(plan)
    policy, backbone = plan.models[0], plan.models[1]
    assert policy.status == backbone.status == "hub"
    assert policy.source == backbone.source == "published config (table in pipeline/sizing/shapes.py)"
    data = {d.key: d for d in plan.data}
    assert data["eval.benchmarks[2] (sat_math_32)"].problems == 32
    assert data["data.train"].status == "needs the hub (nvidia/OpenMathInstruct-2)"
    for stage in plan.stages:
        if stage.memory:
            assert sum(stage.memory.values()) <= plan.gpu.memory_gib * GIB


def test_the_paper_defects_are_errors_naming_the_key_and_the_arithmetic(paper_world):
    plan = make_plan(
        paper(
            "llama3.2-3b",
            "prm.micro_batch_size=4",
            "generation.vllm_gpu_memory_utilization=0.85",
            "gfn.questions_per_step=20",
        )
    )
    errors = {f.key: f.message for f in plan.errors}
    assert "4 x 8 = 32 (144 / 32 = 4.5)" in errors["prm.batch_size"]
    assert (
        "gfn.questions_per_step=20 must be a positive multiple of the number of processes (8)"
        in errors["gfn.questions_per_step"]
    )
    shares = [f.message for f in plan.errors if f.key == "generation.vllm_gpu_memory_utilization"]
    gfn = [m for m in shares if m.startswith("make gfn: ")]  # 0.85 x 80 GiB for vLLM beside the trainer
    assert len(gfn) == 1 and "= 0.85: 1 x 0.85 x 80.00 GiB for vLLM + 39.02 GiB beside it (" in gfn[0]
    assert "exceeds the device's 80.00 GiB (vLLM takes its share of the whole device); at most 0.51" in gfn[0]
    search = [m for m in shares if m.startswith("make search: ")]  # beside the 7B PRM
    assert len(search) == 1 and "+ 15.17 GiB beside it (frozen PRM 13.17 + CUDA context" in search[0]


def test_an_engine_share_is_derived_from_what_shares_the_device_or_refused_with_the_arithmetic():
    from pipeline.generation.vllm_settings import engine_memory_share

    device, needs = 80 * GIB, {"weights": 6 * GIB, "KV cache of one 1344-token sequence": 0.1 * GIB}
    assert engine_memory_share(device, {"trainer": 30 * GIB}, needs) == 0.62  # (80 - 30) / 80, rounded down
    assert (
        engine_memory_share(device, {"two PRMs": 30 * GIB}, needs, engines=2) == 0.31
    )  # two searchers' engines on one GPU
    assert engine_memory_share(device, {}, needs) == 0.9  # alone on the device: vLLM's own default
    assert engine_memory_share(device, {"trainer": 30 * GIB}, needs, requested=0.5) == 0.5
    with pytest.raises(
        ValueError,
        match=r"generation.vllm_gpu_memory_utilization = 0.85: 1 x 0.85 x 80.00 GiB for vLLM \+ 30.00 GiB "
        r"beside it \(trainer 30.00\) = 98.00 GiB exceeds the device's 80.00 GiB .*at most 0.62",
    ):
        engine_memory_share(device, {"trainer": 30 * GIB}, needs, requested=0.85)
    with pytest.raises(
        ValueError,
        match=r"generation.vllm_gpu_memory_utilization \(unset: derived\) = \(80.00 GiB device - 76.00 GiB "
        r"beside the engine \(trainer 76.00\)\) = 0.05 of the device = 4.00 GiB, below the 6.10 GiB",
    ):
        engine_memory_share(device, {"trainer": 76 * GIB}, needs)
    with pytest.raises(
        ValueError, match=r"= 0.05: 0.05 x 80.00 GiB = 4.00 GiB is below the 6.10 GiB a vLLM engine needs"
    ):
        engine_memory_share(device, {}, needs, requested=0.05)


FSDP_LAUNCH = {"WORLD_SIZE": "8", "ACCELERATE_USE_FSDP": "true", "FSDP_ACTIVATION_CHECKPOINTING": "true"}


def test_a_stage_derives_its_engines_share_before_loading_as_make_plan_does(paper_world):
    from stages.startup_checks import device_memory

    unset = "generation.vllm_gpu_memory_utilization=null"
    planned = {s.name: s.engine_share for s in make_plan(paper("llama3.2-3b", unset)).stages}
    for stage, name, environ in [("train_gfn", "gfn", FSDP_LAUNCH), ("search", "search", {}), ("mcts", "mcts", {})]:
        config = paper("llama3.2-3b", unset)
        device_memory(config, stage, environ, device_bytes=80 * GIB)
        assert config.generation.vllm_gpu_memory_utilization == planned[name] is not None
    assert planned["gfn"] == 0.51 and planned["search"] == 0.81 and planned["mcts"] == 0.9
    shares = {}
    for gpus in ("1", "0.5"):  # one or two asynchronous searchers (engine + 7B PRM each) on a GPU
        config = paper("llama3.2-3b", unset, "gfn.mode=async", f"gfn.searcher_gpus={gpus}")
        device_memory(config, "train_gfn", FSDP_LAUNCH, device_bytes=80 * GIB)
        shares[gpus] = config.gfn.searcher_vllm_memory_share  # the searchers' own key; the other stages' is left unset
        assert config.generation.vllm_gpu_memory_utilization is None
    assert shares == {"1": 0.81, "0.5": 0.31}  # (80 - 13.17 - 2) / 80; (80 - 2 x (13.17 + 2)) / 2 / 80


def test_a_share_that_cannot_fit_is_refused_naming_the_key_before_any_model_loads(paper_world):
    from pipeline.config.loader import ConfigError
    from stages.startup_checks import device_memory

    config = paper("llama3.2-3b", "generation.vllm_gpu_memory_utilization=0.85")
    with pytest.raises(
        ConfigError, match=r"make gfn: generation.vllm_gpu_memory_utilization = 0.85: 1 x 0.85 x 80.00 GiB .* exceeds"
    ):
        device_memory(config, "train_gfn", FSDP_LAUNCH, device_bytes=80 * GIB)
    config = paper(
        "llama3.2-3b", "generation.vllm_gpu_memory_utilization=null", "gfn.mode=async", "gfn.searcher_gpus=0.25"
    )
    with pytest.raises(
        ConfigError,
        match=r"make gfn searchers: .*\(unset: derived\) = .* / 4 = 0.0\d of the device .* per engine "
        r"\(4 on the device\), below the",
    ):
        device_memory(config, "train_gfn", FSDP_LAUNCH, device_bytes=80 * GIB)
    config = paper(
        "llama3.2-3b", "generation.vllm_gpu_memory_utilization=null", "gfn.mode=async", "gfn.searcher_gpus=0"
    )
    with pytest.raises(ConfigError, match=r"gfn.searcher_gpus=0 with generation.backend=vllm on a machine with a GPU"):
        device_memory(config, "train_gfn", FSDP_LAUNCH, device_bytes=80 * GIB)
    hf = paper("llama3.2-3b", "generation.backend=hf", "generation.vllm_gpu_memory_utilization=0.99")
    device_memory(hf, "train_gfn", FSDP_LAUNCH, device_bytes=80 * GIB)  # no engine: nothing to check
    assert hf.generation.vllm_gpu_memory_utilization == 0.99


def test_a_stage_whose_estimated_memory_exceeds_its_gpu_is_refused_before_any_model_loads(paper_world):
    from pipeline.config.loader import ConfigError
    from stages.startup_checks import device_memory

    qwen = str(REPO / "configs" / "paper" / "qwen2.5-math-1.5b.yaml")
    full = load_config(qwen, ["prm.lora=false"])  # a 7B backbone's full fine-tuning on one GPU: what make plan refuses
    # (named by prm.lora: the AdamW state dominates, and one process has nothing to shard it over)
    with pytest.raises(ConfigError, match=r"prm.lora: make prm: estimated .* GiB per GPU exceeds the GPU's 80 GiB"):
        device_memory(full, "train_prm", {}, device_bytes=80 * GIB)
    device_memory(load_config(qwen, []), "train_prm", {}, device_bytes=80 * GIB)  # with LoRA it fits
    hf = paper("llama3.2-3b", "generation.backend=hf")  # no engine: the trainer's own memory is still checked
    with pytest.raises(ConfigError, match=r"gfn.micro_batch_size: make gfn: estimated .* exceeds the GPU's 16 GiB"):
        device_memory(hf, "train_gfn", {}, device_bytes=16 * GIB)
    device_memory(hf, "train_gfn", FSDP_LAUNCH, device_bytes=80 * GIB)
    assert hf.generation.vllm_gpu_memory_utilization == paper("llama3.2-3b").generation.vllm_gpu_memory_utilization


def test_a_hard_coded_wrap_class_of_another_family_is_refused(paper_world, tmp_path):
    wrapped = yaml.safe_load((REPO / "configs" / "accelerate" / "policy_fsdp.yaml").read_text())
    wrapped["fsdp_config"]["fsdp_transformer_layer_cls_to_wrap"] = "LlamaDecoderLayer"
    (tmp_path / "llama_fsdp.yaml").write_text(yaml.safe_dump(wrapped))
    plan = make_plan(
        paper("qwen2.5-math-1.5b", "plan.processes=8", f"plan.accelerate={{gfn: {tmp_path / 'llama_fsdp.yaml'}}}")
    )
    assert (
        "wraps LlamaDecoderLayer but model.policy is a qwen2 model (Qwen2DecoderLayer)"
        in {f.key: f.message for f in plan.errors}["plan.accelerate.gfn"]
    )


def test_memory_beyond_the_device_is_refused_and_the_stage_exits_non_zero(paper_world, capsys):
    from stages import plan as plan_stage

    config = str(REPO / "configs" / "paper" / "qwen2.5-math-1.5b.yaml")
    assert plan_stage.main(["--config", config, "prm.lora=false"]) == 1  # a 7B backbone's full fine-tuning on one GPU
    out = capsys.readouterr().out
    # the AdamW state of the 7B backbone dominates on one process: LoRA shrinks it, a smaller micro-batch would not
    assert "ERROR: prm.lora: make prm: estimated" in out and "exceeds the A100-80GB's 80 GiB" in out
    assert plan_stage.main(["--config", config]) == 0


@pytest.mark.parametrize("accelerate_config", ["fsdp.yaml", "policy_fsdp.yaml", "policy_fsdp_lora.yaml"])
def test_fsdp_configs_wrap_each_decoder_layer_of_any_family(accelerate_config, monkeypatch):
    """What accelerate 1.15 does with the file: `accelerate launch` exports the wrap settings the
    file names, the plugin reads them, and with no class named it wraps the model's _no_split_modules."""
    from accelerate.utils import FullyShardedDataParallelPlugin
    from accelerate.utils.fsdp_utils import fsdp2_prepare_auto_wrap_policy
    from peft import LoraConfig, get_peft_model

    from prm.model import ProcessRewardModel

    fsdp = yaml.safe_load((REPO / "configs" / "accelerate" / accelerate_config).read_text())["fsdp_config"]
    assert "fsdp_transformer_layer_cls_to_wrap" not in fsdp
    monkeypatch.setenv("FSDP_AUTO_WRAP_POLICY", fsdp["fsdp_auto_wrap_policy"])
    monkeypatch.delenv("FSDP_TRANSFORMER_CLS_TO_WRAP", raising=False)
    plugin = FullyShardedDataParallelPlugin(fsdp_version=fsdp["fsdp_version"])
    lora = get_peft_model(
        tiny("qwen2", True), LoraConfig(r=4, target_modules=["q_proj", "v_proj"], task_type="CAUSAL_LM")
    )
    for model, layer in [
        (tiny("llama", True), "LlamaDecoderLayer"),
        (lora, "Qwen2DecoderLayer"),
        (ProcessRewardModel.from_backbone(tiny("qwen2", False)), "Qwen2DecoderLayer"),
    ]:
        policy = fsdp2_prepare_auto_wrap_policy(plugin, model)
        wrapped = [type(module).__name__ for module in model.modules() if policy(module)]
        assert wrapped == [layer, layer], type(model).__name__


def test_a_searcher_that_cannot_fit_its_vllm_share_and_prm_is_refused_with_the_arithmetic(paper_world):
    """An asynchronous searcher's GPU (stages.startup_checks.device_memory, before any model loads; the
    device size given, as no GPU runs here): gfn.searcher_vllm_memory_share x the device + the PRM
    (unless scorer actors hold it) + the CUDA context must fit; the searcher holds no reference."""
    from pipeline.config.loader import ConfigError
    from stages.startup_checks import device_memory

    async_run = ("gfn.mode=async", "gfn.searcher_gpus=1")
    config = paper("llama3.2-3b", *async_run, "gfn.searcher_vllm_memory_share=0.9")
    with pytest.raises(
        ConfigError,
        match=r"make gfn searchers: gfn.searcher_vllm_memory_share = 0.9: 1 x 0.9 x 80.00 GiB for vLLM "
        r"\+ 15.17 GiB beside it \(frozen PRM x 1 13.17 \+ CUDA context and buffers \(assumed\) 2.00\) "
        r"= 87.17 GiB exceeds the device's 80.00 GiB .*at most 0.81",
    ):
        device_memory(config, "train_gfn", FSDP_LAUNCH, device_bytes=80 * GIB)
    pooled = paper(
        "llama3.2-3b", *async_run, "gfn.searcher_vllm_memory_share=0.9", "gfn.scorer_actors=1", "gfn.scorer_gpus=1"
    )
    device_memory(pooled, "train_gfn", FSDP_LAUNCH, device_bytes=80 * GIB)  # 72 + 2 GiB: the PRM is in the scorer actor
    assert pooled.gfn.searcher_vllm_memory_share == 0.9
    derived = {}
    for scorers in ("0", "1"):
        config = paper("llama3.2-3b", *async_run, f"gfn.scorer_actors={scorers}", f"gfn.scorer_gpus={scorers}")
        device_memory(config, "train_gfn", FSDP_LAUNCH, device_bytes=80 * GIB)
        derived[scorers] = config.gfn.searcher_vllm_memory_share
    assert derived == {"0": 0.81, "1": 0.9}  # (80 - 13.17 - 2) / 80; (80 - 2) / 80 capped at vLLM's own 0.9
    # a scorer actor's own GPU: the 7B PRM and a CUDA context do not fit in 12 GiB
    with pytest.raises(
        ConfigError,
        match=r"gfn.scorer_gpus: make gfn scorers: estimated 13.2 \+ 2.0 = 15.2 GiB per GPU exceeds the "
        r"GPU's 12 GiB",
    ):
        device_memory(
            paper(
                "llama3.2-3b",
                *async_run,
                "gfn.scorer_actors=1",
                "gfn.scorer_gpus=1",
                "gfn.searcher_vllm_memory_share=0.1",
            ),
            "train_gfn",
            FSDP_LAUNCH,
            device_bytes=12 * GIB,
        )
    # half-GPU searchers beside tenth-GPU scorer actors: Ray may pack one searcher with five scorers' PRMs, the tightest mix
    packed = paper(
        "llama3.2-3b", "gfn.mode=async", "gfn.searcher_gpus=0.5", "gfn.scorer_actors=5", "gfn.scorer_gpus=0.1"
    )
    with pytest.raises(
        ConfigError,
        match=r"gfn.searcher_vllm_memory_share \(unset: derived\) = \(80.00 GiB device - 77.85 GiB beside "
        r"the engine \(frozen PRM of 5 scorer actors packed beside them 65.85 \+ CUDA contexts of 5 "
        r"more processes \(assumed\) 10.00 \+ CUDA context and buffers \(assumed\) 2.00\)\) = 0.02 "
        r"of the device",
    ):
        device_memory(packed, "train_gfn", FSDP_LAUNCH, device_bytes=80 * GIB)
    plan = make_plan(
        paper("llama3.2-3b", *async_run, "gfn.scorer_actors=1", "gfn.scorer_gpus=1", "gfn.ray_address=auto")
    )
    assert plan.errors == [] and [s.name for s in plan.stages if s.name.startswith("gfn")] == [
        "gfn",
        "gfn searchers",
        "gfn scorers",
    ]
    searchers = next(s for s in plan.stages if s.name == "gfn searchers")
    assert not any("PRM" in item for item in searchers.memory) and searchers.engine_share == 0.9


# ----------------------------------------------------------------------------- activations, measured


def _tiny_lora_model(model_type: str, layers: int, hidden: int, heads: int, kv_heads: int, intermediate: int):
    """A random-init Llama / Qwen2 decoder in bf16 with sdpa attention and peft LoRA on q/k/v/o
    (rank 16, dropout 0.05: what the fine-tuning stages add), in train mode."""
    import types

    from transformers import AutoConfig, AutoModelForCausalLM

    from pipeline.finetune.run import add_lora

    config = AutoConfig.for_model(
        model_type,
        hidden_size=hidden,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        intermediate_size=intermediate,
        vocab_size=32000,
        tie_word_embeddings=True,
    )
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16, attn_implementation="sdpa")
    lora = types.SimpleNamespace(
        lora_r=16, lora_alpha=32, lora_dropout=0.05, lora_target_modules=["q_proj", "k_proj", "v_proj", "o_proj"]
    )
    model = add_lora(model, lora)
    model.train()
    return model, shape_from_config(config.to_dict(), "tiny")


def _trajectories(sequences: int, tokens: int, prompt: int, padded: bool):
    from pipeline.steps import SegmentedIds

    generator = torch.Generator().manual_seed(1)
    batch = []
    for b in range(sequences):
        n = tokens - (5 * b if padded else 0)  # padded: every row shorter than the first
        ids = [int(x) for x in torch.randint(3, 32000, (n,), generator=generator)]
        spans = [(s, min(s + 16, n - 1)) for s in range(prompt, n - 1, 16)]
        batch.append(SegmentedIds(ids, prompt, spans, n - 1))
    return batch


def _saved_bytes(model, batch) -> int:
    """Bytes of the distinct storages autograd keeps for backward (parameters left out) over
    the training forward of pipeline.generation.step_logprobs.trajectory_logprobs."""
    from pipeline.generation.step_logprobs import trajectory_logprobs

    parameters = {p.untyped_storage().data_ptr() for p in model.parameters()}
    kept: dict[int, int] = {}

    def pack(tensor):
        storage = tensor.untyped_storage()
        if storage.data_ptr() not in parameters:
            kept[storage.data_ptr()] = storage.nbytes()
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        trajectory_logprobs(model, batch, 0, end_token_id=1, with_grad=True)
    return sum(kept.values())


@pytest.mark.parametrize(
    "model_type, layers, hidden, heads, kv_heads, intermediate, sequences, tokens, padded",
    [
        ("qwen2", 2, 64, 4, 2, 160, 2, 96, True),
        ("llama", 3, 128, 4, 1, 256, 3, 80, False),
    ],
)
def test_the_activation_estimate_is_what_autograd_keeps_for_a_lora_policy(
    model_type, layers, hidden, heads, kv_heads, intermediate, sequences, tokens, padded
):
    """A tiny bf16 decoder with LoRA, trained through trajectory_logprobs as the fine-tuning
    stages train it, keeps for backward what activation_terms counts: one more layer adds its
    per-layer terms to within 0.1%, and the whole is the terms plus the float32 logits (4 bytes a
    value of the kept positions) within 2% (the rest: position ids, gather indices, rotary
    cos/sin, the ends of the stack). Dropout's mask is counted at the CPU's 4 bytes
    (dropout_mask_bytes)."""
    prompt = 16
    batch = _trajectories(sequences, tokens, prompt, padded)
    settings = {
        "lora_modules": ["q_proj", "k_proj", "v_proj", "o_proj"],
        "lora_rank": 16,
        "lora_dropout": True,
        "padded": padded,
        "mask_bytes": activation_memory.dropout_mask_bytes("cpu"),
    }
    measured, estimates = [], []
    for depth in (layers, layers + 1):
        model, shape = _tiny_lora_model(model_type, depth, hidden, heads, kv_heads, intermediate)
        measured.append(_saved_bytes(model, batch))
        estimates.append(activation_memory.activation_bytes(shape, sequences, tokens, checkpointing=False, **settings))
    one_layer = measured[1] - measured[0]
    assert abs(one_layer - (estimates[1] - estimates[0])) <= 0.001 * one_layer, (one_layer, estimates)
    logits = 4 * sequences * (tokens - prompt + 1) * shape.vocab_size
    assert abs(measured[1] - (estimates[1] + logits)) <= 0.02 * measured[1], (measured, estimates, logits)


def test_the_logits_term_is_the_peak_of_the_log_softmax_backward():
    """The peak CPU allocation over one training forward and backward of a one-layer LoRA model
    with a large vocabulary (the profiler's allocation events) is what autograd keeps plus the
    logsumexp backward's 16 further bytes a logit value beyond the 4 kept: logits_bytes, within 2%."""
    from torch.profiler import ProfilerActivity, profile

    from pipeline.generation.step_logprobs import trajectory_logprobs

    model, shape = _tiny_lora_model("qwen2", 1, 64, 4, 2, 160)
    prompt, sequences, tokens = 16, 2, 64
    batch = _trajectories(sequences, tokens, prompt, padded=False)
    kept = _saved_bytes(model, batch)
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as profiler:
        lp = trajectory_logprobs(model, batch, 0, end_token_id=1, with_grad=True)
        (lp.step_logprobs.sum() + lp.termination_logprobs.sum()).backward()
        del lp
    current = peak = 0
    for event in sorted(profiler.profiler.kineto_results.events(), key=lambda e: e.start_ns()):
        if event.name() == "[memory]":
            current += event.nbytes()
            peak = max(peak, current)
    positions = tokens - prompt + 1
    logits_kept = 4 * sequences * positions * shape.vocab_size
    estimate = kept - logits_kept + activation_memory.logits_bytes(shape, sequences, positions)
    assert abs(peak - estimate) <= 0.02 * peak, (peak, estimate, kept)


ACCELERATE = REPO / "configs" / "accelerate"


def accelerate_file(tmp_path, base: str, name: str = "changed.yaml", fsdp: dict | None = None, **top) -> Path:
    """configs/accelerate/<base> with fsdp_config entries and top-level keys changed (None: removed)."""
    settings = yaml.safe_load((ACCELERATE / base).read_text())
    for section, changes in (("fsdp_config", fsdp or {}), (None, top)):
        target = settings.setdefault(section, {}) if section else settings
        for key, value in changes.items():
            target.pop(key, None) if value is None else target.__setitem__(key, value)
    path = tmp_path / name
    path.write_text(yaml.safe_dump(settings))
    return path


def test_the_projects_accelerate_files_hold_only_keys_accelerate_knows_and_values_the_trainer_applies():
    from pipeline.training.launch_settings import check_accelerate_file, read_accelerate_file

    model = paper("llama3.2-3b").model
    for path in sorted(ACCELERATE.glob("*.yaml")):
        read_accelerate_file(path)
        check_accelerate_file(path, model)


def launched_environment(path: Path) -> dict[str, str]:
    """What `accelerate launch --config_file path` exports to each process (accelerate's own code)."""
    from accelerate.commands.launch import _validate_launch_command, launch_command_parser
    from accelerate.utils import prepare_multi_gpu_env

    args, _, _ = _validate_launch_command(launch_command_parser().parse_args(["--config_file", str(path), "train.py"]))
    return prepare_multi_gpu_env(args)


@pytest.mark.parametrize(
    ("fsdp", "top", "key"),
    [
        ({"fsdp_offload_params": True}, {}, "fsdp_config.fsdp_offload_params: true is not applied"),
        ({"fsdp_state_dict_type": "SHARDED_STATE_DICT"}, {}, "fsdp_config.fsdp_state_dict_type: sharded_state_dict"),
        ({"fsdp_auto_wrap_policy": "SIZE_BASED_WRAP"}, {}, "fsdp_config.fsdp_auto_wrap_policy: size_based_wrap"),
        ({}, {"mixed_precision": "fp16"}, "mixed_precision: fp16, but the training base trains with "),
        ({}, {"dynamo_config": {"dynamo_backend": "INDUCTOR"}}, "dynamo_config.dynamo_backend: inductor"),
    ],
)
def test_a_launch_setting_the_trainer_would_not_apply_is_refused_by_make_plan_and_at_the_trainers_start(
    paper_world, tmp_path, monkeypatch, fsdp, top, key
):
    from pipeline.config.loader import ConfigError
    from pipeline.training.accelerator import make_accelerator

    path = accelerate_file(tmp_path, "policy_fsdp_lora.yaml", fsdp=fsdp, **{"mixed_precision": "no", **top})
    plan = make_plan(paper("llama3.2-3b", f"plan.accelerate.gfn={path}"))
    assert [f.key for f in plan.errors] == ["plan.accelerate.gfn"], render(plan)
    assert plan.errors[0].message.startswith(f"{path}: {key}")
    environ = launched_environment(path)  # what accelerate launch really exports
    for name, value in environ.items():
        monkeypatch.setenv(name, value)
    with pytest.raises(ConfigError, match=f"^the accelerate config: {key}"):
        make_accelerator(paper("llama3.2-3b", "model.device=cpu").model)  # refused before accelerate starts


def test_a_float32_model_refuses_a_launch_in_bf16_and_takes_one_without_mixed_precision(paper_world, tmp_path):
    bf16 = make_plan(
        paper("llama3.2-3b", "model.dtype=float32", f"plan.accelerate.gfn={ACCELERATE / 'policy_fsdp_lora.yaml'}")
    )
    assert (
        "mixed_precision: bf16, but the training base trains with no for model.dtype=float32"
        in ({f.key: f.message for f in bf16.errors}["plan.accelerate.gfn"])
    )
    plain = accelerate_file(tmp_path, "policy_fsdp_lora.yaml", mixed_precision="no")
    assert "plan.accelerate.gfn" not in {
        f.key for f in make_plan(paper("llama3.2-3b", "model.dtype=float32", f"plan.accelerate.gfn={plain}")).errors
    }


def test_an_fsdp_key_accelerate_does_not_know_or_a_key_given_twice_is_refused_naming_file_and_key(
    paper_world, tmp_path
):
    path = accelerate_file(
        tmp_path, "policy_fsdp_lora.yaml", fsdp={"fsdp_offload_params": None, "fsdp_cpu_offload": False}
    )
    plan = make_plan(paper("llama3.2-3b", f"plan.accelerate.gfn={path}"))
    message = {f.key: f.message for f in plan.errors}["plan.accelerate.gfn"]
    assert message.startswith(
        f"{path}: fsdp_config.fsdp_cpu_offload is not an FSDP key accelerate knows (accelerate's is fsdp_offload_params)"
    )
    assert [s.notes[-1] for s in plan.stages if s.name == "gfn"] == [f"launch: fsdp ({path})"]  # still read as FSDP
    unknown = accelerate_file(tmp_path, "ddp.yaml", num_gpus=8)
    plan = make_plan(paper("llama3.2-3b", f"plan.accelerate.prm={unknown}"))
    assert f"{unknown}: num_gpus is not a key of accelerate's config files" in [f.message for f in plan.errors]
    twice = tmp_path / "twice.yaml"
    twice.write_text((ACCELERATE / "policy_fsdp_lora.yaml").read_text() + "mixed_precision: 'no'\n")
    plan = make_plan(paper("llama3.2-3b", f"plan.accelerate.gfn={twice}"))
    assert any(
        f.message.startswith(f"{twice}:") and "'mixed_precision' is given twice (first on line " in f.message
        for f in plan.errors
    ), render(plan)


def test_make_plan_takes_fsdp_with_hf_sampling_and_refuses_zero3_with_it_as_the_trainer_does(paper_world):
    fsdp = make_plan(paper("llama3.2-3b", "generation.backend=hf"))  # policy_fsdp_lora.yaml for gfn and ppo
    assert not [f for f in fsdp.errors if f.key.startswith("plan.accelerate") or f.key == "generation.backend"]
    zero3 = str(ACCELERATE / "deepspeed_zero3.yaml")
    plan = make_plan(paper("llama3.2-3b", "generation.backend=hf", f"plan.accelerate.gfn={zero3}"))
    message = {f.key: f.message for f in plan.errors}["plan.accelerate.gfn"]
    assert message.startswith(f"{zero3}: DeepSpeed ZeRO-3 with generation.backend=hf: no process holds the whole")


def test_make_plan_applies_the_trainers_setup_rules_with_the_stages_message(paper_world, monkeypatch):
    """make plan resolves each fine-tuning stage as the trainer does (pipeline.finetune.setup.resolve)
    under the accelerate file it names: FSDP2 with HF sampling is what the trainer runs (an HF copy
    of the policy), and an asynchronous run of several trainer processes without gfn.ray_address is
    refused with the stage's own message."""
    from pipeline.config.loader import ConfigError
    from pipeline.finetune import setup
    from pipeline.training.launch_settings import file_environment, read_accelerate_file

    fsdp = paper("llama3.2-3b", "generation.backend=hf")
    assert not [f for f in make_plan(fsdp).errors if f.key.startswith(("plan.accelerate", "gfn.", "ppo."))]
    environ = file_environment(read_accelerate_file(fsdp.plan.accelerate["gfn"]))
    assert setup.resolve(fsdp, "gfn", setup.FinetuneLaunch(8, environ)).sampler == "hf_copy"

    unjoined = paper("llama3.2-3b-async", "gfn.ray_address=null")
    refused = {f.key: f.message for f in make_plan(unjoined).errors}
    assert refused["gfn.ray_address"].startswith("gfn.mode=async under 8 trainer processes needs gfn.ray_address")
    monkeypatch.setattr(setup, "process_count", lambda model_config: 8)  # the stage under accelerate launch
    with pytest.raises(ConfigError) as stage:
        setup.preflight(unjoined, "gfn")
    assert str(stage.value) == refused["gfn.ray_address"]
    assert "gfn.ray_address" not in {f.key for f in make_plan(paper("llama3.2-3b-async")).errors}


def test_memory_beyond_the_device_names_the_key_that_shrinks_its_largest_item(paper_world):
    unsharded = make_plan(paper("llama3.2-3b", "plan.accelerate={}"))  # 8 DDP processes: each a whole 7B AdamW state
    assert "plan.accelerate.prm" in {f.key for f in unsharded.errors}, render(unsharded)
    one = make_plan(paper("qwen2.5-math-1.5b", "prm.lora=false"))  # one process: nothing to shard over
    assert "prm.lora" in {f.key for f in one.errors}, render(one)
    activations = make_plan(paper("llama3.2-3b", "prm.micro_batch_size=144"))
    prm = [f for f in activations.errors if "make prm: estimated" in f.message]
    assert [f.key for f in prm] == ["prm.micro_batch_size"], render(activations)


@pytest.mark.parametrize(
    ("environ", "strategy", "sharding"),
    [
        ({"ACCELERATE_USE_DEEPSPEED": "true"}, "zero2", "deepspeed"),  # stage unsaid: accelerate's 2
        ({"ACCELERATE_USE_DEEPSPEED": "true", "ACCELERATE_DEEPSPEED_ZERO_STAGE": "3"}, "zero3", "zero3"),
        ({"ACCELERATE_USE_FSDP": "true", "FSDP_VERSION": "2"}, "fsdp", "fsdp"),
        ({}, "ddp", "ddp"),
    ],
)
def test_make_plan_reads_a_launch_as_the_finetuning_setup_does(environ, strategy, sharding):
    """One reading of accelerate's variables (pipeline.finetune.setup.FinetuneLaunch): the running
    launch the stages' memory check plans for, and the setup that trains, agree on the strategy."""
    assert launch_from_environment({**environ, "WORLD_SIZE": "2"}).strategy == strategy
    assert FinetuneLaunch(2, environ).sharding == sharding


def test_the_plan_notes_the_draw_at_temperature_1_when_the_target_is_measured(paper_world):
    def eval_notes(*overrides):
        return next(s.notes for s in make_plan(paper("llama3.2-3b", *overrides)).stages if s.name == "eval")

    assert not any("eval.target_samples" in note for note in eval_notes())
    assert any("eval.target_samples=64" in note for note in eval_notes("eval.target_samples=64"))


def test_the_eval_stage_counts_the_snapshots_eval_curves_will_evaluate():
    from planner.costs import expected_snapshots

    tiny = REPO / "configs" / "tiny.yaml"
    assert expected_snapshots(load_config(tiny)) == {
        "gfn": 3,
        "ppo": 3,
    }  # 56 updates, one kept every 14 before the last
    assert expected_snapshots(load_config(tiny, ["gfn.snapshot_every=0"])) == {"ppo": 3}
    assert expected_snapshots(load_config(tiny, ["eval.curves=[]"])) == {}
    assert expected_snapshots(load_config(tiny, ["ppo.snapshot_every=55"])) == {"gfn": 3, "ppo": 1}
