"""make bootstrap: the tiny world's problems, tokenizer and from-scratch base policy.

Reads:  nothing (everything is generated from config.tinyworld and config.bootstrap)
Writes: runs/<run>/bootstrap/problems_{train,val,test}.jsonl   (the problems contract)
        runs/<run>/bootstrap/model/        weights (safetensors) + config + tokenizer
        runs/<run>/bootstrap/metrics.json  size, training, and quick checks of the policy
        runs/<run>/bootstrap/config.yaml   the resolved config

The checks reload the saved model through the one generation interface, as every later
stage will: greedy accuracy on held-out test problems, sampled accuracy / pass@k / maj@k at
bootstrap.sample_temperature, how many distinct valid strategies the correct samples use,
the share of sampled steps with an arithmetic slip, and the share of sampled step prefixes
whose Monte Carlo value is strictly between 0 and 1 (room for a PRM to learn something).
A finished bootstrap with the same tinyworld/bootstrap/format settings is not redone.
"""

from __future__ import annotations

import json
import sys
from contextlib import contextmanager
from pathlib import Path

import yaml
from tqdm import tqdm

from pipeline.config import Config
from pipeline.io import write_json_atomic
from stages.common import log, parse_args, set_threads, stage_dir, timed

# The config sections that determine what bootstrap writes.
INPUT_SECTIONS = ("tinyworld", "bootstrap", "format")


def main(argv: list[str] | None = None) -> dict:
    config = parse_args("bootstrap", argv)
    set_threads(config)
    out = config.stage_dir("bootstrap")
    if is_done(out, config):
        log.info("bootstrap: %s already holds a model trained with this config; delete it to retrain", out)
        return json.loads((out / "metrics.json").read_text(encoding="utf-8"))
    out = stage_dir(config, "bootstrap")
    with timed("bootstrap"):
        metrics = bootstrap(config, out)
    write_json_atomic(out / "metrics.json", metrics)
    log.info("bootstrap: %s", {k: v for k, v in metrics.items() if k not in ("examples", "loss_curve")})
    return metrics


def is_done(out: Path, config: Config) -> bool:
    """metrics.json and model/ exist, written with the same input sections of the config."""
    saved = out / "config.yaml"
    if not ((out / "metrics.json").is_file() and (out / "model").is_dir() and saved.is_file()):
        return False
    previous = yaml.safe_load(saved.read_text(encoding="utf-8")) or {}
    current = config.to_dict()
    return all(previous.get(section) == current[section] for section in INPUT_SECTIONS)


def bootstrap(config: Config, out: Path) -> dict:
    """Problems -> tokenizer -> model -> training -> save -> checks. Returns the metrics."""
    from pipeline.generation import build_generator
    from pipeline.problems import write_problems_jsonl
    from pipeline.tinyworld.model import build_model, count_parameters, save_policy, train_policy, training_examples
    from pipeline.tinyworld.problems import generate_splits
    from pipeline.tinyworld.tokenizer import tokenizer_corpus, train_tokenizer

    boot = config.bootstrap
    splits = generate_splits(config.tinyworld)
    for name, problems in splits.items():
        write_problems_jsonl(problems, out / f"problems_{name}.jsonl")
    log.info("bootstrap: %s problems", {name: len(p) for name, p in splits.items()})

    tokenizer = train_tokenizer(tokenizer_corpus(splits["train"], config.format), boot.vocab_size)
    model = build_model(boot, tokenizer, attn_implementation=config.model.attn_implementation or "eager")
    examples = training_examples(splits["train"], tokenizer, config.format, boot.max_position_embeddings)
    log.info("bootstrap: %d parameters, vocabulary %d, %d training examples", count_parameters(model), len(tokenizer), len(examples))

    bar = tqdm(total=int(boot.train_seconds), desc="bootstrap training", unit="s", dynamic_ncols=True)

    def on_step(step: int, loss: float, lr: float, elapsed: float) -> None:
        bar.n = min(int(elapsed), bar.total)
        bar.set_postfix(step=step, loss=f"{loss:.3f}", lr=f"{lr:.1e}", refresh=False)
        bar.refresh()

    with torch_threads(boot.torch_threads):
        stats = train_policy(model, examples, boot, tokenizer.pad_token_id, on_step)
    bar.close()
    model_dir = save_policy(model, tokenizer, out / "model")
    log.info("bootstrap: %d steps (%.2f epochs) in %.0f s, final loss %.3f; saved %s", stats.steps, stats.epochs, stats.seconds, stats.final_loss, model_dir)

    metrics = {
        "parameters": count_parameters(model),
        "vocab_size": len(tokenizer),
        "problems": {name: len(p) for name, p in splits.items()},
        "train_seconds": round(stats.seconds, 1),
        "train_steps": stats.steps,
        "train_epochs": round(stats.epochs, 3),
        "train_tokens_per_second": round(stats.tokens / max(stats.seconds, 1e-9)),
        "final_loss": round(stats.final_loss, 4),
        "loss_curve": [round(x, 4) for x in stats.losses],
    }
    generator = build_generator(config, str(model_dir))  # loaded back exactly as a later stage loads it
    test = splits["test"][: boot.eval_problems]
    metrics.update(policy_checks(generator, test, config))
    return metrics


@contextmanager
def torch_threads(count: int):
    """Run the block with ``count`` torch threads (0: leave them as they are)."""
    import torch

    before = torch.get_num_threads()
    if count > 0:
        torch.set_num_threads(count)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def policy_checks(generator, problems, config: Config) -> dict:
    """Greedy and sampled accuracy, strategy diversity, arithmetic slips and MC-value spread."""
    import time

    from eval.accuracy import ProblemSamples, per_problem_scores
    from pipeline.grading import extract_answer, grade_many, normalize_answer
    from pipeline.rollouts.mcts import make_rollout_fn, mc_value
    from pipeline.prompts import prompt_from_config
    from pipeline.steps import split_steps
    from pipeline.tinyworld.problems import arithmetic_errors, num_strategies, solution_strategy

    boot, sep = config.bootstrap, config.format.separator
    max_new = config.generation.max_new_tokens
    if not problems:
        return {"eval_problems": 0}
    kinds = {p.kind for p in problems}
    if len(kinds) > 1:
        raise ValueError(f"bootstrap checks: the test problems mix answer kinds {sorted(kinds)}")
    kind = kinds.pop()
    prompts = [prompt_from_config(p.question, p.kind, generator.tokenizer, config.format) for p in problems]
    golds = [p.answer for p in problems]
    checks: dict = {"eval_problems": len(problems)}

    start = time.monotonic()
    greedy = [outs[0].text for outs in generator.generate(prompts, n=1, temperature=0.0, max_new_tokens=max_new, seed=boot.seed)]
    greedy_correct = grade_many(greedy, golds, kind)
    checks["greedy_accuracy"] = round(sum(greedy_correct) / max(len(problems), 1), 4)
    checks["greedy_seconds"] = round(time.monotonic() - start, 1)
    log.info("bootstrap: greedy accuracy %.3f on %d test problems", checks["greedy_accuracy"], len(problems))

    k = boot.eval_samples
    start = time.monotonic()
    sampled = generator.generate(prompts, n=k, temperature=boot.sample_temperature, max_new_tokens=max_new, seed=boot.seed + 1)
    texts = [o.text for outs in sampled for o in outs]
    correct = grade_many(texts, [g for g in golds for _ in range(k)], kind)
    per_problem, strategies, steps_total, slips, slip_examples = [], [], 0, 0, []
    for i, problem in enumerate(problems):
        flags = correct[i * k:(i + 1) * k]
        step_lists = [split_steps(o.text, sep) for o in sampled[i]]
        answers = [extract_answer(o.text, kind) for o in sampled[i]]
        per_problem.append(ProblemSamples(problem.problem_id, [bool(f) for f in flags], answers))
        used = {solution_strategy(problem, steps) for steps, ok in zip(step_lists, flags) if ok}
        strategies.append((len(used - {None}), num_strategies(problem)))
        for steps in step_lists:
            steps_total += len(steps)
            wrong = arithmetic_errors(steps)
            slips += len(wrong)
            slip_examples.extend(wrong[: max(0, 5 - len(slip_examples))])
    scores = per_problem_scores(per_problem, key=lambda a: normalize_answer(a, kind))
    checks.update({
        "sample_temperature": boot.sample_temperature,
        "samples_per_problem": k,
        "sampled_accuracy": round(float(scores["pass@1"].mean()), 4),
        f"pass@{k}": round(float(scores["pass@k"].mean()), 4),
        f"maj@{k}": round(float(scores["maj@k"].mean()), 4),
        "finished_share": round(sum(o.finish_reason != "length" for outs in sampled for o in outs) / max(len(texts), 1), 4),
        # distinct valid strategies among a problem's correct samples, over problems with >1 valid strategy
        "mean_correct_strategies_multi": _mean([used for used, total in strategies if total > 1]),
        "mean_valid_strategies": _mean([total for _, total in strategies]),
        "step_arithmetic_error_rate": round(slips / max(steps_total, 1), 4),
        "example_wrong_steps": slip_examples,
        "sampling_seconds": round(time.monotonic() - start, 1),
    })
    log.info("bootstrap: sampled accuracy %.3f, pass@%d %.3f at T=%.2f", checks["sampled_accuracy"], k, checks[f"pass@{k}"], boot.sample_temperature)

    # Monte Carlo values of the step prefixes of the first problems' samples: every prefix that
    # ends before the answer step, deduplicated, with mc_rollouts continuations each.
    start = time.monotonic()
    requests = []
    for i in range(min(boot.mc_problems, len(problems))):
        seen = set()
        for out in sampled[i]:
            steps = split_steps(out.text, sep)
            for depth in range(1, len(steps)):
                prefix = tuple(steps[:depth])
                if prefix not in seen and extract_answer(sep.join(prefix), kind) is None:
                    seen.add(prefix)
                    requests.append((i, prefix))
    mcs: list[float] = []
    if requests and boot.mc_rollouts > 0:
        rollout_fn = make_rollout_fn(
            generator, prompts, golds, kind, k=boot.mc_rollouts, temperature=boot.sample_temperature,
            top_p=config.generation.top_p, max_new_tokens=max_new, separator=sep,
            grade_many=grade_many, extract_answer=extract_answer, seed=boot.seed + 2,
        )
        mcs = [mc_value(rollouts) for rollouts in rollout_fn(requests)]
    between = sum(0 < mc < 1 for mc in mcs)
    checks.update({
        "mc_prefixes": len(mcs),
        "mc_rollouts_per_prefix": boot.mc_rollouts,
        "mc_strictly_between": between,
        "mc_share_strictly_between": round(between / len(mcs), 4) if mcs else None,
        "mc_share_zero": round(sum(mc == 0 for mc in mcs) / len(mcs), 4) if mcs else None,
        "mc_share_one": round(sum(mc == 1 for mc in mcs) / len(mcs), 4) if mcs else None,
        "mc_seconds": round(time.monotonic() - start, 1),
    })
    log.info("bootstrap: %d of %d sampled step prefixes have 0 < MC < 1", between, len(mcs))
    return checks


def _mean(values: list) -> float | None:
    return round(sum(values) / len(values), 3) if values else None


if __name__ == "__main__":
    main(sys.argv[1:])
