"""The one answer grader of the project: extract a final answer, compare it with the gold one.

Kinds of answer:
    "math"   MATH / MATH-500 style LaTeX answers; equivalence by Math-Verify (sympy).
    "gsm8k"  a number; "$", thousands commas and trailing units tolerated; numeric equality.
    "sat"    a multiple-choice letter A-E.
    "tiny"   the tiny synthetic-arithmetic world: an integer after a final "The answer is N".

Public functions (every stage calls these; nothing re-implements them):
    extract_answer(text, kind)          -> answer string or None
    grade(text, gold, kind)             -> bool   extract from text, compare with gold
    grade_many(texts, golds, kind)      -> [bool] the same, with all sympy work in one batch
    answers_equal(pred, gold, kind)     -> bool   for answers already extracted
    answers_equal_many(preds, golds, kind)
    normalize_answer(answer, kind)      -> str    canonical string for majority-vote buckets

Safety contract: none of these raises because of what the text or gold contains. Hostile
answers (huge strings, deep nesting, power towers, lone surrogates) are refused by cheap
checks before sympy sees them, and every Math-Verify call runs in a child process
(pipeline.grading_timeout) with a deadline of ``VERIFY_TIMEOUT_S`` seconds that works from any
thread. The only exceptions are ValueError for an unknown kind or for grade_many/
answers_equal_many given lists of different lengths -- caller bugs, not data.

Cheap cases never reach the child: answers whose normalised strings are equal, and pairs of
plain numbers, are decided in-process, so grading thousands of samples stays fast.
"""

from __future__ import annotations

import logging
import re
import threading
from collections import OrderedDict
from fractions import Fraction
from typing import Sequence

from pipeline.grading_timeout import PersistentWorker, register_for_exit

logger = logging.getLogger(__name__)

KINDS = ("math", "gsm8k", "sat", "tiny")

# Seconds one Math-Verify comparison (parse both sides + verify) may take before its child
# process is killed and the comparison counts as not equal. Overridable per call (timeout_s=).
VERIFY_TIMEOUT_S = 2.0
# Longest extracted answer that is compared at all; MATH answers are well under 200 characters.
MAX_ANSWER_CHARS = 10_000
# Deepest {}/()/[] nesting accepted; MATH-500 answers go no deeper than 4.
MAX_NESTING = 50
# Largest literal exponent (and factorial argument) accepted before sympy would build huge numbers.
MAX_EXPONENT = 10_000
# Verdicts of the child process remembered in-process (majority voting re-asks the same pairs).
VERDICT_CACHE_SIZE = 100_000
# Fresh child processes wait this long for sympy to import before a comparison counts as failed.
WORKER_STARTUP_TIMEOUT_S = 120.0


# ----------------------------------------------------------------------------------------------
# Extraction
# ----------------------------------------------------------------------------------------------

_BOX_COMMANDS = ("\\boxed", "\\fbox")
_BRACE_OR_BACKSLASH = re.compile(r"[{}\\]")
# Only the last few boxes are tried: a text of many unbalanced boxes must stay linear.
_MAX_BOXES_TRIED = 4
# Boxes of one answer ("$x = \\boxed{3}$ or $x = \\boxed{4}$"): at most this far apart, no sentence end or other word between.
_MAX_BOX_GAP = 100
_SENTENCE_END = re.compile(r"\.\s|\n\s*\n")
_GAP_WORD = re.compile(r"(?<![\\a-z])[a-z]{2,}")  # a word of prose between boxes (LaTeX commands and variables aside)
_ALTERNATIVE_FORM = re.compile(r",\s*(\$\s*)?or\b")  # "$\boxed{a}$, or $\boxed{b}$": one answer in two forms
# "The answer is X", "the final answer is X", "Answer: X" -- the last one in the text wins.
_ANSWER_IS = re.compile(r"\banswer\s*(?:is\b\s*:?|:)[ \t]*", re.IGNORECASE)
_HASHES = re.compile(r"####[ \t]*")
_CHOICE_CORRECT = re.compile(
    r"\bchoice\s*\$?\s*(?:\\math(?:bf|rm)\{\s*|\\text(?:bf)?\{\s*)?"
    r"\(?([A-E])\)?\s*\}?\s*\$?\s+is\s+(?:the\s+)?correct\b",
    re.IGNORECASE,
)
# "(B)", "(b)", "B)", "B." or a lone "B"; a bare lower-case letter is an article, not a choice.
_LETTER_AT_START = re.compile(r"^(?:\(([A-Ea-e])\)|([A-E])(?:\)|(?=[\s.,:;}$*]|$)))")
_LETTER_DECORATION = re.compile(
    r"^(?:\s|\$|\*|:|\{|\\\(|\\\[|\\boxed\{|\\text(?:bf|rm)?\{|\\math(?:bf|rm)\{"
    r"|option\b|choice\b)+",
    re.IGNORECASE,
)
_FRACTION = re.compile(r"\\[dt]?frac\{(-?\d+)\}\{(\d+)\}")
_NUMBER = re.compile(r"-?(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?(?:/\d+)?|-?\.\d+")


def extract_answer(text: str, kind: str) -> str | None:
    """The final answer stated in ``text``, as a string, or None when there is none.

    Looked for, in order: the last ``\\boxed{...}`` / ``\\fbox{...}`` (nested braces allowed),
    the last "The answer is X" / "the final answer is X" / "Answer: X" (case-insensitive,
    trailing period dropped), the last "#### X". Then, by kind:
      math:  the LaTeX found, with $...$ around it dropped.
      gsm8k, tiny: the first number in it, thousands commas and "$" removed ("1,234.5 dollars"
             -> "1234.5"); after an "=", the number after the last "="; None when the
             answer is one refusal_reason() refuses (a power tower, a megabyte of digits).
      sat:   the choice letter A-E in it ("(B)", "B)", "B", "\\text{(B)}"); failing a marked
             answer, "Choice B is correct" (AGIEval solutions), or a text/last line that starts
             with "(B)" / "B)".
    Never raises: any text, however large or malformed, gives a string or None (a boxed
    answer longer than MAX_ANSWER_CHARS comes back cut to MAX_ANSWER_CHARS + 1 characters,
    which the comparison functions refuse).
    """
    _check_kind(kind)
    try:
        text = _clean_text(text)
        if kind == "sat":
            return _extract_letter(text)
        span = _final_answer_span(text)
        if span is None:
            return None
        if kind == "math":
            # Returned even when hostile: the caller may want to see it; grading refuses it.
            return _strip_math_delimiters(_boxed_list(text) or span) or None
        if refusal_reason(span):
            return None  # "9**9**9" or a megabyte of "1+1+..." does not state the number 9 or 1
        return _number_in(span)
    except Exception:  # a grader bug must cost one sample, not a whole evaluation run
        logger.exception("extract_answer failed; treating the answer as missing")
        return None


def _final_answer_span(text: str) -> str | None:
    boxed = _last_boxed(text)
    if boxed is not None:
        return boxed
    matches = list(_ANSWER_IS.finditer(text)) if "nswer" in text or "NSWER" in text else []
    if matches:
        return _answer_sentence(text, matches[-1].end())
    hashes = text.rfind("####")
    if hashes >= 0:
        return _line_from(text, _HASHES.match(text, hashes).end()).strip()
    return None


def _last_boxed(text: str) -> str | None:
    """Content of the last balanced \\boxed{...} or \\fbox{...} ("\\boxed 5" also counts)."""
    end = len(text)
    for _ in range(_MAX_BOXES_TRIED):
        start = max(text.rfind(command, 0, end) for command in _BOX_COMMANDS)
        if start < 0:
            return None
        command = next(c for c in _BOX_COMMANDS if text.startswith(c, start))
        position = start + len(command)
        while position < len(text) and text[position] == " ":
            position += 1
        if position < len(text) and text[position] == "{":
            # Only MAX_ANSWER_CHARS are searched for the closing brace, so a megabyte of
            # braces stays cheap; an overlong box comes back cut to MAX_ANSWER_CHARS + 1
            # characters, which grading refuses as too long.
            search_end = position + MAX_ANSWER_CHARS + 2
            content_end = _matching_brace(text, position, search_end)
            if content_end is not None:
                return text[position + 1: content_end].strip()
            if len(text) > search_end:
                return text[position + 1: search_end]
        elif not text[start + len(command): start + len(command) + 1].isalpha():
            # "\boxed 5" / "\boxed A": TeX takes the next token
            token = re.match(r"\s*([^\s$.,]+)", text[position: position + MAX_ANSWER_CHARS])
            if token:
                return token.group(1)
        end = start
    return None


def _boxed_list(text: str) -> str | None:
    """The last boxes of the text when one sentence holds them, joined by ", " ("the solutions
    are $\\boxed{-2}$ and $\\boxed{1}$" -> "-2, 1", as MATH writes such an answer and Math-Verify
    reads it); None when the last box stands alone. Boxes are joined while the text between two
    of them is at most _MAX_BOX_GAP characters without a sentence end or a word but "and", "or"
    ("first $\\boxed{1}$, then $\\boxed{2}$" is the answer 2), and not ", or", which offers the
    same answer in another form ("$\\boxed{15\\frac{39}{40}}$, or $\\boxed{\\frac{639}{40}}$
    inches": MATH-500 gives the last; "$\\boxed{3}$ or $\\boxed{\\frac{2}{5}}$" is two solutions)."""
    contents: list[str] = []
    end, later_start = len(text), None
    for _ in range(_MAX_BOXES_TRIED):
        start = max(text.rfind(command, 0, end) for command in _BOX_COMMANDS)
        if start < 0:
            break
        position = start + len(next(c for c in _BOX_COMMANDS if text.startswith(c, start)))
        while position < len(text) and text[position] == " ":
            position += 1
        if text[position: position + 1] != "{":
            break
        close = _matching_brace(text, position, position + MAX_ANSWER_CHARS + 2)
        if close is None or (later_start is not None and close >= later_start):
            break  # unbalanced, or a box around the later one
        if later_start is not None:
            gap = text[close + 1: later_start]
            if (len(gap) > _MAX_BOX_GAP or _SENTENCE_END.search(gap) or set(_GAP_WORD.findall(gap.lower())) - {"and", "or"}
                    or _ALTERNATIVE_FORM.search(gap)):
                break
        contents.append(text[position + 1: close].strip())
        end = later_start = start
    return ", ".join(reversed(contents)) if len(contents) > 1 else None


def _matching_brace(text: str, open_position: int, end: int) -> int | None:
    """Index (< end) of the "}" closing the "{" at open_position; escaped \\{ \\} do not count."""
    depth = 0
    escaped_position = -1
    # The regex jumps between braces, so a megabyte without braces costs one C-level scan.
    for match in _BRACE_OR_BACKSLASH.finditer(text, open_position, end):
        position = match.start()
        if position == escaped_position:
            continue
        token = match.group()
        if token == "\\":
            escaped_position = position + 1
        elif token == "{":
            depth += 1
        else:
            depth -= 1
            if depth == 0:
                return position
    return None


def _line_from(text: str, start: int) -> str:
    end = text.find("\n", start)
    return text[start: end if end >= 0 else len(text)]


def _answer_sentence(text: str, start: int) -> str:
    """The answer after "The answer is": a $...$ group, or the rest of the sentence."""
    rest = text[start: start + MAX_ANSWER_CHARS + 2].lstrip()
    line = _line_from(rest, 0)
    # Display math may span lines; inline math ends on its line (an unclosed "$18." must not
    # run on to the next "$" further down).
    for opener, closer, scope in (("$$", "$$", rest), ("\\[", "\\]", rest), ("$", "$", line),
                                  ("\\(", "\\)", line)):
        if scope.startswith(opener):
            close = scope.find(closer, len(opener))
            # "$18. She paid $20": a "$" before a digit is a currency sign, not a closer.
            if close > 0 and not scope[close + len(closer): close + len(closer) + 1].isdigit():
                return scope[len(opener): close].strip()
    # A period followed by a space ends the sentence ("is 5. I hope it is correct.").
    sentence_end = re.search(r"\.\s", line)
    if sentence_end:
        line = line[: sentence_end.start()]
    return line.strip().rstrip(".").strip()


def _strip_math_delimiters(answer: str) -> str:
    answer = answer.strip()
    for opener, closer in (("$$", "$$"), ("$", "$"), ("\\(", "\\)"), ("\\[", "\\]")):
        if answer.startswith(opener) and answer.endswith(closer) and len(answer) >= 2 * len(opener):
            answer = answer[len(opener): len(answer) - len(closer)].strip()
    return answer.rstrip(".").strip()


def _number_in(span: str) -> str | None:
    """The number a gsm8k/tiny answer states, as plain digits ("$1,234." -> "1234")."""
    span = span[: MAX_ANSWER_CHARS]
    span = span.replace("\\$", "").replace("$", "").replace("{,}", ",").replace("\u2212", "-")
    span = span.replace("\\!", "").replace("**", "")
    span = _FRACTION.sub(r"\1/\2", span)
    if "=" in span:
        span = span.rsplit("=", 1)[1]
    match = _NUMBER.search(span)
    if match is None:
        return None
    return match.group(0).replace(",", "")


def _extract_letter(text: str) -> str | None:
    boxed = _last_boxed(text)
    if boxed is not None:
        letter = _letter_at_start(boxed)
        if letter:
            return letter
    if "nswer" in text or "NSWER" in text:
        for match in reversed(list(_ANSWER_IS.finditer(text))[-_MAX_BOXES_TRIED:]):
            letter = _letter_at_start(text[match.end(): match.end() + 200])
            if letter:
                return letter
    correct = list(_CHOICE_CORRECT.finditer(text)) if "hoice" in text or "HOICE" in text else []
    if correct:
        return correct[-1].group(1).upper()
    stripped = text.strip()
    letter = _letter_at_start(stripped[:200])
    if letter:
        return letter
    last_line = stripped.rsplit("\n", 1)[-1]
    return _letter_at_start(last_line[:200])


def _letter_at_start(span: str) -> str | None:
    span = _LETTER_DECORATION.sub("", span, count=1)
    match = _LETTER_AT_START.match(span)
    return (match.group(1) or match.group(2)).upper() if match else None


# ----------------------------------------------------------------------------------------------
# Normalisation
# ----------------------------------------------------------------------------------------------

_TEXT_COMMANDS = r"\\(?:text|textbf|textrm|textit|mbox|mathrm|mathbf|textnormal)"
_TRAILING_UNIT = re.compile(r"^(.*\S)\s*" + _TEXT_COMMANDS + r"\{[^{}]*\}(?:\^\{?\d\}?)?\s*$", re.S)
_TEXT_GROUP = re.compile(_TEXT_COMMANDS + r"\{([^{}]*)\}")
_ASSIGNED_VARIABLE = re.compile(r"^(?:[a-zA-Z]|\\[a-zA-Z]+)(?:_\{?\w+\}?)?=(?!=)")
_THOUSANDS = re.compile(r"^-?\d{1,3}(?:,\d{3})+(?:\.\d+)?$")
_PLAIN_RATIONAL = re.compile(
    r"^(-?)(?:\\frac\{(-?\d+)\}\{(\d+)\}|(\d+)/(\d+)|(\d+(?:\.\d*)?|\.\d+))$"
)
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
    _check_kind(kind)
    try:
        answer = _clean_text(answer)
        if kind == "math":
            return _normalize_math(answer)
        if kind == "sat":
            return _extract_letter(answer) or answer.strip()
        number = _parse_number(_number_in(answer) if answer else None)
        return _canonical_number(number) if number is not None else answer.strip()
    except Exception:
        logger.exception("normalize_answer failed; using the stripped answer")
        return str(answer).strip()


def _normalize_math(answer: str) -> str:
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
    if _THOUSANDS.match(s):
        s = s.replace(",", "")
    s = re.sub(r"\\frac(\d)(\d)", r"\\frac{\1}{\2}", s)
    s = re.sub(r"\\sqrt(\d|[a-zA-Z](?![a-zA-Z]))", r"\\sqrt{\1}", s)
    number = _plain_rational(s)
    return _canonical_number(number) if number is not None else s


def _plain_rational(s: str) -> Fraction | None:
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
    """"18", "-0.25", "1234.5"; "1/3" when the decimal would not end."""
    if value.denominator == 1:
        return str(value.numerator)
    for places in range(1, 40):
        if 10**places % value.denominator == 0:
            scaled = abs(value.numerator) * (10**places // value.denominator)
            digits = str(scaled).rjust(places + 1, "0")
            decimal = (digits[:-places] + "." + digits[-places:]).rstrip("0")
            return ("-" if value < 0 else "") + decimal
    return f"{value.numerator}/{value.denominator}"


def _parse_number(number: str | None) -> Fraction | None:
    if not number or len(number) > 1000:
        return None
    try:
        if "/" in number:
            numerator, denominator = number.split("/", 1)
            return Fraction(Fraction(numerator), Fraction(denominator))
        return Fraction(number)
    except (ValueError, ZeroDivisionError):
        return None


# ----------------------------------------------------------------------------------------------
# Comparison
# ----------------------------------------------------------------------------------------------


def grade(text: str, gold: str, kind: str, timeout_s: float | None = None) -> bool:
    """True when the final answer in ``text`` equals ``gold`` (a clean answer string).

    Extraction as extract_answer, comparison as answers_equal. A missing answer, a refused
    (hostile) answer, a Math-Verify error and a comparison that overruns timeout_s
    (default VERIFY_TIMEOUT_S) all give False. Safe from any thread; never raises for any
    text or gold.
    """
    return grade_many([text], [gold], kind, timeout_s=timeout_s)[0]


def grade_many(
    texts: Sequence[str], golds: Sequence[str], kind: str, timeout_s: float | None = None
) -> list[bool]:
    """grade() for many (text, gold) pairs; every Math-Verify comparison goes to the child in
    one batch, each with its own deadline. Raises ValueError only if the lengths differ."""
    _check_kind(kind)
    if len(texts) != len(golds):
        raise ValueError(f"grade_many: {len(texts)} texts but {len(golds)} golds")
    predictions = [extract_answer(text, kind) for text in texts]
    return answers_equal_many(predictions, golds, kind, timeout_s=timeout_s)


def answers_equal(pred: str | None, gold: str, kind: str, timeout_s: float | None = None) -> bool:
    """True when two already-extracted answers are the same answer.

    math:  Math-Verify (gold is the reference side), after in-process shortcuts: equal
           normalised strings are equal; two plain numbers are compared exactly, and only
           near-equal ones are left to Math-Verify's rounding.
    gsm8k, tiny: numbers; two integers must be equal, otherwise within 1e-6 relative
           ("0.333333" vs "1/3"); commas, "$" and trailing units ignored.
    sat:   the same choice letter.
    A None or empty pred is never equal. Never raises for any pred or gold.
    """
    return answers_equal_many([pred], [gold], kind, timeout_s=timeout_s)[0]


def answers_equal_many(
    preds: Sequence[str | None],
    golds: Sequence[str],
    kind: str,
    timeout_s: float | None = None,
) -> list[bool]:
    """answers_equal for many pairs, with all Math-Verify work sent to the child in one batch."""
    _check_kind(kind)
    if len(preds) != len(golds):
        raise ValueError(f"answers_equal_many: {len(preds)} preds but {len(golds)} golds")
    verdicts: list[bool | None] = []
    hard: dict[tuple[str, str], list[int]] = {}
    for index, (pred, gold) in enumerate(zip(preds, golds)):
        try:
            verdict, pair = _quick_verdict(pred, gold, kind)
        except Exception:
            logger.exception("answer comparison failed; counting it as not equal")
            verdict, pair = False, None
        verdicts.append(verdict)
        if verdict is None:
            hard.setdefault(pair, []).append(index)
    if hard:
        for pair, verdict in zip(hard, _math_verify_pairs(list(hard), timeout_s)):
            for index in hard[pair]:
                verdicts[index] = verdict
    return [bool(verdict) for verdict in verdicts]


def _quick_verdict(pred, gold, kind) -> tuple[bool | None, tuple[str, str] | None]:
    """(verdict, None) when decided in-process, (None, (pred, gold)) when Math-Verify decides."""
    if pred is None or gold is None:
        return False, None
    pred, gold = _clean_text(pred).strip(), _clean_text(gold).strip()
    if not pred or not gold:
        return False, None
    if kind == "sat":
        pred_letter, gold_letter = _extract_letter(pred), _extract_letter(gold)
        return (pred_letter is not None and pred_letter == gold_letter), None
    if kind in ("gsm8k", "tiny"):
        return _numbers_equal(pred, gold), None
    # math
    if len(pred) > MAX_ANSWER_CHARS or len(gold) > MAX_ANSWER_CHARS:
        return False, None  # refused before any normalisation work on a megabyte
    pred = _strip_math_delimiters(pred)
    gold = _strip_math_delimiters(gold)
    if _normalize_math(pred) == _normalize_math(gold):
        return True, None
    pred_value = _plain_rational(_light_clean(pred))
    gold_value = _plain_rational(_light_clean(gold))
    if pred_value is not None and gold_value is not None:
        if abs(pred_value - gold_value) > _MATH_NEAR_MISS:
            return False, None  # Math-Verify rounds to 6 places; only near-misses need it
    if refusal_reason(pred) or refusal_reason(gold):
        return False, None
    return None, (pred, gold)


# Two plain numbers further apart than this differ for Math-Verify too (it rounds to 6 places).
_MATH_NEAR_MISS = Fraction(1, 10**5)


def _light_clean(s: str) -> str:
    """Spaces, $, \\left/\\right, \\dfrac and thousands commas only: what cannot change a value."""
    s = re.sub(r"\s+|\\\$|\$|\\left(?![a-zA-Z])|\\right(?![a-zA-Z])|\\[,;:! ]", "", s)
    s = re.sub(r"\\[dt]frac", r"\\frac", s).rstrip(".")
    return s.replace(",", "") if _THOUSANDS.match(s) else s


def _numbers_equal(pred: str, gold: str) -> bool:
    if refusal_reason(pred) or refusal_reason(gold):
        return False
    pred_value = _parse_number(_number_in(pred))
    gold_value = _parse_number(_number_in(gold))
    if pred_value is None or gold_value is None:
        return False
    return _within(pred_value, gold_value, 1e-6)


def _within(a: Fraction, b: Fraction, relative: float) -> bool:
    if a.denominator == 1 and b.denominator == 1:
        # Counts are exact: 1450001 is not 1450000, however close relatively.
        return a == b
    return a == b or abs(a - b) <= Fraction(str(relative)) * max(abs(a), abs(b))


# ----------------------------------------------------------------------------------------------
# Hostile-input checks (no sympy involved)
# ----------------------------------------------------------------------------------------------

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
        numeric = not _LETTER.search(_HARMLESS_COMMANDS.sub("", operand)) and (
            next_is_numeric if chained else True
        )
        if numeric:
            if chained or _POWER.search(operand):
                return "numeric power tower"
            if any(
                len(digits) > 6 or int(digits) > MAX_EXPONENT
                for digits in _INTEGER_PART.findall(operand)
            ):
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


# ----------------------------------------------------------------------------------------------
# Math-Verify in the child process
# ----------------------------------------------------------------------------------------------

_worker: PersistentWorker | None = None
_worker_lock = threading.Lock()
_verdict_cache: OrderedDict[tuple[str, str], bool] = OrderedDict()
_cache_lock = threading.Lock()


def _math_verify_worker() -> PersistentWorker:
    global _worker
    with _worker_lock:
        if _worker is None:
            _worker = register_for_exit(
                PersistentWorker(
                    f"{__name__}:_math_verify_in_child",
                    # Touches sympy's lazily imported parts (fractions, intervals, sets) once.
                    warmup_args=[
                        ("\\frac{1}{2}", "0.5"), ("(1,2]", "\\{1,2\\}"), ("x^2+1", "1+x^2"),
                    ],
                    startup_timeout_s=WORKER_STARTUP_TIMEOUT_S,
                )
            )
        return _worker


def start_math_verify_worker() -> None:
    """Start the Math-Verify child process now (it takes seconds to import sympy) rather than
    on the first hard comparison. Optional: grading starts it on demand."""
    _math_verify_worker().start()


def close_math_verify_worker() -> None:
    """Kill the Math-Verify child process; the next hard comparison starts a new one."""
    if _worker is not None:
        _worker.close()


def _math_verify_pairs(pairs: list[tuple[str, str]], timeout_s: float | None) -> list[bool]:
    verdicts: list[bool | None] = [None] * len(pairs)
    with _cache_lock:
        for index, pair in enumerate(pairs):
            if pair in _verdict_cache:
                _verdict_cache.move_to_end(pair)
                verdicts[index] = _verdict_cache[pair]
    todo = [index for index, verdict in enumerate(verdicts) if verdict is None]
    if not todo:
        return verdicts  # type: ignore[return-value]
    timeout = VERIFY_TIMEOUT_S if timeout_s is None else timeout_s
    outcomes = _math_verify_worker().run_many([pairs[index] for index in todo], timeout)
    with _cache_lock:
        for index, outcome in zip(todo, outcomes):
            verdicts[index] = outcome.ok and outcome.value is True
            # A missing worker may come back; every other outcome belongs to the pair itself.
            if outcome.status != "unavailable":
                _verdict_cache[pairs[index]] = verdicts[index]
            if outcome.status == "unavailable":
                logger.error("Math-Verify unavailable, counting as not equal: %s", outcome.value)
            elif outcome.status in ("timeout", "crashed"):
                logger.warning(
                    "Math-Verify %s on pred=%.80r gold=%.80r", outcome.status, *pairs[index]
                )
        while len(_verdict_cache) > VERDICT_CACHE_SIZE:
            _verdict_cache.popitem(last=False)
    return verdicts  # type: ignore[return-value]


_parsed_cache: OrderedDict[str, list] = OrderedDict()


def _math_verify_in_child(pred: str, gold: str) -> bool:
    """Runs in the child process only: Math-Verify's verdict, its own (signal) timeouts off."""
    from math_verify import parse, verify  # heavy (sympy): loaded in the grading child process only

    if not _parsed_cache:
        # Timeouts are ours (the parent kills this process); silence the warning saying so.
        logging.getLogger("math_verify").setLevel(logging.ERROR)
    gold_parsed = _parse_in_child(gold, parse)
    pred_parsed = _parse_in_child(pred, parse)
    if not gold_parsed or not pred_parsed:
        return False
    return bool(verify(gold_parsed, pred_parsed, timeout_seconds=None))


def _parse_in_child(answer: str, parse) -> list:
    # Golds repeat across a batch (k samples per problem): parse each once.
    if answer in _parsed_cache:
        _parsed_cache.move_to_end(answer)
        return _parsed_cache[answer]
    parsed = parse("\\boxed{" + answer + "}", parsing_timeout=None)
    _parsed_cache[answer] = parsed
    if len(_parsed_cache) > 10_000:
        _parsed_cache.popitem(last=False)
    return parsed


# ----------------------------------------------------------------------------------------------
# Small helpers
# ----------------------------------------------------------------------------------------------


def _check_kind(kind: str) -> None:
    if kind not in KINDS:
        raise ValueError(f"unknown answer kind {kind!r}; expected one of {KINDS}")


def _clean_text(text) -> str:
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
