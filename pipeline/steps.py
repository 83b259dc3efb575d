"""The one step format of the project.

A solution is a list of steps. Its text form is every step followed by the separator
(``"s1\\ns2\\n"`` for the separator ``"\\n"``); empty steps are dropped when splitting. Token
ids are built segment by segment -- the prompt, then each step with its separator, then the
end-of-solution token -- so step boundaries are exact for the policy and the PRM even when a
BPE tokenizer would merge across the separator if the text were tokenized whole.

This is the only module that splits, joins or tokenizes steps, or finds the results a step
writes (the numbers corrupt_step alters and the result_likelihood verifier scores); every stage
calls it.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass, field

_WRITTEN_NUMBER = r"-?\d+(?:\.\d+)?"
# The result of a calculation: the number right after an '=' (an optional '$' between), unless an
# operator follows it ("x = 3 + 1 = 4": 3 starts an expression, 4 is the result)
_RESULT = re.compile(rf"=\s*\$?\s*({_WRITTEN_NUMBER})(?!\.?\d)(?!\s*[-+*/^])")


def split_steps(text: str, separator: str = "\n") -> list[str]:
    """Split a solution's text into steps: split on ``separator``, strip each piece, drop empties."""
    if not separator:
        raise ValueError("step separator must be a non-empty string")
    return [piece.strip() for piece in text.split(separator) if piece.strip()]


def join_steps(steps: Sequence[str], separator: str = "\n") -> str:
    """Text form of a list of steps: each step followed by the separator."""
    return "".join(step + separator for step in steps)


def calculation_result_spans(step: str) -> list[tuple[int, int]]:
    """The (start, end) character span of the result of every calculation a step writes: the
    number right after an '=' (an optional '$' between) that no operator follows, in order.
        "3 + 4 = 7, and 7 * 2 = $14" -> [(8, 9), (24, 26)]
        "x = 3 + 1 = 4."             -> [(12, 13)]
    """
    return [match.span(1) for match in _RESULT.finditer(step)]


def step_result_spans(step: str) -> list[tuple[int, int]]:
    """The results a step writes: its calculations' results, else the last number it writes (a
    stated answer: "The answer is 15" -> [(14, 16)]); [] for a step without a number."""
    spans = calculation_result_spans(step)
    if spans:
        return spans
    numbers = list(re.finditer(_WRITTEN_NUMBER, step))
    return [numbers[-1].span()] if numbers else []


@dataclass
class SegmentedIds:
    """Token ids of prompt + steps (+ end token) with the exact span of every step.

    input_ids:    prompt ids, then each step's ids (separator included), then the end token
    prompt_len:   number of prompt tokens
    step_spans:   [start, end) token index range of each step inside input_ids
    end_position: index of the end-of-solution token, or None when the solution is unfinished
    """

    input_ids: list[int]
    prompt_len: int
    step_spans: list[tuple[int, int]] = field(default_factory=list)
    end_position: int | None = None

    @property
    def num_steps(self) -> int:
        return len(self.step_spans)


def encode_prompt(tokenizer, prompt: str) -> list[int]:
    """Prompt ids that carry the tokenizer's BOS exactly once (when it has one).

    A chat template that writes BOS itself (Llama-3's) renders text that already starts with it;
    adding the tokenizer's special tokens on top would put a second BOS in front, a prompt the
    model never saw in training. So special tokens are added only to text that does not start
    with BOS. With Llama-3's tokenizer and template:
        "<|begin_of_text|><|start_header_id|>user..." -> [<|begin_of_text|>, <|start_header_id|>, ...]
        "Question: ..."                                -> [<|begin_of_text|>, "Question", ...]
    A tokenizer without BOS (Qwen2.5's) encodes either text as it is. Every prompt the policy
    or our PRM sees goes through here: training, scoring, HF and vLLM generation.
    """
    bos = getattr(tokenizer, "bos_token", None)
    writes_bos = bool(bos) and prompt.startswith(bos)
    return list(tokenizer(prompt, add_special_tokens=not writes_bos)["input_ids"])


def encode_step(tokenizer, step: str, separator: str = "\n") -> list[int]:
    """Ids of one step followed by its separator, tokenized on its own (no special tokens)."""
    return list(tokenizer(step + separator, add_special_tokens=False)["input_ids"])


def encode_trajectory(
    tokenizer,
    prompt: str | Sequence[int],
    steps: Sequence[str],
    separator: str = "\n",
    add_end: bool = True,
    prompt_ids: Sequence[int] | None = None,
) -> SegmentedIds:
    """Token ids of a trajectory, built segment by segment, with every step's span.

    ``prompt`` is the prompt text (already built by pipeline.prompts); pass ``prompt_ids`` to
    reuse ids encoded once for many trajectories of the same prompt. ``add_end`` appends the
    tokenizer's end-of-solution token (eos_token_id).
    """
    ids = list(prompt_ids) if prompt_ids is not None else encode_prompt(tokenizer, prompt)
    prompt_len = len(ids)
    spans: list[tuple[int, int]] = []
    for step in steps:
        step_ids = encode_step(tokenizer, step, separator)
        if not step_ids:
            raise ValueError(f"step {step!r} encodes to no tokens")
        spans.append((len(ids), len(ids) + len(step_ids)))
        ids.extend(step_ids)
    end_position = None
    if add_end:
        eos = end_token_id(tokenizer)
        end_position = len(ids)
        ids.append(eos)
    return SegmentedIds(ids, prompt_len, spans, end_position)


def end_token_id(tokenizer) -> int:
    """The end-of-solution token: the tokenizer's eos token."""
    eos = tokenizer.eos_token_id
    if eos is None:
        raise ValueError("the tokenizer has no eos_token_id; the step format needs an end token")
    if isinstance(eos, (list, tuple)):
        eos = eos[0]
    return int(eos)
