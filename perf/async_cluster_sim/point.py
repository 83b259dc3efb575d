"""One sweep point: N searchers run while the fake trainer draws, sleeps an update and publishes, as
the real trainer does; returns the point's measurements."""

from __future__ import annotations

import os
import time

from perf.async_cluster_sim.arithmetic import ideal_rate, percentile
from perf.async_cluster_sim.cpu import cpu_split, machine_cpu_ticks, process_cpu_seconds
from perf.async_cluster_sim.publishing import publisher_for
from perf.async_cluster_sim.settings import Calibration, SimSettings, StorePolicy
from pipeline.finetune.tba.drawing import BatchRequest, published_after
from pipeline.finetune.tba.stores import WAIT_SECONDS


def trajectory_identity(trajectory) -> tuple:
    return trajectory.problem_id, tuple(trajectory.steps)


def sampled_by(trajectory) -> int:
    """The searcher whose SleepingEngine wrote the trajectory (its steps begin "searcher i round ...")."""
    return int(trajectory.steps[0].split()[1])


def train_point(
    *,
    searchers: int,
    policy: StorePolicy,
    store,
    weights,
    actors: list,
    settings: SimSettings,
    calibration: Calibration,
    first_step: int,
    sweep_state: dict,
    pids: dict[str, set[int]] | None = None,
) -> dict:
    """One sweep point: ``searchers`` searchers run while the fake trainer trains warmup +
    measured updates under ``policy``. Returns the point's measurements and the next free step.
    pids: role -> process ids ("searchers" of all started searchers, "store", "weights"), for the
    CPU time each role spends in the measured window (this process is the trainer)."""
    import ray  # the optional extra (extra `distributed`)

    questions, used = searchers * settings.questions_per_round, settings.samples_per_question
    rows_per_update = questions * used
    capacity = policy.buffer_size or policy.buffer_batches * rows_per_update
    if capacity < rows_per_update:
        raise ValueError(
            f"async_cluster_sim: policy {policy.name}: buffer_size = {capacity} is below one batch "
            f"({questions} questions x {used}) at {searchers} searchers"
        )
    buffer = {
        "capacity": capacity,
        "per_question": used,
        "priority": policy.async_priority,
        "temperature": 1.0,
        "recency": policy.recency_fraction,
        "seed": searchers,
    }
    ray.get(store.restart.remote(buffer))
    ray.get(weights.resume.remote())
    step = published = first_step
    publisher = publisher_for(weights)
    publisher.publish(sweep_state, step, actors[:searchers])  # what the searchers start from
    runs = [actor.run.remote() for actor in actors[:searchers]]
    trained: set = set()
    window_rows, staleness, waits, window_publications = 0, [], [], []
    # the trainer's seconds per measured update (update, its part of publishing, reading its batch); version -> when published
    updating, publishing, parsing, publish_started = [], [], [], {}
    roles = {**(pids or {}), "trainer": {os.getpid()}}
    fresh_in_window = recent_groups = shared_groups = 0
    window_start = stats_start = None
    updates = settings.warmup_updates + settings.measured_updates
    request = None  # the store request for the next update's batch
    try:
        for update in range(updates):
            if update == settings.warmup_updates:
                window_start, stats_start = time.monotonic(), ray.get(store.timings.remote())
                cpu_start, ticks_start = process_cpu_seconds(), machine_cpu_ticks()
            measured = update >= settings.warmup_updates
            waited, deadline = time.monotonic(), time.monotonic() + settings.draw_timeout
            if request is None or request.conditions != (questions, published, step, policy.max_staleness, 0):
                request = BatchRequest(store, (questions, published, step, policy.max_staleness, 0))
            while True:
                # the real trainer's wait (AsyncFinetuneTrainer.draw_once): the batch as soon as the store
                # holds it, asked for as the previous update started
                answer = request.result(WAIT_SECONDS)
                if answer is not None:
                    break
                ready, _ = ray.wait(runs, num_returns=len(runs), timeout=0)
                for ref in ready:
                    ray.get(ref)  # a searcher's loop ends early only with an error: raised here
                if time.monotonic() > deadline:
                    raise RuntimeError(
                        f"async_cluster_sim: {searchers} searchers: step {step} got no batch of "
                        f"{questions} questions x {used} within {settings.draw_timeout:g} s; store: "
                        f"{ray.get(store.stats.remote())}"
                    )
            _, groups, recent = answer
            parsed = request.read_seconds  # the reading of the batch (json, records checked), in the request's thread
            request = None
            if update + 1 < updates:  # the next batch asked for as the update starts (AsyncFinetuneTrainer.prefetch)
                following = (questions, published_after(step, published, policy.sync_every), step + 1)
                request = BatchRequest(store, (*following, policy.max_staleness, 0))
            batch = [trajectory for group in groups for trajectory in group]
            # a question's group with completions of two searchers: their question cycles met
            shared_groups += sum(len({sampled_by(t) for t in group}) > 1 for group in groups)
            wait = time.monotonic() - waited
            started = time.monotonic()
            time.sleep(calibration.update_seconds)  # the update
            updated = time.monotonic() - started
            new = 0
            for trajectory in batch:
                identity = trajectory_identity(trajectory)
                new += identity not in trained
                trained.add(identity)
            if measured:
                window_rows += len(batch)
                fresh_in_window += new
                recent_groups += recent
                staleness += [step - t.policy_version for t in batch]
                waits.append(wait)
                parsing.append(parsed)
                updating.append(updated)
            step += 1
            if step % policy.sync_every == 0:
                # the real trainer's publication (AsyncFinetuneTrainer.publish): packed here, sent in the
                # background while the next update waits for its batch and trains
                started = time.monotonic()
                publisher.publish(sweep_state, step, actors[:searchers])
                publish_started[step] = started
                published = step
                if measured:
                    publishing.append(time.monotonic() - started)
            if measured:
                window_publications += publisher.take_finished()
        window_seconds = time.monotonic() - window_start
        stats_end = ray.get(store.timings.remote())
        cpu_end, ticks_end = process_cpu_seconds(), machine_cpu_ticks()
    finally:
        if request is not None:
            request.close()
        publisher.close()  # the running publication ends first
        ray.get(weights.stop.remote())
        rounds = ray.get(runs, timeout=settings.draw_timeout)
    # when each version measured reached the searchers (references handed out), and when its last round reached the store
    arrivals = ray.get(store.round_arrivals.remote())
    lags = [
        max(arrivals[p.version]) - (publish_started[p.version] + p.seconds)
        for p in window_publications
        if p.version in publish_started and len(arrivals.get(p.version, [])) >= searchers
    ]
    cpu = cpu_split(cpu_start, cpu_end, roles)
    measured_rounds = (stats_end["added"] - stats_start["added"]) / (
        settings.questions_per_round * settings.samples_per_question
    )
    final = ray.get(store.timings.remote())
    added = stats_end["added"] - stats_start["added"]
    sampled = stats_end["sampled_rows"] - stats_start["sampled_rows"]
    add_s = stats_end["add_seconds"] - stats_start["add_seconds"]
    sample_s = stats_end["sample_seconds"] - stats_start["sample_seconds"]
    ideal = ideal_rate(
        searchers,
        round_seconds=calibration.round_seconds,
        trajectories_per_round=calibration.trajectories_per_round,
        update_seconds=calibration.update_seconds,
        rows_per_update=rows_per_update,
    )
    trained_per_s = fresh_in_window / window_seconds
    point = {
        "policy": policy.name,
        "searchers": searchers,
        "rows_per_update": rows_per_update,
        "window_seconds": window_seconds,
        "trained_per_s": trained_per_s,
        "rows_trained_per_s": window_rows / window_seconds,
        "rows_trained_of_ideal": window_rows / window_seconds / ideal,
        # groups the store took from completions of the newest published weights (the recency share m)
        "recent_group_fraction": recent_groups / (settings.measured_updates * questions),
        "ideal_per_s": ideal,
        "fraction_of_ideal": trained_per_s / ideal,
        "generated_per_s": added / window_seconds,
        "staleness_p50": percentile(staleness, 50),
        "staleness_p90": percentile(staleness, 90),
        "staleness_max": max(staleness) if staleness else None,
        "staleness_histogram": {str(v): staleness.count(v) for v in sorted(set(staleness))},
        "trainer_wait_per_update_s": sum(waits) / max(len(waits), 1),
        "store_ingest_per_s": added / window_seconds,
        "store_ingest_capacity_per_s": added / add_s if add_s > 0 else None,
        "store_sample_per_s": sampled / window_seconds,
        "store_sample_capacity_per_s": sampled / sample_s if sample_s > 0 else None,
        "store_busy_fraction": (add_s + sample_s) / window_seconds,
        "publish_seconds": sum(p.seconds for p in window_publications) / max(len(window_publications), 1),
        "publish_bytes": window_publications[0].bytes if window_publications else None,
        # the trainer's wall time per measured update: waiting for its batch, the update, its own part
        # of a publication (packing; waiting for the previous one), the rest (the simulation's counting)
        "trainer_update_per_update_s": sum(updating) / max(len(updating), 1),
        # the batch's reading (JSON, records built and checked) in the request's thread, and the
        # store's own time checking and drawing (per update): both run while the previous update does,
        # the trainer waits only for what is left of them when it ends
        "trainer_parse_per_update_s": sum(parsing) / max(len(parsing), 1),
        "store_draw_per_update_s": sample_s / settings.measured_updates,
        "trainer_publish_per_update_s": sum(publishing) / max(len(updating), 1),
        "trainer_other_per_update_s": (window_seconds - sum(waits) - sum(updating) - sum(publishing))
        / max(len(updating), 1),
        # a version's last round at the store, seconds after its references were handed out (one
        # round of G with no overhead: G); p50 and max over the measured versions
        "last_round_after_publication_p50_s": percentile(lags, 50),
        "last_round_after_publication_max_s": max(lags) if lags else None,
        # CPU seconds per measured update of each role's processes (all their threads); other: Ray's
        # own processes (raylet, GCS, idle workers) and the rest of the machine; busy: the machine's
        # cores busy over the window (1.0: every core all the time)
        "cpu_per_update_s": {
            role: value / settings.measured_updates
            if isinstance(value, float)
            else {name: seconds / settings.measured_updates for name, seconds in value.items()}
            for role, value in cpu.items()
        },
        "cpu_per_searcher_round_s": cpu.get("searchers", 0.0) / measured_rounds if measured_rounds else None,
        "machine_busy_fraction": (ticks_end[0] - ticks_start[0]) / max(ticks_end[1] - ticks_start[1], 1),
        # the whole point (warm-up included): what the searchers sent, what the trainer trained
        "rounds": sum(rounds),
        "added": final["added"],
        "per_searcher": final["per_searcher"],
        "trained_distinct": len(trained),
        "trained_rows": updates * rows_per_update,
        "shared_question_groups": shared_groups,
        "searcher_rate_of_calibrated": (added / window_seconds)
        / (searchers * calibration.trajectories_per_round / calibration.round_seconds),
        "next_step": step,
    }
    return point
