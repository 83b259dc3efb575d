"""Prompt ids carry the tokenizer's BOS exactly once, on every path a prompt takes to a model:
policy training (LMPolicy / encode_trajectory), PRM training and scoring (SolutionEncoder, the
adapters), HF generation and vLLM generation. Checked with Llama-3's pair (a tokenizer that adds
BOS and a chat template that writes it) and Qwen2.5's (neither), both built locally."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import real_models
import torch

from pipeline.config.schema import Config, FormatConfig
from pipeline.finetune.policy import LMPolicy
from pipeline.generation.hf import HFGenerator
from pipeline.generation.vllm_backend import VLLMGenerator
from pipeline.prompts import build_prompt
from pipeline.steps import encode_prompt
from prm.data import SolutionEncoder

QUESTION = "What is $2 + 3$?"


@pytest.fixture(scope="module")
def tokenizers():
    texts = real_models.corpus([QUESTION])
    return {"llama3": real_models.llama3_tokenizer(texts), "qwen2": real_models.qwen2_tokenizer(texts)}


def expected_start(tokenizer) -> list[int]:
    """What a prompt's ids begin with: BOS once for Llama-3, nothing added for Qwen2.5."""
    return [tokenizer.bos_token_id] if tokenizer.bos_token_id is not None else []


def assert_bos_once(ids, tokenizer):
    ids = list(ids)
    bos = tokenizer.bos_token_id
    if bos is None:
        assert ids[0] == tokenizer.convert_tokens_to_ids(
            "<|im_start|>"
        )  # the template's first token, nothing before it
        return
    assert ids[0] == bos and ids.count(bos) == 1, ids[:4]
    assert ids[1] == tokenizer.convert_tokens_to_ids("<|start_header_id|>")


def chat_prompt(tokenizer) -> str:
    return build_prompt(QUESTION, kind="math", tokenizer=tokenizer)


@pytest.mark.parametrize("name", ["llama3", "qwen2"])
def test_chat_prompt_ids_carry_bos_once(tokenizers, name):
    tokenizer = tokenizers[name]
    prompt = chat_prompt(tokenizer)
    assert prompt.startswith(tokenizer.bos_token or "<|im_start|>")  # Llama-3's template writes BOS itself
    assert_bos_once(encode_prompt(tokenizer, prompt), tokenizer)
    plain = build_prompt(QUESTION, kind="math", tokenizer=tokenizer, use_chat_template=False)
    assert encode_prompt(tokenizer, plain)[: len(expected_start(tokenizer))] == expected_start(
        tokenizer
    )  # the tokenizer adds it


@pytest.mark.parametrize("name", ["llama3", "qwen2"])
def test_training_and_prm_scoring_encode_the_prompt_with_bos_once(tokenizers, name):
    tokenizer = tokenizers[name]
    policy = LMPolicy(torch.nn.Linear(1, 1), tokenizer, "\n", max_new_tokens=4)
    segmented = policy._encode(chat_prompt(tokenizer), ["Add: 2 + 3 = 5.", "The answer is \\boxed{5}"])
    assert_bos_once(segmented.input_ids, tokenizer)
    ids, _ = SolutionEncoder(tokenizer, FormatConfig(), "math").encode(QUESTION, ["Add: 2 + 3 = 5."])
    assert_bos_once(ids, tokenizer)


@pytest.mark.parametrize("name", ["llama3", "qwen2"])
def test_hf_generation_feeds_the_model_bos_once(tokenizers, name):
    tokenizer = tokenizers[name]
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token  # as pipeline.modeling.load_tokenizer does for Llama-3
    model = {"llama3": real_models.llama3_model, "qwen2": real_models.qwen2_model}[name](tokenizer)
    seen = []
    model.register_forward_pre_hook(
        lambda module, args, kwargs: seen.append(kwargs["input_ids"][0].tolist()), with_kwargs=True
    )
    HFGenerator(model, tokenizer).generate([chat_prompt(tokenizer)], n=1, temperature=0, max_new_tokens=1)
    assert_bos_once(seen[0], tokenizer)


class PromptRecordingEngine:
    """Shaped like vllm.LLM: records what generate() is handed."""

    def __init__(self, tokenizer):
        self.tokenizer, self.prompts = tokenizer, None

    def get_tokenizer(self):
        return self.tokenizer

    def generate(self, prompts, sampling_params, use_tqdm=False, lora_request=None):
        self.prompts = prompts
        out = SimpleNamespace(
            index=0, text="", token_ids=(self.tokenizer.eos_token_id,), finish_reason="stop", stop_reason=None
        )
        return [SimpleNamespace(outputs=[out]) for _ in prompts]


@pytest.mark.parametrize("name", ["llama3", "qwen2"])
def test_vllm_generation_is_handed_prompt_ids_with_bos_once(tokenizers, name):
    tokenizer = tokenizers[name]
    engine = PromptRecordingEngine(tokenizer)
    VLLMGenerator("tiny", Config(), engine=engine, sampling_params_cls=SimpleNamespace).generate(
        [chat_prompt(tokenizer)], max_new_tokens=4
    )
    (request,) = engine.prompts
    assert set(request) == {"prompt_token_ids"}  # ids: vLLM adds no special tokens of its own to them
    assert_bos_once(request["prompt_token_ids"], tokenizer)
