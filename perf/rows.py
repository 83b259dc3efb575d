"""What every benchmark row shares: a wall-clock timer, the machine's description, the row schema,
the core choice of pinned processes, and the tables of docs/perf.md.

A ratio row is ``{"name", "ours_s", "reference_s", "ratio", "goal", "reference", ...}`` with
ratio = reference_s / ours_s always (> 1: ours is faster); a row that compares rates (completions
or trajectories per second) states both as seconds per unit of work, so the ratio of the rates is
the ratio of those times (``per_unit``). Rows that are not time ratios (PRM training throughput,
threads under contention) carry their own fields and no "ratio". Benchmarks measure; tests never
time anything.
"""

from __future__ import annotations

import os
import platform
import time
from collections.abc import Callable
from pathlib import Path

import torch

from pipeline.finetune.tba.cores import pin_process


class NotRunHere(RuntimeError):
    """A row this machine or environment cannot run (vllm not installed, no GPU): make bench logs
    the reason and keeps the row's earlier figures; run alone (``only=``) it is an error."""


def seconds_of(fn: Callable[[], object]) -> float:
    """Seconds one call of ``fn`` takes (wall clock)."""
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def best_seconds(fn: Callable[[], object], repeats: int) -> float:
    """The fastest of ``repeats`` (at least one) calls of ``fn``, in seconds."""
    return min(seconds_of(fn) for _ in range(max(1, repeats)))


def machine_description() -> str:
    if torch.cuda.is_available():
        return f"{torch.cuda.get_device_name(0)} (torch {torch.__version__})"
    return f"CPU {platform.machine()} x{os.cpu_count()} cores, torch {torch.__version__} ({torch.get_num_threads()} threads)"


def ratio_row(name: str, *, ours_s: float, reference_s: float, goal: float | None, reference: str, **fields) -> dict:
    """A ratio row: ratio = reference_s / ours_s (> 1: ours is faster; inf when ours took no
    measurable time); ``goal``: the least ratio the row is meant to reach (None: none set);
    ``reference``: what the reference does, as the docs table says it; ``fields``: the row's own."""
    return {
        "name": name,
        "ours_s": ours_s,
        "reference_s": reference_s,
        "ratio": reference_s / ours_s if ours_s > 0 else float("inf"),
        "goal": goal,
        "reference": reference,
        **fields,
    }


def per_unit(seconds: float, units: float) -> float:
    """Seconds per unit of work (a completion, a trajectory): how a row comparing rates states its
    times, so that reference_s / ours_s is ours' rate over the reference's."""
    if units <= 0:
        raise ValueError(f"per_unit: {units} units of work in {seconds} s: nothing to compare")
    return seconds / units


# ----------------------------------------------------------------------------- pinned processes


def pinned_to(core: int) -> Callable[[], None]:
    """A subprocess preexec_fn: the child (and every process it starts) runs on ``core`` only."""
    return lambda: pin_process({core}, key="benchmark core")


# ----------------------------------------------------------------------------- docs/perf.md

RATIO_HEADER = "\n## Batched vs one at a time\n"
TRAINING_HEADER = "\n## PRM training throughput\n"
THREADS_HEADER = "\n## Threads under contention\n"


def _ratio_line(name: str, r: dict, machine: str) -> str:
    goal, reference = r.get("goal"), r["reference"]
    if "ours_tokens" in r:
        reference += f"; generated tokens: ours {r['ours_tokens']}, reference {r['reference_tokens']}"
    if "collectives" in r:
        reference += "; " + collectives_note(r["collectives"])
    return (
        f"| {name} | {r['ours_s']:.3f} | {r['reference_s']:.3f} | {r['ratio']:.2f}x | {f'>= {goal:g}x' if goal else '-'} | "
        f"{reference} | {machine} |"
    )


def collectives_note(c: dict) -> str:
    """A weak-scaling row's loss in words (pipeline.training.collective_clock.collective_shares,
    means over the processes)."""
    return (
        f"mean step {c['step_s']:.2f} s a process vs {c['reference_step_s']:.2f} s alone ({100 * c['slowdown']:+.0f}%): "
        f"waiting in collectives {c['wait_s']:.3f} s ({100 * c['wait_share']:.1f}% of the step; in flight "
        f"{100 * c['in_flight_share']:.1f}%), the rest {c['other_s']:+.3f} s"
    )


def kept_rows(old: str, header: str, machine: str, replaced: set[str] | None = None) -> list[str]:
    """Body rows of the first table under ``header`` in ``old`` whose machine (last cell) is not
    ``machine``; with ``replaced``, also this machine's rows whose name (first cell) is not in it
    (a row another command writes: generation_vllm_vs_hf, from make bench-vllm)."""
    if header not in old:
        return []
    table = []
    for line in old[old.index(header) + len(header) :].splitlines():
        if line.startswith("|"):
            table.append(line)
        elif table or line.startswith("#"):
            break
    return [
        row
        for row in table[2:]
        if row.rstrip(" |").rsplit("|", 1)[-1].strip() != machine
        or (replaced is not None and row.strip(" |").split("|", 1)[0].strip() not in replaced)
    ]


def write_ratio_row(path: Path, name: str, r: dict, model_note: str, machine: str) -> None:
    """One row of the ratio table of docs/perf.md (a row run alone, e.g. make bench-vllm): this
    machine's earlier row of that name replaced, every other row and table kept."""
    old = path.read_text() if path.exists() else ""
    if RATIO_HEADER not in old:
        write_markdown({name: r}, path, model_note, machine)
        return
    lines = old.split("\n")
    start = old[: old.index(RATIO_HEADER) + len(RATIO_HEADER)].count("\n")
    table = [i for i in range(start, len(lines)) if lines[i].startswith("|")]
    last = table[0]
    while last + 1 < len(lines) and lines[last + 1].startswith("|"):
        last += 1
    body = [
        row
        for row in lines[table[0] + 2 : last + 1]
        if not (
            row.strip(" |").split("|", 1)[0].strip() == name and row.rstrip(" |").rsplit("|", 1)[-1].strip() == machine
        )
    ]
    lines[table[0] + 2 : last + 1] = body + [_ratio_line(name, r, machine)]
    path.write_text("\n".join(lines))


def write_markdown(
    results: dict,
    path: Path,
    model_note: str,
    machine: str,
    training: list[dict] | None = None,
    contention: dict | None = None,
) -> None:
    """docs/perf.md from ratio rows ({name: row}), PRM training runs and thread-contention
    rows: this machine's rows replace its earlier ones; other machines' rows (a GPU run's beside a
    CPU run's) and the hand-written notes after '## Notes' are kept."""
    old = path.read_text() if path.exists() else ""
    lines = [
        "# Benchmarks",
        "",
        "Written by `make bench` (`python -m perf`, perf/: one module per row); every figure below comes",
        "from that command on the machine named in its row; a run replaces its own machine's rows and keeps the others'.",
        RATIO_HEADER.strip("\n"),
        "",
        f"ratio = reference_s / ours_s (> 1: ours is faster); goals from the issues. Model: the tiny-world architecture, {model_note}.",
        "",
        "| name | ours (s) | reference (s) | ratio | goal | reference | machine |",
        "|---|---|---|---|---|---|---|",
    ]
    lines += kept_rows(old, RATIO_HEADER, machine, set(results))
    lines += [_ratio_line(name, r, machine) for name, r in results.items()]
    lines += [
        "",
        TRAINING_HEADER.strip("\n"),
        "",
        "prm.train.train_prm on a GPU: Qwen2-0.5B's architecture at random init, bf16 autocast over float32 master",
        "weights, fused AdamW, synthetic merged step sequences (perf/prm_training.py). MFU = achieved /",
        "datasheet dense bf16 peak, achieved = tokens/s x (6 N + 12 L H T) (PaLM appendix B). Goal: MFU >= 40%. compile = prm.compile.",
        "",
        "| tokens/s | achieved TFLOP/s | MFU | sequence length | micro-batch x accumulation | compile | machine |",
        "|---|---|---|---|---|---|---|",
    ]
    lines += kept_rows(old, TRAINING_HEADER, machine)
    for row in training or []:
        mfu = f"{100 * row['mfu']:.1f}%" if row["mfu"] is not None else "peak unknown"
        lines.append(
            f"| {row['tokens_per_s']:.0f} | {row['achieved_tflops']:.1f} | {mfu} | {row['seq_len']:.0f} | "
            f"{row['micro_batch_size']} x {row['batch_size'] // row['micro_batch_size']} | {row['compile']} | {machine} |"
        )
    lines += [
        "",
        THREADS_HEADER.strip("\n"),
        "",
        "The tiny world's bootstrap training step (perf/threads_under_contention.py): optimizer steps/s alone, and",
        "beside a competitor (the same job with torch's defaults: a thread per core, OpenMP's spinning wait), timed over one",
        'window; slowdown = alone / shared. model.torch_threads in configs/tiny.yaml comes from this table (docs/demo.md, "Threads").',
        "",
        "| setting | alone (steps/s) | beside a competitor (steps/s) | slowdown | competitor beside it (steps/s) | machine |",
        "|---|---|---|---|---|---|",
    ]
    lines += kept_rows(old, THREADS_HEADER, machine)
    for name, row in (contention or {}).items():
        lines.append(
            f"| {name} | {row['alone_steps_per_s']:.1f} | {row['shared_steps_per_s']:.1f} | {row['slowdown']:.2f}x | "
            f"{row['competitor_steps_per_s']:.1f} | {machine} |"
        )
    marker = "\n## Notes\n"
    notes = old[old.index(marker) :] if marker in old else ""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("\n".join(lines) + "\n" + notes)
