"""The sweep: a local Ray instance, the run's actors and placement group, the searchers of each store
policy, every sweep point."""

from __future__ import annotations

import dataclasses
import functools
import logging
import os
import time

from perf.async_cluster_sim.fakes import make_sampler, reopenable_weights_class, timed_store_class
from perf.async_cluster_sim.point import train_point
from perf.async_cluster_sim.publishing import bf16_state, full_publication
from perf.async_cluster_sim.settings import (
    CALIBRATION,
    DEFAULT_SETTINGS,
    NAME,
    NO_REPLAY,
    REPO,
    Calibration,
    SimSettings,
    StorePolicy,
    config_policy,
)
from pipeline.finetune.tba import ray_cluster
from pipeline.finetune.tba.searcher import Searcher

log = logging.getLogger("stepflow.bench")


def gfn_section(cfg, settings: SimSettings, searchers: int, policy: StorePolicy | None = None):
    """The gfn section the searchers' samplers and the placement read: the config's, with the
    sweep's round shape, searcher count and the policy's rounds per version (None: no limit)."""
    return dataclasses.replace(
        cfg.gfn,
        questions_per_step=settings.questions_per_round,
        samples_per_question=settings.samples_per_question,
        searchers=searchers,
        searcher_gpus=0.0,
        searcher_rounds_per_version=policy.searcher_rounds_per_version if policy else None,
        min_steps=1,
        placement_timeout=settings.placement_timeout,
    )


def problems_json(count: int) -> list[dict]:
    return [{"problem_id": f"q{i}", "question": f"question {i}", "answer": "1"} for i in range(count)]


def start_searchers(gfn, group, names: dict, calibration: Calibration) -> tuple[list, list, set[int]]:
    """gfn.searchers Searcher actors, searcher i in bundle 1 + i of the run's placement group, each
    sampling its share of the problems: (the actors, each one's bundles as Ray reports them, their process ids)."""
    import ray  # the optional extra (extra `distributed`)

    factory = functools.partial(make_sampler, gfn=gfn, calibration=calibration)
    searcher = ray.remote(num_cpus=1, max_restarts=0, max_concurrency=2)(Searcher)
    actors = [
        searcher.options(scheduling_strategy=ray_cluster.searcher_strategy(group, i)).remote(
            i, factory, names, None, searchers=gfn.searchers
        )
        for i in range(gfn.searchers)
    ]
    statuses = ray.get([actor.status.remote() for actor in actors], timeout=600)
    return actors, [status["placement"]["bundles"] for status in statuses], {status["pid"] for status in statuses}


def sweep(
    cfg, *, settings: SimSettings = DEFAULT_SETTINGS, calibration: Calibration = CALIBRATION, full_payload: bool = True
) -> dict:
    """Start a local Ray instance, the run's actors and max(searcher_counts) searchers in the
    run's placement group, run every sweep point, shut Ray down."""
    import ray  # the optional extra (extra `distributed`)

    most = max(settings.searcher_counts)
    gfn = gfn_section(cfg, settings, most)
    started = time.monotonic()
    path = os.pathsep.join([str(REPO), *filter(None, [os.environ.get("PYTHONPATH")])])
    # Ray's CPU resource is logical: one per searcher bundle, as ray_cluster.bundles asks; the
    # searchers sleep, so more bundles than cores is what the simulation is for
    ray.init(
        num_cpus=most,
        include_dashboard=False,
        log_to_driver=False,
        namespace=f"{NAME}-{os.getpid()}",
        runtime_env={
            "env_vars": {
                "PYTHONPATH": path,
                "OMP_NUM_THREADS": "1",
                "MKL_NUM_THREADS": "1",
                "TOKENIZERS_PARALLELISM": "false",
            }
        },
    )
    try:
        names = {"store": "store", "weights": "weights"}
        store = (
            ray.remote(num_cpus=0)(timed_store_class())
            .options(name=names["store"])
            .remote(
                {"capacity": 1, "per_question": 1, "priority": "uniform", "temperature": 1.0, "recency": 0.0, "seed": 0}
            )
        )
        problems_ref = ray.put(problems_json(settings.problems))
        weights_actor = ray.remote(num_cpus=0)(reopenable_weights_class())
        weights = weights_actor.options(name=names["weights"]).remote([problems_ref])
        group, _ = ray_cluster.reserve(gfn, 0, settings.placement_timeout, "the local Ray instance")
        sweep_state = bf16_state(settings.sweep_payload_parameters)
        points, step, starts, bundles, actors, startup = [], 0, [], None, [], None
        for policy in settings.policies or (config_policy(cfg.gfn), NO_REPLAY):
            # each policy's own searchers: how many rounds they sample per version is their setting
            for actor in actors:
                ray.kill(actor)
            start = time.monotonic()
            actors, placed, searcher_pids = start_searchers(
                gfn_section(cfg, settings, most, policy), group, names, calibration
            )
            pids = {
                "searchers": searcher_pids,
                "store": {ray.get(store.pid.remote())},
                "weights": {ray.get(weights.pid.remote())},
            }
            bundles = bundles or placed
            starts.append(time.monotonic() - start)
            startup = startup or time.monotonic() - started  # Ray and the first searchers
            log.info("%s: %s: %d searchers started in %.1f s", NAME, policy.name, most, starts[-1])
            for count in settings.searcher_counts:
                point = train_point(
                    searchers=count,
                    policy=policy,
                    store=store,
                    weights=weights,
                    actors=actors,
                    settings=settings,
                    calibration=calibration,
                    first_step=step,
                    sweep_state=sweep_state,
                    pids=pids,
                )
                step = point["next_step"]
                points.append(point)
                log.info(
                    "%s: %s N=%d trained %.1f/s of ideal %.1f/s (%.2f); staleness p50 %.1f p90 %.1f; store busy %.3f",
                    NAME,
                    policy.name,
                    count,
                    point["trained_per_s"],
                    point["ideal_per_s"],
                    point["fraction_of_ideal"],
                    point["staleness_p50"],
                    point["staleness_p90"],
                    point["store_busy_fraction"],
                )
        full = None
        if full_payload:
            full = full_publication(weights, actors, bf16_state(settings.full_payload_parameters), step)
            log.info("%s: 1B-parameter bf16 publication %s", NAME, full)
        return {
            "points": points,
            "full_publication": full,
            "startup_seconds": startup,
            "searcher_start_seconds": starts,
            "searcher_bundles": bundles,
            "total_seconds": time.monotonic() - started,
        }
    finally:
        ray.shutdown()
