"""The stages' command line (stages.cli): a user's mistake reads as one line and exit status 2,
a bug keeps its traceback; --help lists every config field with its default; print_config=true
prints the resolved config and writes nothing."""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml

from pipeline.config.loader import describe_fields, load_config
from pipeline.config.schema import Config, MCTSConfig
from stages import evaluate, mcts, search, train_gfn, train_ppo, train_prm
from stages.cli import cli, parse_args

REPO = Path(__file__).resolve().parents[1]


def run_cli(monkeypatch, main, *args: str) -> int:
    """cli(main) as `python -m stages.<main's module>` runs it; returns the exit status."""
    monkeypatch.setattr(sys, "argv", [f"{main.__module__.replace('.', '/')}.py", *args])
    with pytest.raises(SystemExit) as exit_info:
        cli(main)
    return exit_info.value.code


def test_a_bad_override_prints_one_line_and_a_hint_and_exits_2(tmp_path):
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    process = subprocess.run(
        [sys.executable, "-m", "stages.train_gfn", f"runs_root={tmp_path / 'runs'}", "gfn.mode=asyncc"],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert process.returncode == 2
    assert "Traceback" not in process.stderr
    assert process.stderr.splitlines() == [
        "error: command line: gfn.mode must be one of sync, async, got 'asyncc'",
        "hint: python -m stages.train_gfn --help lists every config field with its default",
    ]
    assert not (tmp_path / "runs").exists()


def test_preflight_input_file_and_stage_refusals_read_as_one_line(monkeypatch, tmp_path, capsys):
    runs = f"runs_root={tmp_path / 'runs'}"
    assert run_cli(monkeypatch, train_ppo.main, runs, f"model.prm={tmp_path}", "ppo.mode=async") == 2
    error = capsys.readouterr().err.splitlines()
    assert (
        error[0].startswith("error: ppo.mode=async: PPO is on-policy")
        and len(error) == 2
        and "Traceback" not in "\n".join(error)
    )

    monkeypatch.setenv("STEPFLOW_BENCHMARKS", str(tmp_path / "empty"))
    assert run_cli(monkeypatch, mcts.main, runs, "data.train=sat_math_32", "data.train_path=null") == 2
    error = capsys.readouterr().err.splitlines()
    assert len(error) == 1 and error[0].startswith(
        f"error: benchmark file sat_math_32.jsonl, looked for in {tmp_path / 'empty'}"
    )

    assert run_cli(monkeypatch, mcts.main, runs, f"data.train_path={tmp_path / 'nope.jsonl'}") == 2
    assert capsys.readouterr().err.splitlines() == [f"error: benchmark file not found: {tmp_path / 'nope.jsonl'}"]

    assert run_cli(monkeypatch, train_prm.main, runs, f"model.prm_backbone={tmp_path}") == 2
    error = capsys.readouterr().err.splitlines()
    assert len(error) == 1 and error[0].startswith("error: missing input ")


def test_a_model_folder_vllm_cannot_serve_is_refused_in_one_line_before_any_model_loads(monkeypatch, tmp_path, capsys):
    from safetensors.torch import save_file

    # a policy folder with a stray weight file beside model.safetensors (the stages stop before reading either)
    served, stray = tmp_path / "models" / "base", tmp_path / "models" / "ppo"
    for folder, names in ((served, ["model.safetensors"]), (stray, ["model.safetensors", "value_head.safetensors"])):
        folder.mkdir(parents=True)
        for name in names:
            save_file({"weight": torch.zeros(2)}, str(folder / name))
    monkeypatch.chdir(tmp_path)  # reports/ goes here
    results = tmp_path / "reports" / "t" / "results.json"
    results.parent.mkdir(parents=True)
    results.write_text('{"earlier": "results"}')
    runs = [
        "--config",
        str(REPO / "configs" / "tiny.yaml"),
        f"runs_root={tmp_path / 'runs'}",
        "run=t",
        "generation.backend=vllm",
        f"model.prm={tmp_path}",
    ]
    refusal = (
        "holds 2 *.safetensors files and no model.safetensors.index.json, and vLLM loads every one as weights of the model, "
        "so value_head.safetensors would make the engine fail: move it out of the folder"
    )
    for main, key, args in (
        (evaluate.main, "eval.models.ppo", [f'eval.models={{"base": "{served}", "ppo": "{stray}"}}']),
        (mcts.main, "model.policy", [f"model.policy={stray}"]),
        (search.main, "model.policy", [f"model.policy={stray}"]),
        (train_gfn.main, "model.policy", [f"model.policy={stray}"]),
        (train_ppo.main, "model.policy", [f"model.policy={stray}"]),
    ):
        assert run_cli(monkeypatch, main, *runs, *args) == 2, main.__module__
        error = capsys.readouterr().err.splitlines()
        assert error[0].startswith(f"error: {stray} ({key}): {refusal}"), (main.__module__, error)
        assert "Traceback" not in "\n".join(error)
    assert results.read_text() == '{"earlier": "results"}'  # nothing written is lost
    assert not (tmp_path / "runs").exists()  # no stage wrote anything
    # the HF backend reads model.safetensors only: no refusal (the stage goes on to its next check)
    assert (
        run_cli(
            monkeypatch, mcts.main, *runs[:4], f"model.policy={stray}", f"data.train_path={tmp_path / 'nope.jsonl'}"
        )
        == 2
    )
    assert capsys.readouterr().err.splitlines() == [f"error: benchmark file not found: {tmp_path / 'nope.jsonl'}"]


def test_a_missing_vllm_is_refused_by_each_stage_in_one_line_naming_the_key_and_make_gpu_env(
    monkeypatch, tmp_path, capsys
):
    import importlib.util

    find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "vllm" else find_spec(name, *a))
    monkeypatch.chdir(tmp_path)  # reports/ would go here
    runs = ["--config", str(REPO / "configs" / "tiny.yaml"), f"runs_root={tmp_path / 'runs'}", "run=t"]
    runs.append(f"model.prm={tmp_path}")  # the fine-tuning stages check their PRM input first
    for main in (mcts.main, evaluate.main, search.main, train_gfn.main, train_ppo.main):
        assert run_cli(monkeypatch, main, *runs, "generation.backend=vllm") == 2, main.__module__
        error = capsys.readouterr().err.splitlines()
        assert error[0].startswith("error: generation.backend=vllm but vllm is not installed in this environment ("), (
            main.__module__,
            error,
        )
        assert [line for line in error if not line.startswith("hint: ")] == error[:1]  # one line, no traceback
        assert "`make gpu-env` builds .venv-vllm" in error[0] and "generation.backend=hf" in error[0]
    assert not (tmp_path / "runs").exists() and not (tmp_path / "reports").exists()  # nothing was created


def forbid_model_loads(monkeypatch) -> None:
    """Every way a stage loads a model fails the test if called."""
    import transformers

    from stages import prm_bench

    def loaded(*args, **kwargs):
        raise AssertionError("a model was loaded before the stage checked the config's models")

    for module in (mcts, search, evaluate, train_prm, prm_bench):
        for name in ("build_generator", "load_scorer"):
            if hasattr(module, name):
                monkeypatch.setattr(module, name, loaded)
    monkeypatch.setattr(train_gfn, "finetune_policy", loaded)
    monkeypatch.setattr(train_prm, "train_prm", loaded)
    for auto in (transformers.AutoModelForCausalLM, transformers.AutoModel, transformers.AutoTokenizer):
        monkeypatch.setattr(auto, "from_pretrained", loaded)


def test_a_model_neither_local_nor_a_hub_id_is_refused_by_each_stage_naming_its_key_before_any_model_loads(
    monkeypatch, tmp_path, capsys
):
    from pipeline.config.loader import ConfigError
    from planner.make import make_plan
    from stages import launch, prm_bench

    forbid_model_loads(monkeypatch)
    monkeypatch.chdir(tmp_path)  # reports/ goes here
    runs = ["--config", str(REPO / "configs" / "tiny.yaml"), f"runs_root={tmp_path / 'runs'}", "run=t"]
    missing, malformed = str(tmp_path / "no-such-model"), "org/not a name"
    cases = [
        (mcts.main, "model.policy", missing, []),
        (search.main, "model.prm", malformed, []),
        (train_prm.main, "model.prm_backbone", missing, []),
        (train_prm.main, "model.prm", malformed, ["prm.eval_only=true"]),
        (train_prm.main, "model.policy", missing, [f"model.prm_backbone={tmp_path}"]),  # its exact-check samples
        (train_gfn.main, "model.prm", missing, []),
        (train_ppo.main, "model.policy", malformed, []),
        (
            evaluate.main,
            "eval.models.sft",
            malformed,
            [f'eval.models={{"base": "{missing}", "sft": "{malformed}::{missing}"}}'],
        ),
        (evaluate.main, "eval.prm", "a--b/prm", []),
    ]
    for main, key, value, extra in cases:
        overrides = extra if key.startswith("eval.models") else [f"{key}={value}", *extra]
        assert run_cli(monkeypatch, main, *runs, *overrides) == 2, (main.__module__, key)
        error = capsys.readouterr().err.splitlines()
        stage = main.__module__.split(".")[1]
        assert error == [
            f"error: {key}: {value} is neither a local folder nor a hub id (owner/name)",
            f"hint: python -m stages.{stage} --help lists every config field with its default",
        ], (main.__module__, error)
    with pytest.raises(ConfigError, match=rf"^model\.prm: {missing} is neither a local folder nor a hub id"):
        prm_bench.main([*runs, f"model.prm={missing}"])
    with pytest.raises(
        ConfigError, match=r"^eval\.models\.base: org/not a name is neither"
    ):  # before any worker starts
        launch.main(["eval", "--workers", "2", *runs, f'eval.models={{"base": "{malformed}"}}'])
    assert not (tmp_path / "runs").exists() and not (tmp_path / "reports").exists()  # no stage wrote anything
    # make plan says the same of the same model
    plan = make_plan(
        load_config(REPO / "configs" / "tiny.yaml", [f"runs_root={tmp_path / 'runs'}", f"model.policy={malformed}"])
    )
    assert [str(f) for f in plan.errors] == [
        f"ERROR: model.policy: {malformed} is neither a local folder nor a hub id (owner/name)"
    ]


def test_a_hub_id_a_local_folder_and_a_model_an_earlier_stage_makes_pass_the_stages_model_check(
    monkeypatch, tmp_path, capsys
):
    from stages.startup_checks import STAGE_MODELS, check_models

    hub = {
        "model.policy=meta-llama/Llama-3.2-3B-Instruct",
        "model.prm_backbone=Qwen/Qwen2.5-Math-7B",
        "model.prm=Qwen/Qwen2.5-Math-PRM-7B",
        "eval.prm=Qwen/Qwen2.5-Math-PRM-7B",
    }
    local = (
        f'eval.models={{"base": "meta-llama/Llama-3.2-3B-Instruct", "here": "{tmp_path}", "gone": "{tmp_path / "gone"}", '
        '"gfn": "{run_dir}/gfn/model"}'
    )  # make eval skips "gone" with a note, and "gfn" until make gfn made it
    for eval_only in ("false", "true"):
        config = load_config(
            REPO / "configs" / "tiny.yaml",
            [f"runs_root={tmp_path / 'runs'}", *hub, local, f"prm.eval_only={eval_only}"],
        )
        tiny = load_config(
            REPO / "configs" / "tiny.yaml", [f"runs_root={tmp_path / 'runs'}", f"prm.eval_only={eval_only}"]
        )
        for stage in STAGE_MODELS:
            check_models(config, stage)  # nothing is looked up on the hub (no network here)
            check_models(
                tiny, stage
            )  # every model is {run_dir}/<stage>/model, not made yet: the stage reading it requires it
    # through a stage: the hub id passes and the stage goes on to its next check
    forbid_model_loads(monkeypatch)
    assert (
        run_cli(
            monkeypatch,
            mcts.main,
            "--config",
            str(REPO / "configs" / "tiny.yaml"),
            f"runs_root={tmp_path / 'runs'}",
            "model.policy=meta-llama/Llama-3.2-3B-Instruct",
            f"data.train_path={tmp_path / 'nope.jsonl'}",
        )
        == 2
    )
    assert capsys.readouterr().err.splitlines() == [f"error: benchmark file not found: {tmp_path / 'nope.jsonl'}"]


def test_a_bug_keeps_its_traceback(monkeypatch):
    def broken(argv):
        raise ZeroDivisionError("a bug")

    monkeypatch.setattr(sys, "argv", ["stages/mcts.py"])
    with pytest.raises(ZeroDivisionError):
        cli(broken)


def test_help_lists_every_config_field_with_its_default(capsys):
    with pytest.raises(SystemExit) as exit_info:
        parse_args("mcts", ["--help"])
    assert exit_info.value.code == 0
    shown = capsys.readouterr().out
    for line in describe_fields():
        assert line in shown
    for item in dataclasses.fields(MCTSConfig):  # the listing follows the dataclasses, not a text typed beside them
        assert f"  mcts.{item.name}: " in shown
    assert f"mcts.k: int = {MCTSConfig().k}  (>= 1)" in shown
    assert 'eval.benchmarks: list = ["tiny_test"]' in shown


def test_print_config_prints_the_resolved_config_and_writes_nothing(monkeypatch, tmp_path, capsys):
    args = [
        "--config",
        str(REPO / "configs" / "tiny.yaml"),
        f"runs_root={tmp_path / 'runs'}",
        "mcts.k=3",
        "print_config=true",
    ]
    assert run_cli(monkeypatch, mcts.main, *args) == 0
    printed = yaml.safe_load(capsys.readouterr().out)
    assert (
        printed == load_config(REPO / "configs" / "tiny.yaml", [f"runs_root={tmp_path / 'runs'}", "mcts.k=3"]).to_dict()
    )
    assert printed["mcts"]["k"] == 3 and set(printed) == {f.name for f in dataclasses.fields(Config)}
    assert not (tmp_path / "runs").exists()
    assert run_cli(monkeypatch, mcts.main, *args[:-1], "print_config=maybe") == 2
    assert capsys.readouterr().err.startswith("error: command line: print_config expects true or false, got 'maybe'")


def test_make_plan_stops_at_a_config_error_with_one_line_and_exit_2(monkeypatch, tmp_path, capsys):
    from stages import plan

    runs = f"runs_root={tmp_path / 'runs'}"
    for args, expected in (
        ([runs, "plan.gpu=B200"], "error: command line: plan.gpu must be one of A100-40GB, A100-80GB, H100-80GB, "),
        ([runs, "mcts.kk=3"], "error: command line: unknown key 'mcts.kk'"),
        (["--config", str(tmp_path / "nope.yaml")], f"error: {tmp_path / 'nope.yaml'}: config file not found"),
    ):
        assert run_cli(monkeypatch, plan.run, *args) == 2, args
        captured = capsys.readouterr()
        error = captured.err.splitlines()
        assert error[0].startswith(expected) and len(error) == 2 and error[1].startswith("hint: python -m stages.plan")
        assert captured.out == ""  # no report
    # a config that plans, with errors in its report: the report and exit 1
    assert run_cli(monkeypatch, plan.run, runs, "prm.batch_size=10", "prm.micro_batch_size=4") == 1
    captured = capsys.readouterr()
    assert "ERROR: prm.batch_size: " in captured.out and captured.err == ""
    monkeypatch.setattr(sys, "argv", ["stages/plan.py", runs])
    cli(plan.run)  # no error: cli returns, the process exits 0
    assert not (tmp_path / "runs").exists()
    # what `make plan` runs: the module's entry point goes through the same wrapper
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    process = subprocess.run(
        [sys.executable, "-m", "stages.plan", runs, "plan.gpu=B200"],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert process.returncode == 2 and process.stdout == "", process.stderr[-2000:]
    assert process.stderr.splitlines()[0].startswith("error: command line: plan.gpu must be one of A100-40GB")
    assert len(process.stderr.splitlines()) == 2


def test_an_unknown_eval_benchmark_is_refused_before_the_embedder_loads_and_anything_is_written(
    monkeypatch, tmp_path, capsys
):
    forbid_model_loads(monkeypatch)

    def embedder(*args, **kwargs):
        raise AssertionError("the embedder was loaded before the benchmarks were checked")

    monkeypatch.setattr(evaluate, "load_embedder", embedder)
    monkeypatch.chdir(tmp_path)  # reports/ would go here
    runs = tmp_path / "elsewhere" / "runs"
    tiny = ["--config", str(REPO / "configs" / "tiny.yaml"), f"runs_root={runs}"]
    assert run_cli(monkeypatch, evaluate.main, *tiny, "eval.benchmarks=[gsm8k, nope]") == 2
    error = capsys.readouterr().err.splitlines()
    assert error[0].startswith("error: eval.benchmarks[1]: unknown benchmark 'nope'; expected one of ")
    assert "gsm8k" in error[0] and "tiny_test" in error[0] and "Traceback" not in "\n".join(error)
    missing = tmp_path / "missing.jsonl"
    benchmark = ["eval.benchmarks=[gsm8k]", f"eval.benchmark_paths={{gsm8k: {missing}}}"]
    assert run_cli(monkeypatch, evaluate.main, *tiny, *benchmark) == 2
    assert capsys.readouterr().err.splitlines() == [
        f"error: benchmark 'gsm8k': file {missing} not found "
        "(eval.benchmark_paths.gsm8k, or the stage that writes it has not run)"
    ]
    assert list(tmp_path.iterdir()) == []  # no reports/ here, no run folder under the absolute runs_root


def run_offline(tmp_path, stage: str, *overrides: str) -> subprocess.CompletedProcess:
    """python -m stages.<stage> on the tiny config with the hub off (HF_HUB_OFFLINE=1: fails at once, no network)."""
    env = {**os.environ, "PYTHONPATH": str(REPO), "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"}
    env["HF_HOME"] = str(tmp_path / "hf_home")  # an empty cache: nothing of the hub is here
    command = [sys.executable, "-m", f"stages.{stage}", f"runs_root={tmp_path / 'runs'}", "data.disjoint_from=[]"]
    return subprocess.run([*command, *overrides], cwd=REPO, env=env, capture_output=True, text=True, timeout=300)


def test_an_unreachable_hub_model_or_dataset_is_one_line_naming_it_the_key_and_what_to_do(tmp_path):
    problems = tmp_path / "problems.jsonl"
    problems.write_text('{"problem_id": "p0", "question": "1 + 1?", "answer": "2", "source": "tiny", "meta": {}}\n')
    model = run_offline(tmp_path, "mcts", "model.policy=stepflow-tests/no-such-model", f"data.train_path={problems}")
    assert model.returncode == 2 and "Traceback" not in model.stderr, model.stderr[-3000:]
    error = [line for line in model.stderr.splitlines() if line.startswith("error:")]
    assert len(error) == 1 and error[0].startswith(
        "error: model.policy: hub model stepflow-tests/no-such-model cannot be loaded ("
    ), model.stderr[-3000:]
    assert "HF_HUB_OFFLINE=1" in error[0] and "set model.policy to a local folder" in error[0]
    data = run_offline(tmp_path, "mcts", "data.train=gsm8k", "data.train_path=hub")
    assert data.returncode == 2 and "Traceback" not in data.stderr, data.stderr[-3000:]
    error = [line for line in data.stderr.splitlines() if line.startswith("error:")]
    assert len(error) == 1 and error[0].startswith("error: data.train=gsm8k: hub dataset hf://openai/gsm8k"), error
    assert "set data.train_path to a local file" in error[0]


@pytest.mark.parametrize(
    "stage, args, first_words",
    [
        ("mcts", [], "error: benchmark file not found: "),
        ("augment", [], "error: missing input "),
        ("train_prm", [], "error: missing input "),
        ("train_prm", ["prm.eval_only=true"], "error: missing input "),
        ("train_gfn", [], "error: missing input "),
        ("train_ppo", [], "error: missing input "),
        ("search", [], "error: missing input "),
        ("search", ["search.benchmark=nope"], "error: search.benchmark: unknown benchmark 'nope'; expected one of "),
        ("export_trl", [], "error: missing input "),
        ("prm_bench", [], "error: missing input "),
        ("rollout_temperature", [], "error: benchmark file not found: "),
        ("mc_audit", [], "error: benchmark file not found: "),
        ("evaluate", ["eval.benchmarks=[nope]"], "error: eval.benchmarks[0]: unknown benchmark 'nope'"),
    ],
)
def test_a_stage_whose_inputs_are_missing_stops_in_one_line_and_creates_no_folder(
    monkeypatch, tmp_path, capsys, stage, args, first_words
):
    """Every stage checks its inputs before it makes runs/<run>/<stage>/ (or reports/<run>/): a run
    started too early, or with a wrong name, leaves nothing behind to mistake for a partial run."""
    import importlib

    monkeypatch.chdir(tmp_path)  # reports/ would go here
    main = importlib.import_module(f"stages.{stage}").main
    runs = ["--config", str(REPO / "configs" / "tiny.yaml"), f"runs_root={tmp_path / 'runs'}", "run=early"]
    assert run_cli(monkeypatch, main, *runs, *args) == 2
    error = capsys.readouterr().err.splitlines()
    assert error[0].startswith(first_words), error
    assert "Traceback" not in "\n".join(error)
    assert sorted(path.name for path in tmp_path.iterdir()) == []  # no runs/, no reports/


def save_tokenizer_without_digits(texts, folder: Path, special_tokens: dict[str, str]) -> None:
    """A character-level BPE of ``texts`` with the digits taken out (what it meets outside its vocabulary
    is <unk>), saved alone in ``folder``; ``special_tokens``: which of pad, eos, unk it declares."""
    from tokenizers import Tokenizer, decoders, models, trainers
    from transformers import PreTrainedTokenizerFast

    backend = Tokenizer(models.BPE(unk_token="<unk>"))
    backend.decoder = decoders.Fuse()
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=["<pad>", "</s>", "<unk>"], show_progress=False)
    backend.train_from_iterator([text.translate(str.maketrans("", "", "0123456789")) for text in texts], trainer)
    PreTrainedTokenizerFast(tokenizer_object=backend, **special_tokens).save_pretrained(folder)


def test_a_prm_whose_tokenizer_cannot_encode_the_policys_text_is_refused_naming_its_key(monkeypatch, tmp_path, capsys):
    """The PRM re-encodes the policy's text with its own tokenizer: a local PRM (or backbone) whose
    tokenizer reads the tiny world's digits as <unk>, or that cannot pad, is refused before any model
    loads, naming the key; the tiny world's own tokenizer (and a hub id, not looked up) pass."""
    from pipeline.config.loader import ConfigError
    from pipeline.config.schema import FormatConfig, TinyWorldConfig
    from pipeline.datasets.problems import write_problems_jsonl
    from pipeline.tinyworld.problems import generate_splits
    from pipeline.tinyworld.tokenizer import tokenizer_corpus, train_tokenizer
    from stages.startup_checks import check_prm_tokenizers

    problems = generate_splits(TinyWorldConfig(n_train=30, n_val=2, n_test=2))["train"]
    write_problems_jsonl(problems, tmp_path / "problems.jsonl")
    corpus = tokenizer_corpus(problems, FormatConfig(use_chat_template=False))
    train_tokenizer(corpus, 512).save_pretrained(tmp_path / "tiny")
    save_tokenizer_without_digits(corpus, tmp_path / "no-digits", {"pad_token": "<pad>", "unk_token": "<unk>"})
    save_tokenizer_without_digits(corpus, tmp_path / "no-pad", {"unk_token": "<unk>"})

    def config(*overrides):
        base = [f"runs_root={tmp_path / 'runs'}", f"data.train_path={tmp_path / 'problems.jsonl'}"]
        return load_config(REPO / "configs" / "tiny.yaml", [*base, *overrides])

    tiny, no_digits, no_pad = (str(tmp_path / name) for name in ("tiny", "no-digits", "no-pad"))
    for stage in ("train_prm", "search", "train_gfn", "train_ppo", "prm_bench"):
        check_prm_tokenizers(config(f"model.prm_backbone={tiny}", f"model.prm={tiny}"), stage)
    check_prm_tokenizers(config("model.prm_backbone=Qwen/Qwen2.5-Math-7B"), "train_prm")  # a hub id: not looked up
    check_prm_tokenizers(config(f"model.policy={no_digits}"), "mcts")  # the policy is not re-encoded by a PRM
    cases = [
        ("train_prm", "model.prm_backbone", no_digits, [], r"decodes '\d+' as '(<unk>)+'"),
        ("train_prm", "model.prm", no_digits, ["prm.eval_only=true"], r"decodes '\d+' as '(<unk>)+'"),
        ("search", "model.prm", no_digits, [], r"decodes '\d+' as '(<unk>)+'"),
        ("evaluate", "eval.prm", no_digits, [], r"decodes '\d+' as '(<unk>)+'"),
        ("train_prm", "model.prm_backbone", no_pad, [], "neither a pad token nor an eos token"),
    ]
    for stage, key, folder, extra, what in cases:
        with pytest.raises(ConfigError, match=rf"^{key}: .*{what}"):
            check_prm_tokenizers(config(f"{key}={folder}", *extra), stage)
    # through the stage: one line naming the key, before any model loads and before anything is written
    forbid_model_loads(monkeypatch)
    runs = ["--config", str(REPO / "configs" / "tiny.yaml"), f"runs_root={tmp_path / 'runs'}"]
    data = f"data.train_path={tmp_path / 'problems.jsonl'}"
    assert run_cli(monkeypatch, train_prm.main, *runs, data, f"model.prm_backbone={no_digits}") == 2
    error = capsys.readouterr().err.splitlines()[0]
    assert (
        error.startswith(f"error: model.prm_backbone: the tokenizer of {no_digits} cannot encode") and "<unk>" in error
    )
    assert not (tmp_path / "runs").exists()
