"""Step similarity for the similarity-grouped augmentation (paper 3.2).

Two steps are similar when they compute the same thing and say it in nearly the same words:

1. Calculation consistency. ``calculation_results(step)`` reads the results a step computes:
   the value right of the last ``=`` of each equation chain (``2 + 3 = 5 + 1 = 6`` gives 6;
   ``3 * 4 = 12, so 12 + 5 = 17`` gives 12 and 17); a step with no numeric equation gives its
   final number instead. Numbers are parsed exactly with ``fractions.Fraction`` (integers,
   decimals, negatives, thousands commas, ``a/b``, ``25%`` = 1/4, LaTeX ``\\frac{a}{b}``);
   nothing is ever evaluated. When both steps have results and the multisets differ, the
   similarity is 0.
2. Text. Otherwise -- results agree, or at least one step has no number at all -- the
   similarity is ``Levenshtein.ratio`` of the two texts with whitespace collapsed.

The decisions behind each rule are in docs/augmentation.md.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from fractions import Fraction

import Levenshtein

# LaTeX spellings rewritten to plain arithmetic before lexing. Order matters: mixed numbers
# before \frac, and everything that reads a command before the generic command strip.
_LATEX_MIXED = re.compile(r"([0-9]+)\\[dt]?frac\s*\{\s*([0-9]+)\s*\}\s*\{\s*([0-9]+)\s*\}")  # 2\frac{1}{2}
_LATEX_FRAC = re.compile(r"\\[dt]?frac\s*\{([^{}]*)\}\s*\{([^{}]*)\}")
_LATEX_FRAC_SHORT = re.compile(r"\\[dt]?frac\s*([0-9])\s*([0-9])")
_LATEX_THOUSANDS = re.compile(r"(?<=[0-9])(?:\{,\}|\\,)(?=[0-9]{3}(?![0-9]))")  # 1{,}000, 1\,000
_LATEX_OPERATORS = re.compile(r"\\(times|cdot|div)(?![A-Za-z])")
_LATEX_OPERATOR_TEXT = {"times": " * ", "cdot": " * ", "div": " / "}
_LATEX_REPLACEMENTS = (
    ("\\%", "%"),
    ("\\$", " "),
)
# "(3)/(4)", what \frac{3}{4} became, reads as the fraction literal 3/4.
_BRACKETED_FRACTION = re.compile(r"\(\s*(-?[0-9.,]+)\s*\)\s*/\s*\(\s*(-?[0-9.,]+)\s*\)")
_LATEX_COMMAND = re.compile(r"\\[A-Za-z]+|\\.")
_PLAIN_REPLACEMENTS = (
    ("\u2212", "-"),  # unicode minus
    ("\u2013", "-"),
    ("\u00d7", " * "),  # multiplication sign
    ("\u22c5", " * "),
    ("\u00b7", " * "),
    ("\u00f7", " / "),
    ("$", " "),
    ("{", " "),
    ("}", " "),
)

# One token at a time: a number (optionally a fraction literal a/b, optionally a percentage),
# '=', an arithmetic operator, a word, or any other single character.
_NUMBER = r"(?:[0-9]{1,3}(?:,[0-9]{3})+(?![0-9])|[0-9]+)(?:\.[0-9]+)?|\.[0-9]+"
_TOKEN = re.compile(
    rf"(?P<number>(?P<num>{_NUMBER})(?:\s*/\s*(?P<den>{_NUMBER}))?(?P<percent>\s*%)?)"
    r"|(?P<eq>=)"
    r"|(?P<op>[-+*/^()\[\]])"
    r"|(?P<word>[A-Za-z_]+)"
    r"|(?P<space>\s+)"
    r"|(?P<other>.)",
    re.DOTALL,
)
_MAX_NUMERAL_CHARS = 100
# Words that act as operators between numbers ("3 x 4 = 12"), so they do not end an equation.
_OPERATOR_WORDS = frozenset({"x", "X"})

_NUMBER_KIND = "number"
_EQ_KIND = "eq"
_OP_KIND = "op"
_CLOSE_KIND = "close"  # ")" or "]": an operand ends here, so a following "-" is subtraction
_BREAK_KIND = "break"  # words and punctuation end an arithmetic expression


def _mixed_number(match: re.Match) -> str:
    if int(match.group(3)) == 0:
        return match.group(0)
    value = int(match.group(1)) + Fraction(int(match.group(2)), int(match.group(3)))
    return f" {value.numerator}/{value.denominator} "


def _normalise_math(step: str) -> str:
    text = _LATEX_MIXED.sub(_mixed_number, step)
    text = _LATEX_FRAC.sub(r" (\1)/(\2) ", text)
    text = _LATEX_FRAC_SHORT.sub(r" \1/\2 ", text)
    text = _LATEX_THOUSANDS.sub("", text)
    text = _LATEX_OPERATORS.sub(lambda match: _LATEX_OPERATOR_TEXT[match.group(1)], text)
    for old, new in _LATEX_REPLACEMENTS:
        text = text.replace(old, new)
    text = _LATEX_COMMAND.sub(" ", text)
    for old, new in _PLAIN_REPLACEMENTS:
        text = text.replace(old, new)
    return _BRACKETED_FRACTION.sub(r"\1/\2", text)


def _parse_number(literal: str) -> Fraction:
    return Fraction(literal.replace(",", ""))


def _tokens(step: str) -> list[tuple[str, Fraction | None]]:
    """(kind, value) pairs; value is set for numbers only. Signs are folded into numbers."""
    tokens: list[tuple[str, Fraction | None]] = []
    pending_sign = False
    for match in _TOKEN.finditer(_normalise_math(step)):
        group = match.lastgroup
        if group == "space":
            continue
        if group == "number" and len(match.group()) > _MAX_NUMERAL_CHARS:
            group = "other"  # a degenerate run of digits is text, not a result (and int() caps it)
        if group == "number":
            numerator = _parse_number(match.group("num"))
            value = numerator
            if match.group("den") is not None:
                denominator = _parse_number(match.group("den"))
                if denominator != 0:
                    value = numerator / denominator
                else:
                    # "5/0" is no fraction: read it as 5, '/', 0.
                    tokens.append((_NUMBER_KIND, -numerator if pending_sign else numerator))
                    tokens.append((_OP_KIND, None))
                    tokens.append((_NUMBER_KIND, Fraction(0)))
                    pending_sign = False
                    continue
            if match.group("percent") is not None:
                value = value / 100
            tokens.append((_NUMBER_KIND, -value if pending_sign else value))
            pending_sign = False
            continue
        if pending_sign:  # a '-' that was not followed by a number is an operator after all
            tokens.append((_OP_KIND, None))
            pending_sign = False
        if group == "eq":
            tokens.append((_EQ_KIND, None))
        elif group == "op" or (group == "word" and match.group() in _OPERATOR_WORDS):
            text = match.group()
            previous = tokens[-1][0] if tokens else None
            # A '-' before a number is its sign unless it follows an operand ("24 - 6").
            following = match.string[match.end() : match.end() + 8].lstrip()[:1]
            starts_number = text == "-" and following != "" and following in "0123456789."
            if starts_number and previous not in (_NUMBER_KIND, _CLOSE_KIND):
                pending_sign = True
            else:
                tokens.append((_CLOSE_KIND if text in ")]" else _OP_KIND, None))
        else:
            tokens.append((_BREAK_KIND, None))
    if pending_sign:
        tokens.append((_OP_KIND, None))
    return tokens


def _is_arithmetic(kind: str) -> bool:
    return kind in (_NUMBER_KIND, _OP_KIND, _CLOSE_KIND)


def calculation_results(step: str) -> tuple[Fraction, ...]:
    """The results a step computes, in order of appearance, as exact fractions.

    Each equation chain ``a = b = ... = z`` contributes the first number of its last right-hand
    side ``z``; an '=' is part of a chain when only arithmetic (numbers, operators, brackets)
    stands between it and the next '='. A step with no numeric equation contributes its final
    number; a step with no number gives ``()``.
    """
    tokens = _tokens(step)
    results: list[Fraction] = []
    for index, (kind, _) in enumerate(tokens):
        if kind != _EQ_KIND:
            continue
        first_number: Fraction | None = None
        continues_chain = False
        for next_kind, value in tokens[index + 1 :]:
            if next_kind == _EQ_KIND:
                continues_chain = True
                break
            if not _is_arithmetic(next_kind):
                break
            if next_kind == _NUMBER_KIND and first_number is None:
                first_number = value
        if not continues_chain and first_number is not None:
            results.append(first_number)
    if results:
        return tuple(results)
    numbers = [value for kind, value in tokens if kind == _NUMBER_KIND]
    return (numbers[-1],) if numbers else ()


def normalise_step_text(step: str) -> str:
    """The text the Levenshtein ratio compares: whitespace collapsed to single spaces, stripped."""
    return " ".join(step.split())


@dataclass(frozen=True)
class StepSignature:
    """What the similarity needs of a step, computed once per step.

    text:    normalised text (``normalise_step_text``)
    results: sorted calculation results; ``()`` when the step has no number
    """

    text: str
    results: tuple[Fraction, ...]


def step_signature(step: str) -> StepSignature:
    return StepSignature(normalise_step_text(step), tuple(sorted(calculation_results(step))))


def signature_similarity(a: StepSignature, b: StepSignature) -> float:
    """``step_similarity`` on precomputed signatures (what the grouping calls k^2 times)."""
    if a.results and b.results and a.results != b.results:
        return 0.0
    return float(Levenshtein.ratio(a.text, b.text))


def step_similarity(a: str, b: str) -> float:
    """Similarity of two steps in [0, 1] (paper 3.2).

    0.0 when both steps compute results and the multisets of results differ numerically;
    otherwise the Levenshtein ratio of the whitespace-normalised texts.
    """
    return signature_similarity(step_signature(a), step_signature(b))

