"""A step-level policy: samples whole solutions and gives teacher-forced step log-probs.

The fine-tuning loop and its objectives talk to a policy through three methods only:
- ``sample(prompts, n, temperature, seed)`` -> for each prompt, n ``SampledSolution``s;
- ``logprobs(prompts, step_lists, with_grad, ...)`` -> ``TrajectoryLogprobs`` from ONE
  teacher-forced forward (pipeline.generation.step_logprobs), always under the current weights;
- ``after_update(version, weights)`` after every training step (a sampler with its own copy of
  the weights, such as a colocated vLLM engine, reloads them);
and an asynchronous searcher's copy also through ``load_weights(state, version)``.
``LMPolicy`` is the language model; tests use a tabular policy with the same methods.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass

import torch

from pipeline.generation.hf import HFGenerator
from pipeline.generation.step_logprobs import trajectory_logprobs
from pipeline.modeling import copy_weights, iter_merged_lora
from pipeline.steps import encode_prompt, encode_trajectory, split_steps
from pipeline.training.gathering import load_streamed


@dataclass
class SampledSolution:
    steps: list[str]
    finished: bool  # the policy emitted the end token (not cut off at max_new_tokens)
    num_tokens: int


class LMPolicy:
    """A causal LM (optionally peft-wrapped) seen as a step-level policy.

    model:     the causal LM. Under ``accelerate launch`` the trainer calls ``prepared`` with the
               wrapped module (DDP, FSDP) that teacher-forced forwards must go through, and the
               plain one generation and weight syncing use.
    autocast_dtype: run sampling and scoring under torch.autocast to this dtype (float32 master
               weights trained in bf16, pipeline.modeling.upcast_trainable); None: as stored
    sampler:   what samples solutions: None = HF generation on the live weights (always
               on-policy); or a generator with its own copy of the weights and ``load_weights``
               (the colocated vLLM engine, pipeline.generation.vllm_backend; an HFGenerator over
               a plain copy when the trained model is sharded), which ``after_update`` refreshes
    lora_scaling: alpha / r of the model's LoRA adapters (merged into the weights a vLLM
               sampler is given), None without LoRA
    lora_fan_in_fan_out: the adapters sit on (in, out) weights (GPT-2's Conv1D): merged transposed
    """

    def __init__(
        self,
        model,
        tokenizer,
        separator: str = "\n",
        max_new_tokens: int = 160,
        generation_batch_size: int = 256,
        autocast_dtype: torch.dtype | None = None,
        sampler=None,
        lora_scaling: float | None = None,
        lora_fan_in_fan_out: bool = False,
    ):
        self.model = model
        self.module = model
        self.autocast_dtype = autocast_dtype
        self.tokenizer = tokenizer
        self.separator = separator
        self.max_new_tokens = max_new_tokens
        self.generation_batch_size = generation_batch_size
        self.sampler = sampler
        self.lora_scaling = lora_scaling
        self.lora_fan_in_fan_out = lora_fan_in_fan_out
        self._prompt_ids: dict[str, list[int]] = {}

    def prepared(self, wrapped, module) -> None:
        """Forwards through ``wrapped`` (gradient sync), generation on ``module``."""
        self.model, self.module = wrapped, module

    def _autocast(self):
        device_type = next(self.module.parameters()).device.type
        return torch.autocast(
            device_type, dtype=self.autocast_dtype or torch.bfloat16, enabled=self.autocast_dtype is not None
        )

    def sample(self, prompts: Sequence[str], n: int, temperature: float, seed=None) -> list[list[SampledSolution]]:
        """n solutions per prompt; seed: an int or one per prompt (pipeline.generation)."""
        if self.sampler is not None:
            outputs = self.sampler.generate(
                list(prompts), n=n, temperature=temperature, max_new_tokens=self.max_new_tokens, seed=seed
            )
        else:
            was_training = self.module.training
            self.module.eval()
            generator = HFGenerator(self.module, self.tokenizer, batch_size=self.generation_batch_size)
            with self._autocast():
                outputs = generator.generate(
                    list(prompts), n=n, temperature=temperature, max_new_tokens=self.max_new_tokens, seed=seed
                )
            self.module.train(was_training)
        return [
            [
                SampledSolution(split_steps(o.text, self.separator), o.finish_reason == "eos", len(o.token_ids))
                for o in outs
            ]
            for outs in outputs
        ]

    def after_update(self, version: int, weights: Callable[..., Iterable[tuple[str, torch.Tensor]]]) -> None:
        """The weights changed (training step ``version`` is done): a sampler holding a copy
        reloads them (``weights(dtype=None)``: the trained model's whole state dict as a stream of
        (name, tensor), e.g. TrainingBase.iter_full_state, gathered from shards as it is read), one
        tensor at a time, read to its end on every process (pipeline.training.gathering.load_streamed)."""
        if self.sampler is not None:
            # gathered straight into the sampler's dtype when the sampler says which (LoRA: merged
            # first, in the trained dtype, one module at a time)
            dtype = getattr(self.sampler, "weights_dtype", None) if self.lora_scaling is None else None
            stream = weights(dtype) if dtype is not None else weights()
            load_streamed(self.sampler.load_weights, self.plain_stream(stream))

    def plain_stream(self, weights: Iterable[tuple[str, torch.Tensor]]) -> Iterable[tuple[str, torch.Tensor]]:
        """The trained model's (name, tensor) stream as a plain transformers model's: LoRA
        adapters merged into their base weights (W + alpha/r B A) under the base names, module by
        module as they come (pipeline.modeling.iter_merged_lora)."""
        if self.lora_scaling is None:
            return weights
        return iter_merged_lora(weights, self.lora_scaling, self.lora_fan_in_fan_out)

    def load_weights(
        self, weights: Mapping[str, torch.Tensor] | Iterable[tuple[str, torch.Tensor]], version: int
    ) -> None:
        """Sample from now on with ``weights`` (plain weights: a state dict, or a stream of
        (name, tensor) copied in one at a time), published by the trainer after training step
        ``version``: an asynchronous searcher's copy of the policy, or a reset reference. A searcher
        whose engine samples and whose model scores (gfn.importance_correction) loads both: the
        weights must then be a state dict (a stream is read once)."""
        if self.sampler is not None:
            if self.module is not None:
                if not isinstance(weights, Mapping):
                    raise ValueError(
                        "LMPolicy.load_weights: an engine and a model to load need a state dict, not a stream"
                    )
                copy_weights(self.module, weights, strict=True, who="LMPolicy.load_weights")
            self.sampler.load_weights(weights)
        else:
            copy_weights(self.module, weights, strict=True, who="LMPolicy.load_weights")

    def _encode(self, prompt: str, steps: Sequence[str]):
        if prompt not in self._prompt_ids:
            self._prompt_ids[prompt] = encode_prompt(self.tokenizer, prompt)
        return encode_trajectory(
            self.tokenizer, prompt, steps, self.separator, add_end=True, prompt_ids=self._prompt_ids[prompt]
        )

    def logprobs(
        self,
        prompts: Sequence[str],
        step_lists: Sequence[Sequence[str]],
        with_grad: bool,
        return_entropy: bool = False,
        return_hidden: bool = False,
    ):
        """TrajectoryLogprobs (pipeline.generation.step_logprobs) of the given step lists."""
        batch = [self._encode(p, s) for p, s in zip(prompts, step_lists)]
        pad = self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else self.tokenizer.eos_token_id
        context = torch.enable_grad() if with_grad else torch.no_grad()
        with context, self._autocast():
            return trajectory_logprobs(
                self.model,
                batch,
                pad,
                with_grad=with_grad,
                return_entropy=return_entropy,
                return_boundary_hidden=return_hidden,
            )
