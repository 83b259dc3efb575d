"""The row's figure and the two tables of docs/perf.md (throughput; where the time goes)."""

from __future__ import annotations

import math
from pathlib import Path

from matplotlib.figure import Figure


def by_policy(points: list[dict]) -> dict[str, list[dict]]:
    groups: dict[str, list[dict]] = {}
    for point in points:
        groups.setdefault(point["policy"], []).append(point)
    return groups


def plot(result: dict, path: Path) -> Path:
    """Per store policy: trained trajectories per second and the ideal against N (log-log); the
    fraction of the ideal and the store's busy fraction beside it."""

    fig = Figure(figsize=(11, 4.2))
    left, right = fig.subplots(1, 2)
    groups = by_policy(result["points"])
    first = next(iter(groups.values()))
    n = [p["searchers"] for p in first]
    left.plot(n, [p["ideal_per_s"] for p in first], "k--", label="ideal min(N x 16 / G, 16 N / T)")
    left.plot(
        n, [p["store_ingest_per_s"] for p in first], "s:", color="grey", label=f"store ingest ({first[0]['policy']})"
    )
    for (name, points), marker, color in zip(groups.items(), "o^v", ("tab:blue", "tab:orange", "tab:green")):
        n = [p["searchers"] for p in points]
        left.plot(
            n,
            [p["trained_per_s"] for p in points],
            marker + "-",
            color=color,
            label=f"fresh trained (first time), {name}",
        )
        right.plot(
            n,
            [p["fraction_of_ideal"] for p in points],
            marker + "-",
            color=color,
            label=f"fresh trained / ideal, {name}",
        )
        right.plot(
            n,
            [p["rows_trained_of_ideal"] for p in points],
            marker + "--",
            color=color,
            alpha=0.6,
            label=f"rows trained (replays too) / ideal, {name}",
        )
        right.plot(
            n,
            [p["store_busy_fraction"] for p in points],
            marker + ":",
            color=color,
            alpha=0.6,
            label=f"store busy fraction, {name}",
        )
    left.set_xscale("log", base=2)
    left.set_yscale("log")
    left.set_xlabel("searchers N")
    left.set_ylabel("trajectories / s")
    left.legend(fontsize=7)
    left.set_title("async_cluster_sim (simulated engine and update)", fontsize=9)
    right.axhline(0.9, color="grey", linewidth=0.8, linestyle="--", label="goal 0.9")
    right.set_xscale("log", base=2)
    right.set_ylim(0, 1.1)
    right.set_xlabel("searchers N")
    right.legend(fontsize=7)
    right.set_title(result.get("machine", ""), fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    return path


def markdown_table(row: dict) -> str:
    """The docs/perf.md table of a row: one line per store policy and N."""
    header = (
        "| policy | N | fresh trained traj/s | ideal | fresh trained / ideal | rows trained / ideal | "
        "searchers' rate / calibrated | staleness p50 / p90 (max) | trainer wait per update (s) | "
        "groups mixing searchers | store ingest /s (capacity) | "
        "store sample rows/s (capacity) | store busy | "
        "publication s (sweep payload) |"
    )
    lines = [header, "|" + "---|" * 14]
    for p in row["points"]:
        cells = [
            p["policy"],
            p["searchers"],
            f"{p['trained_per_s']:.1f}",
            f"{p['ideal_per_s']:.1f}",
            f"{p['fraction_of_ideal']:.2f}",
            f"{p['rows_trained_of_ideal']:.2f}",
            f"{p['searcher_rate_of_calibrated']:.2f}",
            f"{p['staleness_p50']:g} / {p['staleness_p90']:g} ({p['staleness_max']})",
            f"{p['trainer_wait_per_update_s']:.3f}",
            p["shared_question_groups"],
            f"{p['store_ingest_per_s']:.0f} ({p['store_ingest_capacity_per_s']:.0f})",
            f"{p['store_sample_per_s']:.0f} ({p['store_sample_capacity_per_s']:.0f})",
            f"{p['store_busy_fraction']:.3f}",
            f"{p['publish_seconds']:.3f}",
        ]
        lines.append("| " + " | ".join(str(cell) for cell in cells) + " |")
    return "\n".join(lines)


def breakdown_table(row: dict) -> str:
    """The docs/perf.md table of where the time goes, per store policy and N: the trainer's
    wall seconds per update, each role's CPU seconds per update, the machine's busy share."""
    header = (
        "| policy | N | trainer wait (s) | store's check + draw (s) | reading the batch, request's thread (s) | "
        "update (s) | publishing, trainer's part (s) | last round after publication p50 / max (s) | "
        "CPU s per update: searchers / store / weights / trainer / other | machine busy |"
    )
    lines = [header, "|" + "---|" * 10]
    for p in row["points"]:
        cpu = p["cpu_per_update_s"]
        cells = [
            p["policy"],
            p["searchers"],
            f"{p['trainer_wait_per_update_s']:.3f}",
            f"{p['store_draw_per_update_s']:.3f}",
            f"{p['trainer_parse_per_update_s']:.3f}",
            f"{p['trainer_update_per_update_s']:.3f}",
            f"{p['trainer_publish_per_update_s']:.3f}",
            f"{p['last_round_after_publication_p50_s']:.3f} / {p['last_round_after_publication_max_s'] or math.nan:.3f}",
            " / ".join(f"{cpu[role]:.3f}" for role in ("searchers", "store", "weights", "trainer", "other")),
            f"{p['machine_busy_fraction']:.2f}",
        ]
        lines.append("| " + " | ".join(str(cell) for cell in cells) + " |")
    return "\n".join(lines)
