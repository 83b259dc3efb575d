"""The one way a stage loads a PRM: ``load_scorer(path_or_hub_id, config)`` -> a StepScorer.

Which format a PRM is: ``model.prm_format`` when it is not ``auto``; otherwise sniffed from the
folder (or the hub id's config.json): our prm_config.json -> ``stepflow``; an architecture ending
in ForTokenClassification -> ``token_classification``; ending in ForProcessRewardModel ->
``qwen_prm``. A plain causal LM (Math-Shepherd) cannot be told from a policy, so it needs
``model.prm_format=math_shepherd``, as a policy used as a verifier needs
``model.prm_format=result_likelihood``. Hub ids the formats were written for: docs/prm.md.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

from transformers.utils import cached_file

from pipeline.config.choices import PRM_FORMATS
from pipeline.modeling import hub_model_errors
from pipeline.storage.files import InputNotFound
from prm.adapters import ADAPTERS
from prm.model import PRM_CONFIG_NAME
from prm.scorer import PRMScorer, StepScorer

FORMATS = tuple(name for name in PRM_FORMATS if name != "auto")  # the config's choices: ours, then ADAPTERS
_HUB_ID = re.compile(r"[A-Za-z0-9][\w.-]*/[\w.-]+")


def is_hub_id(value: str) -> bool:
    """``owner/name`` that is not a local path: a model on the hub (not an artifact of a stage)."""
    return not Path(value).exists() and bool(_HUB_ID.fullmatch(value))


def detect_format(path: str, prm_format: str = "auto") -> str:
    """The PRM format of a folder or hub id (module docstring)."""
    if prm_format != "auto":
        if prm_format not in FORMATS:
            raise ValueError(f"model.prm_format must be auto or one of {', '.join(FORMATS)}, got {prm_format!r}")
        return prm_format
    if (Path(path) / PRM_CONFIG_NAME).is_file():
        return "stepflow"
    with hub_model_errors(path):
        config_file = cached_file(
            path, "config.json", _raise_exceptions_for_missing_entries=False
        )  # a hub id: that file only
    architectures = []
    if config_file:
        architectures = json.loads(Path(config_file).read_text(encoding="utf-8")).get("architectures") or []
    if any(name.endswith("ForTokenClassification") for name in architectures):
        return "token_classification"
    if any(name.endswith("ForProcessRewardModel") for name in architectures):
        return "qwen_prm"
    raise ValueError(
        f"{path}: no known PRM format; tried stepflow (no {PRM_CONFIG_NAME}), token_classification (no "
        f"architecture ending in ForTokenClassification) and qwen_prm (none ending in ForProcessRewardModel): "
        f"architectures {architectures or 'unknown'}; set model.prm_format to one of {', '.join(FORMATS)} "
        f"(math_shepherd for a Math-Shepherd-style causal LM, result_likelihood for a policy scoring the results "
        f'steps write; docs/prm.md, "Other PRMs")'
    )


def load_scorer(path: str | Path, config) -> StepScorer:
    """The scorer of the PRM at ``path`` (a folder, or a hub id), in the format
    ``config.model.prm_format`` names or its folder shows; device, dtype, trust_remote_code from
    config.model, batch size from prm.score_batch_size."""
    path = str(path)
    if not Path(path).exists() and not is_hub_id(path):
        raise InputNotFound(
            f"no PRM at {path}: train one with `make prm` (same CONFIG and RUN), or set the path to a PRM "
            f"folder or hub id (docs/prm.md)"
        )
    prm_format = detect_format(path, config.model.prm_format)
    if prm_format == "stepflow":
        return PRMScorer.from_pretrained(path, config)
    return ADAPTERS[prm_format].from_pretrained(path, config)
