"""threads_under_contention: how the tiny world's training speed holds up when another torch process
shares the cores (not a time ratio: steps/s alone and beside a competitor, slowdown = alone / shared).

``training_rate`` times the bootstrap model's training step (the tiny-world architecture of the
config, batches of bootstrap.batch_size real training examples, AdamW) for a few seconds;
``contention`` runs it in a subprocess alone and beside a competitor (the same job with torch's
defaults: every core, OpenMP's spinning wait), both timed over the same window, for each
candidate setting of threads and OpenMP wait policy. `make bench` reports the table
(docs/perf.md, "Threads under contention"); configs/tiny.yaml's model.torch_threads comes
from it (docs/demo.md, "Threads").

A probe runs as ``python -m perf.threads_under_contention <config> <threads> <seconds>``:
prints one JSON line.
"""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
import time
from pathlib import Path

import torch

from pipeline.config.loader import load_config, save_config
from pipeline.tinyworld.model import build_model, collate, length_grouped_batches, training_examples
from pipeline.tinyworld.problems import generate_splits
from pipeline.tinyworld.tokenizer import tokenizer_corpus, train_tokenizer

NAME = "threads_under_contention"

SETTINGS = {  # name -> (threads, environment)
    "2 threads, OpenMP spin (torch's default)": (2, {}),
    "2 threads, GOMP_SPINCOUNT=1000": (2, {"GOMP_SPINCOUNT": "1000"}),
    "2 threads, OMP_WAIT_POLICY=PASSIVE": (2, {"OMP_WAIT_POLICY": "PASSIVE"}),
    "1 thread": (1, {}),
}


def run(cfg, out_dir: Path) -> dict:
    """{"name", "settings": contention(...)}: the probes read ``cfg`` saved as
    out_dir/contention_config.yaml."""
    save_config(cfg, out_dir / "contention_config.yaml")
    return {"name": NAME, "settings": contention(str(out_dir / "contention_config.yaml"))}


def training_rate(config_path: str, threads: int, seconds: float, warmup: int = 5, ready=None) -> float:
    """Optimizer steps per second of the tiny world's bootstrap training with ``threads`` torch
    threads, over ``seconds`` after ``warmup`` steps; ``ready()`` is called between the two (the
    probe processes below wait there for each other, so their timed windows coincide)."""
    torch.set_num_threads(threads)
    config = load_config(config_path)
    splits = generate_splits(config.tinyworld)
    tokenizer = train_tokenizer(tokenizer_corpus(splits["train"], config.format), config.bootstrap.vocab_size)
    model = build_model(config.bootstrap, tokenizer, attn_implementation=config.model.attn_implementation or "eager")
    examples = training_examples(
        splits["train"][:2048], tokenizer, config.format, config.bootstrap.max_position_embeddings
    )
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    batches = [
        collate([examples[i] for i in batch], tokenizer.pad_token_id)
        for batch in length_grouped_batches(examples, config.bootstrap.batch_size, random.Random(0))
    ]

    def step(batch) -> None:
        model(**batch).loss.backward()
        optimizer.step()
        optimizer.zero_grad()

    for batch in batches[:warmup]:
        step(batch)
    if ready is not None:
        ready()
    start, steps = time.monotonic(), 0
    while time.monotonic() - start < seconds:
        step(batches[steps % len(batches)])
        steps += 1
    return steps / (time.monotonic() - start)


def _probe(config_path: str, threads: int, seconds: float, env: dict) -> subprocess.Popen:
    """A rate probe in its own process, with only ``env`` governing its OpenMP threads."""
    clean = {
        k: v
        for k, v in os.environ.items()
        if k not in ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OMP_WAIT_POLICY", "GOMP_SPINCOUNT")
    }
    return subprocess.Popen(
        [sys.executable, "-m", "perf.threads_under_contention", config_path, str(threads), str(seconds)],
        env={**clean, **env},
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
        cwd=Path(__file__).resolve().parents[1],
    )


def measure_together(
    probes: list[tuple[int, dict]], config_path: str, seconds: float, timeout: float = 600
) -> list[float]:
    """Steps/s of each (threads, env) probe, all timed over the same window: every probe builds
    its model and warms up, says so, and waits; then all are started at once."""
    processes = [_probe(config_path, threads, seconds, env) for threads, env in probes]
    try:
        deadline = time.monotonic() + timeout
        for process in processes:
            line = "start"
            while line and line.strip() != "ready":  # anything a library prints first is skipped
                line = process.stdout.readline()
            if not line:
                raise RuntimeError(f"a rate probe failed before its timed window (exit {process.wait(timeout=60)})")
        for process in processes:
            process.stdin.write("go\n")
            process.stdin.flush()
        rates = []
        for process in processes:
            out, _ = process.communicate(timeout=max(deadline - time.monotonic(), 1))
            if process.returncode != 0:
                raise RuntimeError(f"a rate probe failed (exit {process.returncode})")
            rates.append(json.loads(out.strip().splitlines()[-1])["steps_per_s"])
        return rates
    finally:
        for process in processes:
            if process.poll() is None:
                process.kill()
                process.wait(timeout=60)


def contention(config_path: str, seconds: float = 20.0) -> dict:
    """For each setting of SETTINGS: steps/s alone, and beside a competitor (torch's defaults: a
    thread per core, spinning waits) over the same window, with the competitor's own rate."""
    cores = os.cpu_count() or 1
    rows = {}
    for name, (threads, env) in SETTINGS.items():
        (alone,) = measure_together([(threads, env)], config_path, seconds)
        shared, competitor = measure_together([(threads, env), (cores, {})], config_path, seconds)
        rows[name] = {
            "threads": threads,
            "env": env,
            "alone_steps_per_s": round(alone, 2),
            "shared_steps_per_s": round(shared, 2),
            "slowdown": round(alone / shared, 2),
            "competitor_steps_per_s": round(competitor, 2),
        }
    return rows


def _wait_for_go() -> None:
    print("ready", flush=True)
    sys.stdin.readline()


if __name__ == "__main__":
    rate = training_rate(sys.argv[1], int(sys.argv[2]), float(sys.argv[3]), ready=_wait_for_go)
    print(json.dumps({"threads": int(sys.argv[2]), "steps_per_s": round(rate, 3)}), flush=True)
