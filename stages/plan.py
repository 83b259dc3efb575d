"""make plan: check a config and estimate its cost per stage before any model loads (docs/real-model.md).

Reads:  the config, the local files and model folders it names (config.json only), the hub cache
Writes: nothing. Prints the resolved models and data (which need the hub), per stage the work,
        the memory of one GPU and GPU-hours, then every error and warning; exits 1 on an error.
        A config that cannot be planned at all (a bad key or value, an unknown plan.gpu) stops the
        report: one ``error:`` line and exit 2, as every stage (stages.cli.cli).
The machine is part of the config: plan.processes, plan.gpu (or plan.gpu_memory_gb) and
plan.accelerate.<stage> (the accelerate config make prm / gfn / ppo is launched with).
"""

from __future__ import annotations

import sys

from planner.make import make_plan
from planner.render import render
from stages.cli import cli, parse_args


def main(argv: list[str] | None = None) -> int:
    """The report on stdout; 1 when it holds an error, else 0."""
    argv = sys.argv[1:] if argv is None else argv
    config = parse_args("plan", argv)
    config_path = argv[argv.index("--config") + 1] if "--config" in argv else "configs/tiny.yaml"
    plan = make_plan(config, config_path)
    print(render(plan))
    return 1 if plan.errors else 0


def run(argv: list[str]) -> None:
    """main, its status the process's (cli turns a user's mistake into one line and status 2)."""
    status = main(argv)
    if status:
        raise SystemExit(status)


if __name__ == "__main__":
    cli(run)
