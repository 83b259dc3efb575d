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
    refusal_reason(answer)              -> str or None: why an answer is refused before sympy

This package's __init__ is its interface: callers import these names from ``pipeline.grading``;
only the worker's own tests import a submodule. One module per idea, each importing only the
ones listed above it:
    safety     text made safe to handle; hostile answers refused by cheap checks (no sympy)
    extract    the final answer a text states (boxed, "The answer is", "####", a choice letter)
    normalize  normal forms: canonical answer strings, exact values of plain numbers
    verify     equivalence and the entry points grade / answers_equal; the Math-Verify child
    worker     a function run in a persistent child process with a deadline per call
Names without a leading underscore in a submodule are shared between the submodules.

Safety contract: none of these raises because of what the text or gold contains. Hostile
answers (huge strings, deep nesting, power towers, lone surrogates) are refused by cheap
checks before sympy sees them, and every Math-Verify call runs in a child process
(pipeline.grading.worker) with a deadline (``verify.VERIFY_TIMEOUT_S`` seconds) that works from any
thread. The only exceptions are ValueError for an unknown kind or for grade_many/
answers_equal_many given lists of different lengths -- caller bugs, not data.

Cheap cases never reach the child: answers whose normalised strings are equal, and pairs of
plain numbers, are decided in-process, so grading thousands of samples stays fast.
"""

from pipeline.grading.extract import KINDS, extract_answer
from pipeline.grading.normalize import normalize_answer
from pipeline.grading.safety import refusal_reason
from pipeline.grading.verify import (
    answers_equal,
    answers_equal_many,
    close_math_verify_worker,
    grade,
    grade_many,
    start_math_verify_worker,
)

__all__ = [
    "KINDS",
    "answers_equal",
    "answers_equal_many",
    "close_math_verify_worker",
    "extract_answer",
    "grade",
    "grade_many",
    "normalize_answer",
    "refusal_reason",
    "start_math_verify_worker",
]
