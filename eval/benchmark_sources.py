"""Which file and loader an eval.benchmarks name stands for, and its problems.

A name is a pipeline.datasets.loaders benchmark (gsm8k, math500, ...) or an alias of BENCHMARK_ALIASES;
eval.benchmark_paths[name] overrides the file. Every stage that evaluates on a named benchmark
(evaluation, search, the plan) resolves it here.
"""

from __future__ import annotations

from pathlib import Path
from typing import NamedTuple

from pipeline.config.loader import ConfigError
from pipeline.config.schema import Config
from pipeline.datasets.copies import HUB, HubUnreachable
from pipeline.datasets.loaders import BENCHMARK_LOADERS, load_benchmark
from pipeline.records import Problem
from pipeline.storage.files import InputNotFound

# Evaluation names that are not pipeline.datasets.loaders benchmark names: name -> (loader, default file).
# The tiny world's held-out test set is the only one; eval.benchmark_paths[name] overrides the file.
BENCHMARK_ALIASES: dict[str, tuple[str, str]] = {
    "tiny_test": ("problems", "{run_dir}/bootstrap/problems_test.jsonl"),
}


class BenchmarkSource(NamedTuple):
    """How to load one evaluation benchmark: ``load_benchmark(loader, path)``."""

    loader: str  # a pipeline.datasets.loaders.BENCHMARK_LOADERS name
    path: str | None  # local file; None = the repository's copy (data/benchmarks/), else the hub's; "hub" = the hub's


def resolve_benchmark(config: Config, name: str) -> BenchmarkSource:
    """The loader and file of an eval.benchmarks name: an alias of BENCHMARK_ALIASES or a
    pipeline.datasets.loaders name, with eval.benchmark_paths[name] (``{run_dir}`` resolved) as the file
    when given."""
    loader, default_path = BENCHMARK_ALIASES.get(name, (name, None))
    path = config.eval.benchmark_paths.get(name, default_path)
    return BenchmarkSource(loader, config.resolve(path))


def known_benchmark(config: Config, key: str, name: str) -> BenchmarkSource:
    """resolve_benchmark(config, name), or a ConfigError naming ``key`` and the benchmarks there are
    when ``name`` is none of them."""
    source = resolve_benchmark(config, name)
    if source.loader not in BENCHMARK_LOADERS:
        known = sorted({*BENCHMARK_LOADERS, *BENCHMARK_ALIASES})
        raise ConfigError(f"{key}: unknown benchmark {name!r}; expected one of {', '.join(known)}")
    return source


def check_eval_benchmarks(config: Config) -> None:
    """Before anything loads or is written: every eval.benchmarks name is a benchmark (a
    ConfigError naming the key and the names there are otherwise) and a local file named for
    one exists (InputNotFound, as load_eval_benchmark says it)."""
    for index, name in enumerate(config.eval.benchmarks):
        source = known_benchmark(config, f"eval.benchmarks[{index}]", name)
        if source.path not in (None, HUB) and not Path(source.path).exists():
            raise InputNotFound(
                f"benchmark {name!r}: file {source.path} not found "
                f"(eval.benchmark_paths.{name}, or the stage that writes it has not run)"
            )


def load_eval_benchmark(config: Config, name: str) -> list[Problem]:
    """The first eval.max_problems problems of a benchmark; errors name the missing file."""
    source = resolve_benchmark(config, name)
    if source.path not in (None, HUB) and not Path(source.path).exists():
        raise InputNotFound(
            f"benchmark {name!r}: file {source.path} not found "
            f"(eval.benchmark_paths.{name}, or the stage that writes it has not run)"
        )
    try:
        problems = load_benchmark(
            source.loader, path=source.path, limit=config.eval.max_problems, lenient=config.data.lenient
        )
    except HubUnreachable as error:
        raise error.named(f"eval.benchmarks ({name})", f"eval.benchmark_paths.{name}") from None
    if not problems:
        raise ValueError(f"benchmark {name!r} ({source.path or 'hub'}): no problems")
    seen: set[str] = set()
    for problem in problems:
        if problem.problem_id in seen:
            raise ValueError(
                f"benchmark {name!r} ({source.path or 'hub'}): problem_id {problem.problem_id!r} occurs twice; "
                "samples, shards and paired comparisons key on it"
            )
        seen.add(problem.problem_id)
    return problems
