"""Fine-tuning with a vLLM sampler: after every update the engine holds the trained weights.

The engine is a fake shaped like vllm.LLM (generate, collective_rpc("reload_weights"),
reset_prefix_cache), so these run in every venv. What is tested is our side of the sync: which
weights go in, when, under which names (LoRA merged), that the prefix cache is dropped, and that
every trajectory is sampled by the weights of the step before it (on-policy). The real engine's
side (its greedy tokens equal the trained policy's after every step) is tests/test_vllm_engine.py.
"""

from __future__ import annotations

import copy
from types import SimpleNamespace

import torch

from pipeline.config.loader import load_config
from pipeline.config.schema import GFNConfig, ModelConfig
from pipeline.finetune.objectives import build_objective
from pipeline.finetune.policy import LMPolicy
from pipeline.finetune.run import add_lora, optimizer_settings
from pipeline.finetune.sampling import TrainProblem, TrajectorySampler
from pipeline.finetune.trainer import FinetuneTrainer
from pipeline.generation.vllm_backend import VLLMGenerator
from pipeline.modeling import load_causal_lm, load_tokenizer
from pipeline.training import TrainingBase, make_accelerator

SOLUTIONS = ["Ann has 3 apples: 3 + 2 = 5.\nThe answer is 5.", "Ann has 3 apples: 3 + 2 = 6.\nThe answer is 6."]


class FakeModel:
    """What vLLM's worker reload_weights(weights_iterator=...) reads: (name, tensor) pairs."""

    def __init__(self):
        self.loads: list[dict[str, torch.Tensor]] = []

    def reload_weights(self, weights_iterator):
        self.loads.append({name: tensor.detach().clone() for name, tensor in weights_iterator})


class FakeEngine:
    def __init__(self, tokenizer):
        self.model = FakeModel()
        self.cache_resets = 0
        self.tokenizer = tokenizer  # the sampler encodes its prompts with the engine's tokenizer

    def get_tokenizer(self):
        return self.tokenizer

    def collective_rpc(self, method, timeout=None, args=(), kwargs=None):
        return [getattr(self.model, method)(*args, **(kwargs or {}))]

    def reset_prefix_cache(self):
        self.cache_resets += 1

    def generate(self, prompts, sampling_params, use_tqdm=False, lora_request=None):
        def output(j):
            return SimpleNamespace(
                index=j, text=SOLUTIONS[j % 2], token_ids=(1, 2, 3), finish_reason="stop", stop_reason=None
            )

        return [SimpleNamespace(outputs=[output(j) for j in range(params.n)]) for params in sampling_params]


class ConstantScorer:
    def log_scores_many(self, pairs):
        return [[-0.5] * len(steps) for _, steps in pairs]


def make_trainer(world, tmp_path, lora: bool):
    config = load_config(None, ["format.use_chat_template=false"])
    cfg = GFNConfig(
        loss="tb_vargrad",
        lr=1e-2,
        scheduler="constant",
        warmup_steps=0,
        num_train_steps=3,
        questions_per_step=2,
        samples_per_question=2,
        micro_batch_size=8,
        save_every=0,
        lora=lora,
        lora_r=4,
        lora_alpha=8,
        lora_target_modules=["q_proj", "v_proj"],
    )
    tokenizer = load_tokenizer(str(world / "policy"))
    model = load_causal_lm(str(world / "policy"), ModelConfig(device="cpu", dtype="float32"), is_trainable=True)
    if lora:
        model = add_lora(model, cfg)
    model.train()
    engine = FakeEngine(tokenizer)
    sampler = VLLMGenerator("policy", config, engine=engine, sampling_params_cls=SimpleNamespace)
    policy = LMPolicy(model, tokenizer, sampler=sampler, lora_scaling=cfg.lora_alpha / cfg.lora_r if lora else None)
    objective = build_objective(cfg, policy, hidden_size=model.config.get_text_config().hidden_size)
    base = TrainingBase(
        make_accelerator(ModelConfig(device="cpu", dtype="float32")),
        model,
        optimizer_settings(cfg, 1),
        tmp_path,
        objective=objective,
        progress=False,
    )
    policy.prepared(base.model, base.unwrapped)
    problems = [
        TrainProblem(f"p{i}", "How many apples?", "Question: How many apples?\nAnswer:\n", "5") for i in range(4)
    ]
    return FinetuneTrainer(
        base, TrajectorySampler(policy, ConstantScorer(), problems, "tiny", cfg), objective, cfg, progress=False
    ), engine


def test_every_update_reloads_the_engine_and_drops_its_prefix_cache(random_tiny_world, tmp_path):
    trainer, engine = make_trainer(random_tiny_world, tmp_path, lora=False)
    start = {k: v.clone() for k, v in trainer.base.unwrapped.state_dict().items()}
    for step in range(1, 4):
        trainer.train_step()
        assert len(engine.model.loads) == step and engine.cache_resets == step
        loaded = engine.model.loads[-1]
        live = trainer.base.unwrapped.state_dict()
        assert loaded.keys() == live.keys()  # the transformers names vLLM's loader expects
        assert all(torch.equal(loaded[name], live[name]) for name in live)
    assert not all(
        torch.equal(start[name], engine.model.loads[-1][name]) for name in start
    )  # training moved the weights
    versions = [t.policy_version for t in trainer.objective.buffer.sample(64)]
    assert set(versions) <= {0, 1, 2}  # each trajectory was sampled by the weights of the step before it


def test_lora_adapters_reach_the_engine_merged_into_plain_weight_names(random_tiny_world, tmp_path):
    trainer, engine = make_trainer(random_tiny_world, tmp_path, lora=True)
    trainer.train_step()
    loaded = engine.model.loads[-1]
    assert not any("lora_" in name or "base_layer" in name or name.startswith("base_model.") for name in loaded)
    reference = copy.deepcopy(trainer.base.unwrapped).merge_and_unload().state_dict()
    assert loaded.keys() == reference.keys()
    for name, value in reference.items():
        assert torch.allclose(loaded[name], value, atol=1e-6), name


def test_a_policy_adapter_reaches_the_colocated_engine_merged_before_the_first_sample(
    random_tiny_world, tmp_path, monkeypatch
):
    """The engine loads model.policy alone; the policy being fine-tuned is policy + adapter: the
    engine gets the merged weights (the adapter's own alpha / r) before it samples anything."""
    import importlib.util

    from peft import LoraConfig, get_peft_model

    from pipeline import generation
    from pipeline.datasets.loaders import load_benchmark
    from pipeline.finetune import run

    base_model = load_causal_lm(str(random_tiny_world / "policy"), ModelConfig(device="cpu", dtype="float32"))
    tuned = get_peft_model(
        base_model, LoraConfig(r=2, lora_alpha=6, target_modules=["q_proj", "v_proj"], init_lora_weights=False)
    )
    tuned.save_pretrained(tmp_path / "adapter")  # B != 0: the adapter changes the policy
    merged = copy.deepcopy(tuned).merge_and_unload().state_dict()
    tokenizer = load_tokenizer(str(random_tiny_world / "policy"))
    events: list[str] = []

    class RecordingEngine(FakeEngine):
        def generate(self, prompts, sampling_params, use_tqdm=False, lora_request=None):
            events.append("generate")
            return super().generate(prompts, sampling_params, use_tqdm, lora_request)

        def collective_rpc(self, method, timeout=None, args=(), kwargs=None):
            events.append(method)
            return super().collective_rpc(method, timeout, args, kwargs)

    engines = []

    def fake_generator(path, config, **kwargs):
        engines.append(RecordingEngine(tokenizer))
        return VLLMGenerator(path, config, engine=engines[-1], sampling_params_cls=SimpleNamespace)

    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: object() if name == "vllm" else real_find_spec(name, *a)
    )
    monkeypatch.setattr(generation, "VLLMGenerator", fake_generator)
    config = load_config(
        None,
        [
            f"runs_root={tmp_path}",
            "format.use_chat_template=false",
            "model.device=cpu",
            "model.dtype=float32",
            f"model.policy={random_tiny_world / 'policy'}",
            f"model.policy_adapter={tmp_path / 'adapter'}",
            "generation.backend=vllm",
            "gfn.num_train_steps=1",
            "gfn.questions_per_step=2",
            "gfn.samples_per_question=2",
            "gfn.micro_batch_size=8",
            "gfn.save_every=0",
            "gfn.warmup_steps=0",
        ],
    )
    problems = load_benchmark("problems", path=random_tiny_world / "problems_train.jsonl")
    run.finetune_policy(config, "gfn", problems, ConstantScorer, tmp_path / "gfn", progress=False)
    assert events[:2] == ["reload_weights", "generate"]
    first = engines[0].model.loads[0]
    assert first.keys() == merged.keys()
    for name, value in merged.items():
        assert torch.allclose(first[name], value, atol=1e-6), name
