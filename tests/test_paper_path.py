"""The paper configs through every stage, in order, on real architectures at toy size.

configs/paper/llama3.2-3b.yaml and configs/paper/qwen2.5-math-1.5b.yaml, each with its own policy:
the hub models are replaced by tiny ones built locally (tests/real_models.py). A Llama shaped like
Llama-3.2-Instruct (a tokenizer that adds BOS, a chat template that writes it, eos <|eot_id|>), or
a Qwen2 shaped like Qwen2.5-Math-Instruct (a tokenizer with no BOS that adds none, a ChatML template
with its default system turn, eos <|im_end|>); the PRM backbone a Qwen2 shaped like Qwen2.5-Math
in both. Problems are real MATH, GSM8K and SAT problems from the benchmark files. The paper
config's own settings are kept; the overrides change only sizes, model paths, and what the absence
of a hub (local files, the offline embedder) and of a GPU (the HF backend, float32) forces.
Bootstrap is skipped, as it is for hub models.
"""

from __future__ import annotations

import functools
import json
from pathlib import Path

import pytest
import real_models
import torch
import transformers

from pipeline.config.loader import load_config
from pipeline.generation.hf import HFGenerator
from pipeline.generation.vllm_servable import check_servable
from pipeline.modeling import load_tokenizer
from pipeline.prompts import prompt_from_config
from pipeline.steps import encode_prompt

REPO = Path(__file__).resolve().parents[1]
PAPER = REPO / "configs" / "paper"
# what from_pretrained and vLLM read in a model folder; our manifest.json beside them
MODEL_FILES = {
    "config.json",
    "generation_config.json",
    "model.safetensors",
    "tokenizer.json",
    "tokenizer_config.json",
    "chat_template.jinja",
    "manifest.json",
}


def overrides(tmp_path: Path, benchmarks: Path) -> list[str]:
    policy, backbone = tmp_path / "models" / "policy", tmp_path / "models" / "prm_backbone"
    eval_paths = {
        "math_level5": benchmarks / "math_test.jsonl",
        "gsm8k": benchmarks / "gsm8k_test.jsonl",
        "sat_math_32": benchmarks / "sat_math_32.jsonl",
        "agieval_sat_math": benchmarks / "agieval_sat_math.jsonl",
    }
    return [
        f"runs_root={tmp_path / 'runs'}",
        "run=paper",
        # model paths (no hub)
        f"model.policy={policy}",
        f"model.prm_backbone={backbone}",
        f"eval.models.base={policy}",
        # no GPU: the HF backend, float32 on the CPU, one thread per process (2 busy cores)
        "generation.backend=hf",
        "model.dtype=float32",
        "model.device=cpu",
        "model.torch_threads=1",
        "prm.gradient_checkpointing=false",
        # no hub: local problem files; the OpenMathInstruct-2 filter has nothing to filter in MATH
        "data.train=math",
        f"data.train_path={benchmarks / 'math_test.jsonl'}",
        "data.problem_sources=[]",
        f"data.validation_path={benchmarks / 'math500_test.jsonl'}",
        "eval.embedder=null",
        f"eval.benchmark_paths={json.dumps({k: str(v) for k, v in eval_paths.items()})}",
        f"search.benchmark_path={benchmarks / 'math500_test.jsonl'}",
        # sizes
        "generation.max_new_tokens=24",
        "generation.max_step_tokens=12",
        "data.train_limit=3",
        "data.validation_limit=2",
        "mcts.k=2",
        "mcts.max_iterations=1",
        "mcts.max_rollouts=4",
        "mcts.search_trivial=true",
        "augment.val_fraction=0.34",
        "prm.batch_size=4",
        "prm.micro_batch_size=4",
        "prm.max_length=512",
        "prm.exact_check_problems=1",
        "prm.corrupt_examples=4",
        "gfn.num_train_steps=1",
        "gfn.questions_per_step=2",
        "gfn.samples_per_question=2",
        "gfn.micro_batch_size=4",
        "ppo.num_train_steps=1",
        "ppo.questions_per_step=2",
        "ppo.samples_per_question=2",
        "ppo.micro_batch_size=4",
        "eval.max_problems=2",
        "eval.k=2",
        "eval.bootstrap_resamples=50",
        "search.ks=[1, 2]",
        "search.max_problems=2",
        "search.max_depth=2",
    ]


def assert_prompt_ids(name: str, tokenizer, prompt: str, ids: list[int]) -> None:
    """The prompt the policy sees: Llama-3's BOS exactly once, then the template's first header;
    for Qwen2.5 the ChatML text as it is, nothing added before <|im_start|> (its tokenizer has no
    BOS; the <|endoftext|> its config names as bos id appears nowhere)."""
    if name == "llama3":
        assert ids[0] == tokenizer.bos_token_id and ids.count(tokenizer.bos_token_id) == 1
        assert ids[1] == tokenizer.convert_tokens_to_ids("<|start_header_id|>")
    else:
        assert tokenizer.bos_token_id is None and prompt.startswith("<|im_start|>system\n")
        assert ids == tokenizer(prompt, add_special_tokens=False)["input_ids"]
        assert ids[0] == tokenizer.convert_tokens_to_ids("<|im_start|>")
        assert tokenizer.convert_tokens_to_ids("<|endoftext|>") not in ids


def record_prompt_starts(monkeypatch, model_class) -> list[list[int]]:
    """The first two tokens of every sequence a ``model_class`` forward is handed whole (a
    generation's prefill, a training or scoring pass; not the one-token decode steps), counted
    from the first token its attention mask keeps (generation pads on the left)."""
    seen: list[list[int]] = []
    forward = model_class.forward

    @functools.wraps(forward)
    def recording(self, *args, **kwargs):
        input_ids = kwargs.get("input_ids", args[0] if args else None)
        if input_ids is not None and input_ids.shape[1] > 1:
            mask = kwargs.get("attention_mask")
            mask = torch.ones_like(input_ids) if mask is None else mask
            for row, kept in zip(input_ids.tolist(), mask.tolist()):
                start = kept.index(1)
                seen.append(row[start : start + 2])
        return forward(self, *args, **kwargs)

    monkeypatch.setattr(model_class, "forward", recording)
    return seen


@pytest.mark.slow
@pytest.mark.parametrize("paper,policy_arch", [("llama3.2-3b", "llama3"), ("qwen2.5-math-1.5b", "qwen2")])
def test_the_paper_config_runs_every_stage_on_real_architectures(
    tmp_path, benchmarks_dir, monkeypatch, paper, policy_arch
):
    from stages import augment, evaluate, mcts, search, train_gfn, train_ppo, train_prm

    monkeypatch.chdir(tmp_path)  # reports/ goes here
    problems = [json.loads(line) for line in (benchmarks_dir / "math_test.jsonl").read_text().splitlines()[:3]]
    texts = real_models.corpus([p["problem"] for p in problems])
    build_policy = {"llama3": real_models.build_llama3, "qwen2": real_models.build_qwen2}[policy_arch]
    build_policy(tmp_path / "models" / "policy", texts)
    real_models.build_qwen2(tmp_path / "models" / "prm_backbone", texts, seed=1)
    config_file = PAPER / f"{paper}.yaml"
    argv = ["--config", str(config_file), *overrides(tmp_path, benchmarks_dir)]
    config = load_config(config_file, argv[2:])
    assert config.model.prm == "{run_dir}/prm/model" and config.format.use_chat_template  # the paper's own

    tokenizer = load_tokenizer(config.model.policy)
    prompt = prompt_from_config(problems[0]["problem"], "math", tokenizer, config.format)
    ids = encode_prompt(tokenizer, prompt)
    assert_prompt_ids(policy_arch, tokenizer, prompt, ids)

    # every prompt the policy is handed, in every stage that runs it, begins as this one does
    policy_class = {"llama3": transformers.LlamaForCausalLM, "qwen2": transformers.Qwen2ForCausalLM}[policy_arch]
    starts = record_prompt_starts(monkeypatch, policy_class)  # the PRM is an AutoModel backbone: not recorded
    fed = {}
    for stage in (mcts, augment, train_prm, train_gfn, train_ppo, evaluate, search):
        stage.main(argv)
        fed[stage.__name__.split(".")[-1]] = [list(start) for start in starts]
        starts.clear()
    for stage in ("mcts", "train_gfn", "train_ppo", "evaluate", "search"):
        assert fed[stage] and all(start == ids[:2] for start in fed[stage]), (stage, ids[:2], fed[stage][:3])
    run = tmp_path / "runs" / "paper"
    assert json.loads((run / "mcts" / "stats.json").read_text())["problems"] == 3
    assert (run / "prm" / "model" / "manifest.json").is_file()
    for stage in ("gfn", "ppo"):  # only what from_pretrained and vLLM read: no stray weight file
        files = {p.name for p in (run / stage / "model").iterdir()}
        assert files - MODEL_FILES == set(), (stage, files)
        check_servable(run / stage / "model", f"eval.models.{stage}")  # what a vLLM evaluation checks before it loads
    assert (run / "ppo" / "value_head" / "value_head.safetensors").is_file()  # beside the policy, not in it
    results = json.loads((tmp_path / "reports" / "paper" / "results.json").read_text())
    assert list(results["results"]) == ["base", "ppo", "gfn"] and results["skipped"] == []
    assert set(results["benchmarks"]) == {"math_level5", "gsm8k", "sat_math_32", "agieval_sat_math"}
    # the fine-tuned policy loads and sees its prompt as the base did
    generator = HFGenerator.from_config(config, str(run / "gfn" / "model"))
    assert encode_prompt(generator.tokenizer, prompt) == ids
    generator.close()
