"""One row of make bench alone: gfn_async_speedup, the synchronous and asynchronous `make gfn` at
equal work (stages.bench.async_speedup; docs/async.md, "Measured").

    python -m stages.bench_async --config configs/tiny.yaml run=bench

Reads:  as make bench (the policy at config.model.policy when it exists, else the tiny
        architecture at random init)
Writes: runs/<run>/async_speedup.json (the row, per seed, held-out scores); docs/benchmarks.md is
        left alone (make bench writes the table)
"""

from __future__ import annotations

import json

from pipeline.bench import machine_description
from pipeline.files import write_json_atomic
from stages.bench import async_speedup, scaling_world, tiny_model
from stages.common import cli, log, parse_args, set_threads, stage_dir, timed


def main(argv: list[str] | None = None) -> dict:
    config = parse_args("bench_async", argv)
    set_threads(config, "bench")
    out = stage_dir(config, "bench").parent
    with timed("bench_async"):
        tokenizer, model, splits, note, _ = tiny_model(config, out)
        world = scaling_world(model, tokenizer, splits, out / "scaling")
        result = {**async_speedup(config, world, splits["test"]), "model": note, "machine": machine_description()}
    write_json_atomic(config.run_dir / "async_speedup.json", result)
    log.info("bench: gfn_async_speedup: %s", json.dumps({key: round(result[key], 3) for key in ("ratio", "ceiling", "fraction")}))
    return result


if __name__ == "__main__":
    cli(main)
