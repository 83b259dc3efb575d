"""PRMs of other formats behind the one scorer API (prm.scorer.StepScorer), so search, evaluation,
validation and fine-tuning can use them as they use ours (the paper's Table 3 compares PRMs).

Each adapter builds the input its PRM was trained on and reads one logit per step with
U = sigmoid(logit) (docs/prm.md, "Other PRMs"):

- ``token_classification``: a transformers token-classification model, e.g. the output of TRL's
  PRMTrainer. Input as TRL's PRMTrainer tokenizes it: [BOS] + the question, then each step and
  the separator (``format.separator``) tokenized on their own; read at the separator's last
  token; two labels: logit = l_1 - l_0 (softmax probability of label 1), one label: its logit.
- ``math_shepherd``: a causal LM that scores a step tag by the probability of a "good" token
  against a "bad" one (Math-Shepherd: tag "ки", good "+", bad "-"). Input
  "{question} Step 1: {step 1} ки\\nStep 2: ..." tokenized whole; read at each tag token;
  logit = l_good - l_bad (the softmax over the two tokens).
- ``qwen_prm``: a step-separator token and a two-class reward head (Qwen2.5-Math-PRM: the
  assistant turn of the chat template holds the steps, each followed by "<extra_0>"; the model,
  remote code, returns (B, T, 2) logits); read at each separator; logit = l_1 - l_0.

The PRMs are frozen: loaded in eval mode on model.device in model.dtype; trust_remote_code
from model.trust_remote_code (Qwen2.5-Math-PRM needs it).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from transformers import AutoModel, AutoModelForCausalLM, AutoModelForTokenClassification

from pipeline.modeling import hub_model_errors, load_tokenizer, model_kwargs
from pipeline.steps import encode_prompt
from prm.data import pad_token_id
from prm.scorer import Solution, StepScorer, batched_step_logits

MATH_SHEPHERD_TAG, MATH_SHEPHERD_GOOD, MATH_SHEPHERD_BAD = "ки", "+", "-"
QWEN_PRM_SEPARATOR = "<extra_0>"
QWEN_PRM_SYSTEM = "Please reason step by step, and put your final answer within \\boxed{}."


def single_token(tokenizer, text: str, what: str) -> int:
    """The id of ``text`` when the tokenizer encodes it as one token (as the PRM's recipe needs)."""
    ids = tokenizer.encode(text, add_special_tokens=False)
    if len(ids) != 1:
        raise ValueError(f"the {what} {text!r} must be a single token of this tokenizer, got ids {ids}")
    return ids[0]


def gather(values: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """values (B, T, ...) at positions (B, S) -> (B, S, ...)."""
    index = positions.view(*positions.shape, *([1] * (values.dim() - 2))).expand(*positions.shape, *values.shape[2:])
    return torch.gather(values, 1, index)


def tag_positions(ids: Sequence[int], tag_id: int, n_steps: int, what: str) -> list[int]:
    """Where the step tags are; exactly one per step."""
    positions = [i for i, token in enumerate(ids) if token == tag_id]
    if len(positions) != n_steps:
        raise ValueError(
            f"{what}: {len(positions)} step tags in a solution of {n_steps} steps (the text must not make or merge "
            f"tag tokens)"
        )
    return positions


class AdapterScorer(StepScorer):
    """What the adapters share: a frozen transformers model, its tokenizer, batching by length.
    A subclass gives ``encode`` (ids, read positions) and ``step_logits`` (model output -> logits)."""

    auto_class = AutoModel  # the transformers class its checkpoints load with

    def __init__(self, model, tokenizer, batch_size: int = 64, device: str | torch.device | None = None):
        self.model = model.eval()
        self.tokenizer = tokenizer
        self.batch_size = max(1, int(batch_size))
        self.device = torch.device(device) if device is not None else next(model.parameters()).device
        self.pad_token_id = pad_token_id(tokenizer)

    @classmethod
    def load(cls, path: str, config) -> tuple:
        """(model, tokenizer) of a checkpoint: ``cls.auto_class`` with config.model's dtype, device,
        attention and trust_remote_code."""
        kwargs, device = model_kwargs(config.model)
        with hub_model_errors(path, config.model):
            model = cls.auto_class.from_pretrained(path, **kwargs).to(device)
        return model, load_tokenizer(path, trust_remote_code=config.model.trust_remote_code, model_config=config.model)

    @classmethod
    def from_pretrained(cls, path: str, config) -> AdapterScorer:
        return cls(*cls.load(path, config), batch_size=config.prm.score_batch_size)

    def encode(self, question: str, steps: Sequence[str]) -> tuple[list[int], list[int]]:
        raise NotImplementedError

    def step_logits(
        self, input_ids: torch.Tensor, attention_mask: torch.Tensor, positions: torch.Tensor
    ) -> torch.Tensor:
        raise NotImplementedError

    def logits_many(self, solutions: Sequence[Solution]) -> list[torch.Tensor]:
        encoded = [self.encode(question, list(steps)) if steps else ([], []) for question, steps in solutions]
        return batched_step_logits(encoded, self.batch_size, self.pad_token_id, self.device, self.step_logits)


class TokenClassificationScorer(AdapterScorer):
    """A token-classification PRM (TRL's PRMTrainer output) read at each step separator.

    separator: the step separator it was trained with (TRL's step_separator, default "\\n")
    """

    def __init__(self, model, tokenizer, separator: str = "\n", **kwargs):
        super().__init__(model, tokenizer, **kwargs)
        labels = int(model.config.num_labels)
        if labels not in (1, 2):
            raise ValueError(
                f"a token-classification PRM needs 1 or 2 labels (label 1 = correct step), this one has {labels}"
            )
        self.separator = separator
        self.separator_ids = tokenizer.encode(separator, add_special_tokens=False)
        if not self.separator_ids:
            raise ValueError(f"the step separator {separator!r} encodes to no tokens")

    auto_class = AutoModelForTokenClassification

    @classmethod
    def from_pretrained(cls, path: str, config) -> TokenClassificationScorer:
        return cls(*cls.load(path, config), separator=config.format.separator, batch_size=config.prm.score_batch_size)

    def encode(self, question: str, steps: Sequence[str]) -> tuple[list[int], list[int]]:
        ids = list(self.tokenizer(question, add_special_tokens=False)["input_ids"])
        if self.tokenizer.bos_token_id is not None:
            ids = [self.tokenizer.bos_token_id] + ids
        positions = []
        for step in steps:
            ids += list(self.tokenizer(step, add_special_tokens=False)["input_ids"]) + self.separator_ids
            positions.append(len(ids) - 1)
        return ids, positions

    def step_logits(self, input_ids, attention_mask, positions):
        logits = gather(self.model(input_ids=input_ids, attention_mask=attention_mask).logits, positions).float()
        return logits[..., 0] if logits.shape[-1] == 1 else logits[..., 1] - logits[..., 0]


class MathShepherdScorer(AdapterScorer):
    """A causal LM scoring each step tag by P(good) against P(bad) (Math-Shepherd)."""

    def __init__(
        self,
        model,
        tokenizer,
        tag: str = MATH_SHEPHERD_TAG,
        good: str = MATH_SHEPHERD_GOOD,
        bad: str = MATH_SHEPHERD_BAD,
        **kwargs,
    ):
        super().__init__(model, tokenizer, **kwargs)
        self.tag = tag
        self.tag_id = single_token(tokenizer, tag, "step tag")
        self.good_id, self.bad_id = (
            single_token(tokenizer, good, "good token"),
            single_token(tokenizer, bad, "bad token"),
        )

    auto_class = AutoModelForCausalLM

    def text(self, question: str, steps: Sequence[str]) -> str:
        """The model's input text (a tag already in the text is removed: it would be read as a step)."""
        clean = [step.replace(self.tag, "").strip() for step in steps]
        return (
            question.replace(self.tag, "")
            + " "
            + "\n".join(f"Step {k}: {step} {self.tag}" for k, step in enumerate(clean, 1))
        )

    def encode(self, question: str, steps: Sequence[str]) -> tuple[list[int], list[int]]:
        ids = encode_prompt(self.tokenizer, self.text(question, steps))
        return ids, tag_positions(ids, self.tag_id, len(steps), "math_shepherd")

    def step_logits(self, input_ids, attention_mask, positions):
        # the language-model head at the tags only: (B, S, vocab), never (B, T, vocab)
        hidden = self.model.base_model(input_ids=input_ids, attention_mask=attention_mask).last_hidden_state
        logits = self.model.get_output_embeddings()(gather(hidden, positions)).float()
        return logits[..., self.good_id] - logits[..., self.bad_id]


class QwenPRMScorer(AdapterScorer):
    """A PRM with a step-separator token and a two-class reward head (Qwen2.5-Math-PRM)."""

    def __init__(self, model, tokenizer, separator: str = QWEN_PRM_SEPARATOR, system: str = QWEN_PRM_SYSTEM, **kwargs):
        super().__init__(model, tokenizer, **kwargs)
        self.separator, self.system = separator, system
        self.separator_id = single_token(tokenizer, separator, "step separator")
        if not getattr(tokenizer, "chat_template", None):
            raise ValueError("a qwen_prm PRM's tokenizer needs a chat template (the steps go in the assistant turn)")

    auto_class = AutoModel

    def text(self, question: str, steps: Sequence[str]) -> str:
        answer = "".join(step.replace(self.separator, "") + self.separator for step in steps)
        messages = [
            {"role": "system", "content": self.system},
            {"role": "user", "content": question.replace(self.separator, "")},
            {"role": "assistant", "content": answer},
        ]
        return self.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=False)

    def encode(self, question: str, steps: Sequence[str]) -> tuple[list[int], list[int]]:
        ids = encode_prompt(self.tokenizer, self.text(question, steps))
        return ids, tag_positions(ids, self.separator_id, len(steps), "qwen_prm")

    def step_logits(self, input_ids, attention_mask, positions):
        outputs = self.model(input_ids=input_ids, attention_mask=attention_mask)
        logits = outputs.logits if hasattr(outputs, "logits") else outputs[0]
        if logits.shape[-1] != 2:
            raise ValueError(
                f"a qwen_prm PRM returns two-class logits per token, this one returns {logits.shape[-1]} per token"
            )
        logits = gather(logits, positions).float()
        return logits[..., 1] - logits[..., 0]


ADAPTERS = {
    "token_classification": TokenClassificationScorer,
    "math_shepherd": MathShepherdScorer,
    "qwen_prm": QwenPRMScorer,
}
