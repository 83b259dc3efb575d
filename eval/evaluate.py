"""The evaluation stage's library (paper 5, Tables 2 and 4): sample, grade and score each model.

Per model and benchmark: ONE generate call with every problem of the benchmark and n = k at
eval.temperature, plus ONE greedy call (temperature 0, n = 1); every completion is split into
steps, graded, and written as a samples record (pipeline.records.Sample; sample_idx -1 = greedy). Accuracy
(greedy pass@1, pass@1, maj@k, pass@k with bootstrap CIs) and diversity (mean pairwise cosine of
whole-solution embeddings, Vendi, distinct-n, distinct correct texts, and the entropy and number of
correct strategies where a problem knows its strategies) come from those records
only, so a rerun that finds a pair's samples up to date re-scores them without generating.

Problem p's samples draw from the stream stream_seed(eval.seed, p's id) (sample j: + j), so they
depend on nothing but the problem: the samples are generated eval.problems_per_commit problems at a
time and committed as shards (pipeline.shards.ShardWriter) in reports/<run>/samples/shards/<pair>/, and
``eval.shard = i/n`` makes a worker sample only the problems with index % n == i
(``python -m stages.launch eval``: one worker per GPU). A run with shard 0/1 samples what is still
missing, merges the shards into the samples file in problem order (what one process writes) and
scores every problem at once: intervals, diversity and paired differences are over all problems.
Decisions and formats: docs/evaluation.md; formulas: docs/metrics.md.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import math
import re
import shutil
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import NamedTuple

import numpy as np

from eval.accuracy import ProblemSamples, majority_vote_index, pass_at_k, per_problem_scores, summarize_accuracy
from eval.diversity import Embedder, distinct_correct_texts, distinct_n_per_problem, semantic_similarity, strategy_diversity
from pipeline.config import Config
from pipeline.files import InputNotFound, path_fingerprint, read_records, write_json_atomic, write_records_atomic
from pipeline.generation.base import stream_seed
from pipeline.grading import extract_answer, grade_many, normalize_answer
from pipeline.locks import held_locks
from pipeline.problems import HUB, load_benchmark
from pipeline.prompts import prompt_from_config
from pipeline.records import Problem, Sample
from pipeline.shards import ShardWriter, check_settings, completed_problem_ids, parse_shard, read_stream
from pipeline.stats import bootstrap_ci, mann_whitney_auc
from pipeline.steps import join_steps, split_steps

log = logging.getLogger(__name__)

GREEDY_SAMPLE_IDX = -1
ADAPTER_SEPARATOR = "::"  # eval.models value "model::adapter" = a peft adapter on top of a model
DISTINCT_NS = (1, 2, 3)

# Evaluation names that are not pipeline.problems benchmark names: name -> (loader, default file).
# The tiny world's held-out test set is the only one; eval.benchmark_paths[name] overrides the file.
BENCHMARK_ALIASES: dict[str, tuple[str, str]] = {
    "tiny_test": ("problems", "{run_dir}/bootstrap/problems_test.jsonl"),
}

KindOf = Callable[[Problem], str]
GeneratorFactory = Callable[[str, "str | None"], object]  # (model path, adapter) -> Generator
StepScorer = Callable[[Sequence[tuple[str, Sequence[str]]]], list[list[float]]]  # PRMScorer.score_many


def problem_kind(problem: Problem) -> str:
    """The default ``kind_of``: the grading kind of the problem's source."""
    return problem.kind


def reports_dir(config: Config) -> Path:
    """reports/<run>/: where the evaluation writes results, report and samples."""
    return Path("reports") / config.run


# ----------------------------------------------------------------------------- benchmarks


class BenchmarkSource(NamedTuple):
    """How to load one evaluation benchmark: ``load_benchmark(loader, path)``."""

    loader: str  # a pipeline.problems.BENCHMARK_LOADERS name
    path: str | None  # local file; None = the repository's copy (data/benchmarks/), else the hub's; "hub" = the hub's


def resolve_benchmark(config: Config, name: str) -> BenchmarkSource:
    """The loader and file of an eval.benchmarks name: an alias of BENCHMARK_ALIASES or a
    pipeline.problems name, with eval.benchmark_paths[name] (``{run_dir}`` resolved) as the file
    when given."""
    loader, default_path = BENCHMARK_ALIASES.get(name, (name, None))
    path = config.eval.benchmark_paths.get(name, default_path)
    return BenchmarkSource(loader, config.resolve(path))


def load_eval_benchmark(config: Config, name: str) -> list[Problem]:
    """The first eval.max_problems problems of a benchmark; errors name the missing file."""
    source = resolve_benchmark(config, name)
    if source.path not in (None, HUB) and not Path(source.path).exists():
        raise InputNotFound(
            f"benchmark {name!r}: file {source.path} not found "
            f"(eval.benchmark_paths.{name}, or the stage that writes it has not run)"
        )
    problems = load_benchmark(source.loader, path=source.path, limit=config.eval.max_problems, lenient=config.data.lenient)
    if not problems:
        raise ValueError(f"benchmark {name!r} ({source.path or 'hub'}): no problems")
    seen: set[str] = set()
    for problem in problems:
        if problem.problem_id in seen:
            raise ValueError(f"benchmark {name!r} ({source.path or 'hub'}): problem_id {problem.problem_id!r} occurs twice; "
                             "samples, shards and paired comparisons key on it")
        seen.add(problem.problem_id)
    return problems


# ----------------------------------------------------------------------------- models


@dataclass(frozen=True)
class ModelSpec:
    """One entry of eval.models: a hub id or local path, optionally with a peft adapter."""

    name: str
    path: str
    adapter: str | None = None
    path_is_local: bool = True
    adapter_is_local: bool = True


def _is_local_path(raw: str, resolved: str) -> bool:
    """A value names a local path (not a hub id) when it exists, uses {run_dir}, is absolute,
    starts with "." or "~", or has more than one "/" (hub ids are "name" or "org/name")."""
    return (
        Path(resolved).expanduser().exists()
        or "{run_dir}" in raw
        or Path(resolved).is_absolute()
        or resolved.startswith((".", "~"))
        or resolved.count("/") > 1
    )


def parse_model_spec(config: Config, name: str, value: str) -> ModelSpec:
    """"path" or "path::adapter_path" (either side a hub id or local path; {run_dir} resolved)."""
    raw_path, _, raw_adapter = value.partition(ADAPTER_SEPARATOR)
    raw_path, raw_adapter = raw_path.strip(), raw_adapter.strip()
    if not raw_path:
        raise ValueError(f"eval.models.{name}: {value!r} has no model path; expected 'path' or 'path::adapter'")
    path = config.resolve(raw_path)
    adapter = config.resolve(raw_adapter) if raw_adapter else None
    return ModelSpec(
        name=name,
        path=str(Path(path).expanduser()) if _is_local_path(raw_path, path) else path,
        adapter=adapter,
        path_is_local=_is_local_path(raw_path, path),
        adapter_is_local=adapter is not None and _is_local_path(raw_adapter, adapter),
    )


def missing_model_reason(spec: ModelSpec) -> str | None:
    """Why a model cannot be evaluated (a local model or adapter path that does not exist), or None."""
    if spec.path_is_local and not Path(spec.path).exists():
        return f"model path {spec.path} does not exist"
    if spec.adapter is not None and spec.adapter_is_local and not Path(spec.adapter).expanduser().exists():
        return f"adapter path {spec.adapter} does not exist"
    return None


def _fingerprint(path: str | None, is_local: bool) -> str | None:
    """Changes when a local model folder's files change (retrained); a hub id is itself."""
    return path_fingerprint(path) if path is not None and is_local else path


# ----------------------------------------------------------------------------- sampling


@dataclass
class Evaluation:
    """One model on one benchmark: its samples and its metrics."""

    samples: list[Sample]
    metrics: dict


def _prompts(problems: Sequence[Problem], kind_of: KindOf, tokenizer, config: Config) -> list[str]:
    return [
        prompt_from_config(p.question, kind_of(p), tokenizer, config.format, p.meta.get("options"))
        for p in problems
    ]


def _check_outputs(outputs, problems: Sequence[Problem], n: int, what: str) -> None:
    if len(outputs) != len(problems):
        raise ValueError(f"generate ({what}) returned {len(outputs)} lists for {len(problems)} prompts; expected one each")
    for problem, completions in zip(problems, outputs):
        if len(completions) != n:
            raise ValueError(f"generate ({what}) returned {len(completions)} completions for {problem.problem_id}; expected {n}")


def generate_samples(generator, problems: Sequence[Problem], kind_of: KindOf, config: Config, model: str) -> list[Sample]:
    """The samples of one model on one benchmark, problem by problem: the greedy sample
    (sample_idx -1, when eval.greedy) then samples 0..k-1; a sample cut off at max_new_tokens
    is recorded as not finished.

    Two generate calls in all: every problem with n = eval.k at eval.temperature, and every
    problem with n = 1 at temperature 0. Grading is one grade_many call per answer kind. Each
    problem samples from its own stream, stream_seed(eval.seed, problem id): its samples are the
    same whatever other problems share the call (a chunk, a worker's share).
    """
    prompts = _prompts(problems, kind_of, getattr(generator, "tokenizer", None), config)
    seeds = [stream_seed(config.eval.seed, p.problem_id) for p in problems]
    common = {"top_p": config.generation.top_p, "max_new_tokens": config.generation.max_new_tokens, "seed": seeds}
    k = config.eval.k
    sampled = generator.generate(prompts, n=k, temperature=config.eval.temperature, **common)
    _check_outputs(sampled, problems, k, f"n={k}")
    completions_per_problem = [list(completions) for completions in sampled]
    indices = [list(range(k)) for _ in problems]
    if config.eval.greedy:
        greedy = generator.generate(prompts, n=1, temperature=0.0, **{**common, "top_p": 1.0})
        _check_outputs(greedy, problems, 1, "greedy")
        completions_per_problem = [g + completions for g, completions in zip(greedy, completions_per_problem)]
        indices = [[GREEDY_SAMPLE_IDX] + idx for idx in indices]

    # one grade_many per kind keeps every Math-Verify comparison of the benchmark in one batch
    flat = [(p, i, c) for p, completions in enumerate(completions_per_problem) for i, c in enumerate(completions)]
    correct = [False] * len(flat)
    by_kind: dict[str, list[int]] = {}
    for position, (p, _, _) in enumerate(flat):
        by_kind.setdefault(kind_of(problems[p]), []).append(position)
    for kind, positions in by_kind.items():
        verdicts = grade_many([flat[j][2].text for j in positions], [problems[flat[j][0]].answer for j in positions], kind)
        for j, verdict in zip(positions, verdicts):
            correct[j] = bool(verdict)

    return [
        Sample(
            problem_id=problems[p].problem_id,
            model=model,
            sample_idx=indices[p][i],
            steps=split_steps(completion.text, config.format.separator),
            final_answer=extract_answer(completion.text, kind_of(problems[p])),
            correct=is_correct,
            finished=completion.finish_reason != "length",
        )
        for (p, i, completion), is_correct in zip(flat, correct)
    ]


# ----------------------------------------------------------------------------- scoring


def _group_records(records: Sequence[Sample], problems: Sequence[Problem]) -> tuple[dict, dict]:
    """problem_id -> sampled records in sample_idx order, and problem_id -> greedy record."""
    sampled: dict[str, list[Sample]] = {p.problem_id: [] for p in problems}
    greedy: dict[str, Sample] = {}
    for record in records:
        pid = record.problem_id
        if pid not in sampled:
            raise ValueError(f"samples: record for problem {pid!r}, which is not in the benchmark")
        if record.sample_idx == GREEDY_SAMPLE_IDX:
            greedy[pid] = record
        else:
            sampled[pid].append(record)
    for pid, rows in sampled.items():
        rows.sort(key=lambda r: r.sample_idx)
        if not rows:
            raise ValueError(f"samples: no sampled solutions for problem {pid!r}")
    return sampled, greedy


def _graded(records: Sequence[Sample], problems: Sequence[Problem], kind_of: KindOf):
    """(problem_id -> sampled records, [ProblemSamples] in problem order, problem_id -> greedy
    correct or None when there are no greedy records)."""
    sampled, greedy = _group_records(records, problems)
    per_problem = []
    for problem in problems:
        rows = sampled[problem.problem_id]
        kind = kind_of(problem)
        answers = [r.final_answer for r in rows]
        flags = [r.correct for r in rows]
        winner = majority_vote_index(answers, key=lambda answer: normalize_answer(answer, kind))
        per_problem.append(ProblemSamples(problem.problem_id, flags, answers, winner is not None and flags[winner]))
    greedy_correct = None
    if greedy:
        missing = [p.problem_id for p in problems if p.problem_id not in greedy]
        if missing:
            raise ValueError(f"samples: greedy sample missing for problem {missing[0]!r}")
        greedy_correct = {pid: r.correct for pid, r in greedy.items()}
    return sampled, per_problem, greedy_correct


def paired_accuracy_differences(
    reference_records: Sequence[Sample],
    records: Sequence[Sample],
    problems: Sequence[Problem],
    kind_of: KindOf = problem_kind,
    n_resamples: int = 2000,
    seed: int = 0,
) -> dict:
    """Accuracy of ``records`` minus that of ``reference_records`` on the same problems.

    For each metric (greedy_pass@1 when both have greedy records, pass@1, maj@k, pass@k), the
    per-problem differences d_p = model_p - reference_p (P,) and a paired percentile-bootstrap
    CI of their mean (problems resampled once for both models, pipeline.stats.bootstrap_ci).
    Pairing removes the problem-difficulty variance two separate intervals carry, so a change
    can be clear even where the two models' own intervals overlap.
    Returns {metric: {"mean", "lo", "hi"}}.
    """
    _, reference, reference_greedy = _graded(reference_records, problems, kind_of)
    _, model, model_greedy = _graded(records, problems, kind_of)
    before, after = per_problem_scores(reference), per_problem_scores(model)
    differences = {}
    if reference_greedy is not None and model_greedy is not None:
        differences["greedy_pass@1"] = np.array(
            [float(model_greedy[p.problem_id]) - float(reference_greedy[p.problem_id]) for p in problems]
        )
    for metric in ("pass@1", "maj@k", "pass@k"):
        differences[metric] = after[metric] - before[metric]
    out = {}
    for metric, values in differences.items():
        mean, lo, hi = bootstrap_ci(values, n_resamples=n_resamples, seed=seed)
        out[metric] = {"mean": mean, "lo": lo, "hi": hi}
    return out


def score_samples(
    records: Sequence[Sample],
    problems: Sequence[Problem],
    kind_of: KindOf,
    config: Config,
    embed: Embedder | None = None,
    prm: StepScorer | None = None,
) -> dict:
    """Accuracy and diversity of one model on one benchmark from its samples records.

    Returns {"n_problems", "k", "accuracy": {greedy_pass@1?, pass@1, maj@k, pass@k: {mean, lo, hi}},
    "pass@k_curve": {j: unbiased pass@j}, "answered", "mean_steps", "diversity": {similarity:
    {mean, lo, hi, n_scored, per_problem}, vendi, distinct_1..3, strategy_entropy: {mean, lo, hi,
    n_scored, per_problem}, distinct_strategies, multi_strategy_problems, correct_without_strategy,
    correct_texts, correct_texts_solved}}.
    Diversity is over the k sampled solutions only; similarity and Vendi (each solution's whole
    text embedded) are None without ``embed``; the strategy figures (eval.diversity.strategy_diversity)
    are None on problems that do not know their strategies.
    With ``prm`` (PRMScorer.score_many), also "prm_reward": {mean, lo, hi}, the mean over problems
    of the mean PRM reward R = prod_k U(s_k|s_{k-1}) of its sampled solutions (an empty solution: 0),
    the quantity the GFlowNet samples in proportion to.
    """
    sampled, per_problem, greedy_correct = _graded(records, problems, kind_of)
    settings = config.eval
    accuracy = summarize_accuracy(
        per_problem, greedy_correct, n_resamples=settings.bootstrap_resamples, seed=settings.seed
    )
    k = accuracy.pop("k")
    n_problems = accuracy.pop("n_problems")
    counts = [sum(s.correct) for s in per_problem]
    budgets = sorted({j for j in (1, 2, 4, 8, 16, 32, 64) if j <= k} | {k})
    curve = {str(j): float(np.mean([pass_at_k(k, c, j) for c in counts])) for j in budgets}

    solutions = [[r.steps for r in sampled[p.problem_id]] for p in problems]
    texts = [[join_steps(steps, config.format.separator) for steps in group] for group in solutions]
    correct_texts = [distinct_correct_texts(group, s.correct) for group, s in zip(solutions, per_problem)]
    solved = [n for n, c in zip(correct_texts, counts) if c > 0]
    diversity: dict = {"similarity": {"mean": None, "lo": None, "hi": None, "n_scored": 0}, "vendi": None}
    if embed is not None:
        similarity = semantic_similarity(texts, embed, n_resamples=settings.bootstrap_resamples, seed=settings.seed)
        diversity["similarity"] = {key: similarity[key] for key in ("mean", "lo", "hi", "n_scored", "per_problem")}
        diversity["vendi"] = similarity["vendi_mean"]
    for n in DISTINCT_NS:
        diversity[f"distinct_{n}"] = distinct_n_per_problem(texts, n)["mean"]
    strategies = strategy_diversity(problems, solutions, [s.correct for s in per_problem],
                                    n_resamples=settings.bootstrap_resamples, seed=settings.seed)
    diversity["strategy_entropy"] = strategies["entropy"]  # per_problem in problem order: comparisons pair them
    diversity["distinct_strategies"] = strategies["distinct"]
    diversity["multi_strategy_problems"] = strategies["multi_strategy_problems"]
    diversity["correct_without_strategy"] = strategies["correct_without_strategy"]
    diversity["correct_texts"] = float(np.mean(correct_texts))
    diversity["correct_texts_solved"] = float(np.mean(solved)) if solved else None

    all_rows = [r for rows in sampled.values() for r in rows]
    extra = {}
    if prm is not None:
        extra["prm_reward"] = mean_prm_reward(sampled, problems, prm, settings.bootstrap_resamples, settings.seed)
    return {
        "n_problems": n_problems,
        "k": k,
        "accuracy": accuracy,
        "pass@k_curve": curve,
        "answered": float(np.mean([r.final_answer is not None for r in all_rows])),
        "mean_steps": float(np.mean([len(r.steps) for r in all_rows])),
        "diversity": diversity,
        **extra,
    }


def mean_prm_reward(sampled: dict[str, list[Sample]], problems: Sequence[Problem], prm: StepScorer, n_resamples: int, seed: int) -> dict:
    """How the PRM's reward R = prod U sees one model's samples.

    mean, lo, hi:        per problem, the mean R over its sampled solutions (an empty one: 0); a
                         percentile-bootstrap interval over problems (pipeline.stats.bootstrap_ci)
    per_problem:         those per-problem means, in ``problems`` order (compare_to_reference pairs them)
    within_problem_auc:  over the problems with both correct and wrong samples, the mean AUC of R
                         for correctness among that problem's samples (ties count 1/2); None when
                         no problem has both. 0.5: R does not tell a problem's right solutions from
                         its wrong ones, so no fine-tuning toward R can raise accuracy
    n_mixed:             how many problems that mean is over
    reweighted_accuracy: mean over problems of sum_i R_i * correct_i / sum_i R_i, the accuracy of
                         these samples reweighted in proportion to R (self-normalised importance
                         weights for sampling from pi * R); a problem whose samples all have R = 0
                         keeps its plain accuracy
    reweighted_reward:   the same reweighting of R itself, sum R^2 / sum R: the mean reward a
                         policy sampling in proportion to pi * R would reach on these problems
    """
    pairs = [(p.question, r.steps) for p in problems for r in sampled[p.problem_id]]
    scores = iter(prm([pair for pair in pairs if pair[1]]))
    rewards = iter([math.prod(next(scores)) if steps else 0.0 for _, steps in pairs])
    per_problem_rewards = [np.array([next(rewards) for _ in sampled[p.problem_id]]) for p in problems]
    per_problem_correct = [np.array([r.correct for r in sampled[p.problem_id]]) for p in problems]
    per_problem_mean = [float(r.mean()) for r in per_problem_rewards]
    mean, lo, hi = bootstrap_ci(np.array(per_problem_mean), n_resamples=n_resamples, seed=seed)
    aucs = [mann_whitney_auc(r, c) for r, c in zip(per_problem_rewards, per_problem_correct) if 0 < c.sum() < len(c)]
    reweighted_accuracy, reweighted_reward = [], []
    for r, c in zip(per_problem_rewards, per_problem_correct):
        total = r.sum()
        reweighted_accuracy.append(float((r * c).sum() / total) if total > 0 else float(c.mean()))
        reweighted_reward.append(float((r * r).sum() / total) if total > 0 else 0.0)
    return {
        "mean": mean, "lo": lo, "hi": hi,
        "per_problem": per_problem_mean,  # in problem order: compare_to_reference pairs them
        "within_problem_auc": float(np.mean(aucs)) if aucs else None,
        "n_mixed": len(aucs),
        "reweighted_accuracy": float(np.mean(reweighted_accuracy)),
        "reweighted_reward": float(np.mean(reweighted_reward)),
    }


def evaluate_model(
    generator,
    problems: Sequence[Problem],
    kind_of: KindOf = problem_kind,
    config: Config | None = None,
    *,
    model: str = "model",
    embed: Embedder | None = None,
) -> Evaluation:
    """Sample (one batched call with n = eval.k, one greedy call), grade and score one model
    on one benchmark. ``kind_of(problem)`` gives the grading and prompt kind."""
    config = config or Config()
    records = generate_samples(generator, problems, kind_of, config, model)
    return Evaluation(records, score_samples(records, problems, kind_of, config, embed))


# ----------------------------------------------------------------------------- a whole run


def _safe_name(name: str) -> str:
    return re.sub(r"[^\w.-]+", "_", name)


def samples_path(out_dir: Path, model: str, benchmark: str) -> Path:
    """reports/<run>/samples/<model>__<benchmark>.jsonl"""
    return Path(out_dir) / "samples" / f"{_safe_name(model)}__{_safe_name(benchmark)}.jsonl"


def sampling_settings(config: Config, spec: ModelSpec, source: BenchmarkSource, problems: Sequence[Problem]) -> dict:
    """Everything the samples of a (model, benchmark) pair depend on; equal settings = reusable samples."""
    ids = hashlib.sha256("\n".join(p.problem_id for p in problems).encode()).hexdigest()[:16]
    return {
        "model_path": spec.path, "model_fingerprint": _fingerprint(spec.path, spec.path_is_local),
        "adapter": spec.adapter, "adapter_fingerprint": _fingerprint(spec.adapter, spec.adapter_is_local),
        "benchmark": list(source), "problem_ids": ids, "k": config.eval.k, "temperature": config.eval.temperature,
        "greedy": config.eval.greedy, "top_p": config.generation.top_p, "max_new_tokens": config.generation.max_new_tokens,
        "seed": config.eval.seed, "seeding": "per problem", "format": dataclasses.asdict(config.format),
        "backend": config.generation.backend,
    }


def _reusable_samples(path: Path, settings: dict) -> list[Sample] | None:
    settings_file = path.with_suffix(".settings.json")
    if not (path.exists() and settings_file.exists()):
        return None
    if json.loads(settings_file.read_text(encoding="utf-8")) != settings:
        return None
    return list(read_records(path, Sample))


def shard_folder(out_dir: Path, model: str, benchmark: str) -> Path:
    """reports/<run>/samples/shards/<model>__<benchmark>/: the committed problems of a pair not merged yet."""
    return Path(out_dir) / "samples" / "shards" / samples_path(out_dir, model, benchmark).stem


class _LazyGenerator:
    """A model's generator, loaded on first use (a pair whose samples are up to date loads nothing)."""

    def __init__(self, make_generator: GeneratorFactory, spec: ModelSpec):
        self.make_generator, self.spec, self.generator = make_generator, spec, None

    def get(self):
        if self.generator is None:
            spec = self.spec
            log.info("eval: loading model %r from %s%s", spec.name, spec.path, f" with adapter {spec.adapter}" if spec.adapter else "")
            self.generator = self.make_generator(spec.path, spec.adapter)
        return self.generator

    def close(self) -> None:
        if self.generator is not None:
            self.generator.close()  # its memory back (a vLLM engine shut down) before the next model loads
            self.generator = None


def _in_chunks(items: Sequence, size: int) -> list[Sequence]:
    return [items[start : start + size] for start in range(0, len(items), size)]


def sample_share(generator: _LazyGenerator, problems: Sequence[Problem], kind_of: KindOf, config: Config, folder: Path,
                 settings: dict, shard: tuple[int, int], others_running: bool) -> int:
    """Sample the problems of shard (i, n) (index % n == i) that ``folder`` holds no samples of yet,
    eval.problems_per_commit at a time, each chunk committed as one shard; returns how many.
    The folder's settings.json guards the resume (pipeline.shards.check_settings)."""
    index, count = shard
    check_settings(folder, settings, f"the samples of {generator.spec.name}", others_running=others_running)
    done = completed_problem_ids(folder)
    todo = [p for i, p in enumerate(problems) if i % count == index and p.problem_id not in done]
    if not todo:
        return 0
    log.info("eval: %s: %d problems of shard %d/%d to sample (%d already committed)", folder.name, len(todo), index, count,
             sum(1 for i, p in enumerate(problems) if i % count == index) - len(todo))
    per_commit = config.eval.problems_per_commit
    with ShardWriter(folder, tag=f"{index}of{count}", commit_every=per_commit) as writer:
        for chunk in _in_chunks(todo, per_commit):
            records = generate_samples(generator.get(), chunk, kind_of, config, generator.spec.name)
            by_problem: dict[str, list[Sample]] = {}
            for record in records:
                by_problem.setdefault(record.problem_id, []).append(record)
            for problem in chunk:
                writer.add(problem.problem_id, samples=by_problem[problem.problem_id])
    return len(todo)


def merge_samples(folder: Path, problems: Sequence[Problem]) -> list[Sample]:
    """Every problem's samples from the committed shards of ``folder``, in benchmark order (each
    problem's as generate_samples wrote them): the samples file one process writes."""
    by_problem: dict[str, list[Sample]] = {}
    for record in read_stream(folder, "samples", Sample):
        by_problem.setdefault(record.problem_id, []).append(record)
    missing = [p.problem_id for p in problems if p.problem_id not in by_problem]
    if missing:
        raise ValueError(f"{folder}: no samples of problem {missing[0]!r} ({len(missing)} of {len(problems)} problems missing)")
    return [record for problem in problems for record in by_problem[problem.problem_id]]


def _benchmarks(config: Config) -> tuple[dict[str, BenchmarkSource], dict[str, list[Problem]]]:
    sources = {name: resolve_benchmark(config, name) for name in config.eval.benchmarks}
    return sources, {name: load_eval_benchmark(config, name) for name in config.eval.benchmarks}


def _models(config: Config):
    """(name, ModelSpec, why it cannot be evaluated or None) for every entry of eval.models."""
    for name, value in config.eval.models.items():
        spec = parse_model_spec(config, name, value)
        yield name, spec, missing_model_reason(spec)


def sample_shard(config: Config, make_generator: GeneratorFactory, out_dir: str | Path, kind_of: KindOf = problem_kind) -> dict:
    """Worker i of n (eval.shard = i/n): sample its share of every (model, benchmark) pair into
    the pair's shard folder and nothing else (a run with eval.shard = 0/1 merges and scores).
    Pairs whose samples file is up to date and models that cannot be found are left out.
    Returns {model: {benchmark: problems sampled now}}."""
    out = Path(out_dir)
    shard = parse_shard(config.eval.shard)
    sources, benchmarks = _benchmarks(config)
    others_running = bool(held_locks(out, ".lock-shard-*"))
    sampled: dict = {}
    for name, spec, reason in _models(config):
        if reason is not None:
            log.warning("eval: skipping model %r: %s", name, reason)
            continue
        generator = _LazyGenerator(make_generator, spec)
        try:
            for bench, problems in benchmarks.items():
                settings = sampling_settings(config, spec, sources[bench], problems)
                if _reusable_samples(samples_path(out, name, bench), settings) is not None:
                    continue
                sampled.setdefault(name, {})[bench] = sample_share(generator, problems, kind_of, config, shard_folder(out, name, bench),
                                                                   settings, shard, others_running)
        finally:
            generator.close()
    return sampled


def run_evaluation(
    config: Config,
    make_generator: GeneratorFactory,
    embed: Embedder | None = None,
    out_dir: str | Path | None = None,
    kind_of: KindOf = problem_kind,
    prm: StepScorer | None = None,
) -> dict:
    """Every model of eval.models on every benchmark of eval.benchmarks; writes
    <out_dir>/samples/*.jsonl and <out_dir>/results.json (out_dir: reports/<run>/).

    ``make_generator(path, adapter)`` is called once per model, and only when some benchmark
    needs new samples (samples whose settings file matches are re-scored, not regenerated;
    problems that workers of ``python -m stages.launch eval`` committed are merged, not sampled
    again). A model whose local path or adapter path does not exist is skipped with a warning and
    listed under "skipped". Returns the results.json object (docs/evaluation.md).
    """
    out = Path(out_dir) if out_dir is not None else reports_dir(config)
    sources, benchmarks = _benchmarks(config)
    results: dict = {
        "run": config.run,
        "settings": {
            "k": config.eval.k, "temperature": config.eval.temperature, "greedy": config.eval.greedy,
            "top_p": config.generation.top_p, "max_new_tokens": config.generation.max_new_tokens,
            "max_problems": config.eval.max_problems, "embedder": config.eval.embedder or "all-MiniLM-L6-v2",
            "bootstrap_resamples": config.eval.bootstrap_resamples, "confidence": 0.95, "seed": config.eval.seed,
            "prm": config.resolve(config.eval.prm) if prm is not None else None,
        },
        "benchmarks": {
            name: {"n_problems": len(problems), "kinds": sorted({kind_of(p) for p in problems}),
                   "loader": sources[name].loader, "path": sources[name].path}
            for name, problems in benchmarks.items()
        },
        "models": {},
        "skipped": [],
        "results": {},
    }
    all_records: dict[str, dict[str, list[Sample]]] = {}
    for name, spec, reason in _models(config):
        results["models"][name] = {"path": spec.path, "adapter": spec.adapter}
        if reason is not None:
            log.warning("eval: skipping model %r: %s", name, reason)
            results["skipped"].append({"model": name, "path": spec.path, "adapter": spec.adapter, "reason": reason})
            continue
        generator = _LazyGenerator(make_generator, spec)
        try:
            for bench, problems in benchmarks.items():
                path = samples_path(out, name, bench)
                settings = sampling_settings(config, spec, sources[bench], problems)
                records = _reusable_samples(path, settings)
                if records is None:
                    log.info("eval: %s on %s: %d problems x %d samples%s", name, bench, len(problems), config.eval.k,
                             " + greedy" if config.eval.greedy else "")
                    folder = shard_folder(out, name, bench)
                    sample_share(generator, problems, kind_of, config, folder, settings, (0, 1), others_running=False)
                    records = merge_samples(folder, problems)
                    write_records_atomic(path, records)
                    write_json_atomic(path.with_suffix(".settings.json"), settings)
                    shutil.rmtree(folder)  # merged: the samples file (and its settings) hold them now
                    if not any(folder.parent.iterdir()):
                        folder.parent.rmdir()
                else:
                    log.info("eval: %s on %s: samples up to date in %s, re-scoring", name, bench, path)
                metrics = score_samples(records, problems, kind_of, config, embed, prm)
                metrics["samples"] = str(path)
                results["results"].setdefault(name, {})[bench] = metrics
                acc, similarity = metrics["accuracy"], metrics["diversity"]["similarity"]["mean"]
                log.info("eval: %s on %s: pass@1 %.3f, maj@k %.3f, pass@k %.3f, similarity %s", name, bench,
                         acc["pass@1"]["mean"], acc["maj@k"]["mean"], acc["pass@k"]["mean"],
                         "n/a" if similarity is None else f"{similarity:.3f}")
                all_records.setdefault(name, {})[bench] = records
        finally:
            generator.close()
    results["comparisons"] = compare_to_reference(all_records, benchmarks, kind_of, config, results["results"])
    write_json_atomic(out / "results.json", results)
    return results


def paired_differences(reference_records: Sequence[Sample], records: Sequence[Sample], problems: Sequence[Problem], kind_of: KindOf,
                       config: Config, reference_metrics: dict | None = None, model_metrics: dict | None = None) -> dict:
    """One model minus a reference on the same problems: the accuracy metrics
    (paired_accuracy_differences), and where both carry them per problem, the mean PRM reward
    ("prm_reward"), the mean pairwise similarity of the sampled solutions ("similarity", over the
    problems scored for both; lower = more diverse) and the strategy entropy of the correct
    solutions ("strategy_entropy", bits, over the problems counted for both), each {mean, lo, hi}
    with a paired bootstrap interval."""
    n_resamples, seed = config.eval.bootstrap_resamples, config.eval.seed
    differences = paired_accuracy_differences(reference_records, records, problems, kind_of, n_resamples=n_resamples, seed=seed)
    reference_metrics, model_metrics = reference_metrics or {}, model_metrics or {}

    def paired(values_a, values_b, name: str) -> None:
        pairs = [(a, b) for a, b in zip(values_a, values_b) if a is not None and b is not None]
        if pairs:
            mean, lo, hi = bootstrap_ci(np.array([b - a for a, b in pairs]), n_resamples=n_resamples, seed=seed)
            differences[name] = {"mean": mean, "lo": lo, "hi": hi}

    rewards = [m.get("prm_reward") for m in (reference_metrics, model_metrics)]
    if all(r and "per_problem" in r for r in rewards):
        paired(rewards[0]["per_problem"], rewards[1]["per_problem"], "prm_reward")
    diversities = [m.get("diversity", {}) for m in (reference_metrics, model_metrics)]
    for name in ("similarity", "strategy_entropy"):
        per_problem = [(d.get(name) or {}).get("per_problem") for d in diversities]
        if all(values is not None for values in per_problem):
            paired(per_problem[0], per_problem[1], name)
    return differences


def compare_to_reference(all_records: dict, benchmarks: dict, kind_of: KindOf, config: Config, metrics: dict | None = None) -> dict:
    """{"reference": name, "models": {model: {benchmark: paired differences}}, "pairs": {"a_vs_b":
    {benchmark: a minus b}}} against the model named "base" (else the first evaluated one) and
    for every pair of eval.pairs that was evaluated (paired_differences); empty when fewer than
    two models ran.

    metrics: {model: {benchmark: score_samples output}}: the per-problem PRM reward, similarity and
    strategies the differences beyond accuracy are paired from.
    """
    if len(all_records) < 2:
        return {}
    metrics = metrics or {}
    reference = "base" if "base" in all_records else next(iter(all_records))

    def compare(model: str, against: str) -> dict:
        return {bench: paired_differences(all_records[against][bench], records, benchmarks[bench], kind_of, config,
                                          metrics.get(against, {}).get(bench), metrics.get(model, {}).get(bench))
                for bench, records in all_records[model].items() if bench in all_records[against]}

    models = {name: compare(name, reference) for name in all_records if name != reference}
    pairs = {f"{a}_vs_{b}": compare(a, b) for a, b in config.eval.pairs if a in all_records and b in all_records}
    return {"reference": reference, "models": {m: d for m, d in models.items() if d}, "pairs": pairs}
