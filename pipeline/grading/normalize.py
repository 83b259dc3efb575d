"""Normal forms of answers: one canonical string per answer, so equal strings mean the same
answer (the buckets of majority voting), and the exact value of a plain number.

    normalize_answer("\\dfrac{2}{6}", "math")   -> "1/3"
    normalize_answer("x = 0.50", "math")         -> "0.5"
    normalize_answer("$1,234.50", "gsm8k")       -> "1234.5"
    normalize_answer("(b)", "sat")               -> "B"
"""

from __future__ import annotations

import logging
import re
from fractions import Fraction

from pipeline.grading.extract import check_kind, extract_letter, number_in
from pipeline.grading.safety import MAX_ANSWER_CHARS, clean_text

logger = logging.getLogger(__name__)

_TEXT_COMMANDS = r"\\(?:text|textbf|textrm|textit|mbox|mathrm|mathbf|textnormal)"
_TRAILING_UNIT = re.compile(r"^(.*\S)\s*" + _TEXT_COMMANDS + r"\{[^{}]*\}(?:\^\{?\d\}?)?\s*$", re.S)
_TEXT_GROUP = re.compile(_TEXT_COMMANDS + r"\{([^{}]*)\}")
_ASSIGNED_VARIABLE = re.compile(r"^(?:[a-zA-Z]|\\[a-zA-Z]+)(?:_\{?\w+\}?)?=(?!=)")
THOUSANDS = re.compile(r"^-?\d{1,3}(?:,\d{3})+(?:\.\d+)?$")
_PLAIN_RATIONAL = re.compile(r"^(-?)(?:\\frac\{(-?\d+)\}\{(\d+)\}|(\d+)/(\d+)|(\d+(?:\.\d*)?|\.\d+))$")
_SPACING = re.compile(r"\\[,;:! ]|\\q?quad\b|~")


def normalize_answer(answer: str, kind: str) -> str:
    """Canonical string for majority-vote buckets: equal strings mean the same answer.

    math:  light string clean-up -- spaces, $, \\left/\\right, \\dfrac/\\tfrac -> \\frac,
           \\frac12 -> \\frac{1}{2}, trailing ".", trailing \\text{...} units, ^\\circ, \\%,
           thousands commas and a leading "x=" dropped; plain numbers written canonically
           ("0.50", "\\frac{1}{2}", "1/2" -> "0.5"; "\\frac{2}{6}" -> "1/3"; "18.0" -> "18").
    gsm8k, tiny: the number, canonical ("1,234.50" -> "1234.5"); else the stripped string.
    sat:   the letter, upper case; else the stripped string.
    Never raises; different strings may still be equal answers (use answers_equal for that).
    """
    check_kind(kind)
    try:
        answer = clean_text(answer)
        if kind == "math":
            return normalize_math(answer)
        if kind == "sat":
            return extract_letter(answer) or answer.strip()
        number = parse_number(number_in(answer) if answer else None)
        return _canonical_number(number) if number is not None else answer.strip()
    except Exception:
        logger.exception("normalize_answer failed; using the stripped answer")
        return str(answer).strip()


def normalize_math(answer: str) -> str:
    if len(answer) > MAX_ANSWER_CHARS:
        return answer  # refused later anyway; do not spend regex time on it
    s = answer.strip().replace("\\$", "").replace("$", "")
    s = re.sub(r"\\left(?![a-zA-Z])|\\right(?![a-zA-Z])|\\displaystyle", "", s)
    s = re.sub(r"\\[dt]frac", r"\\frac", s)
    s = _SPACING.sub(" ", s)
    s = re.sub(r"\^\s*\{\s*\\circ\s*\}|\^\s*\\circ|\\circ|\u00b0|\\degree", "", s)
    s = s.replace("\\%", "").replace("%", "")
    for _ in range(2):  # "5\text{ cm}^2", then at most one more unit
        unit = _TRAILING_UNIT.match(s)
        if not unit:
            break
        s = unit.group(1)
    s = _TEXT_GROUP.sub(r"\1", s)
    s = re.sub(r"\s+", "", s)
    s = s.replace("{,}", ",").rstrip(".")
    s = _ASSIGNED_VARIABLE.sub("", s, count=1)
    if THOUSANDS.match(s):
        s = s.replace(",", "")
    s = re.sub(r"\\frac(\d)(\d)", r"\\frac{\1}{\2}", s)
    s = re.sub(r"\\sqrt(\d|[a-zA-Z](?![a-zA-Z]))", r"\\sqrt{\1}", s)
    number = plain_rational(s)
    return _canonical_number(number) if number is not None else s


def plain_rational(s: str) -> Fraction | None:
    """The value of an integer, decimal, a/b or \\frac{a}{b} (optionally negated), else None."""
    if len(s) > 200:
        return None
    match = _PLAIN_RATIONAL.match(s)
    if not match:
        return None
    sign, frac_num, frac_den, slash_num, slash_den, decimal = match.groups()
    try:
        if decimal is not None:
            value = Fraction(decimal)
        elif frac_num is not None:
            value = Fraction(int(frac_num), int(frac_den))
        else:
            value = Fraction(int(slash_num), int(slash_den))
    except (ValueError, ZeroDivisionError):
        return None
    return -value if sign else value


def _canonical_number(value: Fraction) -> str:
    """ "18", "-0.25", "1234.5"; "1/3" when the decimal would not end."""
    if value.denominator == 1:
        return str(value.numerator)
    for places in range(1, 40):
        if 10**places % value.denominator == 0:
            scaled = abs(value.numerator) * (10**places // value.denominator)
            digits = str(scaled).rjust(places + 1, "0")
            decimal = (digits[:-places] + "." + digits[-places:]).rstrip("0")
            return ("-" if value < 0 else "") + decimal
    return f"{value.numerator}/{value.denominator}"


def parse_number(number: str | None) -> Fraction | None:
    if not number or len(number) > 1000:
        return None
    try:
        if "/" in number:
            numerator, denominator = number.split("/", 1)
            return Fraction(Fraction(numerator), Fraction(denominator))
        return Fraction(number)
    except (ValueError, ZeroDivisionError):
        return None
