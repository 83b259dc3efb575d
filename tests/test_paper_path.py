"""The paper configs through every stage, in order, on real architectures at toy size.

The hub models are replaced by tiny ones built locally (tests/real_models.py). configs/paper/
llama3.2-3b.yaml: the policy a Llama shaped like Llama-3.2-Instruct (a tokenizer that adds BOS, a
chat template that writes it, eos <|eot_id|>), the PRM backbone a Qwen2 shaped like Qwen2.5-Math
(ChatML, no BOS). configs/paper/qwen2.5-math-1.5b.yaml: a Qwen2 policy as well (its LoRA PRM,
policy LoRA and ChatML prompts without BOS). Problems
are real MATH, GSM8K and SAT problems from the benchmark files. The paper config's own settings
are kept; the overrides change only sizes, model paths, and what the absence of a hub (local
files, the offline embedder) and of a GPU (the HF backend, float32) forces. Bootstrap is skipped,
as it is for hub models.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import real_models

from pipeline.config import load_config
from pipeline.generation.hf import HFGenerator
from pipeline.modeling import load_tokenizer
from pipeline.prompts import prompt_from_config
from pipeline.steps import encode_prompt

REPO = Path(__file__).resolve().parents[1]
PAPER = REPO / "configs" / "paper"
POLICIES = {"llama3.2-3b": real_models.build_llama3, "qwen2.5-math-1.5b": real_models.build_qwen2}  # config -> policy builder
# what from_pretrained and vLLM read in a model folder; our manifest.json beside them
MODEL_FILES = {"config.json", "generation_config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json",
               "chat_template.jinja", "manifest.json"}


def overrides(tmp_path: Path, benchmarks: Path) -> list[str]:
    policy, backbone = tmp_path / "models" / "policy", tmp_path / "models" / "qwen2"
    eval_paths = {"math_level5": benchmarks / "math_test.jsonl", "gsm8k": benchmarks / "gsm8k_test.jsonl",
                  "sat_math_32": benchmarks / "sat_math_32.jsonl", "agieval_sat_math": benchmarks / "agieval_sat_math.jsonl"}
    return [
        f"runs_root={tmp_path / 'runs'}", "run=paper",
        # model paths (no hub)
        f"model.policy={policy}", f"model.prm_backbone={backbone}", f"eval.models.base={policy}",
        # no GPU: the HF backend, float32 on the CPU, one thread per process (2 busy cores)
        "generation.backend=hf", "model.dtype=float32", "model.device=cpu", "model.torch_threads=1",
        "prm.gradient_checkpointing=false",
        # no hub: local problem files; the OpenMathInstruct-2 filter has nothing to filter in MATH
        "data.train=math", f"data.train_path={benchmarks / 'math_test.jsonl'}", "data.problem_sources=[]",
        f"data.validation_path={benchmarks / 'math500_test.jsonl'}", "eval.embedder=null",
        f"eval.benchmark_paths={json.dumps({k: str(v) for k, v in eval_paths.items()})}",
        f"search.benchmark_path={benchmarks / 'math500_test.jsonl'}",
        # sizes
        "generation.max_new_tokens=24", "generation.max_step_tokens=12", "data.train_limit=3", "data.validation_limit=2",
        "mcts.k=2", "mcts.max_iterations=1", "mcts.max_rollouts=4", "mcts.search_trivial=true", "augment.val_fraction=0.34",
        "prm.batch_size=4", "prm.micro_batch_size=4", "prm.max_length=512", "prm.natural_slip_problems=1", "prm.corrupt_examples=4",
        "gfn.num_train_steps=1", "gfn.questions_per_step=2", "gfn.samples_per_question=2", "gfn.micro_batch_size=4",
        "ppo.num_train_steps=1", "ppo.questions_per_step=2", "ppo.samples_per_question=2", "ppo.micro_batch_size=4",
        "eval.max_problems=2", "eval.k=2", "eval.bootstrap_resamples=50",
        "search.ks=[1, 2]", "search.max_problems=2", "search.max_depth=2",
    ]


@pytest.mark.slow
@pytest.mark.parametrize("name", list(POLICIES))
def test_the_paper_config_runs_every_stage_on_real_architectures(name, tmp_path, benchmarks_dir, monkeypatch):
    from stages import augment, evaluate, mcts, search, train_gfn, train_ppo, train_prm

    monkeypatch.chdir(tmp_path)  # reports/ goes here
    problems = [json.loads(line) for line in (benchmarks_dir / "math_test.jsonl").read_text().splitlines()[:3]]
    texts = real_models.corpus([p["problem"] for p in problems])
    POLICIES[name](tmp_path / "models" / "policy", texts)
    real_models.build_qwen2(tmp_path / "models" / "qwen2", texts, seed=1)
    paper = PAPER / f"{name}.yaml"
    argv = ["--config", str(paper), *overrides(tmp_path, benchmarks_dir)]
    config = load_config(paper, argv[2:])
    assert config.model.prm == "{run_dir}/prm/model" and config.format.use_chat_template  # the paper's own

    # the prompt the policy sees: Llama-3's BOS exactly once, then the template's first header;
    # Qwen2.5's ChatML starts with its first header and has no BOS
    tokenizer = load_tokenizer(config.model.policy)
    prompt = prompt_from_config(problems[0]["problem"], "math", tokenizer, config.format)
    ids = encode_prompt(tokenizer, prompt)
    if tokenizer.bos_token_id is not None:
        assert ids[0] == tokenizer.bos_token_id and ids.count(tokenizer.bos_token_id) == 1
        ids_after_bos = ids[1:]
    else:
        ids_after_bos = ids
    header = "<|start_header_id|>" if name.startswith("llama") else "<|im_start|>"
    assert ids_after_bos[0] == tokenizer.convert_tokens_to_ids(header)

    for stage in (mcts, augment, train_prm, train_gfn, train_ppo, evaluate, search):
        stage.main(argv)
    run = tmp_path / "runs" / "paper"
    assert json.loads((run / "mcts" / "stats.json").read_text())["problems"] == 3
    assert (run / "prm" / "model" / "manifest.json").is_file()
    for stage in ("gfn", "ppo"):  # only what from_pretrained and vLLM read: no stray weight file
        files = {p.name for p in (run / stage / "model").iterdir()}
        assert files - MODEL_FILES == set(), (stage, files)
    assert (run / "ppo" / "value_head" / "value_head.safetensors").is_file()  # beside the policy, not in it
    results = json.loads((tmp_path / "reports" / "paper" / "results.json").read_text())
    assert list(results["results"]) == ["base", "ppo", "gfn"] and results["skipped"] == []
    assert set(results["benchmarks"]) == {"math_level5", "gsm8k", "sat_math_32", "agieval_sat_math"}
    # the fine-tuned policy loads and sees its prompt as the base did
    generator = HFGenerator.from_config(config, str(run / "gfn" / "model"))
    assert encode_prompt(generator.tokenizer, prompt) == ids
    generator.close()
