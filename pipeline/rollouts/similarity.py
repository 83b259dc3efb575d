"""Step consistency for the similarity-grouped augmentation (paper 3.2).

Two steps are consistent -- they may share a group, and so a label -- when they compute exactly
the same thing and say it in nearly the same words:

1. Calculation signature. ``calculation_signature(step)`` reads every equation chain of the
   step with all its operands, operators and results in order (``2 + 3 = 5 + 1 = 6`` is one
   chain; ``3 * 4 = 12, so 12 + 5 = 17`` two), the chains as a multiset, plus the numbers
   outside any equation in order, with the operators written between them. A step without
   numbers has the empty signature. Numbers are parsed exactly with ``fractions.Fraction``
   (integers, decimals, negatives, thousands commas, ``25%`` = 1/4, LaTeX ``\\frac{a}{b}``);
   a fraction ``a/b`` is the division it writes, ``a``, ``/``, ``b``; nothing is ever evaluated.
   The signatures must be equal.
2. Text. The ``Levenshtein.ratio`` of the two texts, whitespace collapsed, must reach the
   threshold.

The decisions behind each rule are in docs/augmentation.md.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from fractions import Fraction
from typing import NamedTuple

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

# The operator a token writes, as the signature records it: "x" is times, brackets are round.
_OPERATOR_SPELLING = {"x": "*", "X": "*", "[": "(", "]": ")"}

# One element of a calculation signature: an exact number or an operator ("+", "=", "(", ...).
Element = Fraction | str


class _Token(NamedTuple):
    """kind: number, eq, op, close or break; parts: what it adds to a signature -- a number's
    value, or ``(numerator, "/", denominator)`` for a fraction literal; an operator's spelling."""

    kind: str
    parts: tuple[Element, ...]


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


def _number_parts(match: re.Match, negative: bool) -> tuple[Element, ...]:
    """A number token's signature elements: its exact value, or numerator "/" denominator for a
    fraction literal (never divided, so "6/2" and "9/3" stay apart and "5/0" is harmless)."""
    numerator = _parse_number(match.group("num"))
    if negative:
        numerator = -numerator
    if match.group("den") is None:
        return (numerator / 100 if match.group("percent") else numerator,)
    denominator = _parse_number(match.group("den"))
    return (numerator, "/", denominator * 100 if match.group("percent") else denominator)


def _tokens(step: str) -> list[_Token]:
    """The step's tokens after LaTeX and unicode normalisation. Signs are folded into numbers."""
    tokens: list[_Token] = []
    pending_sign = False
    for match in _TOKEN.finditer(_normalise_math(step)):
        group = match.lastgroup
        if group == "space":
            continue
        if group == "number" and len(match.group()) > _MAX_NUMERAL_CHARS:
            group = "other"  # a degenerate run of digits is text, not a number (and int() caps it)
        if group == "number":
            tokens.append(_Token(_NUMBER_KIND, _number_parts(match, pending_sign)))
            pending_sign = False
            continue
        if pending_sign:  # a '-' that was not followed by a number is an operator after all
            tokens.append(_Token(_OP_KIND, ("-",)))
            pending_sign = False
        if group == "eq":
            tokens.append(_Token(_EQ_KIND, ("=",)))
        elif group == "op" or (group == "word" and match.group() in _OPERATOR_WORDS):
            text = match.group()
            previous = tokens[-1].kind if tokens else None
            # A '-' before a number is its sign unless it follows an operand ("24 - 6").
            following = match.string[match.end() : match.end() + 8].lstrip()[:1]
            starts_number = text == "-" and following != "" and following in "0123456789."
            if starts_number and previous not in (_NUMBER_KIND, _CLOSE_KIND):
                pending_sign = True
            else:
                kind = _CLOSE_KIND if text in ")]" else _OP_KIND
                tokens.append(_Token(kind, (_OPERATOR_SPELLING.get(text, text),)))
        else:
            tokens.append(_Token(_BREAK_KIND, ()))
    if pending_sign:
        tokens.append(_Token(_OP_KIND, ("-",)))
    return tokens


def _arithmetic_runs(tokens: list[_Token]) -> list[list[_Token]]:
    """Maximal runs of arithmetic tokens (numbers, operators, brackets, '='): a word or
    punctuation ends a run."""
    runs: list[list[_Token]] = [[]]
    for token in tokens:
        if token.kind == _BREAK_KIND:
            runs.append([])
        else:
            runs[-1].append(token)
    return [run for run in runs if run]


def _trimmed_elements(run: list[_Token]) -> tuple[Element, ...]:
    """The run's elements without dangling operators: a run starts at a number, '(' or '=' and
    ends at a number, ')' or '=' ("x = 5" -- 'x' read as times -- is "= 5", like "y = 5")."""
    elements = [part for token in run for part in token.parts]
    dangling_at_start = {"+", "-", "*", "/", "^", ")"}
    dangling_at_end = {"+", "-", "*", "/", "^", "("}
    start, end = 0, len(elements)
    while start < end and isinstance(elements[start], str) and elements[start] in dangling_at_start:
        start += 1
    while end > start and isinstance(elements[end - 1], str) and elements[end - 1] in dangling_at_end:
        end -= 1
    return tuple(elements[start:end])


def _chain_order(chain: tuple[Element, ...]) -> tuple[tuple[bool, Element], ...]:
    # Any fixed total order will do; numbers and operators never compare with each other.
    return tuple((isinstance(element, str), element) for element in chain)


@dataclass(frozen=True)
class CalculationSignature:
    """What a step computes, as written (docs/augmentation.md, "The calculation signature").

    equations: every equation chain (a run of arithmetic holding '=' and a number) with all its
               operands, operators and results in order; the chains sorted, so a multiset
    numbers:   the numbers outside the equations in order, with the operators written between
               them (all of a step's numbers when it has no equation)
    Both empty: the step has no number.
    """

    equations: tuple[tuple[Element, ...], ...]
    numbers: tuple[Element, ...]


def calculation_signature(step: str) -> CalculationSignature:
    """The calculation signature of a step: its equation chains as a multiset, and the numbers
    outside them in order. ``2 + 3 = 6 + 1 = 7`` and ``2 + 3 = 5 + 2 = 7`` differ, so do
    ``8 + 8 = 15`` and ``8 + 7 = 15``; ``Adding 3 and 4 gives 8.`` has numbers (3, 4, 8)."""
    equations: list[tuple[Element, ...]] = []
    numbers: list[Element] = []
    for run in _arithmetic_runs(_tokens(step)):
        if not any(token.kind == _NUMBER_KIND for token in run):
            continue
        elements = _trimmed_elements(run)
        if any(token.kind == _EQ_KIND for token in run):
            equations.append(elements)
        else:
            numbers.extend(elements)
    return CalculationSignature(tuple(sorted(equations, key=_chain_order)), tuple(numbers))


def normalise_step_text(step: str) -> str:
    """The text the Levenshtein ratio compares: whitespace collapsed to single spaces, stripped."""
    return " ".join(step.split())


@dataclass(frozen=True)
class StepSignature:
    """What the consistency test needs of a step, computed once per step.

    text:        normalised text (``normalise_step_text``)
    calculation: its calculation signature (``calculation_signature``)
    """

    text: str
    calculation: CalculationSignature


def step_signature(step: str) -> StepSignature:
    return StepSignature(normalise_step_text(step), calculation_signature(step))


def steps_consistent(a: StepSignature, b: StepSignature, threshold: float) -> bool:
    """Whether two steps may share a group: equal calculation signatures and a Levenshtein ratio
    of the normalised texts >= threshold. Symmetric; reflexive for threshold <= 1."""
    return a.calculation == b.calculation and Levenshtein.ratio(a.text, b.text) >= threshold


def step_similarity(a: str, b: str) -> float:
    """Similarity of two steps in [0, 1] (paper 3.2): 0.0 when their calculation signatures
    differ, otherwise the Levenshtein ratio of the whitespace-normalised texts. Two steps are
    consistent at a threshold t > 0 exactly when their similarity is >= t."""
    first, second = step_signature(a), step_signature(b)
    if first.calculation != second.calculation:
        return 0.0
    return float(Levenshtein.ratio(first.text, second.text))
