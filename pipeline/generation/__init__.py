"""The one generation interface (base.Completion, base.Generator) and its backends.

``build_generator(config)`` picks the backend from ``config.generation.backend``: "hf"
(transformers, pipeline.generation.hf) or "vllm" (pipeline.generation.vllm_backend, imported
only when asked for). Teacher-forced scoring lives in pipeline.generation.step_logprobs.
"""

from __future__ import annotations

import importlib.util
import sys
import typing

from pipeline.config.loader import ConfigError
from pipeline.config.schema import GenerationBackend
from pipeline.generation.base import Completion, Generator
from pipeline.generation.hf import HFGenerator
from pipeline.generation.vllm_backend import VLLMGenerator
from pipeline.generation.vllm_servable import check_servable

BACKENDS = typing.get_args(GenerationBackend)
# What installs each backend's engine where it is missing (README, "GPU and vLLM").
VLLM_INSTALL = "`make gpu-env` builds .venv-vllm with the pinned vLLM, and the make stage targets then run there"


def build_generator(
    config,
    model_path: str | None = None,
    adapter: str | None = None,
    progress: bool = False,
    *,
    weight_updates: bool = False,
    colocate: bool = False,
) -> Generator:
    """A generator for ``model_path`` (default: config.model.policy with config.model.policy_adapter).

    An explicit ``model_path`` takes only the ``adapter`` given here, never the config's.
    weight_updates: a fine-tuning sampler, whose weights are replaced with ``load_weights``;
    colocate: one that shares this process with the trainer replacing them after every update.
    An HF generator takes new weights either way; a vLLM engine is started for them (VLLMGenerator).
    """
    if model_path is None:
        model_path = config.resolve(config.model.policy)
        if adapter is None:
            adapter = config.resolve(config.model.policy_adapter)
    backend = config.generation.backend
    if backend == "hf":
        return HFGenerator.from_config(config, model_path, adapter, progress=progress)
    if backend == "vllm":
        return VLLMGenerator(
            model_path, config, adapter=adapter, progress=progress, weight_updates=weight_updates, colocate=colocate
        )
    raise ConfigError(f"generation.backend is {backend!r}; expected one of {', '.join(BACKENDS)}")


def check_backend_installed(config) -> None:
    """ConfigError in one line, naming generation.backend and the command that installs it, when the
    backend's engine is not installed in this Python (vLLM lives in its own environment)."""
    if config.generation.backend == "vllm" and importlib.util.find_spec("vllm") is None:
        raise ConfigError(
            f"generation.backend=vllm but vllm is not installed in this environment ({sys.prefix}): "
            f"{VLLM_INSTALL}; or use generation.backend=hf"
        )


def check_served_models(config, models: dict[str, str | None]) -> None:
    """Before any model loads: each local model folder that generation.backend's engines will serve
    ({config key: path}; None and hub ids pass) can be served, else pipeline.storage.model_folders.FolderError
    in one line naming the key and the file (vLLM: vllm_servable.check_servable; the HF backend's
    from_pretrained reads only the weight files a folder's model names, and checks them as it
    loads); then the engine is installed (check_backend_installed)."""
    if config.generation.backend != "vllm":
        return
    for key, path in models.items():
        if path:
            check_servable(path, key)
    check_backend_installed(config)


__all__ = [
    "BACKENDS",
    "VLLM_INSTALL",
    "Completion",
    "Generator",
    "build_generator",
    "check_backend_installed",
    "check_served_models",
]
