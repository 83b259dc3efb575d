"""Verification: whether a solution's answer equals the gold one -- the grader's entry points.

    grade("... so the answer is $\\boxed{\\frac12}$.", "0.5", "math")   -> True
    answers_equal("1/3", "0.333333", "gsm8k")                         -> True   (within 1e-6)
    answers_equal("1450001", "1450000", "gsm8k")                      -> False  (counts are exact)
    answers_equal_many(["(x+1)^2", None], ["x^2+2x+1", "3"], "math")  -> [True, False]

Cheap cases never reach sympy: equal normal forms (pipeline.grading.normalize) and pairs of plain
numbers are decided in-process. The rest go to Math-Verify in one long-lived child process
(pipeline.grading.worker), all pairs of a call in one batch, each with a deadline of
``VERIFY_TIMEOUT_S`` seconds; its verdicts are remembered in-process.
"""

from __future__ import annotations

import logging
import re
import threading
from collections import OrderedDict
from collections.abc import Sequence
from fractions import Fraction

from pipeline.grading.extract import check_kind, extract_answer, extract_letter, number_in, strip_math_delimiters
from pipeline.grading.normalize import THOUSANDS, normalize_math, parse_number, plain_rational
from pipeline.grading.safety import MAX_ANSWER_CHARS, clean_text, refusal_reason
from pipeline.grading.worker import PersistentWorker, register_for_exit

logger = logging.getLogger(__name__)

# Seconds one Math-Verify comparison (parse both sides + verify) may take before its child
# process is killed and the comparison counts as not equal. Overridable per call (timeout_s=).
VERIFY_TIMEOUT_S = 2.0
# Verdicts of the child process remembered in-process (majority voting re-asks the same pairs).
VERDICT_CACHE_SIZE = 100_000
# Fresh child processes wait this long for sympy to import before a comparison counts as failed.
WORKER_STARTUP_TIMEOUT_S = 120.0


def grade(text: str, gold: str, kind: str, timeout_s: float | None = None) -> bool:
    """True when the final answer in ``text`` equals ``gold`` (a clean answer string).

    Extraction as extract_answer, comparison as answers_equal. A missing answer, a refused
    (hostile) answer, a Math-Verify error and a comparison that overruns timeout_s
    (default VERIFY_TIMEOUT_S) all give False. Safe from any thread; never raises for any
    text or gold.
    """
    return grade_many([text], [gold], kind, timeout_s=timeout_s)[0]


def grade_many(texts: Sequence[str], golds: Sequence[str], kind: str, timeout_s: float | None = None) -> list[bool]:
    """grade() for many (text, gold) pairs; every Math-Verify comparison goes to the child in
    one batch, each with its own deadline. Raises ValueError only if the lengths differ."""
    check_kind(kind)
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
    check_kind(kind)
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
    pred, gold = clean_text(pred).strip(), clean_text(gold).strip()
    if not pred or not gold:
        return False, None
    if kind == "sat":
        pred_letter, gold_letter = extract_letter(pred), extract_letter(gold)
        return (pred_letter is not None and pred_letter == gold_letter), None
    if kind in ("gsm8k", "tiny"):
        return _numbers_equal(pred, gold), None
    # math
    if len(pred) > MAX_ANSWER_CHARS or len(gold) > MAX_ANSWER_CHARS:
        return False, None  # refused before any normalisation work on a megabyte
    pred = strip_math_delimiters(pred)
    gold = strip_math_delimiters(gold)
    if normalize_math(pred) == normalize_math(gold):
        return True, None
    pred_value = plain_rational(_light_clean(pred))
    gold_value = plain_rational(_light_clean(gold))
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
    return s.replace(",", "") if THOUSANDS.match(s) else s


def _numbers_equal(pred: str, gold: str) -> bool:
    if refusal_reason(pred) or refusal_reason(gold):
        return False
    pred_value = parse_number(number_in(pred))
    gold_value = parse_number(number_in(gold))
    if pred_value is None or gold_value is None:
        return False
    return _within(pred_value, gold_value, 1e-6)


def _within(a: Fraction, b: Fraction, relative: float) -> bool:
    if a.denominator == 1 and b.denominator == 1:
        # Counts are exact: 1450001 is not 1450000, however close relatively.
        return a == b
    return a == b or abs(a - b) <= Fraction(str(relative)) * max(abs(a), abs(b))


# One Math-Verify child process for every thread, started on the first hard comparison.
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
                        ("\\frac{1}{2}", "0.5"),
                        ("(1,2]", "\\{1,2\\}"),
                        ("x^2+1", "1+x^2"),
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
                logger.warning("Math-Verify %s on pred=%.80r gold=%.80r", outcome.status, *pairs[index])
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
