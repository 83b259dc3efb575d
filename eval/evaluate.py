"""The evaluation stage's library (paper 5, Tables 2 and 4): every model on every benchmark.

Per model and benchmark the samples come from eval.sampling (two batched generate calls, graded
into samples records), are kept by eval.samples_store, and are scored by eval.sample_metrics (greedy
pass@1, pass@1, maj@k, pass@k with bootstrap CIs; diversity: mean pairwise cosine of whole-solution
embeddings, Vendi, distinct-n, distinct correct texts, and the entropy and number of correct
strategies where a problem knows its strategies) from those records only, so a rerun that finds
a pair's samples up to date re-scores them without generating. eval.comparisons pairs the models.

Problem p's samples draw from the stream stream_seed(eval.seed, p's id) (sample j: + j), so they
depend on nothing but the problem: the samples are generated eval.problems_per_commit problems at a
time and committed as shards (pipeline.storage.shards.ShardWriter) in reports/<run>/samples/shards/<pair>/, and
``eval.shard = i/n`` makes a worker sample only the problems with index % n == i
(``python -m stages.launch eval``: one worker per GPU). A run with shard 0/1 samples what is still
missing, merges the shards into the samples file in problem order (what one process writes) and
scores every problem at once: intervals, diversity and paired differences are over all problems.
Decisions and formats: docs/evaluation.md; formulas: docs/metrics.md.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from eval.benchmark_sources import BenchmarkSource, load_eval_benchmark, resolve_benchmark
from eval.comparisons import compare_to_reference
from eval.diversity import Embedder
from eval.matched import matched_difference
from eval.model_specs import ModelSpec, missing_model_reason, parse_model_spec
from eval.sample_metrics import StepScorer, graded, score_samples
from eval.samples_store import commit_samples_file, reusable_samples, samples_path, sampling_settings, shard_folder
from eval.sampling import KindOf, generate_samples, problem_kind
from eval.target import score_target, target_line
from pipeline.config.schema import Config
from pipeline.finetune.rewards import StateLogRewards
from pipeline.records import Problem, Sample
from pipeline.storage.files import write_json_atomic
from pipeline.storage.locks import held_locks
from pipeline.storage.model_folders import read_manifest, snapshot_folders, snapshot_step
from pipeline.storage.shards import ShardWriter, check_settings, completed_problem_ids, parse_shard

log = logging.getLogger(__name__)

GeneratorFactory = Callable[[str, "str | None"], object]  # (model path, adapter) -> Generator


def reports_dir(config: Config) -> Path:
    """reports/<run>/: where the evaluation writes results, report and samples."""
    return Path("reports") / config.run


@dataclass
class Evaluation:
    """One model on one benchmark: its samples and its metrics."""

    samples: list[Sample]
    metrics: dict


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


class _LazyGenerator:
    """A model's generator, loaded on first use (a pair whose samples are up to date loads nothing)."""

    def __init__(self, make_generator: GeneratorFactory, spec: ModelSpec):
        self.make_generator, self.spec, self.generator = make_generator, spec, None

    def get(self):
        if self.generator is None:
            spec = self.spec
            log.info(
                "eval: loading model %r from %s%s",
                spec.name,
                spec.path,
                f" with adapter {spec.adapter}" if spec.adapter else "",
            )
            self.generator = self.make_generator(spec.path, spec.adapter)
        return self.generator

    def close(self) -> None:
        if self.generator is not None:
            self.generator.close()  # its memory back (a vLLM engine shut down) before the next model loads
            self.generator = None


def _in_chunks(items: Sequence, size: int) -> list[Sequence]:
    return [items[start : start + size] for start in range(0, len(items), size)]


def sample_share(
    generator: _LazyGenerator,
    problems: Sequence[Problem],
    kind_of: KindOf,
    config: Config,
    *,
    folder: Path,
    settings: dict,
    shard: tuple[int, int],
    others_running: bool,
) -> int:
    """Sample the problems of shard (i, n) (index % n == i) that ``folder`` holds no samples of yet,
    eval.problems_per_commit at a time, each chunk committed as one shard; returns how many.
    The folder's settings.json guards the resume (pipeline.storage.shards.check_settings)."""
    index, count = shard
    check_settings(folder, settings, f"the samples of {generator.spec.name}", others_running=others_running)
    done = completed_problem_ids(folder)
    todo = [p for i, p in enumerate(problems) if i % count == index and p.problem_id not in done]
    if not todo:
        return 0
    log.info(
        "eval: %s: %d problems of shard %d/%d to sample (%d already committed)",
        folder.name,
        len(todo),
        index,
        count,
        sum(1 for i, p in enumerate(problems) if i % count == index) - len(todo),
    )
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


def _benchmarks(config: Config) -> tuple[dict[str, BenchmarkSource], dict[str, list[Problem]]]:
    sources = {name: resolve_benchmark(config, name) for name in config.eval.benchmarks}
    return sources, {name: load_eval_benchmark(config, name) for name in config.eval.benchmarks}


SNAPSHOT_MARK = "@"  # eval.curves: the model <name>'s snapshot of training step n is evaluated as "<name>@<n>"


def _models(config: Config):
    """(name, ModelSpec, why it cannot be evaluated or None) for every entry of eval.models, then for
    every snapshot of the models eval.curves names (``curve_models``)."""
    for name, value in config.eval.models.items():
        spec = parse_model_spec(config, name, value)
        yield name, spec, missing_model_reason(spec)
    for name, spec in curve_models(config):
        yield name, spec, missing_model_reason(spec)


def curve_models(config: Config) -> list[tuple[str, ModelSpec]]:
    """("<model>@<step>", its ModelSpec) for each snapshot of each model of eval.curves: the folders
    <the model folder's parent>/snapshots/step-<n>/ that its training stage wrote (snapshot_every),
    by step, those of the training that wrote the model (their manifests' settings equal its own,
    where it records them). A model that is missing, has an adapter, or none written, has none."""
    out = []
    for name in config.eval.curves:
        if name not in config.eval.models:  # as eval.pairs: a name eval.models does not hold has no curve
            continue
        spec = parse_model_spec(config, name, config.eval.models[name])
        if spec.adapter is not None or not spec.path_is_local or missing_model_reason(spec) is not None:
            continue
        settings = read_manifest(spec.path).get("settings")
        for folder in snapshot_folders(Path(spec.path).parent):
            if settings is not None and read_manifest(folder).get("settings") != settings:
                continue  # another training's snapshot (a retrain that stopped before its model)
            label = f"{name}{SNAPSHOT_MARK}{snapshot_step(folder)}"
            out.append((label, ModelSpec(name=label, path=str(folder))))
    return out


def sample_shard(
    config: Config, make_generator: GeneratorFactory, out_dir: str | Path, kind_of: KindOf = problem_kind
) -> dict:
    """Worker i of n (eval.shard = i/n): sample its share of every (model, benchmark) pair into
    the pair's shard folder and nothing else (a run with eval.shard = 0/1 merges and scores).
    Pairs whose samples file is up to date and models that cannot be found are left out.
    Returns {model: {benchmark: problems sampled now}}."""
    out = Path(out_dir)
    shard = parse_shard(config.eval.shard)
    sources, benchmarks = _benchmarks(config)
    others_running = bool(held_locks(out, ".lock-shard-*"))
    draw_config = target_draw_config(config)
    sampled: dict = {}
    for name, spec, reason in _models(config):
        if reason is not None:
            log.warning("eval: skipping model %r: %s", name, reason)
            continue
        generator = _LazyGenerator(make_generator, spec)
        try:
            for bench, problems in benchmarks.items():
                pairs = [(bench, config, problems)]
                if draw_config is not None and SNAPSHOT_MARK not in name:
                    drawn = problems[: config.eval.target_problems]
                    pairs.append((f"{bench}{TARGET_DRAW_SUFFIX}", draw_config, drawn))
                for label, pair_config, pair_problems in pairs:
                    settings = sampling_settings(pair_config, spec, sources[bench], pair_problems)
                    if reusable_samples(samples_path(out, name, label), settings) is not None:
                        continue
                    sampled.setdefault(name, {})[label] = sample_share(
                        generator,
                        pair_problems,
                        kind_of,
                        pair_config,
                        folder=shard_folder(out, name, label),
                        settings=settings,
                        shard=shard,
                        others_running=others_running,
                    )
        finally:
            generator.close()
    return sampled


TARGET_DRAW_SUFFIX = (
    ".temperature_1"  # the samples file of a model's draw at temperature 1: <model>__<benchmark>.temperature_1.jsonl
)


def target_draw_config(config: Config) -> Config | None:
    """The config of every model's draw at temperature 1 (eval.target_samples samples per problem,
    no greedy sample), or None when eval.target_samples is 0 (off)."""
    if not config.eval.target_samples:
        return None
    settings = dataclasses.replace(config.eval, k=config.eval.target_samples, temperature=1.0, greedy=False)
    return dataclasses.replace(config, eval=settings)


def pair_samples(
    generator: _LazyGenerator,
    pair: tuple[str, str, BenchmarkSource],
    problems: Sequence[Problem],
    kind_of: KindOf,
    config: Config,
    out: Path,
) -> list[Sample]:
    """The samples of one (model, benchmark label, source) pair under ``config``'s eval settings:
    the samples file when its settings are current, else sampled (what workers committed is
    merged, not drawn again) and committed to it."""
    name, bench, source = pair
    path = samples_path(out, name, bench)
    settings = sampling_settings(config, generator.spec, source, problems)
    records = reusable_samples(path, settings)
    if records is not None:
        log.info("eval: %s on %s: samples up to date in %s, re-scoring", name, bench, path)
        return records
    log.info(
        "eval: %s on %s: %d problems x %d samples at temperature %g%s",
        name,
        bench,
        len(problems),
        config.eval.k,
        config.eval.temperature,
        " + greedy" if config.eval.greedy else "",
    )
    folder = shard_folder(out, name, bench)
    sample_share(
        generator, problems, kind_of, config, folder=folder, settings=settings, shard=(0, 1), others_running=False
    )
    return commit_samples_file(folder, path, problems, settings)


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
            "k": config.eval.k,
            "temperature": config.eval.temperature,
            "greedy": config.eval.greedy,
            "top_p": config.generation.top_p,
            "max_new_tokens": config.generation.max_new_tokens,
            "max_problems": config.eval.max_problems,
            "embedder": config.eval.embedder or "all-MiniLM-L6-v2",
            "bootstrap_resamples": config.eval.bootstrap_resamples,
            "confidence": 0.95,
            "seed": config.eval.seed,
            "prm": config.resolve(config.eval.prm) if prm is not None else None,
        },
        "benchmarks": {
            name: {
                "n_problems": len(problems),
                "kinds": sorted({kind_of(p) for p in problems}),
                "loader": sources[name].loader,
                "path": sources[name].path,
            }
            for name, problems in benchmarks.items()
        },
        "models": {},
        "skipped": [],
        "results": {},
    }
    all_records: dict[str, dict[str, list[Sample]]] = {}
    draw_config = target_draw_config(config)
    draws: dict[str, dict[str, dict[str, list[Sample]]]] = {}  # benchmark -> model -> problem_id -> its draw
    if draw_config is not None:
        results["temperature_1"], results["target"] = {}, {}
    for name, spec, reason in _models(config):
        results["models"][name] = {"path": spec.path, "adapter": spec.adapter}
        if reason is not None:
            log.warning("eval: skipping model %r: %s", name, reason)
            results["skipped"].append({"model": name, "path": spec.path, "adapter": spec.adapter, "reason": reason})
            continue
        generator = _LazyGenerator(make_generator, spec)
        try:
            for bench, problems in benchmarks.items():
                pair = (name, bench, sources[bench])
                records = pair_samples(generator, pair, problems, kind_of, config, out)
                if draw_config is not None and SNAPSHOT_MARK not in name:
                    drawn = problems[: config.eval.target_problems]
                    draw = pair_samples(
                        generator,
                        (name, f"{bench}{TARGET_DRAW_SUFFIX}", sources[bench]),
                        drawn,
                        kind_of,
                        draw_config,
                        out,
                    )
                    draw_metrics = score_samples(draw, drawn, kind_of, draw_config, embed)
                    results["temperature_1"].setdefault(name, {})[bench] = draw_metrics
                    draws.setdefault(bench, {})[name] = graded(draw, drawn, kind_of)[0]
                metrics = score_samples(records, problems, kind_of, config, embed, prm)
                metrics["samples"] = str(samples_path(out, name, bench))
                results["results"].setdefault(name, {})[bench] = metrics
                acc, similarity = metrics["accuracy"], metrics["diversity"]["similarity"]["mean"]
                log.info(
                    "eval: %s on %s: pass@1 %.3f, maj@k %.3f, pass@k %.3f, similarity %s",
                    name,
                    bench,
                    acc["pass@1"]["mean"],
                    acc["maj@k"]["mean"],
                    acc["pass@k"]["mean"],
                    "n/a" if similarity is None else f"{similarity:.3f}",
                )
                all_records.setdefault(name, {})[bench] = records
        finally:
            generator.close()
    if draw_config is not None and prm is not None:
        shaping = StateLogRewards.of(config.gfn)
        if config.gfn.reference_prior_coef != 1.0:
            log.warning(
                "eval: gfn.reference_prior_coef is %g, not 1: the GFlowNet's target is pi_base^%g x R^(1/T), while "
                "the base's samples weighted by R^(1/T) estimate pi_base x R^(1/T); the target section measures the latter",
                config.gfn.reference_prior_coef,
                config.gfn.reference_prior_coef,
            )
        for bench, drawn in draws.items():
            reference = "base" if "base" in drawn else next(iter(drawn))
            problems = benchmarks[bench][: config.eval.target_problems]
            target = score_target(
                problems,
                drawn,
                reference,
                prm,
                shaping,
                n_resamples=config.eval.bootstrap_resamples,
                seed=config.eval.seed,
            )
            results["target"][bench] = target
            log.info("eval: %s", target_line(bench, target))
    listed = {name: records for name, records in all_records.items() if SNAPSHOT_MARK not in name}
    results["comparisons"] = compare_to_reference(listed, benchmarks, kind_of, config, results["results"])
    if config.eval.curves:
        results["curves"] = diversity_curves(config, results["results"], list(benchmarks))
    write_json_atomic(out / "results.json", results)
    return results


def trained_steps(model_path: str) -> int | None:
    """The training steps a fine-tuned model folder holds (its manifest's training_steps, as the gfn
    and ppo stages write it: fewer than num_train_steps when the wall-clock safety net stopped the
    run), None when it records none."""
    steps = read_manifest(model_path).get("training_steps")
    return steps if isinstance(steps, int) else None


def _per_problem(metrics: dict) -> tuple[list | None, list | None, float | None]:
    """A model's per-problem mean log L and equal-count strategy entropy (None where missing), and
    that entropy's mean over the problems scored."""
    log_l = ((metrics.get("prm_reward") or {}).get("log_likelihood") or {}).get("per_problem")
    entropy = ((metrics.get("diversity") or {}).get("strategy_entropy_equal_count") or {}).get("entropy") or {}
    return log_l, entropy.get("per_problem"), entropy.get("mean")


def diversity_curves(config: Config, results: dict, benchmarks: list[str]) -> dict:
    """Diversity against reward along training, per benchmark: for each model of eval.curves its
    checkpoints (the reference, base, as step 0, its snapshots, then the model itself as its last
    step) with their mean held-out log L and equal-count strategy entropy, and for every pair of
    eval.pairs whose two models both have curves, the first's entropy minus the second's at the log
    L both reach (eval.matched.matched_difference; eval.bootstrap_resamples, eval.seed).

    {benchmark: {"curves": {model: [{"model", "step", "log_likelihood", "strategy_entropy"}]},
                 "matched": {"a_vs_b": matched_difference(...) | {"note": why not measured}}}}
    """
    reference = "base" if "base" in results else next(iter(results), None)
    snapshots: dict[str, list[tuple[int, str]]] = {}
    for label in results:
        if SNAPSHOT_MARK in label:
            name, _, step = label.rpartition(SNAPSHOT_MARK)
            snapshots.setdefault(name, []).append((int(step), label))
    out: dict = {}
    for bench in benchmarks:
        points: dict[str, list[tuple[str, int]]] = {}
        for name in config.eval.curves:
            if name not in results or reference is None or bench not in results[name]:
                continue
            steps = sorted(snapshots.get(name, []))
            final = trained_steps(parse_model_spec(config, name, config.eval.models[name]).path)
            last = steps[-1][0] + 1 if steps else 1
            points[name] = [(reference, 0)] + [(label, step) for step, label in steps] + [(name, final or last)]
        curves, arrays = {}, {}
        for name, chain in points.items():
            rows = [
                (label, step, *_per_problem(results[label][bench])) for label, step in chain if bench in results[label]
            ]
            curves[name] = [
                {
                    "model": label,
                    "step": step,
                    "log_likelihood": None if log_l is None else float(np.mean(log_l)),
                    "strategy_entropy": mean_entropy,
                }
                for label, step, log_l, _, mean_entropy in rows
            ]
            if all(log_l is not None and entropy is not None for _, _, log_l, entropy, _ in rows):
                arrays[name] = (
                    np.array([log_l for _, _, log_l, _, _ in rows], dtype=np.float64),
                    np.array(
                        [[np.nan if e is None else e for e in entropy] for _, _, _, entropy, _ in rows],
                        dtype=np.float64,
                    ),
                )
        matched = {}
        for a, b in config.eval.pairs:
            if a in points and b in points:
                if a in arrays and b in arrays:
                    matched[f"{a}_vs_{b}"] = matched_difference(
                        *arrays[a], *arrays[b], n_resamples=config.eval.bootstrap_resamples, seed=config.eval.seed
                    )
                else:
                    matched[f"{a}_vs_{b}"] = {
                        "note": "no PRM log-likelihood or strategy entropy per problem (eval.prm unset?)"
                    }
        out[bench] = {"curves": curves, "matched": matched}
    return out
