"""The tiny world's base policy from nothing: problems, tokenizer, model, training (make bootstrap).

``build_base_policy`` writes runs/<run>/bootstrap/problems_{train,val,test,rl}.jsonl (the problems
contract), trains a BPE tokenizer on the training problems, trains a small causal LM from
scratch on their gold solutions (``pipeline.tinyworld.model``, on the training base) and saves
both to bootstrap/model/, loadable like any hub model.
"""

from __future__ import annotations

import logging
from pathlib import Path

from pipeline.datasets.problems import write_problems_jsonl
from pipeline.tinyworld.model import build_model, count_parameters, train_language_model, training_examples
from pipeline.tinyworld.problems import generate_splits
from pipeline.tinyworld.tokenizer import tokenizer_corpus, train_tokenizer
from pipeline.training import Tracking
from pipeline.training.threads import training_threads

log = logging.getLogger("stepflow.bootstrap")


def untrained_policy(config, splits: dict) -> tuple:
    """(tokenizer, model): the tokenizer trained on ``splits["train"]`` and the causal LM of
    config.bootstrap's size at random init, as bootstrap trains it (README's model size is this
    model's count_parameters, checked by a test)."""
    tokenizer = train_tokenizer(tokenizer_corpus(splits["train"], config.format), config.bootstrap.vocab_size)
    return tokenizer, build_model(
        config.bootstrap, tokenizer, attn_implementation=config.model.attn_implementation or "eager"
    )


def build_base_policy(config, out: Path, progress: bool = True, settings: dict | None = None) -> tuple[dict, dict]:
    """Problems -> tokenizer -> model -> training -> bootstrap/model/. Returns (training metrics,
    the problem splits). ``settings``: recorded in the model's manifest (what the model was made with)."""
    boot = config.bootstrap
    tracking = Tracking.from_config(
        config, "bootstrap", out
    )  # a missing tracker package fails before anything is built
    splits = generate_splits(config.tinyworld)
    for name, problems in splits.items():
        write_problems_jsonl(problems, out / f"problems_{name}.jsonl")
    log.info("bootstrap: %s problems", {name: len(p) for name, p in splits.items()})

    tokenizer, model = untrained_policy(config, splits)
    examples = training_examples(
        splits["train"], tokenizer, config.format, boot.max_position_embeddings, boot.every_strategy
    )
    log.info(
        "bootstrap: %d parameters, vocabulary %d, %d training examples",
        count_parameters(model),
        len(tokenizer),
        len(examples),
    )

    with training_threads(boot.torch_threads, "bootstrap"):
        stats = train_language_model(
            model, tokenizer, examples, boot, out, config.model, progress=progress, settings=settings, tracking=tracking
        )
    log.info(
        "bootstrap: %d steps (%.2f epochs) in %.0f s, final loss %.3f; saved %s",
        stats.steps,
        stats.epochs,
        stats.seconds,
        stats.final_loss,
        out / "model",
    )
    metrics = {
        "parameters": count_parameters(model),
        "vocab_size": len(tokenizer),
        "problems": {name: len(p) for name, p in splits.items()},
        "train_seconds": round(stats.seconds, 1),
        "train_steps": stats.steps,
        "train_epochs": round(stats.epochs, 3),
        "train_tokens_per_second": round(stats.tokens / max(stats.seconds, 1e-9)),
        "final_loss": round(stats.final_loss, 4),
        "stopped_by_time": stats.stopped_by_time,
        "loss_curve": [round(x, 4) for x in stats.losses],
    }
    return metrics, splits
