"""make mcts: OmegaPRM-style rollout data generation (paper 3.1, Algorithm 1).

Reads:  the training problems (config.data), the policy (config.model.policy)
Writes: runs/<run>/mcts/shards/part-*/{records,summaries}.jsonl  (resumable, shard=i/n)
        runs/<run>/mcts/stats.json
One process per shard (lock file mcts/.lock-shard-<i>of<n>); a damaged shard (missing or changed
files, no problems list, a copy of another) stops the run with its name instead of being searched
again or read twice (pipeline.storage.shards.verified_shards).
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

from tqdm import tqdm

from pipeline.generation import build_generator, check_served_models
from pipeline.grading import extract_answer, grade_many
from pipeline.prompts import prompt_from_config
from pipeline.records import MCTSRecord, MCTSSummary
from pipeline.rollouts.mcts import make_rollout_fn, run_mcts
from pipeline.storage.files import path_fingerprint, write_json_atomic
from pipeline.storage.locks import held_locks
from pipeline.storage.shards import ShardWriter, check_settings, completed_problem_ids, parse_shard, read_stream
from stages.cli import cli, log, parse_args, set_threads, timed
from stages.inputs import training_problems
from stages.run_folders import stage_dir


def main(argv: list[str] | None = None) -> dict:
    config = parse_args("mcts", argv)
    set_threads(config, "mcts")
    check_served_models(config, {"model.policy": config.resolve(config.model.policy)})  # before any model loads
    shard_index, shard_count = parse_shard(config.mcts.shard)
    problems = training_problems(config)  # before the run folder is made: a stage that cannot start writes nothing
    if config.mcts.max_problems is not None:
        problems = problems[: config.mcts.max_problems]
    # One process per shard: `mcts.shard=i/n` runs n processes on this folder by design.
    out = stage_dir(config, "mcts", lock=f".lock-shard-{shard_index}of{shard_count}")
    other_splits = [h for h in held_locks(out, ".lock-shard-*") if not h["path"].endswith(f"of{shard_count}")]
    if other_splits:
        raise SystemExit(
            f"mcts: {other_splits[0]['path']} is held by process {other_splits[0].get('pid', '?')}: a run split "
            f"another way than {shard_count} shards is searching this folder; both would search the same problems"
        )
    shards = out / "shards"
    with timed("mcts"):
        mine = [p for i, p in enumerate(problems) if i % shard_count == shard_index]
        check_settings(
            shards, mcts_settings(config), "the MCTS run", others_running=bool(held_locks(out, ".lock-shard-*"))
        )
        done = completed_problem_ids(shards)
        todo = [p for p in mine if p.problem_id not in done]
        log.info(
            "mcts: %d problems in shard %s, %d already complete, %d to search",
            len(mine),
            config.mcts.shard,
            len(mine) - len(todo),
            len(todo),
        )
        if todo:
            kinds = {p.kind for p in todo}
            if len(kinds) != 1:
                raise SystemExit(f"mcts: problems mix answer kinds {sorted(kinds)}; run one source at a time")
            kind = kinds.pop()
            generator = build_generator(config)
            prompts = [
                prompt_from_config(p.question, kind, generator.tokenizer, config.format, p.meta.get("options"))
                for p in todo
            ]
            rollout_fn = make_rollout_fn(
                generator,
                prompts,
                [p.answer for p in todo],
                kind,
                k=config.mcts.k,
                temperature=config.mcts.temperature,
                root_temperature=config.mcts.root_temperature,
                top_p=config.mcts.top_p,
                max_new_tokens=config.generation.max_new_tokens,
                separator=config.format.separator,
                grade_many=grade_many,
                extract_answer=extract_answer,
                seed=config.seed,
                problem_ids=[p.problem_id for p in todo],
            )
            bar = tqdm(total=len(todo), desc="mcts problems", unit="problem", dynamic_ncols=True)
            rollouts_total = [0]

            def progress(rollouts: int, finished: int) -> None:
                rollouts_total[0] += rollouts
                bar.update(finished)
                elapsed = bar.format_dict["elapsed"] or 1e-9
                bar.set_postfix(rollouts_per_s=f"{rollouts_total[0] / elapsed:.0f}")

            tag = f"{shard_index}of{shard_count}"
            with ShardWriter(shards, tag=tag, commit_every=config.mcts.problems_per_commit) as writer:
                run_mcts(
                    [(p.problem_id, p.question) for p in todo],
                    config.mcts,
                    rollout_fn,
                    on_done=lambda result: writer.add(
                        result.summary.problem_id, records=result.records, summaries=[result.summary]
                    ),
                    max_active=config.mcts.max_active,
                    progress=progress,
                )
            bar.close()
        stats = mcts_stats(shards)
        write_json_atomic(out / "stats.json", stats)
        log.info("mcts: %s", {k: v for k, v in stats.items() if k != "mc_histogram"})
    return stats


def mcts_settings(config) -> dict:
    """What the records depend on: the policy (and its weights), the search parameters, the
    problems and the step format. Not: shard, max_active, problems_per_commit, max_problems,
    data.lenient, data.disjoint_from (a check of the problems, which it changes none of)."""
    policy = config.resolve(config.model.policy)
    search = {
        k: v
        for k, v in dataclasses.asdict(config.mcts).items()
        if k not in ("shard", "max_active", "problems_per_commit", "max_problems")
    }
    return {
        "policy": policy,
        "policy_fingerprint": _fingerprint_if_local(policy),
        "policy_adapter": config.resolve(config.model.policy_adapter),
        "mcts": search,
        "seed": config.seed,
        # not data.lenient: skipping malformed problem records changes no other problem's records
        "data": {
            k: config.resolve(v) if k == "train_path" else v
            for k, v in dataclasses.asdict(config.data).items()
            if not k.startswith("validation") and k not in ("lenient", "disjoint_from")
        },
        "train_fingerprint": _fingerprint_if_local(config.resolve(config.data.train_path)),
        "format": dataclasses.asdict(config.format),
        "max_new_tokens": config.generation.max_new_tokens,
    }


def _fingerprint_if_local(path: str | None) -> str | None:
    return path_fingerprint(path) if path and Path(path).exists() else None


def mcts_stats(shards) -> dict:
    """Counts over every committed shard (all processes of a sharded run)."""
    summaries = list(read_stream(shards, "summaries", MCTSSummary))
    mcs = [record.mc for record in read_stream(shards, "records", MCTSRecord)]
    histogram = [0] * 10
    for mc in mcs:
        histogram[min(int(mc * 10), 9)] += 1
    return {
        "problems": len(summaries),
        "problems_searched": sum(s.searched for s in summaries),
        "mean_root_mc": sum(s.root_mc for s in summaries) / max(len(summaries), 1),
        "steps_evaluated": len(mcs),
        "rollouts_spent": sum(s.rollouts_spent for s in summaries),
        "share_mc_zero": sum(mc == 0 for mc in mcs) / max(len(mcs), 1),
        "share_mc_one": sum(mc == 1 for mc in mcs) / max(len(mcs), 1),
        "share_mc_between": sum(0 < mc < 1 for mc in mcs) / max(len(mcs), 1),
        "mc_histogram": histogram,
    }


if __name__ == "__main__":
    cli(main)
