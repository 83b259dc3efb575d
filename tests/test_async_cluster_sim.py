"""perf/async_cluster_sim/: the ideal throughput's arithmetic, and a short simulated run
(a local Ray instance, 1 and 2 searchers, round and update times of tens of milliseconds) whose
counts agree: what the store took is what the searchers sent, what the trainer trained came from it."""

from __future__ import annotations

import math
import random
from pathlib import Path

import pytest

from perf.async_cluster_sim import measure
from perf.async_cluster_sim.arithmetic import ideal_rate, percentile
from perf.async_cluster_sim.report import breakdown_table, markdown_table
from perf.async_cluster_sim.settings import NO_REPLAY, Calibration, SimSettings, config_policy

REPO = Path(__file__).resolve().parent.parent


def brute_force_rate(
    searchers: int, round_seconds: float, per_round: int, update_seconds: float, rows: int, horizon: float
) -> float:
    """Trajectories trained per second over ``horizon`` seconds, counted round by round and update
    by update: every searcher sends per_round trajectories at the end of each of its rounds, the
    trainer can take rows trajectories at the end of each update; trained = what was both sent and
    could be taken."""
    sent = 0
    for _ in range(searchers):
        t = round_seconds
        while t <= horizon:
            sent += per_round
            t += round_seconds
    capacity, t = 0, update_seconds
    while t <= horizon:
        capacity += rows
        t += update_seconds
    return min(sent, capacity) / horizon


def test_ideal_rate_is_the_generation_rate_capped_by_the_trainer():
    rng = random.Random(0)
    cases = [(1, 0.911, 16, 1.024, 16), (32, 0.911, 16, 1.024, 512), (4, 2.0, 16, 0.5, 64), (2, 1.0, 8, 1.0, 16)]
    cases += [
        (
            rng.randint(1, 32),
            rng.uniform(0.2, 3.0),
            rng.choice([4, 16, 32]),
            rng.uniform(0.2, 3.0),
            rng.choice([16, 64, 256]),
        )
        for _ in range(20)
    ]
    for searchers, round_seconds, per_round, update_seconds, rows in cases:
        ideal = ideal_rate(
            searchers,
            round_seconds=round_seconds,
            trajectories_per_round=per_round,
            update_seconds=update_seconds,
            rows_per_update=rows,
        )
        horizon = 2_000.0
        counted = brute_force_rate(searchers, round_seconds, per_round, update_seconds, rows, horizon)
        # counting whole rounds and updates misses at most one of each per searcher over the horizon
        slack = (searchers * per_round + rows) / horizon
        assert math.isclose(ideal, counted, abs_tol=slack), (searchers, round_seconds, per_round, update_seconds, rows)


def test_percentile_interpolates_between_ranks():
    assert percentile([3, 1, 2, 4], 50) == 2.5
    assert percentile([0, 10], 90) == 9.0
    assert percentile([7], 90) == 7
    assert math.isnan(percentile([], 50))


@pytest.mark.slow
def test_a_simulated_run_trains_what_the_searchers_sent(tmp_path):
    pytest.importorskip("ray")
    from pipeline.config.loader import load_config

    cfg = load_config(REPO / "configs" / "tiny.yaml")
    calibration = Calibration(
        round_seconds=0.04,
        trajectories_per_round=16,
        update_seconds=0.05,
        token_seconds=0.0,
        tokens_per_trajectory=2,
        source="test",
    )
    settings = SimSettings(
        searcher_counts=(1, 2),
        policies=(config_policy(cfg.gfn), NO_REPLAY),
        warmup_updates=1,
        measured_updates=3,
        problems=8,  # 2 searchers of 4 questions per round: independent question cycles would meet at once
        sweep_payload_parameters=1000,
        draw_timeout=60.0,
    )
    row = measure(cfg, tmp_path, settings=settings, calibration=calibration, full_payload=False)  # Ray shut down inside
    assert (tmp_path / "async_cluster_sim.json").exists() and (tmp_path / "async_cluster_sim.png").exists()
    for table in (markdown_table(row), breakdown_table(row)):  # the docs' tables: a line per point
        assert len(table.splitlines()) == 2 + len(row["points"])
    expected = [("config", 1), ("config", 2), ("no_replay", 1), ("no_replay", 2)]
    assert [(p["policy"], p["searchers"]) for p in row["points"]] == expected
    assert all(bundles == [1 + i] for i, bundles in enumerate(row["searcher_bundles"]))  # searcher i in bundle 1 + i
    for point in row["points"]:
        n = point["searchers"]
        per_round = settings.questions_per_round * settings.samples_per_question
        assert point["rows_per_update"] == n * per_round
        # the store took every round the searchers sent, from these searchers only
        assert point["added"] == point["rounds"] * per_round
        assert sorted(int(k) for k in point["per_searcher"]) == list(range(n))
        assert sum(point["per_searcher"].values()) == point["added"]
        # the trainer trained whole batches, of trajectories the searchers sent
        assert point["trained_rows"] == (settings.warmup_updates + settings.measured_updates) * point["rows_per_update"]
        assert 0 < point["trained_distinct"] <= min(point["added"], point["trained_rows"])
        assert point["ideal_per_s"] == ideal_rate(
            n, round_seconds=0.04, trajectories_per_round=16, update_seconds=0.05, rows_per_update=n * per_round
        )
        assert point["fraction_of_ideal"] == point["trained_per_s"] / point["ideal_per_s"]
        assert point["shared_question_groups"] == 0  # the searchers sample disjoint shares of the problems
    for point in row["points"]:
        if point["policy"] == "no_replay":
            assert point["staleness_max"] <= NO_REPLAY.max_staleness
            # one round per searcher per version: the searchers sent no more rounds than the versions published
            assert point["rounds"] <= point["searchers"] * (settings.warmup_updates + settings.measured_updates + 1)
