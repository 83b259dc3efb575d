"""Hostile input, handled before any real work: text made safe to handle, and extracted answers
refused by cheap checks before sympy sees them (a power tower, a megabyte of digits, deep nesting).

    refusal_reason("9**9**9")       -> "numeric power tower"
    refusal_reason("2^{10}")        -> None
    clean_text("x\ud800y")          -> "x?y"   (a lone surrogate cannot be encoded as UTF-8)
"""

from __future__ import annotations

import re

# Longest extracted answer that is compared at all; MATH answers are well under 200 characters.
MAX_ANSWER_CHARS = 10_000
# Deepest {}/()/[] nesting accepted; MATH-500 answers go no deeper than 4.
MAX_NESTING = 50
# Largest literal exponent (and factorial argument) accepted before sympy would build huge numbers.
MAX_EXPONENT = 10_000

_POWER = re.compile(r"\^|\*\*")
_FACTORIAL_ARGUMENT = re.compile(r"(?<!\d)(\d++)\s*+!")
_EXPONENT_ATOM = re.compile(r"\s*(?:\\[a-zA-Z]+|[\w.]+|.)", re.S)
_HARMLESS_COMMANDS = re.compile(r"\\(?:left|right|frac|cdot|times)\b")
_LETTER = re.compile(r"[a-zA-Z]")
_INTEGER_PART = re.compile(r"(\d+)(?:\.\d*)?")
_EXPONENT_SCAN = 1000  # longest exponent operand examined; keeps the check linear


def refusal_reason(answer: str) -> str | None:
    """Why an extracted answer is refused without asking sympy, or None when it may be parsed.

    Refused: longer than MAX_ANSWER_CHARS; {}/()/[] nested deeper than MAX_NESTING; a power
    whose exponent is numeric and either is itself a power (towers like 9**9**9, 2^{3^{4}},
    10^{10^{10^{10}}}) or holds a literal above MAX_EXPONENT; a factorial of a literal above
    MAX_EXPONENT. Symbolic exponents (e^{x^2}, 2^{n}) are allowed. Linear in the length.
    """
    if len(answer) > MAX_ANSWER_CHARS:
        return f"longer than {MAX_ANSWER_CHARS} characters"
    depth = deepest = 0
    for char in answer:
        if char in "{([":
            depth += 1
            deepest = max(deepest, depth)
        elif char in "})]":
            depth = max(depth - 1, 0)
    if deepest > MAX_NESTING:
        return f"nested deeper than {MAX_NESTING}"
    reason = _power_refusal(answer)
    if reason:
        return reason
    for match in _FACTORIAL_ARGUMENT.finditer(answer):
        if len(match.group(1)) > 6 or int(match.group(1)) > MAX_EXPONENT:
            return f"factorial above {MAX_EXPONENT}"
    return None


def _power_refusal(s: str) -> str | None:
    # Each ^ or ** takes the operand right after it; when another ^/** follows that operand
    # directly, the exponent is the whole rest of the chain (powers group to the right).
    # Walking the operators from the last one back gives every exponent's properties in O(n).
    operators = [(m.start(), m.end()) for m in _POWER.finditer(s)]
    next_is_numeric = False
    next_start = -1
    for _start, end in reversed(operators):
        operand_end = _operand_end(s, end)
        operand = s[end:operand_end]
        chained = s[operand_end:next_start].strip() == "" and next_start >= operand_end
        numeric = not _LETTER.search(_HARMLESS_COMMANDS.sub("", operand)) and (next_is_numeric if chained else True)
        if numeric:
            if chained or _POWER.search(operand):
                return "numeric power tower"
            if any(len(digits) > 6 or int(digits) > MAX_EXPONENT for digits in _INTEGER_PART.findall(operand)):
                return f"exponent above {MAX_EXPONENT}"
        next_is_numeric, next_start = numeric, _start
    return None


def _operand_end(s: str, start: int) -> int:
    """End of the {...} / (...) group or the atom that starts at start (after spaces)."""
    limit = min(len(s), start + _EXPONENT_SCAN)
    end = start
    while end < limit and s[end] == " ":
        end += 1
    if end < limit and s[end] in "{(":
        closer = "}" if s[end] == "{" else ")"
        depth = 0
        while end < limit:
            if s[end] in "{(":
                depth += 1
            elif s[end] in "})":
                depth -= 1
                if depth == 0 and s[end] == closer:
                    return end + 1
            end += 1
        return limit
    atom = _EXPONENT_ATOM.match(s, end, limit)
    return atom.end() if atom else end


def clean_text(text) -> str:
    """A str that encodes as UTF-8: lone surrogates become '?', non-strings are str()-ed."""
    if text is None:
        return ""
    if not isinstance(text, str):
        text = str(text)
    try:
        text.encode("utf-8")
        return text
    except UnicodeEncodeError:
        return text.encode("utf-8", "replace").decode("utf-8")
