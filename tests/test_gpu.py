"""Checks that need a CUDA GPU: the paper configs' policies at their real size, and DeepSpeed.

Skipped where torch sees no GPU (CI, the 2-core development machine), except the parameter-count
check of the real architectures, which builds them on the meta device (no memory, no GPU).
docs/scale.md ("Checks on a GPU") has the one command that runs them on a lent GPU machine; with
$OUT set, every check writes its figures, or the error that stopped it, into $OUT/gpu_checks.json.

1. Real architectures at random init: Qwen2.5-Math-1.5B-Instruct and Llama-3.2-3B-Instruct built
   from their published config.json values (``ARCHITECTURES``) in the paper configs' dtype
   (bfloat16), saved as a model folder with the tiny world's tokenizer (the model's own vocabulary
   size kept), then fine-tuned by ``pipeline.finetune.run.finetune_policy`` (the library behind
   `make gfn` / `make ppo`) with configs/paper/<model>.yaml's objective, LoRA and micro-batch size.
   Sampling and PRM scoring are replaced by trajectories of the shape `make plan` sizes memory
   for (plan.prompt_tokens prompt tokens + generation.max_new_tokens solution tokens, steps of
   at most generation.max_step_tokens): what is measured is the training update (the teacher-forced
   forwards, backward, optimizer step, replay), its peak GPU memory beside make plan's estimate of
   the same items (planner.costs.finetune_stage under a one-process launch), both reported unadjusted.
2. DeepSpeed ZeRO-2 through `accelerate launch --config_file configs/accelerate/deepspeed_zero2.yaml
   --num_processes 1` of the stages on the tiny world's random-init models: TB with a learned log Z,
   and PPO; a TB run killed after a checkpoint (whole tensors per parameter) and resumed, against an
   uninterrupted one; ZeRO-3 with HF sampling refused before any model is loaded; under ZeRO-3
   (deepspeed_zero3.yaml, one process) the sampler's weights gathered by
   TrainingBase.full_state_dict one parameter at a time (tests/zero3_gathered_weights.py).

FSDP2 is not checked here: the training base shards only runs of several processes
(pipeline.training.distributed.fsdp_requested) and NCCL runs one rank per GPU, so one GPU cannot
run that path; the 2-process FSDP2 tests run it on CPU (tests/test_distributed_finetune.py).
"""

from __future__ import annotations

import gc
import importlib.metadata
import importlib.util
import json
import math
import os
import random
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from processes import run_bounded

REPO = Path(__file__).resolve().parents[1]
CUDA = torch.cuda.is_available()
needs_cuda = pytest.mark.skipif(
    not CUDA, reason="needs a CUDA GPU (torch.cuda.is_available() is False); docs/scale.md, 'Checks on a GPU'"
)
LAUNCH_TIMEOUT_S = 300

# The published config.json of each model (hub repository, file config.json), as transformers reads it.
ARCHITECTURES: dict[str, dict] = {
    "Qwen/Qwen2.5-Math-1.5B-Instruct": {
        "architectures": ["Qwen2ForCausalLM"],
        "model_type": "qwen2",
        "attention_dropout": 0.0,
        "bos_token_id": 151643,
        "eos_token_id": 151645,
        "hidden_act": "silu",
        "hidden_size": 1536,
        "initializer_range": 0.02,
        "intermediate_size": 8960,
        "max_position_embeddings": 4096,
        "max_window_layers": 21,
        "num_attention_heads": 12,
        "num_hidden_layers": 28,
        "num_key_value_heads": 2,
        "rms_norm_eps": 1e-06,
        "rope_theta": 10000.0,
        "sliding_window": 4096,
        "tie_word_embeddings": True,
        "use_cache": True,
        "use_sliding_window": False,
        "vocab_size": 151936,
    },
    "meta-llama/Llama-3.2-3B-Instruct": {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "attention_bias": False,
        "attention_dropout": 0.0,
        "bos_token_id": 128000,
        "eos_token_id": [128001, 128008, 128009],
        "head_dim": 128,
        "hidden_act": "silu",
        "hidden_size": 3072,
        "initializer_range": 0.02,
        "intermediate_size": 8192,
        "max_position_embeddings": 131072,
        "mlp_bias": False,
        "num_attention_heads": 24,
        "num_hidden_layers": 28,
        "num_key_value_heads": 8,
        "pretraining_tp": 1,
        "rms_norm_eps": 1e-05,
        "rope_scaling": {
            "factor": 32.0,
            "high_freq_factor": 4.0,
            "low_freq_factor": 1.0,
            "original_max_position_embeddings": 8192,
            "rope_type": "llama3",
        },
        "rope_theta": 500000.0,
        "tie_word_embeddings": True,
        "use_cache": True,
        "vocab_size": 128256,
    },
}
PAPER_CONFIGS = {
    "Qwen/Qwen2.5-Math-1.5B-Instruct": REPO / "configs" / "paper" / "qwen2.5-math-1.5b.yaml",
    "meta-llama/Llama-3.2-3B-Instruct": REPO / "configs" / "paper" / "llama3.2-3b.yaml",
}


# ----------------------------------------------------------------------------- the report


def report(check: str, figures: dict) -> None:
    """Print a check's figures and, with $OUT set (the GPU machine's output folder), merge them
    into $OUT/gpu_checks.json under the check's name (one file for every check)."""
    print(f"GPU CHECK {check}: {json.dumps(figures, default=str)}", flush=True)
    out = os.environ.get("OUT")
    if not out:
        return
    path = Path(out) / "gpu_checks.json"
    results = json.loads(path.read_text()) if path.exists() else {}
    results[check] = figures
    path.write_text(json.dumps(results, indent=2, default=str))


def environment() -> dict:
    import accelerate
    import peft
    import transformers

    return {
        "device": torch.cuda.get_device_name(0) if CUDA else "cpu",
        "device_memory_bytes": torch.cuda.get_device_properties(0).total_memory if CUDA else None,
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "accelerate": accelerate.__version__,
        "peft": peft.__version__,
        "deepspeed": _version("deepspeed"),
    }


def _version(package: str) -> str | None:
    """The installed distribution's version, read without importing it (None: not installed)."""
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return None


# ----------------------------------------------------------------------------- real architectures


def architecture(hub_id: str, **changes):
    """The transformers config of ``hub_id``'s published config.json (``changes``: values replaced,
    e.g. fewer layers for a CPU smoke run)."""
    from transformers import AutoConfig

    values = {**ARCHITECTURES[hub_id], **changes}
    return AutoConfig.for_model(values.pop("model_type"), **values)


def tiny_tokenizer():
    """The tiny world's tokenizer (trained here in seconds, nothing downloaded)."""
    from pipeline.config.schema import FormatConfig, TinyWorldConfig
    from pipeline.tinyworld.problems import generate_splits
    from pipeline.tinyworld.tokenizer import tokenizer_corpus, train_tokenizer

    splits = generate_splits(TinyWorldConfig(n_train=40, n_val=4, n_test=4))
    return train_tokenizer(tokenizer_corpus(splits["train"], FormatConfig(use_chat_template=False)), 512)


def random_model_folder(hub_id: str, folder: Path, device: str, dtype: torch.dtype, **changes) -> dict:
    """``hub_id``'s architecture at random init, built on ``device`` in ``dtype``, saved to ``folder``
    as a hub download is (config.json, model.safetensors, the tokenizer; no manifest), with the
    tiny world's tokenizer and its special-token ids. Returns what was built."""
    from transformers import AutoModelForCausalLM

    tokenizer = tiny_tokenizer()
    config = architecture(
        hub_id,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        **changes,
    )
    start = time.monotonic()
    torch.manual_seed(0)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    parameters = sum(p.numel() for p in model.parameters())  # tied embeddings counted once
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    del model
    gc.collect()
    if device.startswith("cuda"):
        torch.cuda.empty_cache()
    return {"parameters": parameters, "build_and_save_seconds": time.monotonic() - start}


def plan_shaped_trajectories(config, stage: str, tokenizer):
    """A stand-in for TrajectorySampler.sample: this process's share of the step's questions (the
    sampler's own question cycle), samples_per_question trajectories each, of the length make plan
    sizes: plan.prompt_tokens prompt tokens, generation.max_new_tokens solution tokens (steps of at
    most generation.max_step_tokens, their separators and the end token included), random digits
    (one token each in the tiny world's tokenizer) and random PRM scores."""
    from pipeline.records import Trajectory
    from pipeline.steps import encode_prompt, encode_trajectory

    cfg = config.finetune_section(stage)
    prompt_tokens, solution_tokens = config.plan.prompt_tokens, config.generation.max_new_tokens
    step_room = config.generation.max_step_tokens - 1  # each step is followed by its separator token
    digits = solution_tokens - 1  # the end token
    lengths = []
    while digits > 0:
        length = min(step_room, digits - 1)  # the step's digits, then its separator
        lengths.append(length)
        digits -= length + 1

    def sample(self, step: int, version: int | None = None):
        rng = random.Random(step)
        problems = self.next_problems()
        share = len(problems) // self.collective.world
        mine = problems[self.collective.rank * share : (self.collective.rank + 1) * share]
        trajectories = []
        for problem in mine:
            prompt = "".join(rng.choice("0123456789") for _ in range(prompt_tokens - 1))  # + BOS
            for _ in range(cfg.samples_per_question):
                steps = ["".join(rng.choice("0123456789") for _ in range(n)) for n in lengths]
                scores = [math.log(rng.uniform(0.05, 0.95)) for _ in steps]
                trajectories.append(
                    Trajectory(
                        problem_id=problem.problem_id,
                        question=problem.question,
                        prompt=prompt,
                        steps=steps,
                        step_log_scores=scores,
                        answer_flags=[-1] * (len(steps) - 1) + [rng.choice([0, 1])],
                        finished=True,
                        log_reward=sum(scores),
                        policy_version=step if version is None else version,
                    )
                )
        first = trajectories[0]
        encoded = encode_trajectory(tokenizer, first.prompt, first.steps, config.format.separator, add_end=True)
        assert len(encode_prompt(tokenizer, first.prompt)) == prompt_tokens
        assert len(encoded.input_ids) == prompt_tokens + solution_tokens, (
            len(encoded.input_ids),
            prompt_tokens,
            solution_tokens,
        )
        return trajectories, {"sampled": len(trajectories), "empty_solutions": 0}

    return sample


def plan_memory(config, stage: str, device_bytes: float) -> dict[str, float]:
    """make plan's memory items of ``stage`` on one GPU under a one-process launch (what
    planner.runtime.stage_memory sums for the stage at its start)."""
    import copy

    from planner.costs import finetune_stage
    from planner.launch import launch_from_environment
    from planner.plan import GIB, GPU, Plan
    from planner.resolve import resolve_model

    config = copy.deepcopy(config)
    config.plan.processes = 1
    plan = Plan("", config, "GPU", GPU(device_bytes / GIB, 1.0), launch=launch_from_environment({}))
    policy = resolve_model(config, "model.policy", config.model.policy)
    backbone = resolve_model(config, "model.prm_backbone", config.model.prm_backbone)
    prm = resolve_model(config, "model.prm", config.model.prm, backbone)
    return dict(finetune_stage(plan, stage, policy, prm).memory)


# the items of make plan's estimate that the measured update holds: the trained model's state,
# activations and logits (not the frozen PRM, the reference or the sampler's KV cache / engine)
TRAINING_ITEMS = ("weights", "gradients", "AdamW state", "activations", "logits")


def finetune_real_architecture(
    hub_id: str,
    folder: Path,
    run_root: Path,
    monkeypatch,
    stage: str = "gfn",
    steps: int = 3,
    overrides: tuple[str, ...] = (),
) -> dict:
    """configs/paper/<hub_id's>.yaml's ``stage`` on the model folder ``folder`` through
    finetune_policy, sampling replaced by plan-shaped trajectories (plan_shaped_trajectories),
    for ``steps`` training steps. Returns per step: seconds (synchronised), peak GPU memory,
    trajectories trained, loss; and make plan's memory items for the same settings."""
    from pipeline.config.loader import load_config
    from pipeline.config.schema import TinyWorldConfig
    from pipeline.finetune import run as finetune_run
    from pipeline.finetune.sampling import TrajectorySampler
    from pipeline.finetune.trainer import FinetuneTrainer
    from pipeline.modeling import load_tokenizer
    from pipeline.tinyworld.problems import generate_splits

    config = load_config(
        PAPER_CONFIGS[hub_id],
        [
            f"runs_root={run_root}",
            f"run={folder.name}-{stage}",
            f"model.policy={folder}",
            "generation.backend=hf",  # no vLLM on the lent machine; the stand-in sampler samples nothing
            "format.use_chat_template=false",  # the tiny world's tokenizer has no chat template
            f"{stage}.num_train_steps={steps}",
            f"{stage}.save_every=0",
            *([f"{stage}.ceiling_questions=0"] if stage == "gfn" else []),  # the ceiling samples the policy
            *overrides,
        ],
    )
    cfg = config.finetune_section(stage)
    on_cuda = torch.device(config.model.device if config.model.device != "auto" else "cuda").type == "cuda"
    tokenizer = load_tokenizer(str(folder))
    problems = generate_splits(TinyWorldConfig(n_train=max(cfg.questions_per_step, 8), n_val=2, n_test=2))["train"]
    measured: list[dict] = []
    train_step = FinetuneTrainer.train_step

    def measured_step(self):
        if on_cuda:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
        resident = torch.cuda.memory_allocated() if on_cuda else None
        start = time.perf_counter()
        record = train_step(self)
        if on_cuda:
            torch.cuda.synchronize()
        measured.append(
            {
                "step": record["step"],
                "seconds": time.perf_counter() - start,
                "peak_bytes": torch.cuda.max_memory_allocated() if on_cuda else None,
                "allocated_before_bytes": resident,
                "trajectories_trained": record["trained"],
                "loss": record.get("loss"),
                "grad_norm": record.get("grad_norm"),
            }
        )
        return record

    monkeypatch.setattr(TrajectorySampler, "sample", plan_shaped_trajectories(config, stage, tokenizer))
    monkeypatch.setattr(FinetuneTrainer, "train_step", measured_step)
    start = time.monotonic()
    history = finetune_run.finetune_policy(
        config, stage, problems, lambda: None, Path(config.resolve("{run_dir}")) / stage, progress=False
    )
    total = time.monotonic() - start
    device_bytes = torch.cuda.get_device_properties(0).total_memory if on_cuda else 80 * 1024**3
    items = plan_memory(config, stage, device_bytes)
    training = {name: value for name, value in items.items() if name.startswith(TRAINING_ITEMS)}
    tokens = config.plan.prompt_tokens + config.generation.max_new_tokens
    gc.collect()
    if on_cuda:
        torch.cuda.empty_cache()
    return {
        "config": str(PAPER_CONFIGS[hub_id].relative_to(REPO)),
        "stage": stage,
        "objective": cfg.loss if stage == "gfn" else "ppo",
        "lora": cfg.lora,
        "dtype": config.model.dtype,
        "questions_per_step": cfg.questions_per_step,
        "samples_per_question": cfg.samples_per_question,
        "micro_batch_size": cfg.micro_batch_size,
        "tokens_per_trajectory": tokens,
        "steps": measured,
        "losses": [r.get("loss") for r in history],
        "stage_seconds_total": total,
        "plan_memory_items_bytes": items,
        "plan_training_items_bytes": sum(training.values()),
        "measured_peak_bytes": max((m["peak_bytes"] or 0) for m in measured) if on_cuda else None,
    }


def test_the_real_architectures_have_the_parameter_counts_make_plan_uses():
    """Each architecture built from its published config.json (on the meta device: no memory)
    has the parameters pipeline.sizing.shapes counts for it, and make plan's shape table agrees with the
    config.json values."""
    from transformers import AutoModelForCausalLM

    from pipeline.sizing.shapes import PUBLISHED, shape_from_config

    for hub_id, values in ARCHITECTURES.items():
        assert shape_from_config(values, hub_id) == PUBLISHED[hub_id], hub_id
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(architecture(hub_id))
        counted = sum(p.numel() for p in model.parameters())
        assert counted == PUBLISHED[hub_id].parameters(lm_head=True), (hub_id, counted)


@pytest.fixture(scope="module")
def model_folders(tmp_path_factory) -> dict[str, Path]:
    """Each real architecture at random init in bfloat16, saved once for the module's checks."""
    root = tmp_path_factory.mktemp("real_architectures")
    folders = {hub_id: root / hub_id.split("/")[1].lower() for hub_id in ARCHITECTURES}

    def build() -> dict:
        built = {
            hub_id: random_model_folder(hub_id, folder, "cuda", torch.bfloat16) for hub_id, folder in folders.items()
        }
        return {"environment": environment(), **built}

    run_check("model_folders", build)
    return folders


def run_check(name: str, body) -> dict:
    """Run one check, report its figures or the error that stopped it, and re-raise the error."""
    try:
        figures = body()
    except BaseException as error:
        report(name, {"error": f"{type(error).__name__}: {error}"[-4000:]})
        raise
    report(name, figures)
    return figures


def _check_finite(figures: dict) -> None:
    losses = [m["loss"] for m in figures["steps"]]
    assert len(losses) == len(figures["steps"]) and all(x is not None and math.isfinite(x) for x in losses), losses
    assert figures["measured_peak_bytes"] > 0


@needs_cuda
@pytest.mark.slow
def test_qwen2_5_math_1_5b_gfn_update_at_the_paper_config_shape(model_folders, tmp_path, monkeypatch):
    """configs/paper/qwen2.5-math-1.5b.yaml's SubTB with LoRA, 24 questions x 6 samples a step
    (then + half as many replayed), micro-batches of 4 x 1,280 tokens, on one GPU."""
    hub_id = "Qwen/Qwen2.5-Math-1.5B-Instruct"
    figures = run_check(
        "qwen2.5-math-1.5b_gfn",
        lambda: finetune_real_architecture(hub_id, model_folders[hub_id], tmp_path, monkeypatch, "gfn", steps=3),
    )
    _check_finite(figures)


@needs_cuda
@pytest.mark.slow
def test_llama_3_2_3b_gfn_update_at_one_gpus_share_of_the_paper_config(model_folders, tmp_path, monkeypatch):
    """configs/paper/llama3.2-3b.yaml's SubTB with LoRA and micro-batches of 8 x 1,280 tokens, at
    one GPU's share of its 8-process step (3 questions x 6 samples, then + half as many replayed),
    in one process (no FSDP: that needs several processes)."""
    hub_id = "meta-llama/Llama-3.2-3B-Instruct"
    figures = run_check(
        "llama3.2-3b_gfn",
        lambda: finetune_real_architecture(
            hub_id,
            model_folders[hub_id],
            tmp_path,
            monkeypatch,
            "gfn",
            steps=3,
            overrides=("gfn.questions_per_step=3",),
        ),
    )
    _check_finite(figures)


# ----------------------------------------------------------------------------- DeepSpeed through accelerate launch


def deepspeed_missing() -> str | None:
    if importlib.util.find_spec("deepspeed") is None:
        return "deepspeed is not installed (docs/scale.md, 'Checks on a GPU': carried as wheels)"
    return None


def accelerate_launch(
    accelerate_config: str,
    stage: str,
    args: list[str],
    script: Path | None = None,
    kill_when: Path | None = None,
    float32: bool = False,
) -> subprocess.CompletedProcess | None:
    """`accelerate launch --config_file <config> --num_processes 1 -m stages.train_<stage> <args>`
    (or `<script> <args>`), bounded in time, its process group killed however it ends; with
    ``kill_when``, killed (SIGKILL) as soon as that path exists, returning None."""
    command = [
        sys.executable,
        "-m",
        "accelerate.commands.launch",
        "--config_file",
        str(REPO / "configs" / "accelerate" / accelerate_config),
        "--num_processes",
        "1",
        # the files say bf16; a float32 run trains without autocast, which the trainer requires the launch to say
        *(["--mixed_precision", "no"] if float32 or "model.dtype=float32" in args else []),
        *([str(script)] if script is not None else ["-m", f"stages.train_{stage}"]),
        *args,
    ]
    path = os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH")) if p)  # a script imports pipeline
    env = {**os.environ, "TOKENIZERS_PARALLELISM": "false", "DS_ACCELERATOR": "cuda", "PYTHONPATH": path}
    result = run_bounded(command, timeout=LAUNCH_TIMEOUT_S, env=env, kill_when=kill_when)
    return None if result is None else subprocess.CompletedProcess(command, *result)


def error_lines(output: str) -> list[str]:
    """The lines of a launch's output that say why it stopped (the launcher's traceback follows them)."""
    return [line[-500:] for line in output.splitlines() if "error" in line.lower()][:20]


def _metrics(out: Path) -> list[dict]:
    path = out / "metrics.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def deepspeed_run(world: Path, tmp_path: Path, stage: str, extra: dict, kill_when: Path | None = None) -> dict:
    """One ZeRO-2 launch of the stage into tmp_path/<stage>/<stage> (float32 on the GPU); with
    ``kill_when``, killed as soon as that path exists (returncode None)."""
    from test_distributed_finetune import settings

    out = tmp_path / stage
    args = settings(world, stage, out, **{"model.device": "cuda", "model.dtype": "float32", **extra})
    start = time.monotonic()
    result = accelerate_launch("deepspeed_zero2.yaml", stage, args, kill_when=kill_when)
    output = result.stdout if result is not None else ""
    rows = _metrics(out / stage)
    figures = {
        "returncode": result.returncode if result is not None else None,
        "seconds": time.monotonic() - start,
        "losses": [r.get("loss") for r in rows],
        "log_z": [r["log_z"] for r in rows if "log_z" in r],
        "model_saved": (out / stage / "model" / "model.safetensors").exists(),
        "error_lines": error_lines(output),
        "output_tail": output[-3000:],
        "resumed": [line[-300:] for line in output.splitlines() if "resumed from" in line][:3],
    }
    return figures


@needs_cuda
@pytest.mark.slow
def test_deepspeed_zero2_one_process_trains_tb_with_a_learned_log_z(random_tiny_world, tmp_path):
    reason = deepspeed_missing()
    if reason:
        report("deepspeed_zero2_gfn_tb", {"skipped": reason})
        pytest.skip(reason)
    extra = {"gfn.loss": "tb", "gfn.learn_log_z": "true", "gfn.num_train_steps": 3}
    figures = run_check("deepspeed_zero2_gfn_tb", lambda: deepspeed_run(random_tiny_world, tmp_path, "gfn", extra))
    assert figures["returncode"] == 0, (figures["error_lines"], figures["output_tail"])
    assert len(figures["losses"]) == 3 and all(math.isfinite(x) for x in figures["losses"]), figures["losses"]
    assert len(figures["log_z"]) == 3 and figures["log_z"][-1] != 0.0, figures["log_z"]  # starts at 0
    assert figures["model_saved"]


@needs_cuda
@pytest.mark.slow
def test_deepspeed_zero2_one_process_trains_ppo(random_tiny_world, tmp_path):
    reason = deepspeed_missing()
    if reason:
        report("deepspeed_zero2_ppo", {"skipped": reason})
        pytest.skip(reason)
    extra = {"ppo.num_train_steps": 2, "ppo.ppo_epochs": 2}
    figures = run_check("deepspeed_zero2_ppo", lambda: deepspeed_run(random_tiny_world, tmp_path, "ppo", extra))
    assert figures["returncode"] == 0, (figures["error_lines"], figures["output_tail"])
    assert len(figures["losses"]) == 2 and all(math.isfinite(x) for x in figures["losses"]), figures["losses"]
    assert figures["model_saved"]


@needs_cuda
@pytest.mark.slow
def test_a_killed_deepspeed_zero2_run_resumes_from_whole_tensors_to_the_uninterrupted_run(random_tiny_world, tmp_path):
    """TB with a learned log Z under ZeRO-2 (1 process, float32), 3 steps with a checkpoint after
    each: killed once the step-1 checkpoint is committed (whole float32 tensors per parameter and
    both AdamW moments in full/, the AdamW step count 1 in its index), resumed, and ending where an
    uninterrupted run on the same seed ends: the same sampled solutions, losses within 1e-4, log Z
    within 1e-5, final weights within 1e-5 (one GPU, the same kernels in both runs). A resume that
    restored the weights but not the moments or the step count moves the weights by about the
    learning rate (1e-3) at the next step. ZeRO-3 resume is not run (its policy training samples
    with vLLM only)."""
    reason = deepspeed_missing()
    if reason:
        report("deepspeed_zero2_resume", {"skipped": reason})
        pytest.skip(reason)
    from test_distributed_finetune import assert_same_run

    extra = {"gfn.loss": "tb", "gfn.learn_log_z": "true", "gfn.save_every": 1, "gfn.num_train_steps": 3}
    straight_dir, killed_dir = tmp_path / "straight" / "gfn" / "gfn", tmp_path / "killed" / "gfn" / "gfn"
    step_1 = killed_dir / "checkpoints" / "step-00000001"

    def body() -> dict:
        straight = deepspeed_run(random_tiny_world, tmp_path / "straight", "gfn", extra)
        killed = deepspeed_run(random_tiny_world, tmp_path / "killed", "gfn", extra, kill_when=step_1)
        index_path = step_1 / "full" / "index.json"
        index = json.loads(index_path.read_text()) if index_path.exists() else {}
        checkpoint_files = sorted(p.relative_to(step_1).as_posix() for p in step_1.rglob("*") if p.is_file())
        resumed = deepspeed_run(random_tiny_world, tmp_path / "killed", "gfn", extra)
        return {
            "straight": straight,
            "killed": {k: killed[k] for k in ("returncode", "seconds", "losses", "model_saved")},
            "checkpoint_files": checkpoint_files,
            "index": {k: v for k, v in index.items() if k != "tensors"},
            "indexed_tensors": len(index.get("tensors", {})),
            "resumed": resumed,
        }

    figures = run_check("deepspeed_zero2_resume", body)
    straight, killed, resumed = figures["straight"], figures["killed"], figures["resumed"]
    assert straight["returncode"] == 0, (straight["error_lines"], straight["output_tail"])
    assert killed["returncode"] is None and not killed["model_saved"], killed
    index = figures["index"]
    assert index.get("written_under") == "DeepSpeed ZeRO-2, 1 process(es)" and index.get("optimizer_step") == 1, index
    assert figures["indexed_tensors"] == 3 * len(index["parameters"]) > 0  # weight, exp_avg, exp_avg_sq each
    assert "model.safetensors" not in figures["checkpoint_files"], figures["checkpoint_files"]
    assert "objective_optimizer.safetensors" in figures["checkpoint_files"]  # log Z's own AdamW
    assert resumed["returncode"] == 0, (resumed["error_lines"], resumed["output_tail"])
    assert any("step 1 of 3" in line for line in resumed["resumed"]), (resumed["resumed"], resumed["output_tail"])
    assert_same_run(straight_dir, killed_dir, loss_tolerance=1e-4, weight_tolerance=1e-5, steps=3)
    assert resumed["log_z"] == pytest.approx(straight["log_z"], abs=1e-5) and straight["log_z"][-1] != 0.0


@needs_cuda
@pytest.mark.slow
def test_a_deepspeed_engine_on_a_gpu_resumes_from_whole_tensors(tmp_path):
    """DeepSpeed's own engine on one CUDA GPU (tests/zero_resume.py, NCCL, 1 process), ZeRO-2 and
    ZeRO-3 in turn: a checkpoint written after 2 of 4 steps (pipeline.training.zero_state through
    checkpoint_io.write_full), loaded into another initialisation, ends at the uninterrupted run's
    weights with the AdamW step count 4; its weights loaded without the moments end more than 1e-3
    away. Under ZeRO-3 this is the resume path a policy run takes (whose stage samples with vLLM,
    absent from the GPU machine)."""
    reason = deepspeed_missing()
    if reason:
        report("deepspeed_engine_resume", {"skipped": reason})
        pytest.skip(reason)
    worker, stages = str(REPO / "tests" / "zero_resume.py"), ["2", "3"]
    env = {**os.environ, "DS_ACCELERATOR": "cuda", "MASTER_PORT": "29613"}

    def body() -> dict:
        figures: dict = {}
        for mode in ("save", "load"):
            start = time.monotonic()
            command = [sys.executable, worker, ",".join(stages), mode, str(tmp_path)]
            returncode, out = run_bounded(command, timeout=LAUNCH_TIMEOUT_S, env=env)
            figures[mode] = {"returncode": returncode, "seconds": time.monotonic() - start, "tail": out[-2000:]}
            if returncode != 0:
                return figures
        figures["results"] = {s: json.loads((tmp_path / f"zero-{s}" / "load-1.json").read_text()) for s in stages}
        return figures

    figures = run_check("deepspeed_engine_resume", body)
    assert figures["save"]["returncode"] == 0 and figures.get("load", {}).get("returncode") == 0, figures
    for stage, found in figures["results"].items():
        resumed, weights_only = found["load"], found["load_weights_only"]
        assert resumed["written_by"] == 1 and resumed["optimizer_step"] == 4, (stage, found)
        assert resumed["max_difference"] <= 1e-6, (stage, found)
        assert weights_only["max_difference"] > 1e-3, (stage, found)


@needs_cuda
@pytest.mark.slow
def test_deepspeed_zero3_with_hf_sampling_is_refused_before_any_model_loads(random_tiny_world, tmp_path):
    """The policy's weights file is cut short: a run that loaded it would stop on the damaged
    file, so the ZeRO-3 refusal in the output shows nothing was loaded before it."""
    reason = deepspeed_missing()
    if reason:
        report("deepspeed_zero3_hf_refused", {"skipped": reason})
        pytest.skip(reason)
    from test_distributed_finetune import settings

    world = tmp_path / "world"
    shutil.copytree(random_tiny_world, world)
    weights = world / "policy" / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])
    out = tmp_path / "gfn"

    def body() -> dict:
        result = accelerate_launch(
            "deepspeed_zero3.yaml", "gfn", settings(world, "gfn", out, **{"model.device": "cuda"})
        )
        return {
            "returncode": result.returncode,
            "refused": "DeepSpeed ZeRO-3 with generation.backend=hf" in result.stdout,
            "loaded_the_damaged_policy": "truncated or damaged" in result.stdout,
            "error_lines": error_lines(result.stdout),
        }

    figures = run_check("deepspeed_zero3_hf_refused", body)
    assert figures["returncode"] != 0
    assert figures["refused"] and not figures["loaded_the_damaged_policy"], figures["error_lines"]


@needs_cuda
@pytest.mark.slow
def test_deepspeed_zero3_gathers_the_samplers_weights_one_parameter_at_a_time(random_tiny_world, tmp_path):
    """TrainingBase.full_state_dict under a one-process ZeRO-3 launch, every parameter partitioned
    (tests/zero3_gathered_weights.py): in bfloat16, the policy's own weights, the tied embedding
    and lm_head one tensor, the parameters partitioned again afterwards; after one update, what
    DeepSpeed's own consolidated state dict holds."""
    reason = deepspeed_missing()
    if reason:
        report("deepspeed_zero3_gathered_weights", {"skipped": reason})
        pytest.skip(reason)
    script = REPO / "tests" / "zero3_gathered_weights.py"

    def body() -> dict:
        start = time.monotonic()
        result = accelerate_launch(
            "deepspeed_zero3.yaml", "", [str(random_tiny_world / "policy"), str(tmp_path)], script=script, float32=True
        )
        verdict = tmp_path / "verdict.json"
        return {
            "returncode": result.returncode,
            "seconds": time.monotonic() - start,
            "verdict": json.loads(verdict.read_text()) if verdict.exists() else None,
            "error_lines": error_lines(result.stdout),
            "output_tail": result.stdout[-3000:],
        }

    figures = run_check("deepspeed_zero3_gathered_weights", body)
    assert figures["returncode"] == 0 and figures["verdict"] is not None, (
        figures["error_lines"],
        figures["output_tail"],
    )
    verdict = figures["verdict"]
    assert verdict["distributed_type"] == "DistributedType.DEEPSPEED" and verdict["zero_stage"] == 3, verdict
    assert verdict["partitioned_before"] and verdict["partitioned_after"], verdict
    assert verdict["names_match"] and verdict["dtypes"] == ["torch.bfloat16"], verdict
    assert verdict["mismatched"] == [] and verdict["tied_one_tensor"], verdict
    assert verdict["after_update_names_match"] and verdict["after_update_mismatched"] == [], verdict
    assert verdict["after_update_dtypes"] == [verdict["trained_dtype"]] and verdict["weights_moved"] > 0, verdict


# ----------------------------------------------------------------------------- PPO at the real size, last (cheapest to lose)


@needs_cuda
@pytest.mark.slow
def test_qwen2_5_math_1_5b_ppo_update_at_the_paper_config_shape(model_folders, tmp_path, monkeypatch):
    """configs/paper/qwen2.5-math-1.5b.yaml's PPO (LoRA, 24 x 6 a step, micro-batches of 4, 2
    epochs): one training step."""
    hub_id = "Qwen/Qwen2.5-Math-1.5B-Instruct"
    figures = run_check(
        "qwen2.5-math-1.5b_ppo",
        lambda: finetune_real_architecture(hub_id, model_folders[hub_id], tmp_path, monkeypatch, "ppo", steps=1),
    )
    _check_finite(figures)


@needs_cuda
@pytest.mark.slow
def test_qwen2_5_math_1_5b_gfn_memory_at_a_held_out_shape(model_folders, tmp_path, monkeypatch):
    """A shape no earlier run measured: SubTB with LoRA, micro-batches of 2 x 640 tokens (256 prompt
    + 384 solution), 2 questions x 6 samples, 2 steps: the measured peak beside make plan's
    estimate (recorded, compared in docs/results/scale.md)."""
    hub_id = "Qwen/Qwen2.5-Math-1.5B-Instruct"
    figures = run_check(
        "qwen2.5-math-1.5b_gfn_held_out",
        lambda: finetune_real_architecture(
            hub_id,
            model_folders[hub_id],
            tmp_path,
            monkeypatch,
            "gfn",
            steps=2,
            overrides=("gfn.questions_per_step=2", "gfn.micro_batch_size=2", "generation.max_new_tokens=384"),
        ),
    )
    _check_finite(figures)
    assert figures["plan_training_items_bytes"] > 0 and math.isfinite(figures["plan_training_items_bytes"])
