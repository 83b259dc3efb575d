"""Where the samples of a (model, benchmark) pair live on disk, and when they can be reused.

    reports/<run>/samples/<model>__<benchmark>.jsonl           the pair's samples records (problem order)
    reports/<run>/samples/<model>__<benchmark>.settings.json   what they depend on (sampling_settings)
    reports/<run>/samples/shards/<model>__<benchmark>/         committed problems not merged yet

A samples file whose settings file equals the pair's sampling_settings is reused (re-scored, not
regenerated); shards that workers committed are merged into the samples file in problem order.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import re
import shutil
from collections.abc import Sequence
from pathlib import Path

from eval.benchmark_sources import BenchmarkSource
from eval.model_specs import ModelSpec, model_fingerprint
from pipeline.config.schema import Config
from pipeline.records import Problem, Sample
from pipeline.storage.files import read_records, write_json_atomic, write_records_atomic
from pipeline.storage.shards import read_stream


def _safe_name(name: str) -> str:
    return re.sub(r"[^\w.-]+", "_", name)


def samples_path(out_dir: Path, model: str, benchmark: str) -> Path:
    """reports/<run>/samples/<model>__<benchmark>.jsonl"""
    return Path(out_dir) / "samples" / f"{_safe_name(model)}__{_safe_name(benchmark)}.jsonl"


def sampling_settings(config: Config, spec: ModelSpec, source: BenchmarkSource, problems: Sequence[Problem]) -> dict:
    """Everything the samples of a (model, benchmark) pair depend on; equal settings = reusable samples."""
    ids = hashlib.sha256("\n".join(p.problem_id for p in problems).encode()).hexdigest()[:16]
    return {
        "model_path": spec.path,
        "model_fingerprint": model_fingerprint(spec.path, spec.path_is_local),
        "adapter": spec.adapter,
        "adapter_fingerprint": model_fingerprint(spec.adapter, spec.adapter_is_local),
        "benchmark": list(source),
        "problem_ids": ids,
        "k": config.eval.k,
        "temperature": config.eval.temperature,
        "greedy": config.eval.greedy,
        "top_p": config.generation.top_p,
        "max_new_tokens": config.generation.max_new_tokens,
        "seed": config.eval.seed,
        "seeding": "per problem",
        "format": dataclasses.asdict(config.format),
        "backend": config.generation.backend,
    }


def reusable_samples(path: Path, settings: dict) -> list[Sample] | None:
    """The samples file's records when its settings file equals ``settings``, else None."""
    settings_file = path.with_suffix(".settings.json")
    if not (path.exists() and settings_file.exists()):
        return None
    if json.loads(settings_file.read_text(encoding="utf-8")) != settings:
        return None
    return list(read_records(path, Sample))


def shard_folder(out_dir: Path, model: str, benchmark: str) -> Path:
    """reports/<run>/samples/shards/<model>__<benchmark>/: the committed problems of a pair not merged yet."""
    return Path(out_dir) / "samples" / "shards" / samples_path(out_dir, model, benchmark).stem


def merge_samples(folder: Path, problems: Sequence[Problem]) -> list[Sample]:
    """Every problem's samples from the committed shards of ``folder``, in benchmark order (each
    problem's as generate_samples wrote them): the samples file one process writes."""
    by_problem: dict[str, list[Sample]] = {}
    for record in read_stream(folder, "samples", Sample):
        by_problem.setdefault(record.problem_id, []).append(record)
    missing = [p.problem_id for p in problems if p.problem_id not in by_problem]
    if missing:
        raise ValueError(
            f"{folder}: no samples of problem {missing[0]!r} ({len(missing)} of {len(problems)} problems missing)"
        )
    return [record for problem in problems for record in by_problem[problem.problem_id]]


def commit_samples_file(folder: Path, path: Path, problems: Sequence[Problem], settings: dict) -> list[Sample]:
    """Merge the shard folder's samples (merge_samples) into the samples file ``path`` and its
    settings file, then remove the folder (and the shards folder once empty); returns the records."""
    records = merge_samples(folder, problems)
    write_records_atomic(path, records)
    write_json_atomic(path.with_suffix(".settings.json"), settings)
    shutil.rmtree(folder)  # merged: the samples file (and its settings) hold them now
    if not any(folder.parent.iterdir()):
        folder.parent.rmdir()
    return records
