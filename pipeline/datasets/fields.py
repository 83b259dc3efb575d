"""The fields of a benchmark record whose text holds structure: the final answer of a MATH
solution (its last box) and of a GSM8K one (after '####'), and SAT's multiple-choice options,
as a list (AGIEval) or as one string (the 32-question set)."""

from __future__ import annotations

import re
from collections.abc import Sequence
from typing import Any

from pipeline.grading import extract_answer
from pipeline.records import RecordError


def math_final_answer(solution: str) -> str | None:
    """The final answer of a MATH reference solution: the content of its last \\boxed{...} (or
    \\fbox{...}), nested braces matched, e.g. ``\\boxed{\\frac{1}{2}}`` -> ``\\frac{1}{2}`` (the grader
    also drops ``$...$`` around it and a trailing period).

    The one grader extracts it (``pipeline.grading.extract_answer``), so a reference answer is
    read exactly as a model's answer is; a solution without a box has no answer (None) rather
    than the grader's "The answer is ..." fallback.
    """
    if "\\boxed" not in solution and "\\fbox" not in solution:
        return None
    return extract_answer(solution, "math")


def gsm8k_final_answer(solution: str) -> str | None:
    """The number after GSM8K's '####' marker, thousands commas removed ('2,125' -> '2125')."""
    if "####" not in solution:
        return None
    answer = solution.rsplit("####", 1)[1].strip().replace(",", "")
    return answer or None


# ----------------------------------------------------------------------------- SAT options

_ITEM_OPTION = re.compile(r"^\s*\(?([A-Z])\s*[).:]\s*(.*)$", re.DOTALL)
_FIRST_MARKER = re.compile(r"^\s*(\()?A([).])")


def parse_options_list(items: Sequence[Any], where: str = "record", field_name: str = "options") -> dict[str, str]:
    """AGIEval's option list ["(A)2", "(B)4", ...] as {"A": "2", "B": "4", ...}."""
    if not isinstance(items, (list, tuple)) or not items:
        raise RecordError(f"{where}: field '{field_name}': expected a non-empty list of '(A)...' strings")
    options: dict[str, str] = {}
    for i, item in enumerate(items):
        expected = chr(ord("A") + i)
        match = _ITEM_OPTION.match(item) if isinstance(item, str) else None
        if match is None or match.group(1) != expected:
            raise RecordError(
                f"{where}: field '{field_name}': item {i} {item!r}: expected it to start with '({expected})'"
            )
        options[expected] = match.group(2).strip()
    return options


def parse_options_string(text: Any, where: str = "record", field_name: str = "options") -> dict[str, str]:
    """One-string options "A) x B) y C) z D) w" (or "A. x B. y ...") as {"A": "x", ...}.

    The marker style is taken from the leading "A)" / "A." / "(A)"; each next letter's marker must
    follow whitespace, and the first such marker after the previous option is the split point,
    so option text such as "data set $B$" (no marker punctuation) stays whole.
    """
    if not isinstance(text, str):
        raise RecordError(f"{where}: field '{field_name}': expected a string, got {type(text).__name__}")
    first = _FIRST_MARKER.match(text)
    if first is None:
        raise RecordError(f"{where}: field '{field_name}': expected it to start with 'A)' or 'A.', got {text[:30]!r}")
    open_paren = r"\(" if first.group(1) else ""
    close = re.escape(first.group(2))
    # "A." style needs whitespace after the marker too ("U.S." or "B.C." must not split).
    after = r"\s+" if first.group(2) == "." else r"\s*"
    letters: list[str] = ["A"]
    starts: list[int] = [first.end()]
    ends: list[int] = []
    position = first.end()
    while True:
        letter = chr(ord(letters[-1]) + 1)
        marker = re.compile(rf"\s{open_paren}{letter}{close}{after}")
        match = marker.search(text, position)
        if match is None:
            break
        ends.append(match.start())
        letters.append(letter)
        starts.append(match.end())
        position = match.end()
    ends.append(len(text))
    if len(letters) < 2:
        raise RecordError(f"{where}: field '{field_name}': expected at least options A and B, found only A")
    return {letter: text[s:e].strip() for letter, s, e in zip(letters, starts, ends)}
