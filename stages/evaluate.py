"""make eval: accuracy and diversity of several models on several benchmarks (paper 5, Tables 2 and 4).

Reads:  the models of config.eval.models ({name: path or hub id, "path::adapter" for a peft
        adapter}; a local path that does not exist is skipped and noted), the benchmarks of
        config.eval.benchmarks (eval.benchmark_paths[name] when given; "tiny_test" = the
        bootstrap stage's problems_test.jsonl)
        the PRM at eval.prm when it exists (each model's mean PRM reward)
Writes: reports/<run>/results.json, report.md, accuracy.png, similarity.png, config.yaml,
        samples/<model>__<benchmark>.jsonl (+ .settings.json: a rerun with the same settings
        and unchanged model files re-scores these instead of generating again)
"""

from __future__ import annotations

from pathlib import Path

from eval.diversity import load_embedder
from eval.evaluate import parse_model_spec, reports_dir, run_evaluation
from eval.report import write_report
from pipeline.config import save_config
from pipeline.generation import build_generator, check_served_models
from pipeline.io import acquire_stage_lock
from pipeline.modeling import resolve_device
from prm.formats import is_hub_id, load_scorer
from stages.common import cli, log, parse_args, set_threads, timed

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
    check_served_models(config, {f"eval.models.{name}": parse_model_spec(config, name, value).path
                                 for name, value in config.eval.models.items()})
    out = reports_dir(config)
    out.mkdir(parents=True, exist_ok=True)
    acquire_stage_lock(out / ".lock", f"make eval for run {config.run}")  # one writer per reports folder
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


if __name__ == "__main__":
    cli(main)
