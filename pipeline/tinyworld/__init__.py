"""The tiny world: the embedded CPU default of the whole pipeline (docs/tinyworld.md).

- problems:  synthetic multi-step arithmetic word problems in families whose correct solutions
             follow different strategies (``generate_splits``), from ``stories`` (events, stories,
             question text), ``solutions`` (each strategy's solutions) and ``sampling`` (a
             family's stories from the seeded stream)
- checker:   a solution against its problem's valid ones, exactly (``valid_step_orders``,
             ``strategy_names``, ``solution_strategy``, ``strategy_of``, ``first_wrong_step``)
- tokenizer: a byte-level BPE with single-digit numbers, trained locally (``train_tokenizer``)
- model:     a ~1M-parameter Llama-style causal LM trained from scratch on the strategies' templates
             (``build_model``, ``training_examples``, ``train_policy``, ``save_policy``)

``stages.bootstrap`` puts them together (``make bootstrap``). Only the problem generator and
the checker are imported here: the tokenizer and model modules import torch/transformers when asked for.
"""

from pipeline.tinyworld.checker import (
    arithmetic_errors,
    first_wrong_step,
    num_strategies,
    solution_strategy,
    step_equations,
    strategy_names,
    strategy_of,
    strategy_templates,
    valid_step_orders,
)
from pipeline.tinyworld.problems import generate_splits

__all__ = [
    "arithmetic_errors",
    "first_wrong_step",
    "generate_splits",
    "num_strategies",
    "solution_strategy",
    "step_equations",
    "strategy_names",
    "strategy_of",
    "strategy_templates",
    "valid_step_orders",
]
