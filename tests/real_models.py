"""Tiny models of the real architectures the paper configs name, built locally (no hub).

A Llama shaped like Llama-3.2-Instruct and a Qwen2 shaped like Qwen2.5(-Math): their special
tokens, their BOS behaviour and their chat templates, on a byte-level BPE tokenizer trained here
with ``tokenizers`` and a model a few thousand parameters wide at random init.

- Llama-3: the tokenizer adds <|begin_of_text|> (BOS) to every encoded text AND the chat template
  writes it too (the pair that gives a double BOS when a rendered template is tokenized with
  special tokens); eos <|eot_id|>; no pad token; the generation config stops on <|eot_id|>,
  <|eom_id|> and <|end_of_text|>.
- Qwen2.5: a tokenizer with no BOS (the model's config names <|endoftext|> as its bos id, but
  nothing adds it), a ChatML template (<|im_start|> ... <|im_end|>) with a default system turn,
  eos <|im_end|>, pad <|endoftext|>.

Tests that need a policy or a PRM backbone of a real architecture build them here
(``build_llama3``, ``build_qwen2``); nothing is downloaded.
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path

import torch
import transformers
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
from transformers import PreTrainedTokenizerFast

from pipeline.prompts import FEW_SHOT, INSTRUCTIONS

LLAMA3_BOS, LLAMA3_EOT, LLAMA3_EOM, LLAMA3_END = "<|begin_of_text|>", "<|eot_id|>", "<|eom_id|>", "<|end_of_text|>"
LLAMA3_SPECIALS = [LLAMA3_BOS, LLAMA3_END, "<|start_header_id|>", "<|end_header_id|>", LLAMA3_EOM, LLAMA3_EOT]

# Llama-3.2-Instruct's template, shortened (no tools): it writes bos_token itself, then a system
# turn with the knowledge-cutoff lines, then every message as a header + content + <|eot_id|>.
LLAMA3_CHAT_TEMPLATE = (
    "{{- bos_token }}"
    "{%- if messages[0]['role'] == 'system' %}{%- set system_message = messages[0]['content'] | trim %}"
    "{%- set messages = messages[1:] %}{%- else %}{%- set system_message = '' %}{%- endif %}"
    "{{- '<|start_header_id|>system<|end_header_id|>\\n\\n' }}"
    "{{- 'Cutting Knowledge Date: December 2023\\nToday Date: 26 Jul 2024\\n\\n' }}"
    "{{- system_message }}{{- '<|eot_id|>' }}"
    "{%- for message in messages %}"
    "{{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n' + message['content'] | trim + '<|eot_id|>' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}{%- endif %}"
)

QWEN2_PAD, QWEN2_START, QWEN2_END = "<|endoftext|>", "<|im_start|>", "<|im_end|>"
QWEN2_SPECIALS = [QWEN2_PAD, QWEN2_START, QWEN2_END]

# Qwen2.5-Math's ChatML template: a default system turn when the messages bring none; no BOS.
QWEN2_CHAT_TEMPLATE = (
    "{%- for message in messages %}"
    "{%- if loop.first and message['role'] != 'system' %}"
    "{{- '<|im_start|>system\\nPlease reason step by step, and put your final answer within \\\\boxed{}.<|im_end|>\\n' }}"
    "{%- endif %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)


def corpus(questions: Iterable[str] = ()) -> list[str]:
    """What the tokenizers are trained on: the prompts' instructions, the few-shot solutions,
    the chat templates' fixed text and ``questions`` (e.g. benchmark problems)."""
    texts = list(INSTRUCTIONS.values()) + list(questions)
    for shots in FEW_SHOT.values():
        for question, steps in shots:
            texts += [question, *steps]
    texts += [
        "system",
        "user",
        "assistant",
        "Cutting Knowledge Date: December 2023\nToday Date: 26 Jul 2024",
        "Please reason step by step, and put your final answer within \\boxed{}.",
        "The answer is \\boxed{42}",
    ]
    return texts


def _byte_level_bpe(texts: Iterable[str], specials: list[str], vocab_size: int) -> Tokenizer:
    backend = Tokenizer(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    backend.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=specials,
        show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )  # any byte stays encodable
    backend.train_from_iterator(list(texts), trainer=trainer)
    return backend


def llama3_tokenizer(texts: Iterable[str], vocab_size: int = 640) -> PreTrainedTokenizerFast:
    """Byte-level BPE with Llama-3's special tokens: adds <|begin_of_text|> to every encoded text
    (add_special_tokens=True), eos <|eot_id|>, no pad token, Llama-3's chat template."""
    backend = _byte_level_bpe(texts, LLAMA3_SPECIALS, vocab_size)
    bos_id = backend.token_to_id(LLAMA3_BOS)
    backend.post_processor = processors.TemplateProcessing(
        single=f"{LLAMA3_BOS} $A", pair=f"{LLAMA3_BOS} $A {LLAMA3_BOS} $B", special_tokens=[(LLAMA3_BOS, bos_id)]
    )
    return PreTrainedTokenizerFast(
        tokenizer_object=backend,
        bos_token=LLAMA3_BOS,
        eos_token=LLAMA3_EOT,
        chat_template=LLAMA3_CHAT_TEMPLATE,
        clean_up_tokenization_spaces=True,
        model_max_length=1024,
    )


def qwen2_tokenizer(texts: Iterable[str], vocab_size: int = 640) -> PreTrainedTokenizerFast:
    """Byte-level BPE with Qwen2.5's special tokens: no BOS, eos <|im_end|>, pad <|endoftext|>,
    the ChatML template."""
    backend = _byte_level_bpe(texts, QWEN2_SPECIALS, vocab_size)
    return PreTrainedTokenizerFast(
        tokenizer_object=backend,
        eos_token=QWEN2_END,
        pad_token=QWEN2_PAD,
        chat_template=QWEN2_CHAT_TEMPLATE,
        clean_up_tokenization_spaces=False,
        model_max_length=1024,
    )


_SIZES = dict(
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=1024,
    tie_word_embeddings=True,
)


def llama3_model(tokenizer, seed: int = 0) -> transformers.LlamaForCausalLM:
    """A LlamaForCausalLM at random init with Llama-3.2's ids: bos <|begin_of_text|>, the three
    end tokens of its generation config, tied embeddings, rope theta 500000."""
    torch.manual_seed(seed)
    ends = [tokenizer.convert_tokens_to_ids(t) for t in (LLAMA3_END, LLAMA3_EOM, LLAMA3_EOT)]
    config = transformers.LlamaConfig(
        vocab_size=len(tokenizer), bos_token_id=tokenizer.bos_token_id, eos_token_id=ends, rope_theta=500000.0, **_SIZES
    )
    model = transformers.LlamaForCausalLM(config)
    model.generation_config.bos_token_id, model.generation_config.eos_token_id = tokenizer.bos_token_id, ends
    return model.eval()


def qwen2_model(tokenizer, seed: int = 0) -> transformers.Qwen2ForCausalLM:
    """A Qwen2ForCausalLM at random init with Qwen2.5-Math-Instruct's ids: its config.json names
    <|endoftext|> as bos_token_id although the tokenizer has no BOS and adds none (nothing may
    take the model's bos id for a token to put before a prompt), eos <|im_end|>, the generation
    config stopping on <|im_end|> and <|endoftext|>, pad <|endoftext|>."""
    torch.manual_seed(seed)
    end, pad = tokenizer.convert_tokens_to_ids(QWEN2_END), tokenizer.convert_tokens_to_ids(QWEN2_PAD)
    config = transformers.Qwen2Config(
        vocab_size=len(tokenizer), bos_token_id=pad, eos_token_id=end, pad_token_id=pad, rope_theta=1000000.0, **_SIZES
    )
    model = transformers.Qwen2ForCausalLM(config)
    model.generation_config.bos_token_id, model.generation_config.eos_token_id = pad, [end, pad]
    model.generation_config.pad_token_id = pad
    return model.eval()


def save(model, tokenizer, path: str | Path) -> Path:
    """A model folder as the hub holds one (save_pretrained of model and tokenizer)."""
    path = Path(path)
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


def build_llama3(path: str | Path, texts: Iterable[str], seed: int = 0) -> Path:
    """A tiny Llama-3.2-Instruct-shaped model folder at ``path``."""
    tokenizer = llama3_tokenizer(texts)
    return save(llama3_model(tokenizer, seed), tokenizer, path)


def build_qwen2(path: str | Path, texts: Iterable[str], seed: int = 0) -> Path:
    """A tiny Qwen2.5-shaped model folder at ``path``."""
    tokenizer = qwen2_tokenizer(texts)
    return save(qwen2_model(tokenizer, seed), tokenizer, path)
