"""make bench-vllm: make bench's generation_vllm_vs_hf row, run where vllm is installed (.venv-vllm).

`make bench` runs in .venv, which has no vllm: there it logs that the row is not run. This stage
measures only that row (stages.bench.vllm_generation: the vLLM backend vs the HF backend on the
same tiny-world model folder, prompts, samples and token budget) and writes it into
docs/benchmarks.md beside make bench's rows (this machine's earlier row of that name replaced).

Reads:  as make bench (the policy at config.model.policy, else the tiny architecture at random init)
Writes: runs/<run>/results_vllm.json and the row in docs/benchmarks.md
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from pipeline.bench import machine_description
from pipeline.files import write_json_atomic
from pipeline.prompts import prompt_from_config
from stages.bench import tiny_model, vllm_generation, write_ratio_row
from stages.common import cli, log, parse_args, set_threads, stage_dir, timed

NAME = "generation_vllm_vs_hf"


def main(argv: list[str] | None = None) -> dict:
    config = parse_args("bench_vllm", argv)
    set_threads(config, "bench_vllm")
    out = stage_dir(config, "bench_vllm").parent
    machine = machine_description()
    with timed("bench_vllm"):
        tokenizer, model, splits, note, model_path = tiny_model(config, out)
        prompts = [prompt_from_config(p.question, "tiny", tokenizer, config.format) for p in splits["test"][:64]]
        del model
        row = vllm_generation(config, model_path, prompts)
    if row is None:
        raise SystemExit("vllm is not installed here: `make bench-vllm` builds .venv-vllm and runs this stage there")
    row["machine"] = machine
    write_json_atomic(config.run_dir / "results_vllm.json", {NAME: row})
    write_ratio_row(Path("docs") / "benchmarks.md", NAME, row, note, machine)
    log.info("bench_vllm: %s", json.dumps(row))
    return row


if __name__ == "__main__":
    cli(main)
