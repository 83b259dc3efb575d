"""make bench: throughput of the batched designs vs their one-at-a-time references.

Reads:  the tiny world (config.tinyworld/bootstrap); the policy at config.model.policy when it
        exists (e.g. RUN=demo after `make bootstrap`), else the same architecture at random init
Writes: runs/<run>/results.json ({name: {ours_s, reference_s, ratio, machine}}, and
        threads_under_contention) and docs/benchmarks.md (the tables, with the machine each
        figure came from)
"""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import os
import shutil
import statistics
import subprocess
import sys
from pathlib import Path
from typing import Callable

import numpy as np
import torch

from eval.comparisons import paired_differences
from eval.sampling import generate_samples, problem_kind
from eval.scoring import score_samples
from pipeline.bench import machine_description
from pipeline.config import MCTSConfig, save_config
from pipeline.finetune.bench import bench_gfn_step, equal_work_overrides, equal_work_speedup, speedup_ceiling
from pipeline.finetune.losses import subtb_loss
from pipeline.finetune.policy import LMPolicy
from pipeline.generation.bench import bench_backends, bench_shared_prompt
from pipeline.generation.hf import HFGenerator
from pipeline.generation.vllm_backend import VLLMGenerator
from pipeline.grading import extract_answer, grade_many
from pipeline.io import write_json_atomic
from pipeline.modeling import load_causal_lm, load_tokenizer
from pipeline.problems import write_problems_jsonl
from pipeline.prompts import prompt_from_config
from pipeline.records import Problem
from pipeline.rollouts.bench import bench_mcts_batched
from pipeline.rollouts.mcts import make_rollout_fn
from pipeline.stats import bootstrap_ci
from pipeline.steps import join_steps
from pipeline.tinyworld.bench import SETTINGS
from pipeline.tinyworld.bench import contention as thread_contention
from pipeline.tinyworld.model import build_model, save_policy
from pipeline.tinyworld.problems import generate_splits
from pipeline.tinyworld.tokenizer import train_tokenizer
from pipeline.training.metrics import MetricsLog
from prm.bench import bench_batched_search, bench_one_pass_scoring, bench_prm_training
from prm.formats import load_scorer
from prm.model import ProcessRewardModel
from prm.scorer import PRMScorer
from stages.common import cli, log, parse_args, set_threads, stage_dir, timed

GOALS = {"generation_shared_prompt": None, "generation_vllm_vs_hf": None, "mcts_batched": 4.0, "prm_one_pass": 3.0, "gfn_batched_step": 5.0,
         "search_batched": 4.0, "gfn_step_scaling": 1.8, "gfn_step_scaling_fsdp2": 1.8,
         "gfn_async_speedup": None}  # gfn_async_speedup's goal: 0.8 x its ceiling (the result's "goal")
REFERENCES = {
    "generation_shared_prompt": "one generate call per prompt (64 prompts x n=16 x 48 new tokens)",
    "mcts_batched": "one generator call per pending prefix, same k and budget (completions/s ratio)",
    "prm_one_pass": "one forward per step prefix of 8-step solutions",
    "gfn_batched_step": "a batch-1 teacher-forced forward per trajectory (forward + backward)",
    "search_batched": "step-level best-of-k one problem at a time",
    "gfn_step_scaling": "weak scaling of make gfn under DDP: 1 process on 1 core vs 2 processes (torchrun) on a core each "
                        "(sched_setaffinity, one torch thread each), 8 questions x 4 samples per process a step; ours/reference "
                        "= s per trajectory; ratio = trajectories/s of 2 over 1 (ideal 2.0)",
    "gfn_step_scaling_fsdp2": "the same with the policy sharded by FSDP2 over the 2 processes (gathered HF copy for sampling)",
    "gfn_async_speedup": "make gfn gfn.mode=sync (one process on core 0) vs async (trainer on core 0; one searcher and the "
                         "local Ray instance on core 1), one torch thread each, at equal work (4 questions x 4 trajectories per update, nothing "
                         "replayed, 20 updates, 3 seeds): seconds of updates 3-20, weight publication included; goal 0.8 x the "
                         "ceiling (G + T) / max(G, T) of the sync run's generation G and training T per update",
    "generation_vllm_vs_hf": "the HF backend on the same model folder: one generate call, 64 prompts x n=16 x 48 new tokens "
                             "(ours = the vLLM backend; engine start excluded)",
}


def tiny_model(config, out: Path):
    """The policy at config.model.policy if it exists, else the tiny architecture at random init
    (saved in ``out``/model): (tokenizer, model, splits, which of the two, its folder)."""
    path = Path(config.resolve(config.model.policy))
    splits = generate_splits(config.tinyworld)
    if (path / "config.json").exists():
        return load_tokenizer(str(path)), load_causal_lm(str(path), config.model), splits, f"trained ({path})", str(path)
    texts = [p.question + "\n" + join_steps(p.meta["solutions"][0]) for p in splits["train"]]
    tokenizer = train_tokenizer(texts)
    model = build_model(config.bootstrap, tokenizer, attn_implementation=config.model.attn_implementation or "eager")
    save_policy(model, tokenizer, out / "model")
    return load_tokenizer(str(out / "model")), load_causal_lm(str(out / "model"), config.model), splits, "random init", str(out / "model")


def scaling_world(model, tokenizer, splits, world: Path) -> Path:
    """What `make gfn` reads for the two scaling benchmarks: the policy, a PRM on its backbone and
    200 training problems, under ``world``."""
    save_policy(model, tokenizer, world / "policy")
    ProcessRewardModel.from_backbone(model).save_pretrained(world / "prm", tokenizer=tokenizer)
    write_problems_jsonl(splits["train"][:200], world / "problems_train.jsonl")
    return world


def _gfn_overrides(world: Path, run: str, steps: int, threads: int) -> list[str]:
    """`make gfn` on the scaling world: TB-VarGrad, 8 questions x 4 samples a step, ``threads``
    torch threads per process."""
    return [f"runs_root={world}", f"run={run}", f"model.policy={world / 'policy'}", f"model.prm={world / 'prm'}",
            f"data.train_path={world / 'problems_train.jsonl'}", "data.disjoint_from=[]", "gfn.loss=tb_vargrad", f"gfn.num_train_steps={steps}",
            "gfn.questions_per_step=8", "gfn.samples_per_question=4", "gfn.save_every=0", f"model.torch_threads={threads}"]


# Runs a module in a process pinned to one core of those this one may use, picked by the
# process's LOCAL_RANK (torchrun sets it): what each process of the weak-scaling benchmark runs.
PINNED = ("import os, runpy, sys; cores = sorted(os.sched_getaffinity(0)); "
          "os.sched_setaffinity(0, {cores[int(os.environ.get('LOCAL_RANK', '0')) % len(cores)]}); "
          "module = sys.argv[1]; sys.argv = [module, *sys.argv[2:]]; runpy.run_module(module, run_name='__main__', alter_sys=True)")


def step_scaling(config, world: Path, processes: int = 2, steps: int = 6, fsdp: bool = False) -> dict:
    """gfn_step_scaling: weak scaling of `make gfn`: 1 process on one core, then ``processes``
    (torchrun) on a core each (os.sched_setaffinity), one torch thread each, the same work per
    process (8 questions x 4 samples a step each); trajectories per second of the main process's
    steps after the first (median). ``fsdp``: the policy sharded with FSDP2 over the processes.
    Needs ``processes`` cores."""
    if len(os.sched_getaffinity(0)) < processes:
        raise ValueError(f"gfn_step_scaling pins each of {processes} processes to its own core; this process may use "
                         f"{len(os.sched_getaffinity(0))}")
    rates = {}
    for count in (1, processes):
        run = f"run{count}{'_fsdp2' if fsdp else ''}"
        command = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(count), "--master_port",
                   str(29400 + os.getpid() % 500 + count), "--no-python", sys.executable, "-c", PINNED, "stages.train_gfn",
                   "--config", "configs/tiny.yaml", *_gfn_overrides(world, run, steps, 1), f"gfn.questions_per_step={8 * count}",
                   f"model.device={config.model.device}"]
        env = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1",
               **({"ACCELERATE_USE_FSDP": "true", "FSDP_VERSION": "2"} if fsdp and count > 1 else {})}
        subprocess.run(command, check=True, timeout=1800, env=env, stdout=subprocess.DEVNULL)
        rows = MetricsLog(world / run / "gfn" / "metrics.jsonl").read()[1:]
        rates[count] = statistics.median(r["sampled"] / r["seconds"] for r in rows)
    return {"ours_s": 1 / rates[processes], "reference_s": 1 / rates[1], "ratio": rates[processes] / rates[1], "processes": processes,
            "trajectories_per_s": {str(k): v for k, v in rates.items()}}


def _pinned(core: int) -> Callable[[], None]:
    """Run in a child before it starts: it (and every process it starts) runs on ``core`` only."""
    return lambda: os.sched_setaffinity(0, {core})


def async_speedup(config, world: Path, held_out: list[Problem], seeds: tuple[int, ...] = (0, 1, 2), updates: int = 20,
                  questions: int = 4, samples: int = 4, timed_from: int = 2, problems: int = 32, k: int = 4,
                  cores: tuple[int, int] = (0, 1)) -> dict:
    """gfn_async_speedup: `make gfn` synchronous vs asynchronous on the scaling world at equal work
    (pipeline.finetune.bench.equal_work_overrides: ``questions`` x ``samples`` trajectories per
    update, nothing replayed, ``updates`` updates), on CPU cores whatever the machine: the
    synchronous process on ``cores[0]``; asynchronously the trainer on ``cores[0]``, one searcher
    and the Ray processes the stage starts on ``cores[1]``; one torch thread each. Per seed, the
    equal-work check and the timing of updates ``timed_from`` + 1 .. ``updates``
    (equal_work_speedup); then each final policy's held-out PRM reward and accuracy on the first
    ``problems`` held-out problems (``k`` samples and a greedy one each, eval's sampling and
    scoring), async minus sync paired per seed (eval.comparisons.paired_differences) and over the seeds
    (per problem, the mean over seeds of async minus sync; a bootstrap interval over problems)."""
    if not set(cores) <= os.sched_getaffinity(0):
        raise RuntimeError(f"gfn_async_speedup pins its processes to cores {list(cores)}, but this process may run on "
                           f"{sorted(os.sched_getaffinity(0))} only")
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
    per_seed, models = [], {}
    for seed in seeds:
        rows = {}
        for mode in ("sync", "async"):  # alternating, so that a machine slowing down meanwhile weighs on both
            run = f"speed_{mode}_{seed}"
            shutil.rmtree(world / run, ignore_errors=True)
            command = [sys.executable, "-m", "stages.train_gfn", "--config", "configs/tiny.yaml", f"runs_root={world}", f"run={run}",
                       f"model.policy={world / 'policy'}", f"model.prm={world / 'prm'}", f"data.train_path={world / 'problems_train.jsonl'}", "data.disjoint_from=[]",
                       "model.device=cpu", "model.torch_threads=1", f"gfn.num_train_steps={updates}", f"gfn.seed={seed}",
                       *equal_work_overrides(mode, questions, samples, cores)]
            (world / run).mkdir(parents=True)
            # started on the trainer's core, or asynchronously on the searcher's: the Ray processes the stage
            # starts stay there when the trainer moves to its own core (gfn.trainer_cores)
            with open(world / run / "stage.log", "w") as stage_log:
                subprocess.run(command, check=True, timeout=1800, env=env, stdout=stage_log, stderr=subprocess.STDOUT,
                               preexec_fn=_pinned(cores[0] if mode == "sync" else cores[1]))
            rows[mode] = MetricsLog(world / run / "gfn" / "metrics.jsonl").read()
            models[seed, mode] = world / run / "gfn" / "model"
        per_seed.append({"seed": seed, **equal_work_speedup(rows["sync"], rows["async"], questions, samples, timed_from)})
        log.info("bench: gfn_async_speedup seed %d: %s", seed, json.dumps({key: round(v, 3) for key, v in per_seed[-1].items()}))
    held_out = held_out[:problems]
    eval_config = dataclasses.replace(config, eval=dataclasses.replace(config.eval, k=k))
    prm = load_scorer(world / "prm", config)
    scored = {}
    for (seed, mode), path in models.items():
        model = load_causal_lm(str(path), config.model)
        generator = HFGenerator(model, load_tokenizer(str(path)), batch_size=config.generation.batch_size)
        records = generate_samples(generator, held_out, problem_kind, eval_config, mode)
        scored[seed, mode] = records, score_samples(records, held_out, problem_kind, eval_config, prm=prm.score_many)
    paired = {str(seed): paired_differences(scored[seed, "sync"][0], scored[seed, "async"][0], held_out, problem_kind,
                                            n_resamples=eval_config.eval.bootstrap_resamples, seed=eval_config.eval.seed,
                                            reference_metrics=scored[seed, "sync"][1], model_metrics=scored[seed, "async"][1])
              for seed in seeds}

    def over_seeds(per_problem) -> dict:
        """Per problem, the mean over seeds of async minus sync, and its bootstrap interval over problems."""
        differences = np.mean([np.asarray(per_problem(seed, "async")) - np.asarray(per_problem(seed, "sync")) for seed in seeds], axis=0)
        mean, lo, hi = bootstrap_ci(differences, n_resamples=config.eval.bootstrap_resamples, seed=config.eval.seed)
        return {"mean": mean, "lo": lo, "hi": hi}

    def accuracy(seed: int, mode: str) -> list[float]:
        records = [r for r in scored[seed, mode][0] if r.sample_idx >= 0]
        return [float(np.mean([r.correct for r in records if r.problem_id == p.problem_id])) for p in held_out]

    def reward(seed: int, mode: str) -> list[float]:
        return scored[seed, mode][1]["prm_reward"]["per_problem"]

    held = {mode: {"prm_reward": [scored[seed, mode][1]["prm_reward"]["mean"] for seed in seeds],
                   "pass@1": [scored[seed, mode][1]["accuracy"]["pass@1"]["mean"] for seed in seeds]} for mode in ("sync", "async")}
    sync_s, async_s = sum(r["sync_s"] for r in per_seed), sum(r["async_s"] for r in per_seed)
    generate, train = (statistics.mean(r[key] for r in per_seed) for key in ("generate_s", "train_s"))
    ceiling = speedup_ceiling(generate, train)
    return {"ours_s": async_s, "reference_s": sync_s, "ratio": sync_s / async_s, "goal": 0.8 * ceiling, "ceiling": ceiling,
            "fraction": sync_s / async_s / ceiling, "generate_s": generate, "train_s": train, "seeds": per_seed,
            "settings": {"updates": updates, "timed_from": timed_from, "questions": questions, "samples": samples, "cores": list(cores),
                         "held_out_problems": len(held_out), "k": k},
            "held_out": {**held, "async_minus_sync": {"prm_reward": over_seeds(reward), "pass@1": over_seeds(accuracy)},
                         "paired_per_seed": paired}}


def _kept_rows(old: str, header: str, machine: str, replaced: set[str] | None = None) -> list[str]:
    """Body rows of the first table under ``header`` in ``old`` whose machine (last cell) is not
    ``machine``; with ``replaced``, also this machine's rows whose name (first cell) is not in it
    (a row another command writes: generation_vllm_vs_hf, from make bench-vllm)."""
    if header not in old:
        return []
    table = []
    for line in old[old.index(header) + len(header):].splitlines():
        if line.startswith("|"):
            table.append(line)
        elif table or line.startswith("#"):
            break
    return [row for row in table[2:] if row.rstrip(" |").rsplit("|", 1)[-1].strip() != machine
            or (replaced is not None and row.strip(" |").split("|", 1)[0].strip() not in replaced)]


def vllm_generation(config, model_path: str, prompts: list[str]) -> dict | None:
    """generation_vllm_vs_hf: the vLLM backend against the HF backend on the same model folder, the
    same prompts, samples and token budget (pipeline.generation.bench.bench_backends); None, with
    the reason logged, where vllm is not installed (`make bench-vllm` runs it in .venv-vllm)."""
    if importlib.util.find_spec("vllm") is None:
        log.info("bench: generation_vllm_vs_hf not run: vllm is not installed here (make bench-vllm runs it in .venv-vllm)")
        return None
    engine = VLLMGenerator(model_path, config)
    try:
        hf = HFGenerator(load_causal_lm(model_path, config.model), load_tokenizer(model_path), batch_size=config.generation.batch_size)
        return bench_backends(engine, hf, prompts, n_prompts=64, n=16, max_new_tokens=48)
    finally:
        engine.close()


RATIO_HEADER = "\n## Batched vs one at a time\n"


def _ratio_row(name: str, r: dict, machine: str) -> str:
    goal = r.get("goal", GOALS.get(name))  # a row whose goal depends on what it measured carries it
    reference = REFERENCES[name]
    if "ours_tokens" in r:
        reference += f"; generated tokens: ours {r['ours_tokens']}, reference {r['reference_tokens']}"
    return (f"| {name} | {r['ours_s']:.3f} | {r['reference_s']:.3f} | {r['ratio']:.2f}x | {f'>= {goal:g}x' if goal else '-'} | "
            f"{reference} | {machine} |")


def write_ratio_row(path: Path, name: str, r: dict, model_note: str, machine: str) -> None:
    """One row of the ratio table of docs/benchmarks.md (make bench-vllm): this machine's earlier row
    of that name replaced, every other row and table kept."""
    old = path.read_text() if path.exists() else ""
    if RATIO_HEADER not in old:
        write_markdown({name: r}, path, model_note, machine)
        return
    lines = old.split("\n")
    start = old[:old.index(RATIO_HEADER) + len(RATIO_HEADER)].count("\n")
    table = [i for i in range(start, len(lines)) if lines[i].startswith("|")]
    last = table[0]
    while last + 1 < len(lines) and lines[last + 1].startswith("|"):
        last += 1
    body = [row for row in lines[table[0] + 2:last + 1]
            if not (row.strip(" |").split("|", 1)[0].strip() == name and row.rstrip(" |").rsplit("|", 1)[-1].strip() == machine)]
    lines[table[0] + 2:last + 1] = body + [_ratio_row(name, r, machine)]
    path.write_text("\n".join(lines))


def write_markdown(results: dict, path: Path, model_note: str, machine: str, training: list[dict] | None = None,
                   contention: dict | None = None) -> None:
    """docs/benchmarks.md: this machine's rows replace its earlier ones; other machines' rows
    (a GPU run's beside a CPU run's) and the hand-written notes after '## Notes' are kept."""
    old = path.read_text() if path.exists() else ""
    ratio_header, training_header = RATIO_HEADER, "\n## PRM training throughput\n"
    threads_header = "\n## Threads under contention\n"
    lines = [
        "# Benchmarks",
        "",
        "Written by `make bench` (stages/bench.py); every figure below comes from that command on the",
        "machine named in its row; a run replaces its own machine's rows and keeps the others'.",
        ratio_header.strip("\n"),
        "",
        f"ratio = reference_s / ours_s (> 1: ours is faster); goals from the issues. Model: the tiny-world architecture, {model_note}.",
        "",
        "| name | ours (s) | reference (s) | ratio | goal | reference | machine |",
        "|---|---|---|---|---|---|---|",
    ]
    lines += _kept_rows(old, ratio_header, machine, set(results))
    lines += [_ratio_row(name, r, machine) for name, r in results.items()]
    lines += [
        "",
        training_header.strip("\n"),
        "",
        "prm.train.train_prm on a GPU: Qwen2-0.5B's architecture at random init, bf16 autocast over float32 master",
        "weights, fused AdamW, synthetic merged step sequences (prm/bench.py, bench_prm_training). MFU = achieved /",
        "datasheet dense bf16 peak, achieved = tokens/s x (6 N + 12 L H T) (PaLM appendix B). Goal: MFU >= 40%. compile = prm.compile.",
        "",
        "| tokens/s | achieved TFLOP/s | MFU | sequence length | micro-batch x accumulation | compile | machine |",
        "|---|---|---|---|---|---|---|",
    ]
    lines += _kept_rows(old, training_header, machine)
    for row in training or []:
        mfu = f"{100 * row['mfu']:.1f}%" if row["mfu"] is not None else "peak unknown"
        lines.append(f"| {row['tokens_per_s']:.0f} | {row['achieved_tflops']:.1f} | {mfu} | {row['seq_len']:.0f} | "
                     f"{row['micro_batch_size']} x {row['batch_size'] // row['micro_batch_size']} | {row['compile']} | {machine} |")
    lines += [
        "",
        threads_header.strip("\n"),
        "",
        "The tiny world's bootstrap training step (pipeline/tinyworld/bench.py): optimizer steps/s alone, and beside a",
        "competitor (the same job with torch's defaults: a thread per core, OpenMP's spinning wait), timed over one window;",
        "slowdown = alone / shared. model.torch_threads in configs/tiny.yaml comes from this table (docs/demo.md, \"Threads\").",
        "",
        "| setting | alone (steps/s) | beside a competitor (steps/s) | slowdown | competitor beside it (steps/s) | machine |",
        "|---|---|---|---|---|---|",
    ]
    lines += _kept_rows(old, threads_header, machine)
    for name, row in (contention or {}).items():
        lines.append(f"| {name} | {row['alone_steps_per_s']:.1f} | {row['shared_steps_per_s']:.1f} | {row['slowdown']:.2f}x | "
                     f"{row['competitor_steps_per_s']:.1f} | {machine} |")
    marker = "\n## Notes\n"
    notes = old[old.index(marker):] if marker in old else ""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("\n".join(lines) + "\n" + notes)


def main(argv: list[str] | None = None) -> dict:
    config = parse_args("bench", argv)
    set_threads(config, "bench")
    out = stage_dir(config, "bench").parent
    machine = machine_description()
    results = {}
    with timed("bench"):
        tokenizer, model, splits, note, model_path = tiny_model(config, out)
        problems = splits["test"][:64]
        prompts = [prompt_from_config(p.question, "tiny", tokenizer, config.format) for p in problems]
        generator = HFGenerator(model, tokenizer, batch_size=config.generation.batch_size)

        log.info("bench: generation_shared_prompt")
        results["generation_shared_prompt"] = bench_shared_prompt(lambda: generator, prompts, n_prompts=64, n=16, max_new_tokens=48)

        log.info("bench: generation_vllm_vs_hf")
        vllm_row = vllm_generation(config, model_path, prompts)
        if vllm_row is not None:
            results["generation_vllm_vs_hf"] = vllm_row

        log.info("bench: mcts_batched")
        k = 8
        mcts_problems = problems[:16]
        rollout_fn = make_rollout_fn(generator, prompts[:16], [p.answer for p in mcts_problems], "tiny", k=k, temperature=0.6, top_p=1.0,
                                     max_new_tokens=config.generation.max_new_tokens, separator=config.format.separator,
                                     grade_many=grade_many, extract_answer=extract_answer)
        params = MCTSConfig(k=k, max_iterations=2, max_rollouts=64, search_trivial=True)
        results["mcts_batched"] = bench_mcts_batched([(p.problem_id, p.question) for p in mcts_problems], params, rollout_fn)

        log.info("bench: prm_one_pass")

        results["prm_one_pass"] = bench_one_pass_scoring(config, tokenizer, model)

        log.info("bench: gfn_batched_step")
        model.train()
        policy = LMPolicy(model, tokenizer, config.format.separator)
        gold = [p.meta["solutions"][0] for p in problems[:32]]

        def loss_fn(lp):
            log_r = torch.zeros_like(lp.termination_logprobs)
            return subtb_loss(lp.step_logprobs, lp.termination_logprobs, log_r, lp.mask)

        results["gfn_batched_step"] = bench_gfn_step(policy, prompts[:32], gold, loss_fn)
        model.eval()

        log.info("bench: search_batched")

        prm = PRMScorer(ProcessRewardModel.from_backbone(model), tokenizer, config.format, "tiny")
        results["search_batched"] = bench_batched_search([p.question for p in problems[:16]], generator, prm, "step_best_of_k", k=4,
                                                         prompts=prompts[:16], kind="tiny", temperature=0.0, max_depth=6,
                                                         max_step_tokens=config.generation.max_step_tokens, format_config=config.format)
        log.info("bench: gfn_step_scaling (1 vs 2 processes)")
        world = scaling_world(model, tokenizer, splits, out / "scaling")
        results["gfn_step_scaling"] = step_scaling(config, world)
        results["gfn_step_scaling_fsdp2"] = step_scaling(config, world, fsdp=True)
        log.info("bench: gfn_async_speedup (synchronous vs asynchronous at equal work, 3 seeds)")
        results["gfn_async_speedup"] = async_speedup(config, world, splits["test"])
        log.info("bench: threads under contention (%d settings, alone and beside a competitor)", len(SETTINGS))
        save_config(config, out / "contention_config.yaml")
        contention = thread_contention(str(out / "contention_config.yaml"))
        log.info("bench: threads under contention: %s", json.dumps(contention))
        for r in results.values():
            r["machine"] = machine
        training = None
        if torch.cuda.is_available():  # a 0.5B-parameter model: a GPU benchmark only
            log.info("bench: prm_training (Qwen2-0.5B architecture, random init)")

            del model, policy, prm, generator
            torch.cuda.empty_cache()
            training = [bench_prm_training(config, out / f"prm_training_{mode}", compile=mode == "compiled") for mode in ("eager", "compiled")]
            for row in training:
                results[f"prm_training_{'compiled' if row['compile'] else 'eager'}"] = {**row, "machine": machine}
    results["threads_under_contention"] = {"machine": machine, "settings": contention}
    write_json_atomic(config.run_dir / "results.json", results)
    write_markdown({k: v for k, v in results.items() if k in GOALS}, Path("docs") / "benchmarks.md", note, machine, training, contention)
    log.info("bench: %s", json.dumps({k: round(v["ratio"], 2) if "ratio" in v else v for k, v in results.items()}))
    return results


if __name__ == "__main__":
    cli(main)
