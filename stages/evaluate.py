"""make eval: accuracy and diversity of several models on several benchmarks (paper 5, Tables 2 and 4).

Reads:  the models of config.eval.models ({name: path or hub id, "path::adapter" for a peft
        adapter}; a local path that does not exist is skipped and noted), the benchmarks of
        config.eval.benchmarks (eval.benchmark_paths[name] when given; "tiny_test" = the
        bootstrap stage's problems_test.jsonl)
        the PRM at eval.prm when it exists (each model's mean PRM reward)
Writes: reports/<run>/results.json, report.md, accuracy.png, similarity.png, config.yaml,
        samples/<model>__<benchmark>.jsonl (+ .settings.json: a rerun with the same settings
        and unchanged model files re-scores these instead of generating again)
With eval.shard=i/n (python -m stages.launch eval: one worker per GPU) a worker only samples
the problems with index % n == i into samples/shards/<model>__<benchmark>/ and writes nothing
else; the run with eval.shard=0/1 after them merges the shards and writes everything above,
the files one process writes (eval.evaluate, docs/evaluation.md).
"""

from __future__ import annotations

from pathlib import Path

from eval.benchmark_sources import check_eval_benchmarks
from eval.diversity import load_embedder
from eval.evaluate import reports_dir, run_evaluation, sample_shard
from eval.model_specs import parse_model_spec
from eval.report import write_report
from pipeline.config.loader import save_config
from pipeline.generation import build_generator, check_served_models
from pipeline.modeling import resolve_device
from pipeline.storage.locks import acquire_stage_lock, held_locks
from pipeline.storage.shards import parse_shard
from prm.formats import is_hub_id, load_scorer
from stages.cli import cli, log, parse_args, set_threads, timed

__all__ = ["main", "reports_dir"]


def load_prm_scores(config):
    """score_many of the PRM at eval.prm (ours, or another format: model.prm_format), or None
    (not configured, or not trained yet)."""
    path = config.resolve(config.eval.prm)
    if path is None:
        return None
    if not Path(path).exists() and not is_hub_id(path):
        log.warning("eval: no PRM at %s (eval.prm); mean PRM reward not reported", path)
        return None
    return load_scorer(path, config).score_many


def main(argv: list[str] | None = None) -> dict:
    config = parse_args("evaluate", argv)
    set_threads(config, "eval")
    # every model's folder before the first loads: a later model that cannot be served would
    # otherwise stop the evaluation after the earlier ones had run
    check_served_models(
        config,
        {
            f"eval.models.{name}": parse_model_spec(config, name, value).path
            for name, value in config.eval.models.items()
        },
    )
    check_eval_benchmarks(config)  # before the embedder loads and before reports/<run>/ is made
    out = reports_dir(config)
    out.mkdir(parents=True, exist_ok=True)
    index, count = parse_shard(config.eval.shard)
    if count > 1:
        return sample_worker(config, out, index, count)
    acquire_stage_lock(out / ".lock", f"make eval for run {config.run}")  # one writer per reports folder
    workers = held_locks(out, ".lock-shard-*")
    if workers:
        raise SystemExit(
            f"eval: {workers[0]['path']} is held by process {workers[0].get('pid', '?')}: workers of "
            "`python -m stages.launch eval` are sampling this run; wait for them (the launcher merges when they finish)"
        )
    save_config(config, out / "config.yaml")
    with timed("eval"):
        embed = load_embedder(config.eval.embedder, device=str(resolve_device(config.model.device)))
        results = run_evaluation(
            config,
            lambda path, adapter: build_generator(config, model_path=path, adapter=adapter, progress=True),
            embed=embed,
            out_dir=out,
            prm=load_prm_scores(config),
        )
        paths = write_report(results, out)
    log.info("eval: report written to %s", paths["report"])
    return results


def sample_worker(config, out: Path, index: int, count: int) -> dict:
    """One worker of a sharded evaluation: its share of every pair's problems, sampled into the
    shard folders (eval.evaluate.sample_shard); no scoring, report or config.yaml."""
    acquire_stage_lock(out / f".lock-shard-{index}of{count}", f"make eval shard {index}/{count} for run {config.run}")
    others = [h for h in held_locks(out, ".lock*") if not h["path"].endswith(f"of{count}")]
    if others:
        raise SystemExit(
            f"eval: {others[0]['path']} is held by process {others[0].get('pid', '?')}: another evaluation of this run "
            f"(one process, or split another way than {count} shards) is sampling the same problems"
        )
    with timed(f"eval shard {index}/{count}"):
        sampled = sample_shard(
            config, lambda path, adapter: build_generator(config, model_path=path, adapter=adapter, progress=True), out
        )
    log.info("eval: shard %d/%d sampled %s", index, count, sampled or "nothing (up to date)")
    return {"shard": config.eval.shard, "sampled": sampled}


if __name__ == "__main__":
    cli(main)
