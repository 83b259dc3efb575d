"""The one generation interface: what every stage that samples codes against.

``generate(prompts, n, temperature, top_p, max_new_tokens, stop, seed)`` returns, for each
prompt in order, ``n`` Completions. ``seed`` is an int (one seed for the call) or one seed per
prompt (prompt i's sample j then draws from seed[i] + j only).

When a prompt's samples depend on the batch (the other prompts of the call, the chunk or engine
step it is decoded in, the process it lands on):

- with one seed for the call, always: the draws are consumed in batch order (HF) or by position (vLLM);
- with per-prompt seeds, the random draws are the prompt's own, but the logits they are applied
  to are computed in a batch whose size, padding (HF: the chunk's left padding and prefix) and
  composition (vLLM: continuous batching, chunked prefill, prefix-cache hits) depend on the rest
  of the call. Matrix kernels pick their reduction order by shape, so a logit can round
  differently in another batch, and a sample whose draw falls within that rounding of a token
  boundary changes from that token on. In float32 on one CPU thread this was not seen (the
  launcher test's workers write byte-equal samples); in bfloat16 on a GPU it happens in rare
  cases (docs/evaluation.md).
- vLLM promises samples independent of the batch only in its opt-in batch-invariant mode
  (``VLLM_BATCH_INVARIANT=1``; vLLM 0.32 implements it on CUDA GPUs of compute capability 8.x,
  9.x and 10.x, ROCm and XPU, not in its CPU build), with a seed per request, at a cost in speed:
  ``generation.vllm_batch_invariant=true`` sets it before the engine starts
  (pipeline.generation.vllm_settings.engine_environment). The HF backend has no such mode.

Both backends follow vLLM's conventions:

- ``text`` is the generated text; it ends with the stop string when generation stopped on one
  (and is cut right after it) and never contains the end token.
- ``token_ids`` are the generated ids up to and including the token that completed the stop
  string or the end token.
- ``finish_reason`` is "stop" (a stop string), "eos" (an end token) or "length" (max_new_tokens).

``close()`` hands the model's memory back at once (a vLLM engine is shut down): whoever loads one
model after another calls it in between.
"""

from __future__ import annotations

import gc
import hashlib
import json
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import torch

FINISH_REASONS = ("stop", "eos", "length")


@dataclass
class Completion:
    """One sampled continuation of a prompt."""

    text: str  # generated text; includes the stop string when it stopped on one; excludes the end token
    token_ids: list[int]  # generated ids (up to and including the stop/end token)
    finish_reason: str  # "stop" (hit a stop string) | "eos" (end token) | "length"


class Generator(Protocol):
    """Any generation backend (pipeline.generation.hf, pipeline.generation.vllm_backend)."""

    tokenizer: object

    def generate(
        self,
        prompts: Sequence[str],
        n: int = 1,
        temperature: float = 1.0,
        top_p: float = 1.0,
        max_new_tokens: int = 256,
        stop: Sequence[str] | None = None,
        seed: int | Sequence[int] | None = None,
    ) -> list[list[Completion]]: ...

    def close(self) -> None:
        """Let go of the model and the memory it holds now, before the next one loads (an
        evaluation of several models calls it between them); safe to call twice."""
        ...


def release_memory() -> None:
    """Collect what a closed generator dropped and return the GPU's cached blocks to the device."""
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def check_sampling_args(
    n: int, temperature: float, top_p: float, max_new_tokens: int, stop: Sequence[str] | None
) -> list[str]:
    """Validate the arguments shared by every backend, by vLLM's rules (its SamplingParams would
    refuse the rest, late and in its own words; n > 1 at temperature 0, which it refuses too, is n
    copies of the one greedy sample in both backends); returns the stop strings as a list."""
    if n < 1:
        raise ValueError(f"generate: n must be >= 1, got {n}")
    if not 0 <= temperature <= 2:
        raise ValueError(f"generate: temperature must be in [0, 2] (0 = greedy; vLLM refuses more), got {temperature}")
    if not 0 < top_p <= 1:
        raise ValueError(f"generate: top_p must be in (0, 1], got {top_p}")
    if max_new_tokens < 0:
        raise ValueError(f"generate: max_new_tokens must be >= 0, got {max_new_tokens}")
    if isinstance(stop, str):
        raise ValueError(f"generate: stop must be a sequence of strings, got the string {stop!r}; wrap it in a list")
    stops = list(stop or [])
    if any(not s for s in stops):
        raise ValueError("generate: stop strings must be non-empty")
    return stops


def stream_seed(*parts) -> int:
    """The seed of one random stream, a 62-bit integer drawn from ``parts`` (JSON values: a run's
    seed, a problem id, a prefix...). Passed per prompt (``generate(..., seed=[...])``), it makes a
    prompt's samples depend on nothing but its own parts: not on the other prompts of the call, the
    batch it lands in, or which worker of a sharded run holds it. Sample j draws from stream + j;
    62 bits leave room for that."""
    text = json.dumps(list(parts), ensure_ascii=False)
    return int.from_bytes(hashlib.sha256(text.encode("utf-8")).digest()[:8], "little") >> 2


def check_seeds(seed, prompts: Sequence[str]) -> None:
    """Per-prompt seeds (a sequence) must come one per prompt."""
    if isinstance(seed, Sequence) and len(seed) != len(prompts):
        raise ValueError(f"generate: {len(seed)} seeds for {len(prompts)} prompts; expected one per prompt")


def truncate_at_stop(text: str, stops: Sequence[str]) -> tuple[str, bool]:
    """Cut ``text`` right after the stop string that is completed first (earliest end).

    Returns (text, True) when a stop string occurs, else (text, False).
    """
    best_end = None
    for s in stops:
        index = text.find(s)
        if index >= 0:
            end = index + len(s)
            if best_end is None or end < best_end:
                best_end = end
    if best_end is None:
        return text, False
    return text[:best_end], True
