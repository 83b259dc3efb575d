"""make search: PRM-guided search at inference (paper 3.4, Figure 2).

Reads:  the benchmark config.search.benchmark (eval.evaluate.resolve_benchmark when present),
        the policy (config.model.policy) and the trained PRM (config.model.prm)
Writes: runs/<run>/search/results.json  one row per (strategy, k): accuracy with a bootstrap CI,
                                        finished share, tokens generated per problem
        runs/<run>/search/table.md      the same rows as a table
        runs/<run>/search/accuracy_vs_k.png  accuracy against k and against tokens per problem
The unguided baseline ("majority": unweighted vote over k samples; k=1 is pass@1 of a single
sample) runs at every k beside the PRM-guided strategies. docs/search.md has the rules.
"""

from __future__ import annotations

from pathlib import Path

from matplotlib.figure import Figure
from tqdm import tqdm

from eval.evaluate import resolve_benchmark
from pipeline.generation import build_generator, check_served_models
from pipeline.io import write_json_atomic
from pipeline.problems import load_benchmark
from pipeline.prompts import prompt_from_config, question_text
from prm.formats import load_scorer
from prm.search import STRATEGIES, search_many, summarize_search
from stages.common import cli, log, parse_args, require, require_prm, set_threads, stage_dir, timed

BASELINE = "majority"


def search_problems(config):
    """The benchmark's problems: search.benchmark_path when given, else where the evaluation
    finds that benchmark (eval.evaluate.resolve_benchmark: "tiny_test" is the bootstrap stage's
    held-out file)."""
    name, path = config.search.benchmark, config.resolve(config.search.benchmark_path)
    if path is not None:
        problems = load_benchmark("problems" if name == "tiny_test" else name, path, lenient=config.data.lenient)
    else:
        source = resolve_benchmark(config, name)
        if name == "tiny_test":
            require(source.path, "bootstrap")
        problems = load_benchmark(source.loader, source.path, lenient=config.data.lenient)
    if config.search.max_problems is not None:
        problems = problems[: config.search.max_problems]
    if not problems:
        raise SystemExit(f"search: benchmark {name!r} has no problems")
    return problems


def search_settings(config, kind: str) -> dict:
    s = config.search
    return {
        "kind": kind, "temperature": s.temperature, "top_p": config.generation.top_p, "max_depth": s.max_depth,
        "beam_width": s.beam_width, "aggregation": s.aggregation, "max_step_tokens": config.generation.max_step_tokens,
        "max_new_tokens": config.generation.max_new_tokens, "separator": config.format.separator, "seed": s.seed,
    }


def main(argv: list[str] | None = None) -> dict:
    config = parse_args("search", argv)
    set_threads(config, "search")
    check_served_models(config, {"model.policy": config.resolve(config.model.policy)})  # before any model loads
    out = stage_dir(config, "search")
    unknown = [s for s in config.search.strategies if s not in STRATEGIES]
    if unknown:
        raise SystemExit(f"search.strategies: unknown {unknown}; expected some of {list(STRATEGIES)}")
    with timed("search"):
        problems = search_problems(config)
        kinds = {p.kind for p in problems}
        if len(kinds) != 1:
            raise SystemExit(f"search: problems mix answer kinds {sorted(kinds)}; run one benchmark at a time")
        kind = kinds.pop()
        policy = build_generator(config)
        prm = load_scorer(require_prm(config.resolve(config.model.prm)), config)  # ours or another format (model.prm_format)
        questions = [question_text(p.question, p.meta.get("options")) for p in problems]
        prompts = [prompt_from_config(p.question, kind, policy.tokenizer, config.format, p.meta.get("options")) for p in problems]
        golds = [p.answer for p in problems]
        settings = search_settings(config, kind)
        strategies = [BASELINE] + [s for s in config.search.strategies if s != BASELINE]
        rows = []
        bar = tqdm(total=len(strategies) * len(config.search.ks), desc="search runs", unit="run", dynamic_ncols=True)
        for strategy in strategies:
            for k in config.search.ks:
                bar.set_postfix_str(f"{strategy} k={k}")
                results = search_many(questions, policy, prm, strategy, k, prompts=prompts, **settings)
                row = {"strategy": strategy, "k": k, **summarize_search(results, golds, kind, seed=config.seed)}
                log.info("search: %s k=%d accuracy %.3f [%.3f, %.3f], %.0f tokens/problem", strategy, k,
                         row["accuracy"]["mean"], row["accuracy"]["lo"], row["accuracy"]["hi"], row["tokens_per_problem"])
                rows.append(row)
                bar.update(1)
        bar.close()
        summary = {"benchmark": config.search.benchmark, "n_problems": len(problems), "settings": settings, "rows": rows}
        write_json_atomic(out / "results.json", summary)
        (out / "table.md").write_text(results_table(rows), encoding="utf-8")
        plot_accuracy_vs_k(rows, out / "accuracy_vs_k.png")
    return summary


def results_table(rows: list[dict]) -> str:
    lines = ["| strategy | k | accuracy | 95% CI | finished | tokens / problem |", "|---|---:|---:|---|---:|---:|"]
    for r in rows:
        a = r["accuracy"]
        lines.append(f"| {r['strategy']} | {r['k']} | {a['mean']:.3f} | [{a['lo']:.3f}, {a['hi']:.3f}] "
                     f"| {r['finished_fraction']:.2f} | {r['tokens_per_problem']:.0f} |")
    return "\n".join(lines) + "\n"


def plot_accuracy_vs_k(rows: list[dict], path: Path) -> None:
    """Figure 2's shape: accuracy against k (left) and against tokens per problem (right)."""
    fig = Figure(figsize=(10, 4))
    by_k, by_tokens = fig.subplots(1, 2)
    for strategy in dict.fromkeys(r["strategy"] for r in rows):
        mine = sorted((r for r in rows if r["strategy"] == strategy), key=lambda r: r["k"])
        ks = [r["k"] for r in mine]
        mean = [r["accuracy"]["mean"] for r in mine]
        lo = [r["accuracy"]["mean"] - r["accuracy"]["lo"] for r in mine]
        hi = [r["accuracy"]["hi"] - r["accuracy"]["mean"] for r in mine]
        style = "--" if strategy == BASELINE else "-"
        by_k.errorbar(ks, mean, yerr=[lo, hi], marker="o", linestyle=style, capsize=3, label=strategy)
        by_tokens.plot([r["tokens_per_problem"] for r in mine], mean, marker="o", linestyle=style, label=strategy)
    by_k.set_xscale("log", base=2)
    by_k.set(xlabel="k (candidates per step / samples)", ylabel="accuracy", title="accuracy vs k")
    by_tokens.set_xscale("log")
    by_tokens.set(xlabel="policy tokens generated per problem", ylabel="accuracy", title="at equal compute")
    by_k.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


if __name__ == "__main__":
    cli(main)
