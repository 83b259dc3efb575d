"""make prm-bench: the ProcessBench protocol (first wrong step; F1 of the accuracies on erroneous
and on correct solutions) for the PRM at model.prm, in any format load_scorer reads.

Reads:  model.prm (model.prm_format); prm_bench.processbench_paths (ProcessBench-format JSON/JSONL,
        or hub splits hf://owner/name/split, e.g. hf://Qwen/ProcessBench/gsm8k),
        prm_bench.prm800k_path (PRM800K phase-2 ratings); for the policy's own samples, the policy
        (model.policy) and held-out problems (data.validation*), labelled exactly where their
        kind has a labeller (prm.exact_check.FIRST_ERROR_LABELLERS: the tiny world)
Writes: runs/<run>/prm_bench/results.json ({set name: source, threshold, f1, interval, accuracies, cases}),
        config.yaml
Library: prm.processbench.
"""

from __future__ import annotations

from pathlib import Path

from pipeline.generation import build_generator
from pipeline.prompts import question_text
from pipeline.storage.files import write_json_atomic
from prm.exact_check import FIRST_ERROR_LABELLERS, policy_solutions
from prm.formats import load_scorer
from prm.processbench import (
    labelled_cases,
    prm800k_cases,
    processbench,
    processbench_source,
    read_processbench,
    read_processbench_hub,
)
from stages.cli import cli, log, parse_args, set_threads, timed
from stages.inputs import require, require_prm, validation_problems
from stages.run_folders import stage_dir


def policy_cases(config) -> tuple[str, list, str] | None:
    """(set name, cases, where they come from) of the policy's samples of held-out problems,
    labelled by their kind's labeller; None when prm_bench.policy_problems is 0 or the kind has
    no labeller."""
    cfg = config.prm_bench
    if cfg.policy_problems <= 0:
        return None
    problems = validation_problems(config)[: cfg.policy_problems]
    kinds = {problem.kind for problem in problems}
    labeller = FIRST_ERROR_LABELLERS.get(kinds.pop()) if len(kinds) == 1 else None
    if labeller is None:
        log.info(
            "prm_bench: no exact step labels for problems of kind(s) %s: the policy's samples are skipped",
            sorted(kinds),
        )
        return None
    samples = policy_solutions(
        build_generator(config),
        problems,
        config.format,
        cfg.policy_samples,
        cfg.temperature,
        config.generation.max_new_tokens,
        seed=cfg.seed,
    )
    cases = labelled_cases(
        [sample.problem for sample in samples],
        [sample.steps for sample in samples],
        labeller,
        question=lambda p: question_text(p.question, p.meta.get("options")),
    )
    source = (
        f"the policy's ({config.resolve(config.model.policy)}) {cfg.policy_samples} samples at temperature {cfg.temperature} "
        f"of each of {len(problems)} held-out problems (data.validation: "
        f"{config.resolve(config.data.validation_path) or config.data.validation}), "
        f"labelled exactly by {labeller.__module__}.{labeller.__name__}"
    )
    return f"{problems[0].kind}_policy", cases, source


def hub_cases(spec: str, hub_id: str, hub_config: str | None, split: str) -> list:
    """A ProcessBench split read from the hub; an unreachable hub is an error saying what to do."""
    try:
        return read_processbench_hub(hub_id, hub_config, split)
    except OSError as exc:  # datasets' unreachable hub (ConnectionError) and missing dataset (FileNotFoundError)
        raise SystemExit(
            f"prm_bench: could not read {spec} from the hub ({type(exc).__name__}: {exc}); download the split "
            "as JSON/JSONL and pass its path in prm_bench.processbench_paths"
        ) from None


def main(argv: list[str] | None = None) -> dict:
    config = parse_args("prm_bench", argv)
    set_threads(config, "prm_bench")
    cfg = config.prm_bench
    with timed("prm_bench"):
        sets, sources = {}, {}
        for spec in cfg.processbench_paths:
            hub = processbench_source(spec)
            if hub is None:
                path = require(Path(config.resolve(spec)), "prm-bench (a ProcessBench file you supply)")
                name, cases, source = path.stem, read_processbench(path), f"ProcessBench-format file {path}"
            else:
                name, cases, source = hub[2], hub_cases(spec, *hub), f"ProcessBench-format hub split {spec}"
            if name in sets:
                raise SystemExit(
                    f"prm_bench.processbench_paths: two sets named {name!r} ({sources[name]}; {source}): "
                    "rename one file"
                )
            sets[name], sources[name] = cases, source
        if cfg.prm800k_path:
            path = require(Path(config.resolve(cfg.prm800k_path)), "prm-bench (a PRM800K file you supply)")
            sets["prm800k"], sources["prm800k"] = (
                prm800k_cases(path),
                f"PRM800K phase-2 ratings {path} (the first step rated -1)",
            )
        scorer = load_scorer(require_prm(config.resolve(config.model.prm)), config)
        policy = policy_cases(config)
        if policy is not None:
            sets[policy[0]], sources[policy[0]] = policy[1], policy[2]
        if not sets:
            raise SystemExit(
                "prm_bench: nothing to score: set prm_bench.processbench_paths, prm_bench.prm800k_path or "
                "prm_bench.policy_problems (with problems of a kind that has exact step labels)"
            )
        out = stage_dir(config, "prm_bench")  # after the input checks: a stage that cannot start writes nothing
        results = {
            name: {
                "source": sources[name],
                **processbench(
                    scorer,
                    cases,
                    held_out_fraction=cfg.held_out_fraction,
                    threshold=cfg.threshold,
                    n_resamples=cfg.bootstrap_resamples,
                    seed=cfg.seed,
                ),
            }
            for name, cases in sets.items()
        }
        write_json_atomic(out / "results.json", results)
        for name, result in results.items():
            log.info(
                "prm_bench: %s: F1 %s %s at threshold %.2f (%s); acc erroneous %s (n %d), correct %s (n %d)",
                name,
                result["f1"],
                result["interval"],
                result["threshold"],
                result["threshold_from"],
                result["accuracy_erroneous"],
                result["n_erroneous"],
                result["accuracy_correct"],
                result["n_correct"],
            )
    return results


if __name__ == "__main__":
    cli(main)
