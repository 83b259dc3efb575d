"""gfn_async_speedup: `make gfn` synchronous vs asynchronous at equal work, on CPU cores whatever
the machine, and the held-out quality of both modes' policies (docs/async.md, "Measured").

ratio = reference_s / ours_s = synchronous seconds / asynchronous seconds of the timed updates; the
row's goal is 0.8 x the ceiling (G + T) / max(G, T) of the synchronous run's generation G and
training T per update (it carries it: "goal"), fraction = ratio / ceiling. Here too: the settings
and the arithmetic of the equal-work comparison (equal_work_overrides, equal_work_speedup,
speedup_ceiling).

Alone: ``python -m perf --config configs/tiny.yaml run=bench only=gfn_async_speedup``.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import statistics
import subprocess
import sys
from pathlib import Path

import numpy as np

from eval.comparisons import paired_differences
from eval.sample_metrics import score_samples
from eval.sampling import generate_samples, problem_kind
from perf.rows import pinned_to, ratio_row
from perf.world import tiny_world
from pipeline.generation.hf import HFGenerator
from pipeline.modeling import load_causal_lm, load_tokenizer
from pipeline.records import Problem
from pipeline.stats import bootstrap_ci
from pipeline.training.metrics import MetricsLog
from prm.formats import load_scorer
from stages.cli import log

NAME = "gfn_async_speedup"
REFERENCE = (
    "make gfn gfn.mode=sync (one process on core 0) vs async (trainer on core 0; one searcher and the "
    "local Ray instance on core 1), one torch thread each, at equal work (4 questions x 4 trajectories per update, nothing "
    "replayed, 20 updates, 3 seeds): seconds of updates 3-20, weight publication included; goal 0.8 x the "
    "ceiling (G + T) / max(G, T) of the sync run's generation G and training T per update"
)


def run(cfg, out_dir: Path) -> dict:
    world = tiny_world(cfg, out_dir)
    return {**async_speedup(cfg, world.scaling_world(), world.splits["test"]), "model": world.note}


def async_speedup(
    config,
    world: Path,
    held_out: list[Problem],
    seeds: tuple[int, ...] = (0, 1, 2),
    updates: int = 20,
    questions: int = 4,
    samples: int = 4,
    timed_from: int = 2,
    problems: int = 32,
    k: int = 4,
    cores: tuple[int, int] = (0, 1),
) -> dict:
    """gfn_async_speedup: `make gfn` synchronous vs asynchronous on the scaling world at equal work
    (equal_work_overrides: ``questions`` x ``samples`` trajectories per
    update, nothing replayed, ``updates`` updates), on CPU cores whatever the machine: the
    synchronous process on ``cores[0]``; asynchronously the trainer on ``cores[0]``, one searcher
    and the Ray processes the stage starts on ``cores[1]``; one torch thread each. Per seed, the
    equal-work check and the timing of updates ``timed_from`` + 1 .. ``updates``
    (equal_work_speedup); then each final policy's held-out PRM reward and accuracy on the first
    ``problems`` held-out problems (``k`` samples and a greedy one each, eval's sampling and
    scoring), async minus sync paired per seed (eval.comparisons.paired_differences) and over the seeds
    (per problem, the mean over seeds of async minus sync; a bootstrap interval over problems)."""
    if not set(cores) <= os.sched_getaffinity(0):
        raise RuntimeError(
            f"gfn_async_speedup pins its processes to cores {list(cores)}, but this process may run on "
            f"{sorted(os.sched_getaffinity(0))} only"
        )
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
    per_seed, models = [], {}
    for seed in seeds:
        rows = {}
        for mode in ("sync", "async"):  # alternating, so that a machine slowing down meanwhile weighs on both
            run = f"speed_{mode}_{seed}"
            shutil.rmtree(world / run, ignore_errors=True)
            command = [
                sys.executable,
                "-m",
                "stages.train_gfn",
                "--config",
                "configs/tiny.yaml",
                f"runs_root={world}",
                f"run={run}",
                f"model.policy={world / 'policy'}",
                f"model.prm={world / 'prm'}",
                f"data.train_path={world / 'problems_train.jsonl'}",
                "data.disjoint_from=[]",
                "model.device=cpu",
                "model.torch_threads=1",
                f"gfn.num_train_steps={updates}",
                f"gfn.seed={seed}",
                *equal_work_overrides(mode, questions, samples, cores),
            ]
            (world / run).mkdir(parents=True)
            # started on the trainer's core, or asynchronously on the searcher's: the Ray processes the stage
            # starts stay there when the trainer moves to its own core (gfn.trainer_cores)
            with open(world / run / "stage.log", "w") as stage_log:
                subprocess.run(
                    command,
                    check=True,
                    timeout=1800,
                    env=env,
                    stdout=stage_log,
                    stderr=subprocess.STDOUT,
                    preexec_fn=pinned_to(cores[0] if mode == "sync" else cores[1]),
                )
            rows[mode] = MetricsLog(world / run / "gfn" / "metrics.jsonl").read()
            models[seed, mode] = world / run / "gfn" / "model"
        per_seed.append(
            {"seed": seed, **equal_work_speedup(rows["sync"], rows["async"], questions, samples, timed_from)}
        )
        log.info(
            "bench: gfn_async_speedup seed %d: %s",
            seed,
            json.dumps({key: round(v, 3) for key, v in per_seed[-1].items()}),
        )
    held_out = held_out[:problems]
    eval_config = dataclasses.replace(config, eval=dataclasses.replace(config.eval, k=k))
    prm = load_scorer(world / "prm", config)
    scored = {}
    for (seed, mode), path in models.items():
        model = load_causal_lm(str(path), config.model)
        generator = HFGenerator(model, load_tokenizer(str(path)), batch_size=config.generation.batch_size)
        records = generate_samples(generator, held_out, problem_kind, eval_config, mode)
        scored[seed, mode] = records, score_samples(records, held_out, problem_kind, eval_config, prm=prm.score_many)
    paired = {
        str(seed): paired_differences(
            scored[seed, "sync"][0],
            scored[seed, "async"][0],
            held_out,
            problem_kind,
            n_resamples=eval_config.eval.bootstrap_resamples,
            seed=eval_config.eval.seed,
            reference_metrics=scored[seed, "sync"][1],
            model_metrics=scored[seed, "async"][1],
        )
        for seed in seeds
    }

    def over_seeds(per_problem) -> dict:
        """Per problem, the mean over seeds of async minus sync, and its bootstrap interval over problems."""
        differences = np.mean(
            [np.asarray(per_problem(seed, "async")) - np.asarray(per_problem(seed, "sync")) for seed in seeds], axis=0
        )
        mean, lo, hi = bootstrap_ci(differences, n_resamples=config.eval.bootstrap_resamples, seed=config.eval.seed)
        return {"mean": mean, "lo": lo, "hi": hi}

    def accuracy(seed: int, mode: str) -> list[float]:
        records = [r for r in scored[seed, mode][0] if r.sample_idx >= 0]
        return [float(np.mean([r.correct for r in records if r.problem_id == p.problem_id])) for p in held_out]

    def reward(seed: int, mode: str) -> list[float]:
        return scored[seed, mode][1]["prm_reward"]["per_problem"]

    held = {
        mode: {
            "prm_reward": [scored[seed, mode][1]["prm_reward"]["mean"] for seed in seeds],
            "pass@1": [scored[seed, mode][1]["accuracy"]["pass@1"]["mean"] for seed in seeds],
        }
        for mode in ("sync", "async")
    }
    sync_s, async_s = sum(r["sync_s"] for r in per_seed), sum(r["async_s"] for r in per_seed)
    generate, train = (statistics.mean(r[key] for r in per_seed) for key in ("generate_s", "train_s"))
    ceiling = speedup_ceiling(generate, train)
    return {
        **ratio_row(NAME, ours_s=async_s, reference_s=sync_s, goal=0.8 * ceiling, reference=REFERENCE),
        "ceiling": ceiling,
        "fraction": sync_s / async_s / ceiling,
        "generate_s": generate,
        "train_s": train,
        "seeds": per_seed,
        "settings": {
            "updates": updates,
            "timed_from": timed_from,
            "questions": questions,
            "samples": samples,
            "cores": list(cores),
            "held_out_problems": len(held_out),
            "k": k,
        },
        "held_out": {
            **held,
            "async_minus_sync": {"prm_reward": over_seeds(reward), "pass@1": over_seeds(accuracy)},
            "paired_per_seed": paired,
        },
    }


def speedup_ceiling(generate_s: float, train_s: float) -> float:
    """(G + T) / max(G, T): the most that overlapping generation (G s per update) with training
    (T s per update) can gain over doing one after the other, each on its own core."""
    if generate_s < 0 or train_s < 0 or generate_s + train_s <= 0:
        raise ValueError(f"speedup ceiling: expected G, T >= 0 and G + T > 0, got G = {generate_s}, T = {train_s}")
    return (generate_s + train_s) / max(generate_s, train_s)


def equal_work_overrides(mode: str, questions: int, samples: int, cores: tuple[int, int]) -> list[str]:
    """`make gfn` settings of the equal-work comparison (TB-VarGrad, ``questions`` x ``samples``
    trajectories per update, nothing replayed, the trainer pinned to ``cores[0]``), for ``mode``:

    sync:  one process samples the step's questions, scores them, trains on them (replay off);
    async: one searcher pinned to ``cores[1]`` samples one round (the same questions x samples)
           per published version; the trainer publishes after every update (k = 1), trains on all
           ``samples`` completions of ``questions`` questions (K = S) drawn from the newest weights'
           completions first (m = 1, uniform within a question), and drops completions more than one
           update old (max_staleness = 1): in the steady state update t trains the round sampled with
           the weights of update t - 1 while the searcher samples the next one. Update 1 waits for
           the searcher's start and first round; update 2 trains that round again (the only one
           sampled with the first weights); a round with a question short of K distinct completions
           (an empty solution) makes the trainer wait for the next round, which it then trains twice.
    """
    common = [
        "gfn.loss=tb_vargrad",
        f"gfn.questions_per_step={questions}",
        f"gfn.samples_per_question={samples}",
        "gfn.replay_fraction=0",
        "gfn.save_every=0",
        f"gfn.mode={mode}",
        f"gfn.trainer_cores=[{cores[0]}]",
    ]
    if mode == "sync":
        return common
    if mode != "async":
        raise ValueError(f"equal-work comparison: mode must be sync or async, got {mode!r}")
    batch = questions * samples
    return common + [
        "gfn.searchers=1",
        f"gfn.searcher_cores=[{cores[1]}]",
        f"gfn.async_samples_used={samples}",
        "gfn.sync_every=1",
        "gfn.max_staleness=1",
        "gfn.searcher_rounds_per_version=1",
        "gfn.recency_fraction=1.0",
        "gfn.async_priority=uniform",
        f"gfn.async_initial_completions={batch}",
        f"gfn.buffer_size={4 * batch}",
    ]


def equal_work_speedup(
    sync_rows: list[dict], async_rows: list[dict], questions: int, samples: int, timed_from: int = 2
) -> dict:
    """The equal-work comparison from the two runs' metrics records (one per update).

    Checks the work first (ValueError naming what differs): the same number of updates; the
    synchronous updates train their fresh samples only (nothing replayed: trained = sampled - empty
    solutions, at most questions x samples); every asynchronous update trains questions x samples.
    Then times updates ``timed_from`` + 1 .. N of each run by wall clock (end of update
    ``timed_from`` to end of the last: logging and, asynchronously, weight publication included).
    The synchronous run's generation time G per update is its sampling and scoring
    (``sample_seconds``), T the rest of its time per update. Returns
    {updates, timed_updates, generate_s, train_s, sync_s, async_s, ceiling, speedup, fraction,
     sync_trained, async_trained (rows per update), and over the timed asynchronous updates:
     async_generated_per_trained (completions the searcher sent per row trained), async_staleness_mean,
     async_busy_s (drawing, training and logging per update, waits excluded), async_trainer_idle_s
     (waiting for a batch), async_publish_s (publishing the weights)}.
    """
    if timed_from < 1:
        raise ValueError(f"equal work: timed_from = {timed_from}: the timing starts at the end of an update (>= 1)")
    if len(sync_rows) != len(async_rows):
        raise ValueError(f"equal work: {len(sync_rows)} synchronous updates vs {len(async_rows)} asynchronous ones")
    if len(sync_rows) < timed_from + 1:
        raise ValueError(f"equal work: {len(sync_rows)} updates leave none to time after the first {timed_from}")
    batch = questions * samples
    for row in sync_rows:
        fresh = row["sampled"] - row["empty_solutions"]
        if row.get("replayed", 0) or row["trained"] != fresh or row["sampled"] != batch:
            raise ValueError(
                f"equal work: synchronous update {row['step']} trained {row['trained']} rows ({row.get('replayed', 0)} "
                f"replayed) of {row['sampled']} sampled, {row['empty_solutions']} empty; expected its {batch} samples, none replayed"
            )
    for row in async_rows:
        if row["trained"] != batch or row["trajectories_per_question_min"] != samples:
            raise ValueError(
                f"equal work: asynchronous update {row['step']} trained {row['trained']} rows (at least "
                f"{row['trajectories_per_question_min']} per question); expected {questions} x {samples}"
            )
    n_timed = len(sync_rows) - timed_from
    sync_s = sync_rows[-1]["wall_time"] - sync_rows[timed_from - 1]["wall_time"]
    async_s = async_rows[-1]["wall_time"] - async_rows[timed_from - 1]["wall_time"]
    generate = sum(row["sample_seconds"] for row in sync_rows[timed_from:]) / n_timed
    train = sync_s / n_timed - generate
    ceiling = speedup_ceiling(generate, train)
    window = async_rows[timed_from:]
    return {
        "updates": len(sync_rows),
        "timed_updates": n_timed,
        "generate_s": generate,
        "train_s": train,
        "sync_s": sync_s,
        "async_s": async_s,
        "ceiling": ceiling,
        "speedup": sync_s / async_s,
        "fraction": sync_s / async_s / ceiling,
        "sync_trained": sum(row["trained"] for row in sync_rows) / len(sync_rows),
        "async_trained": sum(row["trained"] for row in async_rows) / len(async_rows),
        "async_generated_per_trained": sum(row["generated_per_trained"] * row["trained"] for row in window)
        / sum(row["trained"] for row in window),
        "async_staleness_mean": sum(row["staleness_mean"] for row in window) / n_timed,
        "async_busy_s": sum(row["seconds"] - row["trainer_idle_seconds"] for row in window) / n_timed,
        "async_trainer_idle_s": sum(row["trainer_idle_seconds"] for row in window) / n_timed,
        "async_publish_s": sum(row["publish_seconds"] for row in window) / n_timed,
    }
