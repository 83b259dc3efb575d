"""The tiny world: the embedded CPU default of the whole pipeline (docs/tinyworld.md).

- problems:  synthetic multi-step arithmetic word problems with several valid step orders
             (``generate_splits``, ``valid_step_orders``, ``num_strategies``, ``solution_strategy``)
- tokenizer: a byte-level BPE with single-digit numbers, trained locally (``train_tokenizer``)
- model:     a ~2M-parameter Llama-style causal LM trained from scratch on the gold solutions
             (``build_model``, ``training_examples``, ``train_policy``, ``save_policy``)

``stages.bootstrap`` puts them together (``make bootstrap``). Only the problem generator is
imported here: the tokenizer and model modules import torch/transformers when asked for.
"""

from pipeline.tinyworld.problems import (
    arithmetic_errors,
    generate_splits,
    num_strategies,
    solution_strategy,
    step_equations,
    strategy_of,
    valid_step_orders,
)

__all__ = [
    "arithmetic_errors",
    "generate_splits",
    "num_strategies",
    "solution_strategy",
    "step_equations",
    "strategy_of",
    "valid_step_orders",
]
