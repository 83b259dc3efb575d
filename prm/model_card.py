"""The model card (README.md) written beside a saved PRM: what it scores and how to score a
solution with transformers alone, with this PRM's own prompt and separator written in."""

from __future__ import annotations

import re
from pathlib import Path

from pipeline.prompts import prompt_from_config

# Stands for the question in the rendered prompt (a text the prompt template itself cannot hold).
QUESTION_SLOT = "<<QUESTION>>"


def rendered_prompt(info, tokenizer) -> str:
    """The prompt this PRM was trained on, with QUESTION_SLOT where the question goes (chat
    template, instruction and few-shot exemplars included): what pipeline.prompts builds."""
    return prompt_from_config(QUESTION_SLOT, info.kind, tokenizer, info.format_config())


def model_card(info, transformers_class: str | None, tokenizer=None) -> str:
    """README.md of a saved PRM (``info``: its PRMInfo; ``transformers_class``: the
    token-classification class it is saved as, None for the backbone/ + head layout)."""
    base = info.base_model if re.fullmatch(r"[\w.-]+/[\w.-]+", info.base_model or "") else ""
    front = [
        "---",
        "library_name: transformers",
        "pipeline_tag: token-classification",
        "tags: [process-reward-model, prm, stepflow]",
    ]
    if base:
        front.append(f"base_model: {base}")
    front.append("---")
    backbone = info.base_model or info.base_architecture
    what = (
        "A process reward model (PRM) trained with stepflow. For a question and a solution written as steps it gives every\n"
        "step k a score U_k in (0, 1): the probability that step k leads to a correct final answer, given that the steps\n"
        "before it are right (trained on step labels in [0, 1]: Monte Carlo values of rollouts, or human ratings;\n"
        f"prompt kind `{info.kind}`" + (f", backbone `{backbone}`" if backbone else "") + ").\n"
    )
    if transformers_class is None:
        return (
            "\n".join(front)
            + "\n\n# Process reward model\n\n"
            + what
            + (
                "\nThis architecture has no transformers token-classification class, so the PRM is saved as `backbone/` (a\n"
                "transformers base model) plus `head.safetensors` (a Linear(hidden, 1) read at each step's last token,\n"
                "U = sigmoid(logit)). Load it with stepflow: `prm.formats.load_scorer(folder, config)` (docs/prm.md).\n"
            )
        )
    prompt = rendered_prompt(info, tokenizer)
    return (
        "\n".join(front)
        + f"""

# Process reward model

{what}
It is a `{transformers_class}` with two labels (0 `wrong`, 1 `correct`). A step's score is the probability of
label 1 at the step's **last token**, its separator {info.separator!r}. Attention is causal, so one forward
pass scores every step, and a step's score depends only on the prompt and the steps up to it.

## Scoring a solution

```python
import torch
from transformers import AutoModelForTokenClassification, AutoTokenizer

PROMPT = {prompt!r}
SEPARATOR = {info.separator!r}


def step_scores(path, question, steps):
    \"\"\"U_k of every step of one solution (steps: a list of strings, without separators).\"\"\"
    tokenizer = AutoTokenizer.from_pretrained(path)
    model = AutoModelForTokenClassification.from_pretrained(path).eval()
    text = PROMPT.replace({QUESTION_SLOT!r}, question)
    bos = tokenizer.bos_token  # added only when the text does not start with it: BOS once, as stepflow encodes prompts
    ids = tokenizer(text, add_special_tokens=not (bos and text.startswith(bos)))["input_ids"]
    positions = []
    for step in steps:  # each step and its separator tokenized on their own, appended
        ids = ids + tokenizer(step + SEPARATOR, add_special_tokens=False)["input_ids"]
        positions.append(len(ids) - 1)  # the step's last token
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([ids])).logits[0, positions]
    return logits.float().softmax(-1)[:, 1].tolist()
```

- The prompt is the one the PRM was trained on (`PROMPT`, the question in place of `{QUESTION_SLOT}`); a
  multiple-choice question has its options appended as lines `A) ...`.
- Tokenize step by step as above, not the joined text: a BPE tokenizer may merge a step's end with the next
  step's start, and the score belongs at the step's own last token.
- Several solutions: right-pad them into one batch with an attention mask; the positions do not move.
- With stepflow: `prm.formats.load_scorer(folder, config).score_many([(question, steps), ...])` (docs/prm.md).
- The head is stored in float32; loading in bfloat16 rounds the scores slightly.
"""
    )


def write_model_card(directory: str | Path, info, transformers_class: str | None, tokenizer=None) -> Path:
    path = Path(directory) / "README.md"
    path.write_text(model_card(info, transformers_class, tokenizer), encoding="utf-8")
    return path
