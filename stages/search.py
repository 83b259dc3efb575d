"""make search: PRM-guided search at inference (paper 3.4, Figure 2).

Reads:  the benchmark config.search.benchmark (eval.benchmark_sources.resolve_benchmark when present),
        the policy (config.model.policy) and the trained PRM (config.model.prm)
Writes: runs/<run>/search/results.json  one row per (strategy, k): accuracy with a bootstrap CI,
                                        finished share, tokens generated per problem; for the
                                        step-level strategies the sibling AUC, distinct
                                        candidate texts per step and their error rate
                                        (prm.search.siblings); for every row the first wrong
                                        step of each wrongly answered solution by category
                                        (prm.search.wrong_steps)
        runs/<run>/search/table.md      the same rows as a table
        runs/<run>/search/accuracy_vs_k.png  accuracy against k and against tokens per problem
        runs/<run>/search/solutions.jsonl    the solution of every (problem, strategy, k)
                                        (pipeline.records.SearchRecord), in problem order
The unguided baseline ("majority": unweighted vote over k samples; k=1 is pass@1 of a single
sample) runs at every k beside the PRM-guided strategies. docs/search.md has the rules.

The problems are searched search.problems_per_commit at a time (every strategy and k), each
chunk committed to runs/<run>/search/shards/ (pipeline.storage.shards.ShardWriter): a killed run resumes
where it stopped. With search.shard=i/n (python -m stages.launch search: one worker per GPU) a
worker searches only the problems with index % n == i and writes nothing else; a run with
search.shard=0/1 searches what is still missing, then writes the files above from every problem
at once (the intervals are over all problems) and removes the shards. A problem's search depends
on nothing but the problem (prm.search: per-problem random streams), so n workers write what
one process writes.
"""

from __future__ import annotations

import dataclasses
import hashlib
import shutil
from pathlib import Path

from matplotlib.figure import Figure
from tqdm import tqdm

from eval.benchmark_sources import known_benchmark
from pipeline.datasets.loaders import load_benchmark
from pipeline.generation import build_generator, check_served_models
from pipeline.prompts import prompt_from_config, question_text
from pipeline.records import SearchRecord
from pipeline.storage.files import path_fingerprint, write_json_atomic, write_records_atomic, write_text_atomic
from pipeline.storage.locks import held_locks
from pipeline.storage.shards import ShardWriter, check_settings, completed_problem_ids, parse_shard, read_stream
from prm.formats import load_scorer
from prm.search import search_many
from prm.search.candidates import STEP_STRATEGIES, SearchResult
from prm.search.siblings import label_expansions, sibling_labeller, summarize_siblings
from prm.search.summary import summarize_search, vote_comparisons
from prm.search.wrong_steps import WRONG_STEP_CATEGORIES, summarize_wrong_steps, wrong_step_classifier
from stages.cli import cli, log, parse_args, set_threads, timed
from stages.inputs import require, require_prm
from stages.run_folders import stage_dir

BASELINE = "majority"


def search_problems(config):
    """The benchmark's problems: search.benchmark_path when given, else where the evaluation
    finds that benchmark (eval.benchmark_sources.resolve_benchmark: "tiny_test" is the bootstrap stage's
    held-out file)."""
    name, path = config.search.benchmark, config.resolve(config.search.benchmark_path)
    source = known_benchmark(config, "search.benchmark", name)
    if path is None and name == "tiny_test":
        require(source.path, "bootstrap")
    problems = load_benchmark(source.loader, path or source.path, lenient=config.data.lenient)
    if config.search.max_problems is not None:
        problems = problems[: config.search.max_problems]
    if not problems:
        raise SystemExit(f"search: benchmark {name!r} has no problems")
    ids = [p.problem_id for p in problems]
    if len(set(ids)) != len(ids):
        duplicate = next(i for i in ids if ids.count(i) > 1)
        raise SystemExit(
            f"search: benchmark {name!r}: problem_id {duplicate!r} occurs twice; each problem's search and record key on it"
        )
    return problems


def search_settings(config, kind: str) -> dict:
    s = config.search
    return {
        "kind": kind,
        "temperature": s.temperature,
        "top_p": config.generation.top_p,
        "max_depth": s.max_depth,
        "beam_width": s.beam_width,
        "aggregation": s.aggregation,
        "max_step_tokens": config.generation.max_step_tokens,
        "max_new_tokens": config.generation.max_new_tokens,
        "separator": config.format.separator,
        "seed": s.seed,
    }


def strategies_of(config) -> list[str]:
    return [BASELINE] + [s for s in config.search.strategies if s != BASELINE]


def shard_settings(config, settings: dict, problems) -> dict:
    """What the committed solutions depend on (the resume guard of the shards folder): the
    search settings, strategies and ks, the models and their files, the problems and the prompt
    format. Not: shard, problems_per_commit."""

    def fingerprint(path):
        return path_fingerprint(path) if path and Path(path).exists() else None

    policy, prm = config.resolve(config.model.policy), config.resolve(config.model.prm)
    return {
        **settings,
        "strategies": strategies_of(config),
        "ks": list(config.search.ks),
        "policy": policy,
        "policy_fingerprint": fingerprint(policy),
        "policy_adapter": config.resolve(config.model.policy_adapter),
        "prm": prm,
        "prm_fingerprint": fingerprint(prm),
        "prm_format": config.model.prm_format,
        "problem_ids": hashlib.sha256("\n".join(p.problem_id for p in problems).encode()).hexdigest()[:16],
        "format": dataclasses.asdict(config.format),
        "backend": config.generation.backend,
    }


def search_share(
    config, problems, kind: str, settings: dict, shards: Path, shard: tuple[int, int], others_running: bool
) -> int:
    """Search the problems of shard (i, n) (index % n == i) that ``shards`` holds no solutions of
    yet, search.problems_per_commit at a time with every strategy and k, each chunk committed as
    one shard; returns how many."""
    index, count = shard
    check_settings(shards, shard_settings(config, settings, problems), "the search run", others_running=others_running)
    done = completed_problem_ids(shards)
    todo = [p for i, p in enumerate(problems) if i % count == index and p.problem_id not in done]
    log.info(
        "search: %d problems in shard %d/%d, %d to search",
        sum(1 for i in range(len(problems)) if i % count == index),
        index,
        count,
        len(todo),
    )
    if not todo:
        return 0
    policy = build_generator(config)
    prm = load_scorer(
        require_prm(config.resolve(config.model.prm)), config
    )  # ours or another format (model.prm_format)
    per_commit = config.search.problems_per_commit
    chunks = [todo[start : start + per_commit] for start in range(0, len(todo), per_commit)]
    runs = [(strategy, k) for strategy in strategies_of(config) for k in config.search.ks]
    labeller, _ = sibling_labeller(problems, kind)  # measures the candidates after the search; it never reads it
    bar = tqdm(total=len(chunks) * len(runs), desc="search runs", unit="run", dynamic_ncols=True)
    with ShardWriter(shards, tag=f"{index}of{count}", commit_every=per_commit) as writer:
        for chunk in chunks:
            questions = [question_text(p.question, p.meta.get("options")) for p in chunk]
            prompts = [
                prompt_from_config(p.question, kind, policy.tokenizer, config.format, p.meta.get("options"))
                for p in chunk
            ]
            solutions: dict[str, list[SearchRecord]] = {p.problem_id: [] for p in chunk}
            for strategy, k in runs:
                bar.set_postfix_str(f"{strategy} k={k}")
                results = search_many(
                    questions,
                    policy,
                    prm,
                    strategy,
                    k,
                    prompts=prompts,
                    problem_ids=[p.problem_id for p in chunk],
                    **settings,
                )
                for problem, r in zip(chunk, results):
                    solutions[problem.problem_id].append(
                        SearchRecord(
                            problem.problem_id,
                            strategy,
                            k,
                            r.steps,
                            r.step_scores,
                            r.finished,
                            r.answer,
                            r.tokens_generated,
                            label_expansions(problem, r.expansions, labeller)
                            if labeller is not None and strategy in STEP_STRATEGIES
                            else None,
                        )
                    )
                bar.update(1)
            for problem in chunk:
                writer.add(problem.problem_id, solutions=solutions[problem.problem_id])
    bar.close()
    return len(todo)


def merged_solutions(shards: Path, problems, config) -> list[SearchRecord]:
    """Every problem's solutions from the committed shards, in problem order (and each problem's
    in strategy and k order, as searched): what one process writes."""
    by_problem: dict[str, list[SearchRecord]] = {}
    for record in read_stream(shards, "solutions", SearchRecord):
        by_problem.setdefault(record.problem_id, []).append(record)
    runs = [(strategy, k) for strategy in strategies_of(config) for k in config.search.ks]
    for problem in problems:
        found = [(r.strategy, r.k) for r in by_problem.get(problem.problem_id, [])]
        if found != runs:
            raise ValueError(
                f"{shards}: problem {problem.problem_id!r} has solutions for {found or 'nothing'}; expected {runs}"
            )
    return [record for problem in problems for record in by_problem[problem.problem_id]]


def main(argv: list[str] | None = None) -> dict:
    config = parse_args("search", argv)
    set_threads(config, "search")
    check_served_models(config, {"model.policy": config.resolve(config.model.policy)})  # before any model loads
    index, count = parse_shard(config.search.shard)
    worker = count > 1
    problems = search_problems(config)  # before the run folder is made: a stage that cannot start writes nothing
    out = stage_dir(config, "search", lock=f".lock-shard-{index}of{count}" if worker else ".lock", save=not worker)
    others = [h for h in held_locks(out, ".lock*") if not (worker and h["path"].endswith(f"of{count}"))]
    if others:
        raise SystemExit(
            f"search: {others[0]['path']} is held by process {others[0].get('pid', '?')}: another search of this run "
            "(the workers of `python -m stages.launch search`, one process, or a split another way) is searching the same problems"
        )
    shards = out / "shards"
    with timed("search" if not worker else f"search shard {index}/{count}"):
        kinds = {p.kind for p in problems}
        if len(kinds) != 1:
            raise SystemExit(f"search: problems mix answer kinds {sorted(kinds)}; run one benchmark at a time")
        kind = kinds.pop()
        settings = search_settings(config, kind)
        searched = search_share(
            config,
            problems,
            kind,
            settings,
            shards,
            (index, count),
            others_running=worker and bool(held_locks(out, ".lock-shard-*")),
        )
        if worker:
            return {"shard": config.search.shard, "searched": searched}
        solutions = merged_solutions(shards, problems, config)
        golds = [p.answer for p in problems]
        not_labelled = sibling_labeller(problems, kind)[1]
        if not_labelled is not None:
            log.info("search: sibling AUC not measured: %s", not_labelled)
        classifier, not_classified = wrong_step_classifier(problems, kind)
        rows = []
        for strategy in strategies_of(config):
            for k in config.search.ks:
                records = [r for r in solutions if r.strategy == strategy and r.k == k]
                results = [
                    SearchResult(r.steps, r.step_scores, r.finished, r.answer, r.tokens_generated) for r in records
                ]
                row = {"strategy": strategy, "k": k, **summarize_search(results, golds, kind, seed=config.seed)}
                if strategy in STEP_STRATEGIES:
                    row["siblings"] = summarize_siblings([r.siblings for r in records], not_labelled, seed=config.seed)
                row["wrong_steps"] = wrong_steps_of(records, problems, row["correct"], classifier, not_classified)
                log.info(
                    "search: %s k=%d accuracy %.3f [%.3f, %.3f], %.0f tokens/problem",
                    strategy,
                    k,
                    row["accuracy"]["mean"],
                    row["accuracy"]["lo"],
                    row["accuracy"]["hi"],
                    row["tokens_per_problem"],
                )
                rows.append(row)
        summary = {
            "benchmark": config.search.benchmark,
            "n_problems": len(problems),
            "settings": settings,
            "rows": rows,
            "weighted_vote_vs_majority": vote_comparisons(rows, config.search.ks, seed=config.seed),
        }
        write_records_atomic(out / "solutions.jsonl", solutions)
        write_json_atomic(out / "results.json", summary)
        write_text_atomic(out / "table.md", results_table(rows) + vote_table(summary["weighted_vote_vs_majority"]))
        plot_accuracy_vs_k(rows, out / "accuracy_vs_k.png")
        shutil.rmtree(shards)  # merged: solutions.jsonl holds them now
    return summary


def wrong_steps_of(records: list[SearchRecord], problems, correct: list[bool], classifier, not_classified) -> dict:
    """summarize_wrong_steps of one (strategy, k): records and correct are in problem order; the
    wrongly answered solutions classified by ``classifier`` (prm.search.wrong_steps.wrong_step_classifier,
    None with the reason ``not_classified``)."""
    if classifier is None:
        return summarize_wrong_steps(None, not_classified)
    return summarize_wrong_steps(
        [classifier(p, r.steps, r.finished, r.answer) for p, r, ok in zip(problems, records, correct) if not ok]
    )


WRONG_STEP_HEADER = "wrong: " + " / ".join(WRONG_STEP_CATEGORIES)


def wrong_steps_cell(wrong_steps: dict | None) -> str:
    """The counts of a row's wrong steps in WRONG_STEP_CATEGORIES order ("3/1/0/0/2"); "-" where
    not measured."""
    counts = (wrong_steps or {}).get("counts") or {}
    if any(counts.get(c) is None for c in WRONG_STEP_CATEGORIES):
        return "-"
    return "/".join(str(counts[c]) for c in WRONG_STEP_CATEGORIES)


def results_table(rows: list[dict]) -> str:
    """One line per row; the sibling columns (step-level strategies) and the wrong-step counts
    read "-" where not measured."""
    lines = [
        "| strategy | k | accuracy | 95% CI | finished | tokens / problem | sibling AUC | 95% CI | distinct / step | e "
        f"| {WRONG_STEP_HEADER} |",
        "|---|---:|---:|---|---:|---:|---:|---|---:|---:|---|",
    ]
    for r in rows:
        a, siblings = r["accuracy"], r.get("siblings") or {}
        lo, hi = siblings.get("interval", [None, None])
        lines.append(
            f"| {r['strategy']} | {r['k']} | {a['mean']:.3f} | [{a['lo']:.3f}, {a['hi']:.3f}] "
            f"| {r['finished_fraction']:.2f} | {r['tokens_per_problem']:.0f} "
            f"| {_number(siblings.get('auc'), 3)} | {'-' if lo is None else f'[{lo:.3f}, {hi:.3f}]'} "
            f"| {_number(siblings.get('distinct_per_step'), 2)} | {_number(siblings.get('error_rate'), 3)} "
            f"| {wrong_steps_cell(r.get('wrong_steps'))} |"
        )
    return "\n".join(lines) + "\n"


def vote_table(comparisons: list[dict]) -> str:
    """What the PRM adds over counting (prm.search.summary.vote_comparisons) as a table in points;
    "" when the search ran no weighted_vote."""
    if not comparisons:
        return ""
    lines = [
        "",
        "PRM-weighted voting minus majority voting on the same k samples, paired per problem (what the PRM "
        "adds over counting; reported, not judged):",
        "",
        "| k | weighted_vote - majority (points) | 95% CI |",
        "|---:|---:|---|",
    ]
    for row in comparisons:
        d = row["difference"]
        lines.append(f"| {row['k']} | {100 * d['mean']:+.1f} | [{100 * d['lo']:+.1f}, {100 * d['hi']:+.1f}] |")
    return "\n".join(lines) + "\n"


def _number(value: float | None, digits: int) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


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
