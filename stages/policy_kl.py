"""make policy-kl: each learner's KL to the base policy, from the draws a finished evaluation made.

Reads:  reports/<run>/samples/<model>__<benchmark>.temperature_1.jsonl, every model's draw at
        temperature 1 (make eval with eval.target_samples > 0), and the models of eval.models
Writes: reports/<run>/policy_kl.json ({benchmark: {"reference", "models": {model: {mean, lo, hi,
        n_problems, n_samples} | {"note"}}}}); logs one line per benchmark
Library: eval.policy_kl (KL(pi || pi_ref) = E_pi[log pi - log pi_ref], per problem then over
        problems, a bootstrap over problems). Nothing is sampled: a model without a draw is left out.
"""

from __future__ import annotations

from pathlib import Path

from eval.benchmark_sources import load_eval_benchmark
from eval.evaluate import TARGET_DRAW_SUFFIX, reports_dir
from eval.model_specs import missing_model_reason, parse_model_spec
from eval.policy_kl import kl_line, policy_kls, read_draw
from eval.samples_store import samples_path
from eval.sampling import problem_kind
from pipeline.finetune.policy import LMPolicy
from pipeline.modeling import load_causal_lm, load_tokenizer
from pipeline.storage.files import write_json_atomic
from stages.cli import cli, log, parse_args, set_threads, timed


def main(argv: list[str] | None = None) -> Path:
    config = parse_args("policy_kl", argv)
    set_threads(config, "policy_kl")
    out = reports_dir(config)
    benchmarks = {name: load_eval_benchmark(config, name) for name in config.eval.benchmarks}
    specs = {name: parse_model_spec(config, name, value) for name, value in config.eval.models.items()}
    draws: dict = {}
    for bench in benchmarks:
        for name, spec in specs.items():
            path = samples_path(out, name, f"{bench}{TARGET_DRAW_SUFFIX}")
            if missing_model_reason(spec) is None and path.exists():
                draws.setdefault(bench, {})[name] = read_draw(path)
    if not draws:
        raise SystemExit(
            f"policy_kl: no draw at temperature 1 under {out / 'samples'}: run make eval with eval.target_samples > 0 first"
        )

    def load_policy(name: str) -> LMPolicy:
        spec = specs[name]
        model = load_causal_lm(spec.path, config.model, spec.adapter)
        tokenizer = load_tokenizer(spec.path, config.model.trust_remote_code, check=False, model_config=config.model)
        return LMPolicy(model, tokenizer, config.format.separator, config.generation.max_new_tokens)

    with timed("policy_kl"):
        kls = policy_kls(config, draws, benchmarks, problem_kind, load_policy)
    for bench, block in kls.items():
        log.info("policy_kl: %s", kl_line(bench, block))
    path = out / "policy_kl.json"
    write_json_atomic(path, kls)
    return path


if __name__ == "__main__":
    cli(main)
