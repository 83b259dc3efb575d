"""make bench: every row of perf.ROWS, or one (``only=<row>``).

Reads:  the tiny world (config.tinyworld/bootstrap); the policy at config.model.policy when it
        exists (e.g. RUN=demo after `make bootstrap`), else the same architecture at random init
Writes: every row: runs/<run>/results.json ({row: {..., machine}}) and docs/perf.md (the
        tables, with the machine each figure came from; other machines' rows kept);
        one row (only=<row>): runs/<run>/<row>.json and, for a ratio row, its line of the table
        (this machine's earlier line of that name replaced, everything else kept)
A row this machine cannot run (vllm not installed, no GPU) is logged and skipped, its earlier
figures kept; run alone, it is an error.
"""

from __future__ import annotations

import importlib
import json
from pathlib import Path

from perf import ROWS
from perf.rows import NotRunHere, machine_description, write_markdown, write_ratio_row
from pipeline.storage.files import write_json_atomic
from stages.cli import cli, log, parse_args, set_threads, timed
from stages.run_folders import stage_dir

ONLY = "only="
DOCS = Path("docs") / "perf.md"


def split_only(argv: list[str]) -> tuple[list[str], str | None]:
    """(the stage arguments, the row named by only=<row> or None); an unknown row or a second
    only= is an error naming the rows."""
    rows = [text[len(ONLY) :] for text in argv if text.startswith(ONLY)]
    if len(rows) > 1 or (rows and rows[0] not in ROWS):
        raise SystemExit(f"{' '.join(ONLY + row for row in rows)}: name one row of {', '.join(ROWS)}")
    return [text for text in argv if not text.startswith(ONLY)], (rows[0] if rows else None)


def run_rows(config, out: Path, names: list[str], machine: str, *, alone: bool) -> dict:
    """{row: its result with the machine}, in the order of ``names``; a NotRunHere row is logged and
    left out, or with ``alone`` a SystemExit giving the reason."""
    results = {}
    for name in names:
        log.info("bench: %s", name)
        try:
            row = importlib.import_module(f"perf.{name}").run(config, out)
        except NotRunHere as reason:
            if alone:
                raise SystemExit(f"{name} not run: {reason}") from None
            log.info("bench: %s not run: %s", name, reason)
            continue
        results[name] = {**row, "machine": machine}
    return results


def write_results(results: dict, run_dir: Path, machine: str, *, alone: bool, docs: Path = DOCS) -> None:
    """Every row: run_dir/results.json and docs/perf.md's tables; one row (``alone``):
    run_dir/<row>.json and, for a ratio row, its line of the ratio table."""
    ratio_rows = {name: row for name, row in results.items() if "ratio" in row}
    note = next((row["model"] for row in ratio_rows.values() if "model" in row), "random init")
    if alone:
        [(name, row)] = results.items()
        write_json_atomic(run_dir / f"{name}.json", row)
        if name in ratio_rows:
            write_ratio_row(docs, name, row, note, machine)
        return
    write_json_atomic(run_dir / "results.json", results)
    training = results["prm_training"]["runs"] if "prm_training" in results else None
    contention = results["threads_under_contention"]["settings"] if "threads_under_contention" in results else None
    write_markdown(ratio_rows, docs, note, machine, training, contention)


def main(argv: list[str] | None = None) -> dict:
    arguments, only = split_only(list(argv or []))
    config = parse_args("bench", arguments, prog="python -m perf")
    set_threads(config, "bench")
    out = stage_dir(config, "bench").parent
    machine = machine_description()
    with timed("bench" if only is None else f"bench {only}"):
        results = run_rows(config, out, list(ROWS) if only is None else [only], machine, alone=only is not None)
    write_results(results, config.run_dir, machine, alone=only is not None)
    log.info("bench: %s", json.dumps({name: round(row["ratio"], 2) for name, row in results.items() if "ratio" in row}))
    return results


if __name__ == "__main__":
    cli(main)
