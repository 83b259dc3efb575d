"""A step-level policy: samples whole solutions and gives teacher-forced step log-probs.

The fine-tuning loop and its objectives talk to a policy through two methods only:
- ``sample(prompts, n, temperature, seed)`` -> for each prompt, n ``SampledSolution``s;
- ``logprobs(prompts, step_lists, with_grad, ...)`` -> ``TrajectoryLogprobs`` from ONE
  teacher-forced forward (pipeline.generation.scoring), always under the current weights.
``LMPolicy`` is the language model; tests use a tabular policy with the same two methods.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch

from pipeline.generation.hf import HFGenerator
from pipeline.generation.scoring import trajectory_logprobs
from pipeline.steps import encode_prompt, encode_trajectory, split_steps


@dataclass
class SampledSolution:
    steps: list[str]
    finished: bool  # the policy emitted the end token (not cut off at max_new_tokens)
    num_tokens: int


class LMPolicy:
    """A causal LM (optionally peft-wrapped) seen as a step-level policy."""

    def __init__(self, model, tokenizer, separator: str = "\n", max_new_tokens: int = 160, generation_batch_size: int = 256,
                 autocast_dtype: torch.dtype | None = None):
        """autocast_dtype: run sampling and scoring under torch.autocast to this dtype (float32
        master weights trained in bf16, pipeline.modeling.upcast_trainable); None: as stored."""
        self.model = model
        self.autocast_dtype = autocast_dtype
        self.tokenizer = tokenizer
        self.separator = separator
        self.max_new_tokens = max_new_tokens
        self.generation_batch_size = generation_batch_size
        self._prompt_ids: dict[str, list[int]] = {}

    def parameters(self):
        return self.model.parameters()

    def _autocast(self):
        device_type = next(self.model.parameters()).device.type
        return torch.autocast(device_type, dtype=self.autocast_dtype or torch.bfloat16, enabled=self.autocast_dtype is not None)

    def sample(self, prompts: Sequence[str], n: int, temperature: float, seed: int | None = None) -> list[list[SampledSolution]]:
        was_training = self.model.training
        self.model.eval()
        generator = HFGenerator(self.model, self.tokenizer, batch_size=self.generation_batch_size)
        with self._autocast():
            outputs = generator.generate(list(prompts), n=n, temperature=temperature, max_new_tokens=self.max_new_tokens, seed=seed)
        self.model.train(was_training)
        return [
            [SampledSolution(split_steps(o.text, self.separator), o.finish_reason == "eos", len(o.token_ids)) for o in outs]
            for outs in outputs
        ]

    def _encode(self, prompt: str, steps: Sequence[str]):
        if prompt not in self._prompt_ids:
            self._prompt_ids[prompt] = encode_prompt(self.tokenizer, prompt)
        return encode_trajectory(self.tokenizer, prompt, steps, self.separator, add_end=True, prompt_ids=self._prompt_ids[prompt])

    def logprobs(
        self,
        prompts: Sequence[str],
        step_lists: Sequence[Sequence[str]],
        with_grad: bool,
        return_entropy: bool = False,
        return_hidden: bool = False,
    ):
        """TrajectoryLogprobs (pipeline.generation.scoring) of the given step lists."""
        batch = [self._encode(p, s) for p, s in zip(prompts, step_lists)]
        pad = self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else self.tokenizer.eos_token_id
        context = torch.enable_grad() if with_grad else torch.no_grad()
        with context, self._autocast():
            return trajectory_logprobs(
                self.model, batch, pad, with_grad=with_grad, return_entropy=return_entropy,
                return_boundary_hidden=return_hidden,
            )
