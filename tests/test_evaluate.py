"""The evaluation stage on the real benchmark files with canned model outputs of known accuracy."""

from __future__ import annotations

import json
import sys
import weakref
import zlib
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import real_models
import torch

from eval.benchmark_sources import load_eval_benchmark, resolve_benchmark
from eval.comparisons import compare_to_reference, paired_differences
from eval.evaluate import evaluate_model, reports_dir, run_evaluation, sample_shard
from eval.model_specs import missing_model_reason, parse_model_spec
from eval.report import direction, write_report
from eval.sample_metrics import mean_prm_reward, score_samples
from eval.sampling import GREEDY_SAMPLE_IDX, problem_kind
from pipeline.config.loader import load_config
from pipeline.generation.base import Completion
from pipeline.generation.hf import HFGenerator
from pipeline.generation.vllm_backend import VLLMGenerator
from pipeline.prompts import prompt_from_config
from pipeline.records import Problem, Sample
from pipeline.steps import split_steps
from pipeline.storage.files import write_records_atomic
from pipeline.tinyworld import generate_splits

REPO = Path(__file__).resolve().parents[1]
BENCHMARK_FILES = {
    "gsm8k": "gsm8k_test.jsonl",
    "math_level5": "math_test.jsonl",
    "sat_math_32": "sat_math_32.jsonl",
    "agieval_sat_math": "agieval_sat_math.jsonl",
}

# Canned outputs, by problem index % 4: C correct, W one wrong answer (the same in every W of a
# problem, so wrong answers vote together), M malformed (cut off before the answer), E empty.
SAMPLED = ["WWME", "WCWE", "CMCW", "CCCC"]
GREEDY = ["M", "C", "C", "W"]
# Over a multiple of 4 problems, k = 4:
#   pass@1 = mean(0, 1/4, 2/4, 4/4) = 0.4375; pass@4 = 3/4 (one pattern has no C);
#   maj@4 = 2/4 (pattern 1 loses 1 C against 2 W); greedy = 2/4; answered = 12/16 samples.
EXPECTED = {"pass@1": 0.4375, "pass@k": 0.75, "maj@k": 0.5, "greedy_pass@1": 0.5}
WRONG_NUMBER = "987654321"


def canned_text(outcome: str, problem: Problem, kind: str) -> str:
    if outcome == "E":
        return ""
    if outcome == "M":
        return "Let us think about it.\nFirst we look at the numbers.\nThe answer is"
    if kind == "sat":
        letter = (
            problem.answer
            if outcome == "C"
            else next(x for x in sorted(problem.meta["options"]) if x != problem.answer)
        )
        return f"We check each option in turn.\nThe answer is ({letter})"
    answer = problem.answer if outcome == "C" else WRONG_NUMBER
    if kind == "math":
        return f"We simplify the expression.\nThe answer is \\boxed{{{answer}}}"
    return f"We add the amounts.\nThe answer is {answer}"


class CannedGenerator:
    """A Generator whose completions follow SAMPLED / GREEDY by problem index; records its calls."""

    tokenizer = None

    def __init__(self, problems, config, sampled=SAMPLED, greedy=GREEDY, text=canned_text):
        self.by_prompt = {}
        for index, problem in enumerate(problems):
            prompt = prompt_from_config(
                problem.question, problem.kind, None, config.format, problem.meta.get("options")
            )
            self.by_prompt[prompt] = (index, problem)
        assert len(self.by_prompt) == len(problems), "two problems share a prompt"
        self.sampled, self.greedy, self.text = sampled, greedy, text
        self.calls = []

    def generate(self, prompts, n=1, temperature=1.0, top_p=1.0, max_new_tokens=256, stop=None, seed=None):
        self.calls.append({"prompts": len(prompts), "n": n, "temperature": temperature})
        outputs = []
        for prompt in prompts:
            index, problem = self.by_prompt[prompt]
            pattern = (
                self.greedy[index % len(self.greedy)] if temperature == 0 else self.sampled[index % len(self.sampled)]
            )
            assert len(pattern) == n
            texts = [self.text(outcome, problem, problem.kind) for outcome in pattern]
            outputs.append(
                [Completion(t, list(range(len(t))), "length" if "M" == o else "eos") for t, o in zip(texts, pattern)]
            )
        return outputs

    def close(self):
        pass


@pytest.mark.parametrize("name", ["llama3.2-3b.yaml", "llama3.1-8b.yaml"])
def test_paper_configs_read_their_benchmarks_from_the_repository(name, monkeypatch):
    monkeypatch.delenv("STEPFLOW_BENCHMARKS", raising=False)
    monkeypatch.setitem(sys.modules, "datasets", None)  # a reach for the hub would fail to import it
    config = load_config(REPO / "configs" / "paper" / name, ["eval.max_problems=2"])
    for benchmark in [*config.eval.benchmarks, config.search.benchmark, config.data.validation]:
        assert resolve_benchmark(config, benchmark).path is None
        assert len(load_eval_benchmark(config, benchmark)) == 2


def fake_embed(texts):
    """Deterministic 8-d vectors seeded by each text's checksum."""
    rows = [np.random.default_rng(zlib.crc32(t.encode())).standard_normal(8) for t in texts]
    return np.stack(rows) if rows else np.zeros((0, 8))


def make_config(tmp_path, benchmarks_dir, *overrides):
    paths = {name: str(benchmarks_dir / file) for name, file in BENCHMARK_FILES.items()}
    return load_config(
        REPO / "configs" / "tiny.yaml",
        [
            f"runs_root={tmp_path / 'runs'}",
            "run=t",
            "eval.k=4",
            "eval.max_problems=20",
            "eval.bootstrap_resamples=200",
            "eval.target_samples=0",  # tiny.yaml's draw at temperature 1: tested on its own below
            f"eval.benchmark_paths={json.dumps(paths)}",
            *overrides,
        ],
    )


@pytest.mark.parametrize("benchmark", list(BENCHMARK_FILES))
def test_canned_outputs_give_exact_accuracy_on_real_benchmarks(tmp_path, benchmarks_dir, benchmark):
    config = make_config(tmp_path, benchmarks_dir)
    problems = load_eval_benchmark(config, benchmark)
    assert len(problems) == 20
    if benchmark == "math_level5":
        assert all(p.meta["level"] == 5 for p in problems)
    generator = CannedGenerator(problems, config)

    evaluation = evaluate_model(generator, problems, problem_kind, config, model="base", embed=fake_embed)

    # every problem in ONE sampled call with n=k, and ONE greedy call at temperature 0
    assert generator.calls == [{"prompts": 20, "n": 4, "temperature": 0.6}, {"prompts": 20, "n": 1, "temperature": 0.0}]
    accuracy = evaluation.metrics["accuracy"]
    for metric, expected in EXPECTED.items():
        assert accuracy[metric]["mean"] == pytest.approx(expected, abs=1e-12), metric
        assert accuracy[metric]["lo"] <= expected <= accuracy[metric]["hi"]
    assert evaluation.metrics["answered"] == pytest.approx(0.75)
    assert evaluation.metrics["pass@k_curve"]["1"] == pytest.approx(0.4375)
    assert evaluation.metrics["pass@k_curve"]["4"] == pytest.approx(0.75)

    samples = evaluation.samples
    assert len(samples) == 20 * 5
    assert [r.sample_idx for r in samples[:5]] == [GREEDY_SAMPLE_IDX, 0, 1, 2, 3]
    assert {r.model for r in samples} == {"base"}
    first = samples[1]  # problem 0, sample 0: a wrong answer, graded and extracted
    assert first.correct is False and first.final_answer is not None and first.finished is True
    assert first.steps == split_steps(canned_text("W", problems[0], problems[0].kind))
    empty, malformed = samples[4], samples[3]  # problem 0: "WWME"
    assert empty.steps == [] and empty.final_answer is None and empty.correct is False and empty.finished is True
    assert malformed.final_answer is None and malformed.correct is False
    assert malformed.finished is False  # cut off at max_new_tokens (finish_reason "length")
    assert samples[15].problem_id == problems[3].problem_id  # "CCCC", greedy "W"
    assert [r.correct for r in samples[15:20]] == [False, True, True, True, True]


class FixedGenerator:
    """Generation interface returning texts[i] (a list of completions) for the i-th prompt."""

    tokenizer = None

    def __init__(self, texts: dict[int, list[str]]):
        self.texts = texts

    def generate(self, prompts, n=1, temperature=1.0, top_p=1.0, max_new_tokens=256, stop=None, seed=None):
        return [[Completion(t, [], "eos") for t in self.texts[i]] for i in range(len(prompts))]


def test_diversity_metrics_on_hand_made_solutions():
    problems = [Problem(f"tiny-{i}", f"Question {i}?", str(i + 1), "tiny") for i in range(2)]
    texts = {0: ["x\nThe answer is 1", "x\nThe answer is 1"], 1: ["a\nThe answer is 2", "b\nThe answer is 3"]}
    config = load_config(None, ["eval.k=2", "eval.greedy=false", "eval.bootstrap_resamples=100"])

    vocabulary: dict[str, int] = {}

    def one_hot(batch):  # every distinct step its own axis
        rows = np.zeros((len(batch), 16))
        for row, text in enumerate(batch):
            rows[row, vocabulary.setdefault(text, len(vocabulary))] = 1.0
        return rows

    metrics = evaluate_model(FixedGenerator(texts), problems, problem_kind, config, embed=one_hot).metrics
    diversity = metrics["diversity"]
    assert "greedy_pass@1" not in metrics["accuracy"]
    assert diversity["similarity"]["mean"] == pytest.approx(0.5)  # identical pair 1, orthogonal pair 0
    assert diversity["similarity"]["n_scored"] == 2
    assert diversity["vendi"] == pytest.approx(1.5)  # 1 and 2 effective solutions
    assert diversity["distinct_1"] == pytest.approx((5 / 10 + 7 / 10) / 2)
    assert diversity["correct_texts"] == pytest.approx(1.0)
    assert metrics["accuracy"]["pass@1"]["mean"] == pytest.approx(0.75)
    # these records list no valid solutions: their strategies are unknown, not zero
    assert diversity["strategy_entropy"]["mean"] is None and diversity["strategy_entropy"]["per_problem"] == [
        None,
        None,
    ]
    assert diversity["distinct_strategies"] is None and diversity["multi_strategy_problems"] is None


def test_run_evaluation_writes_samples_results_and_report_and_skips_missing_models(tmp_path, benchmarks_dir):
    model_dir = tmp_path / "models" / "base"
    model_dir.mkdir(parents=True)
    (model_dir / "config.json").write_text("{}")
    models = {
        "base": str(model_dir),
        "gfn": str(tmp_path / "models" / "gfn"),
        "ppo": f"{model_dir}::{tmp_path / 'no_adapter'}",
    }
    config = make_config(
        tmp_path,
        benchmarks_dir,
        "eval.benchmarks=[gsm8k, sat_math_32]",
        "eval.max_problems=8",
        f"eval.models={json.dumps(models)}",
    )
    problems = {name: load_eval_benchmark(config, name) for name in ("gsm8k", "sat_math_32")}
    built = []

    def make_generator(path, adapter):
        built.append((path, adapter))
        return CannedGenerator(problems["gsm8k"] + problems["sat_math_32"], config)

    out = tmp_path / "reports"
    half = lambda pairs: [[0.5] * len(steps) for _, steps in pairs]  # a PRM scoring every step 0.5
    results = run_evaluation(config, make_generator, embed=fake_embed, out_dir=out, prm=half)

    assert built == [(str(model_dir), None)]  # one model load for both benchmarks
    assert [s["model"] for s in results["skipped"]] == ["gfn", "ppo"]
    assert "does not exist" in results["skipped"][0]["reason"] and "adapter" in results["skipped"][1]["reason"]
    for bench in ("gsm8k", "sat_math_32"):
        accuracy = results["results"]["base"][bench]["accuracy"]
        assert {m: accuracy[m]["mean"] for m in EXPECTED} == pytest.approx(EXPECTED)
        lines = (out / "samples" / f"base__{bench}.jsonl").read_text().splitlines()
        assert len(lines) == 8 * 5
        assert list(json.loads(lines[0])) == [
            "problem_id",
            "model",
            "sample_idx",
            "steps",
            "final_answer",
            "correct",
            "finished",
        ]
    saved = json.loads((out / "results.json").read_text())
    assert saved["results"]["base"]["gsm8k"]["accuracy"]["pass@1"]["mean"] == pytest.approx(0.4375)

    paths = write_report(saved, out)
    report = paths["report"].read_text()
    assert "| base | gsm8k | 8 | 50.0 [" in report and "| base | sat_math_32 | 8 | 50.0 [" in report
    assert "maj@4" in report and "Table 4" in report
    assert "Mean PRM reward" in report and 0 < results["results"]["base"]["gsm8k"]["prm_reward"]["mean"] < 0.5
    assert "**gfn**" in report and "**ppo**" in report  # skipped models are noted
    for png in ("accuracy.png", "similarity.png"):
        assert (out / png).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"

    # a second run with the same settings re-scores the saved samples without loading the model
    again = run_evaluation(config, make_generator, embed=fake_embed, out_dir=out, prm=half)
    assert len(built) == 1
    assert again["results"] == results["results"]
    # a changed setting (here the temperature) makes the samples stale
    config.eval.temperature = 0.8
    run_evaluation(
        config,
        lambda path, adapter: CannedGenerator(problems["gsm8k"] + problems["sat_math_32"], config),
        embed=fake_embed,
        out_dir=out,
    )
    settings = json.loads((out / "samples" / "base__gsm8k.settings.json").read_text())
    assert settings["temperature"] == 0.8


def test_report_renders_when_every_model_is_skipped(tmp_path, benchmarks_dir):
    config = make_config(
        tmp_path, benchmarks_dir, "eval.benchmarks=[sat_math_32]", f"eval.models={{gfn: {tmp_path / 'nope'}}}"
    )
    results = run_evaluation(
        config, lambda *a: pytest.fail("no model exists"), embed=fake_embed, out_dir=tmp_path / "r"
    )
    paths = write_report(results, tmp_path / "r")
    report = paths["report"].read_text()
    assert "No model was evaluated" in report and "**gfn**" in report
    assert paths["accuracy"].exists() and paths["similarity"].exists()


def test_benchmark_names_resolve_through_a_table(tmp_path):
    config = load_config(None, [f"runs_root={tmp_path}", "run=r", "eval.max_problems=2"])
    test_file = tmp_path / "r" / "bootstrap" / "problems_test.jsonl"
    assert resolve_benchmark(config, "tiny_test") == ("problems", str(test_file))
    assert resolve_benchmark(config, "gsm8k") == ("gsm8k", None)  # the hub copy
    with pytest.raises(FileNotFoundError, match="problems_test.jsonl"):
        load_eval_benchmark(config, "tiny_test")
    test_file.parent.mkdir(parents=True)
    rows = [
        Problem(f"tiny-test-{i}", f"Ann has {i} pens. How many pens does Ann have?", str(i), "tiny").to_json()
        for i in range(3)
    ]
    test_file.write_text("".join(json.dumps(r) + "\n" for r in rows))
    assert [p.problem_id for p in load_eval_benchmark(config, "tiny_test")] == ["tiny-test-0", "tiny-test-1"]
    config.eval.benchmark_paths["math500"] = "{run_dir}/m.jsonl"
    assert resolve_benchmark(config, "math500") == ("math500", str(tmp_path / "r" / "m.jsonl"))


def test_model_specs_hub_ids_local_paths_and_adapters(tmp_path):
    config = load_config(None, [f"runs_root={tmp_path}", "run=r"])
    hub = parse_model_spec(config, "llama", "meta-llama/Llama-3.2-3B-Instruct")
    assert (hub.path, hub.adapter, hub.path_is_local) == ("meta-llama/Llama-3.2-3B-Instruct", None, False)
    assert missing_model_reason(hub) is None  # a hub id is never skipped
    with_adapter = parse_model_spec(config, "gfn", "meta-llama/Llama-3.2-3B-Instruct::{run_dir}/gfn/adapter")
    assert with_adapter.adapter == str(tmp_path / "r" / "gfn" / "adapter")
    assert "adapter path" in missing_model_reason(with_adapter)
    local = parse_model_spec(config, "base", "{run_dir}/bootstrap/model")
    assert local.path == str(tmp_path / "r" / "bootstrap" / "model") and local.path_is_local
    assert "does not exist" in missing_model_reason(local)
    (tmp_path / "r" / "bootstrap" / "model").mkdir(parents=True)
    assert missing_model_reason(local) is None
    with pytest.raises(ValueError, match="eval.models.bad"):
        parse_model_spec(config, "bad", "::adapter")


@pytest.mark.slow
def test_stage_cli_with_the_real_embedder(tmp_path, benchmarks_dir, monkeypatch):
    import stages.evaluate

    model_dir = tmp_path / "model"
    model_dir.mkdir()
    argv = [
        "--config",
        str(REPO / "configs" / "tiny.yaml"),
        "run=cli",
        "eval.k=4",
        "eval.max_problems=4",
        "eval.target_samples=0",
        "eval.benchmarks=[sat_math_32]",
        f"eval.benchmark_paths={{sat_math_32: {benchmarks_dir / 'sat_math_32.jsonl'}}}",
        f"eval.models={{base: {model_dir}, ppo: {tmp_path / 'ppo'}}}",
        "eval.bootstrap_resamples=100",
    ]
    config = load_config(REPO / "configs" / "tiny.yaml", argv[2:])
    problems = load_eval_benchmark(config, "sat_math_32")
    monkeypatch.setattr(
        stages.evaluate, "build_generator", lambda cfg, model_path, adapter, progress: CannedGenerator(problems, cfg)
    )
    monkeypatch.chdir(tmp_path)

    results = stages.evaluate.main(argv)

    out = tmp_path / reports_dir(config)
    assert out == tmp_path / "reports" / "cli"
    for name in (
        "results.json",
        "report.md",
        "accuracy.png",
        "similarity.png",
        "config.yaml",
        "samples/base__sat_math_32.jsonl",
    ):
        assert (out / name).exists(), name
    similarity = results["results"]["base"]["sat_math_32"]["diversity"]["similarity"]
    assert 0.0 < similarity["mean"] <= 1.0  # real MiniLM cosines of the canned solutions
    assert results["results"]["base"]["sat_math_32"]["accuracy"]["pass@1"]["mean"] == pytest.approx(0.4375)


def _records(model: str, problems, greedy: list[bool], sampled: list[list[bool]]) -> list[Sample]:
    rows = []
    for problem, g, flags in zip(problems, greedy, sampled):
        for idx, ok in [(GREEDY_SAMPLE_IDX, g)] + list(enumerate(flags)):
            answer = problem.answer if ok else "999"
            rows.append(Sample(problem.problem_id, model, idx, [f"The answer is {answer}"], answer, ok))
    return rows


def test_paired_differences_are_per_problem_and_name_clear_changes_only():
    problems = [Problem(f"q{i}", f"question {i}", str(i), "gsm8k", {}) for i in range(4)]
    base = _records(
        "base", problems, [True, False, False, False], [[True, False], [False, False], [True, False], [False, False]]
    )
    better = _records(
        "gfn", problems, [True, True, True, True], [[True, True], [True, False], [True, True], [True, False]]
    )
    diffs = paired_differences(base, better, problems, n_resamples=500)
    # hand values: greedy +3/4; pass@1 per problem +0.5, +0.5, +0.5, +0.5; maj@2 (ties go to the first
    # sample) +0, +1, +0, +1 over 4; pass@2 +0, +1, +0, +1 over 4
    assert diffs["greedy_pass@1"]["mean"] == pytest.approx(0.75)
    assert diffs["pass@1"] == pytest.approx({"mean": 0.5, "lo": 0.5, "hi": 0.5})
    assert diffs["maj@k"]["mean"] == pytest.approx(0.5) and diffs["pass@k"]["mean"] == pytest.approx(0.5)
    assert direction(diffs["pass@1"]) == "higher" and direction(diffs["pass@k"]) == "no clear change"
    same = paired_differences(base, base, problems, n_resamples=50)
    assert all(d == {"mean": 0.0, "lo": 0.0, "hi": 0.0} for d in same.values())
    assert direction(paired_differences(better, base, problems, n_resamples=500)["pass@1"]) == "lower"


def test_mean_prm_reward_is_the_product_of_step_scores_averaged_per_problem():
    problems = [Problem(f"tiny-{i}", f"Question {i}?", str(i + 1), "tiny") for i in range(2)]
    texts = {0: ["x\ny\nThe answer is 1", "x\nThe answer is 1"], 1: ["a\nThe answer is 2", ""]}
    config = load_config(None, ["eval.k=2", "eval.greedy=false", "eval.bootstrap_resamples=100"])

    seen = []

    def prm(pairs):  # U = 0.5 for a step "x", 0.8 otherwise
        seen.extend(pairs)
        return [[0.5 if step == "x" else 0.8 for step in steps] for _, steps in pairs]

    records = evaluate_model(FixedGenerator(texts), problems, problem_kind, config).samples
    reward = score_samples(records, problems, problem_kind, config, prm=prm)["prm_reward"]
    # problem 0: (0.5*0.8*0.8 + 0.5*0.8) / 2 = 0.36; problem 1: (0.8*0.8 + 0 for the empty one) / 2 = 0.32
    assert reward["mean"] == pytest.approx((0.36 + 0.32) / 2)
    assert reward["lo"] <= reward["mean"] <= reward["hi"]
    assert all(steps for _, steps in seen) and seen[0][0] == "Question 0?"  # empty solutions are not scored
    assert "prm_reward" not in score_samples(records, problems, problem_kind, config)
    # problem 1 is the only one with a right and a wrong sample, and R ranks them right
    assert reward["n_mixed"] == 1 and reward["within_problem_auc"] == 1.0
    assert reward["reweighted_reward"] == pytest.approx(((0.32**2 + 0.4**2) / 0.72 + 0.64) / 2)


def test_configured_pairs_compare_strategy_entropy_and_similarity_problem_by_problem():
    from eval.report import render_markdown

    narrative = [
        "Ann buys 3 * 4 = 12 apples.",
        "Ann has 5 + 12 = 17 apples.",
        "Ann has 17 - 2 = 15 apples.",
        "The answer is 15",
    ]
    reverse = [
        "Ann has 5 - 2 = 3 apples.",
        "Ann buys 3 * 4 = 12 apples.",
        "Ann has 3 + 12 = 15 apples.",
        "The answer is 15",
    ]
    problems = [
        Problem(f"tiny-{i}", f"Question {i}?", "15", "tiny", {"solutions": [narrative, reverse]}) for i in range(3)
    ]
    config = load_config(
        None, ["eval.k=4", "eval.greedy=false", "eval.bootstrap_resamples=200", "eval.pairs=[[gfn, ppo]]"]
    )
    text = "\n".join
    texts = {
        "ppo": {i: [text(narrative)] * 4 for i in range(3)},  # one strategy, identical solutions
        "gfn": {
            i: [text(narrative), text(reverse), text(reverse), text(narrative[:-1] + ["The answer is 16"])]
            for i in range(3)
        },
    }

    def embed(texts):  # one axis per distinct whole text: identical solutions have cosine 1, others 0
        vocabulary = sorted(set(texts))
        return np.array([[1.0 if t == v else 0.0 for v in vocabulary] for t in texts])

    records = {
        m: evaluate_model(FixedGenerator(t), problems, problem_kind, config, model=m).samples for m, t in texts.items()
    }
    metrics = {m: {"tiny": score_samples(r, problems, problem_kind, config, embed=embed)} for m, r in records.items()}
    h = -(np.log2(1 / 3) / 3 + 2 / 3 * np.log2(2 / 3))  # gfn's correct names: 0, 1, 1
    assert metrics["gfn"]["tiny"]["diversity"]["strategy_entropy"]["per_problem"] == [pytest.approx(h)] * 3
    assert metrics["ppo"]["tiny"]["diversity"]["strategy_entropy"]["mean"] == 0.0
    assert metrics["gfn"]["tiny"]["diversity"]["distinct_strategies"] == 2.0
    assert metrics["gfn"]["tiny"]["diversity"]["multi_strategy_problems"] == 3
    comparisons = compare_to_reference(
        {m: {"tiny": r} for m, r in records.items()}, {"tiny": problems}, problem_kind, config, metrics
    )
    pair = comparisons["pairs"]["gfn_vs_ppo"]["tiny"]
    assert pair["strategy_entropy"] == pytest.approx({"mean": h, "lo": h, "hi": h})
    assert pair["similarity"]["hi"] < 0  # gfn's solutions are less alike than ppo's
    assert pair["pass@1"]["mean"] == pytest.approx(-1 / 4)  # and one in four is wrong
    assert "correct_strategies" not in pair
    assert (
        set(comparisons["models"]) == {"gfn"} and comparisons["reference"] == "ppo"
    )  # no "base": the first model is the reference
    settings = {
        "k": 4,
        "greedy": False,
        "temperature": 0.6,
        "top_p": 1.0,
        "max_new_tokens": 160,
        "bootstrap_resamples": 200,
        "seed": 0,
        "embedder": None,
    }
    report = render_markdown(
        {
            "run": "t",
            "settings": settings,
            "benchmarks": {"tiny": {"n_problems": 3, "kinds": ["tiny"], "path": "p"}},
            "skipped": [],
            "results": metrics,
            "comparisons": comparisons,
        }
    )
    assert "strategy entropy (bits)" in report and f"+{h:.3f} [+{h:.3f}, +{h:.3f}] *higher*" in report
    assert (
        "| gfn | tiny | 0.167 [0.167, 0.167] | " in report and "| 3 / 3 |" in report
    )  # similarity (1 pair of 6 alike), problems counted

    # problems that do not know their strategies: no strategy entropy to pair
    plain = [Problem(f"q{i}", f"Question {i}?", "15", "gsm8k", {}) for i in range(3)]
    records = {
        m: evaluate_model(FixedGenerator(t), plain, problem_kind, config, model=m).samples for m, t in texts.items()
    }
    metrics = {m: {"gsm": score_samples(r, plain, problem_kind, config, embed=embed)} for m, r in records.items()}
    comparisons = compare_to_reference(
        {m: {"gsm": r} for m, r in records.items()}, {"gsm": plain}, problem_kind, config, metrics
    )
    assert (
        "strategy_entropy" not in comparisons["pairs"]["gfn_vs_ppo"]["gsm"]
        and "similarity" in comparisons["pairs"]["gfn_vs_ppo"]["gsm"]
    )


def test_paired_prm_reward_difference_against_the_reference_model():
    from eval.report import render_markdown

    problems = [Problem(f"tiny-{i}", f"Question {i}?", "1", "tiny") for i in range(4)]
    config = load_config(None, ["eval.k=2", "eval.greedy=false", "eval.bootstrap_resamples=200"])
    texts = {
        "base": {i: ["x\nThe answer is 1", "x\nx\nThe answer is 1"] for i in range(4)},
        "gfn": {i: ["y\nThe answer is 1", "x\nThe answer is 1"] for i in range(4)},
    }

    def prm(pairs):  # U = 0.5 for a step "x", 0.9 otherwise: gfn's samples score higher everywhere
        return [[0.5 if step == "x" else 0.9 for step in steps] for _, steps in pairs]

    records = {
        m: evaluate_model(FixedGenerator(t), problems, problem_kind, config, model=m).samples for m, t in texts.items()
    }
    metrics = {m: {"tiny": score_samples(r, problems, problem_kind, config, prm=prm)} for m, r in records.items()}
    comparisons = compare_to_reference(
        {m: {"tiny": r} for m, r in records.items()}, {"tiny": problems}, problem_kind, config, metrics
    )
    diff = comparisons["models"]["gfn"]["tiny"]["prm_reward"]
    # base: (0.5*0.9 + 0.5*0.5*0.9) / 2 = 0.3375; gfn: (0.9*0.9 + 0.5*0.9) / 2 = 0.63 on every problem
    assert diff == pytest.approx({"mean": 0.63 - 0.3375, "lo": 0.63 - 0.3375, "hi": 0.63 - 0.3375})
    settings = {
        "k": 2,
        "greedy": False,
        "temperature": 0.6,
        "top_p": 1.0,
        "max_new_tokens": 160,
        "bootstrap_resamples": 200,
        "seed": 0,
        "embedder": None,
        "prm": "prm",
    }
    report = render_markdown(
        {
            "run": "t",
            "settings": settings,
            "benchmarks": {"tiny": {"n_problems": 4, "kinds": ["tiny"], "path": "p"}},
            "skipped": [],
            "results": metrics,
            "comparisons": comparisons,
        }
    )
    assert "mean PRM reward" in report and "+0.2925 [+0.2925, +0.2925] *higher*" in report
    without = compare_to_reference(
        {m: {"tiny": r} for m, r in records.items()}, {"tiny": problems}, problem_kind, config
    )
    assert "prm_reward" not in without["models"]["gfn"]["tiny"]


def test_within_problem_ranking_and_reweighting_against_brute_force():
    rng = np.random.default_rng(0)
    problems = [Problem(f"p{i}", f"Q{i}", "1", "tiny") for i in range(6)]

    def sample(steps, correct):
        return Sample("p", "m", 0, steps, None, correct)

    sampled = {
        p.problem_id: [sample([f"{p.problem_id}-{j}"], bool(rng.random() < 0.5)) for j in range(5)] for p in problems
    }
    sampled["p0"] = [sample(["p0-0"], True)] + [sample([f"p0-{j}"], False) for j in (1, 2)]
    u = {f"{p.problem_id}-{j}": float(rng.choice([0.1, 0.3, 0.3, 0.6])) for p in problems for j in range(5)}
    u.update({"p0-0": 0.1, "p0-1": 0.3, "p0-2": 0.3})  # R ranks p0's one right answer below its wrong ones

    out = mean_prm_reward(sampled, problems, lambda pairs: [[u[s] for s in steps] for _, steps in pairs], 50, 0)
    aucs, accs, rews = [], [], []
    for p in problems:
        rows = sampled[p.problem_id]
        r = [u[row.steps[0]] for row in rows]
        good = [x for x, row in zip(r, rows) if row.correct]
        bad = [x for x, row in zip(r, rows) if not row.correct]
        if good and bad:
            aucs.append(sum((g > b) + 0.5 * (g == b) for g in good for b in bad) / (len(good) * len(bad)))
        accs.append(sum(good) / sum(r))
        rews.append(sum(x * x for x in r) / sum(r))
    assert out["n_mixed"] == len(aucs) and out["within_problem_auc"] == pytest.approx(np.mean(aucs))
    assert out["reweighted_accuracy"] == pytest.approx(np.mean(accs))
    assert out["reweighted_reward"] == pytest.approx(np.mean(rews))
    assert mean_prm_reward(
        {"p0": sampled["p0"]}, problems[:1], lambda pairs: [[u[s] for s in steps] for _, steps in pairs], 50, 0
    )["reweighted_accuracy"] == pytest.approx(0.1 / 0.7)


# The memory a vLLM engine holds lives in its worker processes (weights, KV cache): dropping the
# LLM object does not hand it back, only a shutdown does. Keyed by engine.
WORKER_MEMORY: dict[int, torch.Tensor] = {}


class EngineWithWorkers:
    """Shaped like vllm.LLM: holds WORKER_MEMORY until shutdown(); answers every prompt alike."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        WORKER_MEMORY[id(self)] = torch.zeros(1 << 18)  # 1 MiB

    def get_tokenizer(self):
        return self.tokenizer

    def generate(self, prompts, sampling_params, use_tqdm=False, lora_request=None):
        out = lambda j: SimpleNamespace(
            index=j, text="The answer is 1", token_ids=(1,), finish_reason="stop", stop_reason=None
        )
        return [SimpleNamespace(outputs=[out(j) for j in range(params.n)]) for params in sampling_params]

    def shutdown(self):
        WORKER_MEMORY.pop(id(self))


def test_every_engine_an_evaluation_starts_is_shut_down_before_the_next_loads(tmp_path, benchmarks_dir):
    models = {}
    for name in ("base", "ppo", "gfn"):
        (tmp_path / name).mkdir()
        models[name] = str(tmp_path / name)
    config = make_config(
        tmp_path,
        benchmarks_dir,
        "eval.benchmarks=[gsm8k]",
        "eval.max_problems=2",
        "eval.k=2",
        f"eval.models={json.dumps(models)}",
    )
    tokenizer = real_models.llama3_tokenizer(real_models.corpus())
    held_at_start = []

    def make_generator(path, adapter):
        held_at_start.append(sum(t.numel() * t.element_size() for t in WORKER_MEMORY.values()))
        return VLLMGenerator(path, config, engine=EngineWithWorkers(tokenizer), sampling_params_cls=SimpleNamespace)

    results = run_evaluation(config, make_generator, embed=fake_embed, out_dir=tmp_path / "reports")
    assert list(results["results"]) == ["base", "ppo", "gfn"]
    assert (
        held_at_start == [0, 0, 0] and not WORKER_MEMORY
    )  # each engine's memory back before the next starts, the last's too


def test_a_closed_hf_generator_lets_its_model_go():
    tokenizer = real_models.llama3_tokenizer(real_models.corpus())
    tokenizer.pad_token = tokenizer.eos_token
    model = real_models.llama3_model(tokenizer)
    alive = weakref.ref(model)
    generator = HFGenerator(model, tokenizer)
    del model
    generator.close()
    generator.close()  # twice is fine
    assert alive() is None


def test_the_draw_at_temperature_1_measures_every_model_against_the_target_on_the_tiny_world(tmp_path):
    problems = generate_splits(load_config(REPO / "configs" / "tiny.yaml").tinyworld)["test"][:8]
    test_file = tmp_path / "problems_test.jsonl"
    write_records_atomic(test_file, problems)
    model_dir = tmp_path / "models" / "base"
    model_dir.mkdir(parents=True)
    (model_dir / "config.json").write_text("{}")
    config = load_config(
        REPO / "configs" / "tiny.yaml",
        [
            f"runs_root={tmp_path / 'runs'}",
            "run=t",
            "eval.k=4",
            "eval.entropy_samples=2",
            "eval.pass_at_k_max=5",
            "eval.target_samples=6",
            "eval.target_problems=8",
            "eval.bootstrap_resamples=50",
            "gfn.reward_temperature=0.25",  # a sharp target, so its length effect is plain on 8 problems
            f"eval.benchmark_paths={json.dumps({'tiny_test': str(test_file)})}",
            f"eval.models={json.dumps({'base': str(model_dir), 'gfn': f'{model_dir}/.'})}",
        ],
    )
    separator = config.format.separator
    by_prompt = {prompt_from_config(p.question, p.kind, None, config.format): p for p in problems}

    class ValidSolutions:  # the base cycles through a problem's valid solutions, "gfn" writes its shortest
        tokenizer = None

        def __init__(self, shortest):
            self.shortest, self.temperatures = shortest, []

        def generate(self, prompts, n=1, temperature=1.0, top_p=1.0, max_new_tokens=256, stop=None, seed=None):
            self.temperatures.append((n, temperature))
            out = []
            for prompt in prompts:
                solutions = by_prompt[prompt].meta["solutions"]
                picks = (
                    [min(solutions, key=len)] * n
                    if self.shortest
                    else [solutions[j % len(solutions)] for j in range(n)]
                )
                out.append([Completion(separator.join(s), [0], "eos") for s in picks])
            return out

        def close(self):
            pass

    generators = {}

    def make_generator(path, adapter):
        generators[path] = ValidSolutions(shortest=path.endswith("."))
        return generators[path]

    half = lambda pairs: [[0.5] * len(steps) for _, steps in pairs]  # a shorter solution has the higher L
    results = run_evaluation(config, make_generator, out_dir=tmp_path / "reports", prm=half)

    assert (6, 1.0) in generators[str(model_dir)].temperatures  # the draw: target_samples at temperature 1
    drawn = results["temperature_1"]["base"]["tiny_test"]
    assert drawn["k"] == 6 and len(drawn["pass@k_all"]) == 5 and drawn["pass@k_all"] == pytest.approx([1.0] * 5)
    equal = results["results"]["base"]["tiny_test"]["diversity"]["strategy_entropy_equal_count"]
    assert equal["m"] == 2 and equal["entropy"]["n_scored"] > 0 and equal["accuracy"] == pytest.approx(1.0)
    target = results["target"]["tiny_test"]
    assert target["reference"] == "base" and target["effective_samples"]["min"] >= 1.0
    assert target["reference_prior_coef"] == config.gfn.reference_prior_coef == 1.0
    assert set(target["families"]) == {p.meta["family"] for p in problems}
    # the length effect: under the target (R^(1/0.25) of 0.5 per step), containers_first, one step
    # shorter than running_total, takes a larger share of its family than among the base's right samples
    family = target["families"].index("shared_containers")
    strategy = target["strategies"].index("containers_first")
    effect = target["length_effect"]
    assert effect["target"][family][strategy] > effect["base_correct"][family][strategy] + 0.2
    for model in ("base", "gfn"):
        compared = target["models"][model]
        assert (
            compared["share_distance"]["lo"]
            <= compared["share_distance"]["estimate"]
            <= compared["share_distance"]["hi"]
        )
        assert compared["log_likelihood"]["target"] == pytest.approx(
            target["models"]["base"]["log_likelihood"]["target"]
        )
    # the base's own samples are longer on average than the target's: its mean log L is below it
    assert target["models"]["base"]["log_likelihood"]["difference"] < 0
    assert json.loads((tmp_path / "reports" / "results.json").read_text())["target"]["tiny_test"]["strategies"]
    report = write_report(results, tmp_path / "reports")["report"].read_text()
    assert "## The GFlowNet's target" in report and "effective samples per question" in report
    assert "| gfn | " in report.split("## The GFlowNet's target")[1]
    # a worker of stages.launch eval samples the draw at temperature 1 as its own pair
    shares = sample_shard(config, make_generator, tmp_path / "worker")
    assert shares == {name: {"tiny_test": 8, "tiny_test.temperature_1": 8} for name in ("base", "gfn")}


def test_eval_curves_score_every_snapshot_and_compare_diversity_at_matched_log_likelihood(tmp_path):
    """eval.curves: each named model's snapshots are evaluated as <name>@<step> beside it (never
    against the base in "comparisons", never in the draw at temperature 1), and results.json's
    "curves" holds each checkpoint's mean log L (by hand from the PRM's scores) and equal-count
    strategy entropy, with the matched comparison of the eval.pairs pair."""
    import math

    from eval.evaluate import curve_models

    problems = generate_splits(load_config(REPO / "configs" / "tiny.yaml").tinyworld)["test"][:8]
    test_file = tmp_path / "problems_test.jsonl"
    write_records_atomic(test_file, problems)
    folders = {}
    for name in ("base", "gfn", "ppo"):
        model = tmp_path / "runs" / name / "model"
        model.mkdir(parents=True)
        (model / "config.json").write_text("{}")
        folders[name] = model
    for name, steps in (("gfn", (2, 4)), ("ppo", (2, 4))):
        for step in steps:
            snapshot = folders[name].parent / "snapshots" / f"step-{step}"
            snapshot.mkdir(parents=True)
            (snapshot / "config.json").write_text("{}")
    (folders["gfn"].parent / "snapshots" / ".staging-step-6").mkdir()  # an unfinished write: not a snapshot
    (folders["gfn"] / "manifest.json").write_text(json.dumps({"training_steps": 6}))
    # ppo's model records its settings: a snapshot of another training (a retrain that stopped early) is left out
    (folders["ppo"] / "manifest.json").write_text(json.dumps({"settings": {"lr": 1}}))
    for step, lr in ((2, 1), (4, 2)):
        (folders["ppo"].parent / "snapshots" / f"step-{step}" / "manifest.json").write_text(
            json.dumps({"training_steps": step, "settings": {"lr": lr}})
        )
    config = load_config(
        REPO / "configs" / "tiny.yaml",
        [
            f"runs_root={tmp_path / 'runs'}",
            "run=t",
            "eval.k=4",
            "eval.entropy_samples=2",
            "eval.bootstrap_resamples=50",
            "eval.curves=[gfn, ppo, absent]",
            f"eval.benchmark_paths={json.dumps({'tiny_test': str(test_file)})}",
            f"eval.models={json.dumps({name: str(path) for name, path in folders.items()})}",
        ],
    )
    assert [label for label, _ in curve_models(config)] == ["gfn@2", "gfn@4", "ppo@2"]
    separator = config.format.separator
    by_prompt = {prompt_from_config(p.question, p.kind, None, config.format): p for p in problems}

    class Solutions:  # a model writes its problem's valid solutions in turn, from an offset of its own
        tokenizer = None

        def __init__(self, offset):
            self.offset = offset

        def generate(self, prompts, n=1, temperature=1.0, top_p=1.0, max_new_tokens=256, stop=None, seed=None):
            out = []
            for prompt in prompts:
                solutions = by_prompt[prompt].meta["solutions"]
                picks = [solutions[(self.offset + j) % len(solutions)] for j in range(n)]
                out.append([Completion(separator.join(s), [0], "eos") for s in picks])
            return out

        def close(self):
            pass

    offsets = {}

    def make_generator(path, adapter):
        offsets[path] = len(offsets)
        return Solutions(offsets[path])

    score = lambda pairs: [[0.5] * len(steps) for _, steps in pairs]  # log L = n log 0.5 for an n-step answer
    results = run_evaluation(config, make_generator, out_dir=tmp_path / "reports", prm=score)
    assert set(results["results"]) == {"base", "gfn", "ppo", "gfn@2", "gfn@4", "ppo@2"}
    assert set(results["comparisons"]["models"]) == {"gfn", "ppo"}  # snapshots are not compared with the base
    curves = results["curves"]["tiny_test"]
    assert [(c["model"], c["step"]) for c in curves["curves"]["gfn"]] == [
        ("base", 0),
        ("gfn@2", 2),
        ("gfn@4", 4),
        ("gfn", 6),
    ]
    # ppo's model records no training steps: it is placed one after its last snapshot
    assert [(c["model"], c["step"]) for c in curves["curves"]["ppo"]] == [("base", 0), ("ppo@2", 2), ("ppo", 3)]
    for point in curves["curves"]["gfn"]:
        reward = results["results"][point["model"]]["tiny_test"]["prm_reward"]
        per_problem = reward["log_likelihood"]["per_problem"]
        samples = [
            json.loads(line)
            for line in Path(results["results"][point["model"]]["tiny_test"]["samples"]).read_text().splitlines()
        ]
        by_hand = {}
        for row in samples:
            if row["sample_idx"] != GREEDY_SAMPLE_IDX:
                by_hand.setdefault(row["problem_id"], []).append(len(row["steps"]) * math.log(0.5))
        assert per_problem == pytest.approx([float(np.mean(by_hand[p.problem_id])) for p in problems])
        assert point["log_likelihood"] == pytest.approx(float(np.mean(per_problem)))
    matched = curves["matched"]["gfn_vs_ppo"]
    anchor = {"a": "gfn", "b": "ppo"}[matched["anchor"]]  # the one whose log L moved less from the base's
    assert matched["reward"] == pytest.approx(curves["curves"][anchor][-1]["log_likelihood"])
    assert [p[0] for p in matched["curves"]["a"]] == pytest.approx(
        [c["log_likelihood"] for c in curves["curves"]["gfn"]]
    )
    report = write_report(results, tmp_path / "reports")["report"].read_text()
    section = report.split("## Diversity against reward along training (eval.curves)")[1]
    assert "| gfn | tiny_test | gfn@2 (2) |" in section and "- gfn - ppo at matched log L" in section


def test_a_matched_line_says_when_the_curves_do_not_meet():
    from eval.report import matched_line

    assert "not matched: ppo's curve never reaches gfn's final mean log L -3.500" in matched_line(
        "gfn_vs_ppo", {"matched": False, "anchor": "a", "reward": -3.5}
    )
    assert "gfn's curve never reaches ppo's final" in matched_line(
        "gfn_vs_ppo", {"matched": False, "anchor": "b", "reward": -3.5}
    )
    assert "not measured (no PRM)" in matched_line("gfn_vs_ppo", {"note": "no PRM"})
    line = matched_line(
        "gfn_vs_ppo",
        {
            "matched": True,
            "anchor": "b",
            "reward": -3.5,
            "mean": 0.1,
            "lo": 0.02,
            "hi": 0.2,
            "a": 0.6,
            "b": 0.5,
            "resamples": 10,
            "resamples_matched": 9,
        },
    )
    assert "(ppo's final, -3.500, the log L both reach)" in line and "gfn's interpolated" in line
    assert "strategy entropy +0.100 [+0.020, +0.200] bits (gfn 0.600, ppo 0.500" in line and "9 of 10" in line


def test_a_model_name_with_the_snapshot_mark_is_refused_at_config_load():
    from pipeline.config.loader import ConfigError

    with pytest.raises(ConfigError, match=r"eval.models names 'gfn@2': '@' marks a training snapshot"):
        load_config(REPO / "configs" / "tiny.yaml", ['eval.models={"gfn@2": "runs/x/gfn/model"}'])
