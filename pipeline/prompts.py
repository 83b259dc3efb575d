"""The one prompt builder: every stage that shows a question to a model builds it here.

With a tokenizer that has a chat template (instruct models) the question goes in a user turn
with an instruction that fixes the step format and the answer format; otherwise the plain
template of the config is used, optionally after few-shot exemplars in the same step format.
The tiny world's from-scratch model is trained on exactly these plain prompts.
"""

from __future__ import annotations

from collections.abc import Mapping

from pipeline.steps import join_steps

INSTRUCTIONS = {
    "math": "Solve the problem step by step, one step per line. "
    "Finish with a line of the form 'The answer is \\boxed{ANSWER}'.",
    "gsm8k": "Solve the problem step by step, one step per line. "
    "Finish with a line of the form 'The answer is N' where N is a number.",
    "sat": "Solve the problem step by step, one step per line. "
    "Finish with a line of the form 'The answer is (X)' where X is the letter of the correct option.",
    "tiny": "Solve the problem step by step, one step per line. Finish with 'The answer is N'.",
}

# Few-shot exemplars in the project's step format (used only for plain-text prompts).
FEW_SHOT = {
    "gsm8k": [
        (
            "Tom has 3 boxes with 4 apples each. He eats 2 apples. How many apples are left?",
            ["The boxes hold 3 * 4 = 12 apples.", "After eating, 12 - 2 = 10 apples are left.", "The answer is 10"],
        ),
        (
            "A shirt costs $15 and a hat costs $7. How much do 2 shirts and 1 hat cost?",
            ["Two shirts cost 2 * 15 = 30 dollars.", "With the hat, 30 + 7 = 37 dollars.", "The answer is 37"],
        ),
    ],
    "math": [
        (
            "What is the value of $x$ if $2x + 3 = 11$?",
            ["Subtract 3 from both sides: $2x = 8$.", "Divide by 2: $x = 4$.", "The answer is \\boxed{4}"],
        ),
        (
            "Simplify $\\frac{6}{8}$.",
            [
                "Both 6 and 8 are divisible by 2.",
                "So $\\frac{6}{8} = \\frac{3}{4}$.",
                "The answer is \\boxed{\\frac{3}{4}}",
            ],
        ),
    ],
    "sat": [
        (
            "If $3x = 12$, what is $x + 1$?\nA) 3 B) 4 C) 5 D) 6",
            ["From $3x = 12$, $x = 4$.", "Then $x + 1 = 5$.", "The answer is (C)"],
        ),
    ],
}


def format_options(options: Mapping[str, str] | None) -> str:
    """SAT-style options as 'A) ... B) ...' lines."""
    if not options:
        return ""
    return "\n".join(f"{letter}) {text}" for letter, text in sorted(options.items()))


def question_text(question: str, options: Mapping[str, str] | None = None) -> str:
    """The question, with its answer options when it is multiple choice."""
    shown = format_options(options)
    return f"{question}\n{shown}" if shown else question


def has_chat_template(tokenizer) -> bool:
    return tokenizer is not None and bool(getattr(tokenizer, "chat_template", None))


def build_prompt(
    question: str,
    *,
    kind: str,
    tokenizer=None,
    options: Mapping[str, str] | None = None,
    template: str = "Question: {question}\nAnswer:\n",
    use_chat_template: bool = True,
    num_few_shot: int = 0,
    separator: str = "\n",
) -> str:
    """The prompt text for one question (the model continues it with the first step).

    kind: the grading kind (math | gsm8k | sat | tiny), which picks the instruction and the
    few-shot exemplars. Chat template when the tokenizer has one and ``use_chat_template``;
    plain ``template`` (with ``{question}``) otherwise.
    """
    shown = question_text(question, options)
    if use_chat_template and has_chat_template(tokenizer):
        instruction = INSTRUCTIONS.get(kind, INSTRUCTIONS["math"])
        messages = [{"role": "user", "content": f"{instruction}\n\n{shown}"}]
        return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    shots = FEW_SHOT.get(kind, FEW_SHOT["math"])[:num_few_shot] if num_few_shot > 0 else []
    parts = [template.format(question=q) + join_steps(steps, separator) + "\n" for q, steps in shots]
    parts.append(template.format(question=shown))
    return "".join(parts)


def prompt_from_config(question: str, kind: str, tokenizer, format_config, options=None) -> str:
    """build_prompt with the settings of a FormatConfig."""
    return build_prompt(
        question,
        kind=kind,
        tokenizer=tokenizer,
        options=options,
        template=format_config.prompt_template,
        use_chat_template=format_config.use_chat_template,
        num_few_shot=format_config.num_few_shot,
        separator=format_config.separator,
    )
