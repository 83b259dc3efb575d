"""The vLLM backend (extra ``vllm``; GPU only). The only module of the project that imports vllm,
and only inside VLLMGenerator's constructor, so everything else runs without it.

generate() sends all prompts in one ``LLM.generate`` call with ``SamplingParams(n=...)``;
prefix caching lets the n samples of a prompt (and prompts that share a prefix, as MCTS
prefixes do) reuse its KV blocks. The conversion of vLLM's RequestOutput to Completion is the
pure function ``completions_from_request_output``, unit-tested with a fake engine.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any, Sequence

from pipeline.generation.base import Completion, check_sampling_args, check_seeds, release_memory
from pipeline.steps import encode_prompt


def finish_reason_from_vllm(finish_reason: str | None, stop_reason: int | str | None) -> str:
    """vLLM's (finish_reason, stop_reason) -> ours.

    "stop" with stop_reason None: the EOS token; with an int: a stop token id (vLLM also stops on
    the generation config's extra eos ids this way) -> "eos"; with a string: a stop string -> "stop".
    "length" -> "length". Anything else (None, "abort") is an error: the request did not finish.
    """
    if finish_reason == "length":
        return "length"
    if finish_reason == "stop":
        return "stop" if isinstance(stop_reason, str) else "eos"
    raise RuntimeError(f"vLLM request did not finish normally (finish_reason={finish_reason!r}, stop_reason={stop_reason!r})")


def completions_from_request_output(request_output: Any) -> list[Completion]:
    """One vLLM RequestOutput (``.outputs``: CompletionOutputs with text, token_ids,
    finish_reason, stop_reason, index) -> Completions ordered by sample index."""
    outputs = sorted(request_output.outputs, key=lambda o: getattr(o, "index", 0))
    return [
        Completion(
            text=output.text,
            token_ids=[int(t) for t in output.token_ids],
            finish_reason=finish_reason_from_vllm(output.finish_reason, output.stop_reason),
        )
        for output in outputs
    ]


def sampling_params_kwargs(
    n: int, temperature: float, top_p: float, max_new_tokens: int, stop: Sequence[str], seed: int | None
) -> dict:
    """The SamplingParams of one request (vLLM gives the n children seeds seed, seed+1, ...)."""
    return {
        "n": n,
        "temperature": temperature,
        "top_p": top_p,
        "max_tokens": max_new_tokens,
        "stop": list(stop),
        "include_stop_str_in_output": True,
        "seed": seed,
    }


def _adapter_rank(adapter: str) -> int:
    config_file = Path(adapter) / "adapter_config.json"
    if not config_file.is_file():
        raise FileNotFoundError(f"{config_file}: not found; model.policy_adapter must be a peft adapter folder")
    return int(json.loads(config_file.read_text(encoding="utf-8")).get("r", 16))


class VLLMGenerator:
    """Generation through a vLLM engine.

    model_path: hub id or folder of the model
    config:     the pipeline Config (generation.vllm_*, model.dtype, model.trust_remote_code, seed)
    adapter:    optional peft LoRA adapter folder, served with a LoRARequest
    weight_updates: its weights will be replaced with ``load_weights`` (a fine-tuning sampler):
                the engine core runs in this process so that ``apply_model`` reaches the model
                without pickling anything
    colocate:   the engine shares this process (and its GPU) with a trainer that refreshes its
                weights after every optimizer step: as weight_updates, plus vLLM's
                "external_launcher" executor under ``accelerate launch`` (one engine per
                process, tensor parallel size 1)
    engine, sampling_params_cls: inject a fake engine (tests); by default vllm.LLM / SamplingParams
    """

    def __init__(self, model_path: str, config, adapter: str | None = None, *, weight_updates: bool = False, colocate: bool = False,
                 engine=None, sampling_params_cls=None, progress: bool = False):
        self.model_path = model_path
        self.adapter = adapter
        self.progress = progress
        self._lora_request = None
        self._owns_engine = engine is None
        if engine is None:
            import vllm  # lazy: the extra is optional and GPU-only

            gen = config.generation
            kwargs = {
                "model": model_path,
                "tensor_parallel_size": gen.vllm_tensor_parallel_size,
                "enable_prefix_caching": gen.vllm_enable_prefix_caching,
                "gpu_memory_utilization": gen.vllm_gpu_memory_utilization,
                "max_model_len": gen.vllm_max_model_len,
                "trust_remote_code": config.model.trust_remote_code,
                "seed": config.seed,
            }
            if config.model.dtype != "auto":
                kwargs["dtype"] = config.model.dtype
            if adapter:
                kwargs["enable_lora"] = True
                kwargs["max_lora_rank"] = _adapter_rank(adapter)
            if weight_updates or colocate:
                os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # the engine core in this process: apply_model needs no pickling
            if colocate:
                kwargs.update(tensor_parallel_size=1, distributed_executor_backend="external_launcher")
            engine = vllm.LLM(**kwargs)
            sampling_params_cls = vllm.SamplingParams
            if adapter:
                from vllm.lora.request import LoRARequest  # the optional extra, as above

                self._lora_request = LoRARequest("policy_adapter", 1, adapter)
        if sampling_params_cls is None:
            raise ValueError("VLLMGenerator: an injected engine needs sampling_params_cls too")
        self.engine = engine
        self._sampling_params_cls = sampling_params_cls
        self.tokenizer = engine.get_tokenizer()

    def close(self) -> None:
        """Shut the engine down and hand its GPU memory back before another engine starts: an
        engine that is only dropped keeps its workers, KV cache and weights until garbage
        collection reaches it, and the next engine's start sees that memory as taken. Uses
        ``LLM.shutdown()`` where vLLM has it, else its engine core's ``shutdown()``; then tears
        down the model-parallel groups the engine set up. Safe to call twice."""
        engine, self.engine = self.engine, None
        if engine is None:
            return
        shutdown = getattr(engine, "shutdown", None)
        if shutdown is None:
            shutdown = getattr(getattr(getattr(engine, "llm_engine", None), "engine_core", None), "shutdown", None)
        if shutdown is not None:
            shutdown()
        del engine
        if self._owns_engine:
            from vllm.distributed.parallel_state import destroy_distributed_environment, destroy_model_parallel  # the optional extra

            destroy_model_parallel()
            destroy_distributed_environment()
        release_memory()

    def load_weights(self, state: dict[str, Any]) -> None:
        """Replace the engine's weights with ``state`` (a plain transformers state dict of the
        served model: names as save_pretrained writes them, LoRA already merged) and drop the
        prefix cache, whose blocks were computed with the old weights."""
        items = list(state.items())
        self.engine.apply_model(lambda model: model.load_weights(items))
        self.engine.reset_prefix_cache()

    def generate(
        self,
        prompts: Sequence[str],
        n: int = 1,
        temperature: float = 1.0,
        top_p: float = 1.0,
        max_new_tokens: int = 256,
        stop: Sequence[str] | None = None,
        seed: int | Sequence[int] | None = None,
    ) -> list[list[Completion]]:
        """For each prompt (in order), n completions; see pipeline.generation.base."""
        stops = check_sampling_args(n, temperature, top_p, max_new_tokens, stop)
        if not prompts:
            return []
        if max_new_tokens == 0:
            return [[Completion("", [], "length") for _ in range(n)] for _ in prompts]
        # One SamplingParams per prompt so that, with a seed, prompt i's children get their own
        # seeds (seed + i*n + j, or seed[i] + j) instead of every prompt replaying the same stream.
        check_seeds(seed, prompts)
        if isinstance(seed, Sequence):
            seeds = [int(s) for s in seed]
        else:
            seeds = [None if seed is None else seed + i * n for i in range(len(prompts))]
        params = [self._sampling_params_cls(**sampling_params_kwargs(n, temperature, top_p, max_new_tokens, stops, s)) for s in seeds]
        kwargs = {"use_tqdm": self.progress}
        if self._lora_request is not None:
            kwargs["lora_request"] = self._lora_request
        # token ids, not text: vLLM would add the tokenizer's BOS to text that a chat template
        # already began with BOS (pipeline.steps.encode_prompt keeps it to one)
        requests = [{"prompt_token_ids": encode_prompt(self.tokenizer, prompt)} for prompt in prompts]
        request_outputs = self.engine.generate(requests, params, **kwargs)
        if len(request_outputs) != len(prompts):
            raise RuntimeError(f"vLLM returned {len(request_outputs)} outputs for {len(prompts)} prompts")
        results = [completions_from_request_output(r) for r in request_outputs]
        for i, completions in enumerate(results):
            if len(completions) != n:
                raise RuntimeError(f"vLLM returned {len(completions)} completions for prompt {i}, expected n={n}")
        return results
