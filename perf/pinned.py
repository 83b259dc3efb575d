"""Run a module on one core, picked by the process's LOCAL_RANK (torchrun sets it; 0 without it):
what each process of the weak-scaling benchmark runs.

    python -m perf.pinned <module> [args...]

The core is pipeline.finetune.tba.cores.core_for(LOCAL_RANK) of those this process may use; every thread of
the process is pinned there (pipeline.finetune.tba.cores.pin_process) before the module runs as
__main__ with ``args``."""

from __future__ import annotations

import os
import runpy
import sys

from pipeline.finetune.tba.cores import core_for, pin_process


def main(argv: list[str]) -> None:
    if not argv:
        raise SystemExit("usage: python -m perf.pinned <module> [args...]")
    pin_process({core_for(int(os.environ.get("LOCAL_RANK", "0")))}, key="LOCAL_RANK")
    module = argv[0]
    sys.argv = [module, *argv[1:]]
    runpy.run_module(module, run_name="__main__", alter_sys=True)


if __name__ == "__main__":
    main(sys.argv[1:])
