"""Answer extraction: the final answer a solution text states, by kind of answer.

extract_answer("... so $x = \\boxed{\\frac{1}{2}}$.", "math")  -> "\\frac{1}{2}"
extract_answer("3 + 4 = 7. The answer is 7.", "tiny")          -> "7"
extract_answer("She pays $1,234.50 in all. #### 1,234.50", "gsm8k") -> "1234.50"
extract_answer("Choice B is correct.", "sat")                  -> "B"
extract_answer("I do not know.", "math")                       -> None
"""

from __future__ import annotations

import logging
import re

from pipeline.grading.safety import MAX_ANSWER_CHARS, clean_text, refusal_reason

logger = logging.getLogger(__name__)

# The kinds of answer (pipeline.grading's docstring says what each means).
KINDS = ("math", "gsm8k", "sat", "tiny")

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
    check_kind(kind)
    try:
        text = clean_text(text)
        if kind == "sat":
            return extract_letter(text)
        span = _final_answer_span(text)
        if span is None:
            return None
        if kind == "math":
            # Returned even when hostile: the caller may want to see it; grading refuses it.
            return strip_math_delimiters(_boxed_list(text) or span) or None
        if refusal_reason(span):
            return None  # "9**9**9" or a megabyte of "1+1+..." does not state the number 9 or 1
        return number_in(span)
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
                return text[position + 1 : content_end].strip()
            if len(text) > search_end:
                return text[position + 1 : search_end]
        elif not text[start + len(command) : start + len(command) + 1].isalpha():
            # "\boxed 5" / "\boxed A": TeX takes the next token
            token = re.match(r"\s*([^\s$.,]+)", text[position : position + MAX_ANSWER_CHARS])
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
        if text[position : position + 1] != "{":
            break
        close = _matching_brace(text, position, position + MAX_ANSWER_CHARS + 2)
        if close is None or (later_start is not None and close >= later_start):
            break  # unbalanced, or a box around the later one
        if later_start is not None:
            gap = text[close + 1 : later_start]
            if (
                len(gap) > _MAX_BOX_GAP
                or _SENTENCE_END.search(gap)
                or set(_GAP_WORD.findall(gap.lower())) - {"and", "or"}
                or _ALTERNATIVE_FORM.search(gap)
            ):
                break
        contents.append(text[position + 1 : close].strip())
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
    return text[start : end if end >= 0 else len(text)]


def _answer_sentence(text: str, start: int) -> str:
    """The answer after "The answer is": a $...$ group, or the rest of the sentence."""
    rest = text[start : start + MAX_ANSWER_CHARS + 2].lstrip()
    line = _line_from(rest, 0)
    # Display math may span lines; inline math ends on its line (an unclosed "$18." must not
    # run on to the next "$" further down).
    for opener, closer, scope in (("$$", "$$", rest), ("\\[", "\\]", rest), ("$", "$", line), ("\\(", "\\)", line)):
        if scope.startswith(opener):
            close = scope.find(closer, len(opener))
            # "$18. She paid $20": a "$" before a digit is a currency sign, not a closer.
            if close > 0 and not scope[close + len(closer) : close + len(closer) + 1].isdigit():
                return scope[len(opener) : close].strip()
    # A period followed by a space ends the sentence ("is 5. I hope it is correct.").
    sentence_end = re.search(r"\.\s", line)
    if sentence_end:
        line = line[: sentence_end.start()]
    return line.strip().rstrip(".").strip()


def strip_math_delimiters(answer: str) -> str:
    answer = answer.strip()
    for opener, closer in (("$$", "$$"), ("$", "$"), ("\\(", "\\)"), ("\\[", "\\]")):
        if answer.startswith(opener) and answer.endswith(closer) and len(answer) >= 2 * len(opener):
            answer = answer[len(opener) : len(answer) - len(closer)].strip()
    return answer.rstrip(".").strip()


def number_in(span: str) -> str | None:
    """The number a gsm8k/tiny answer states, as plain digits ("$1,234." -> "1234")."""
    span = span[:MAX_ANSWER_CHARS]
    span = span.replace("\\$", "").replace("$", "").replace("{,}", ",").replace("\u2212", "-")
    span = span.replace("\\!", "").replace("**", "")
    span = _FRACTION.sub(r"\1/\2", span)
    if "=" in span:
        span = span.rsplit("=", 1)[1]
    match = _NUMBER.search(span)
    if match is None:
        return None
    return match.group(0).replace(",", "")


def extract_letter(text: str) -> str | None:
    boxed = _last_boxed(text)
    if boxed is not None:
        letter = _letter_at_start(boxed)
        if letter:
            return letter
    if "nswer" in text or "NSWER" in text:
        for match in reversed(list(_ANSWER_IS.finditer(text))[-_MAX_BOXES_TRIED:]):
            letter = _letter_at_start(text[match.end() : match.end() + 200])
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


def check_kind(kind: str) -> None:
    if kind not in KINDS:
        raise ValueError(f"unknown answer kind {kind!r}; expected one of {KINDS}")
