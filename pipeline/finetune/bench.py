"""Fine-tuning's benchmarks: `gfn_batched_step` (one batched teacher-forced forward + backward
per training step against a batch-1 forward per trajectory) and the bookkeeping of
`gfn_async_speedup` (the settings and the arithmetic of the equal-work comparison of the
synchronous and asynchronous modes; stages.bench runs it)."""

from __future__ import annotations

from typing import Callable, Sequence

from pipeline.bench import timed


def bench_gfn_step(policy, prompts: Sequence[str], step_lists: Sequence[Sequence[str]], loss_fn: Callable) -> dict:
    """One training step's forward + backward: ONE batched teacher-forced forward over all
    trajectories (ours) vs a batch-1 forward per trajectory (the reference's approach).

    loss_fn(TrajectoryLogprobs) -> (B,) per-trajectory loss (e.g. SubTB with fixed rewards).
    """
    model = policy.model

    def batched():
        lp = policy.logprobs(prompts, step_lists, with_grad=True)
        loss_fn(lp).mean().backward()
        model.zero_grad(set_to_none=True)

    def per_trajectory():
        for p, s in zip(prompts, step_lists):
            lp = policy.logprobs([p], [s], with_grad=True)
            (loss_fn(lp).sum() / len(prompts)).backward()
        model.zero_grad(set_to_none=True)

    batched()  # warm-up
    ours = min(timed(batched) for _ in range(2))
    reference = min(timed(per_trajectory) for _ in range(2))
    return {"ours_s": ours, "reference_s": reference, "ratio": reference / ours, "trajectories": len(prompts)}


# ----------------------------------------------------------------------------- gfn_async_speedup (equal work)


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
    common = ["gfn.loss=tb_vargrad", f"gfn.questions_per_step={questions}", f"gfn.samples_per_question={samples}",
              "gfn.replay_fraction=0", "gfn.save_every=0", f"gfn.mode={mode}", f"gfn.trainer_cores=[{cores[0]}]"]
    if mode == "sync":
        return common
    if mode != "async":
        raise ValueError(f"equal-work comparison: mode must be sync or async, got {mode!r}")
    batch = questions * samples
    return common + ["gfn.searchers=1", f"gfn.searcher_cores=[{cores[1]}]", f"gfn.async_samples_used={samples}",
                     "gfn.sync_every=1", "gfn.max_staleness=1", "gfn.searcher_rounds_per_version=1", "gfn.recency_fraction=1.0",
                     "gfn.async_priority=uniform", f"gfn.async_initial_completions={batch}", f"gfn.buffer_size={4 * batch}"]


def equal_work_speedup(sync_rows: list[dict], async_rows: list[dict], questions: int, samples: int, timed_from: int = 2) -> dict:
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
            raise ValueError(f"equal work: synchronous update {row['step']} trained {row['trained']} rows ({row.get('replayed', 0)} "
                             f"replayed) of {row['sampled']} sampled, {row['empty_solutions']} empty; expected its {batch} samples, none replayed")
    for row in async_rows:
        if row["trained"] != batch or row["trajectories_per_question_min"] != samples:
            raise ValueError(f"equal work: asynchronous update {row['step']} trained {row['trained']} rows (at least "
                             f"{row['trajectories_per_question_min']} per question); expected {questions} x {samples}")
    timed = len(sync_rows) - timed_from
    sync_s = sync_rows[-1]["wall_time"] - sync_rows[timed_from - 1]["wall_time"]
    async_s = async_rows[-1]["wall_time"] - async_rows[timed_from - 1]["wall_time"]
    generate = sum(row["sample_seconds"] for row in sync_rows[timed_from:]) / timed
    train = sync_s / timed - generate
    ceiling = speedup_ceiling(generate, train)
    window = async_rows[timed_from:]
    return {"updates": len(sync_rows), "timed_updates": timed, "generate_s": generate, "train_s": train, "sync_s": sync_s,
            "async_s": async_s, "ceiling": ceiling, "speedup": sync_s / async_s, "fraction": sync_s / async_s / ceiling,
            "sync_trained": sum(row["trained"] for row in sync_rows) / len(sync_rows),
            "async_trained": sum(row["trained"] for row in async_rows) / len(async_rows),
            "async_generated_per_trained": sum(row["generated_per_trained"] * row["trained"] for row in window)
                                           / sum(row["trained"] for row in window),
            "async_staleness_mean": sum(row["staleness_mean"] for row in window) / timed,
            "async_busy_s": sum(row["seconds"] - row["trainer_idle_seconds"] for row in window) / timed,
            "async_trainer_idle_s": sum(row["trainer_idle_seconds"] for row in window) / timed,
            "async_publish_s": sum(row["publish_seconds"] for row in window) / timed}
