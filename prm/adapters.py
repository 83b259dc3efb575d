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
- ``result_likelihood``: a causal LM, the policy itself, as a verifier that needs no training:
  U = the LM's probability of the results the step writes (pipeline.steps.step_result_spans),
  given the policy's prompt (pipeline.prompts), the earlier steps and the step's text before each
  result, tokenized as the policy's trajectories are (pipeline.steps.encode_trajectory);
  logit = log U - log(1 - U) (+inf for a step that writes no number).

The PRMs are frozen: loaded in eval mode on model.device in model.dtype; trust_remote_code
from model.trust_remote_code (Qwen2.5-Math-PRM needs it).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from transformers import AutoModel, AutoModelForCausalLM, AutoModelForTokenClassification

from pipeline.config.schema import FormatConfig
from pipeline.modeling import hub_model_errors, load_tokenizer, model_kwargs
from pipeline.prompts import INSTRUCTIONS, prompt_from_config
from pipeline.steps import encode_prompt, encode_step, encode_trajectory, step_result_spans
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


def result_token_offsets(tokenizer, step: str, separator: str) -> list[int]:
    """Indices, into the step's ids (pipeline.steps.encode_step), of the tokens that write its
    results: each result's number with the whitespace before it (tokenizers such as the tiny
    world's write " 7" as one token). Found by tokenizing the step in pieces cut at the results;
    an error when the pieces do not give the ids the whole step does (a token that crosses a cut).
        "x = 3 + 4 = 7" -> pieces "x = 3 + 4 =", " 7", "\\n" -> the indices of " 7"'s tokens
    """

    def piece(text: str) -> list[int]:
        return list(tokenizer(text, add_special_tokens=False)["input_ids"]) if text else []

    ids: list[int] = []
    offsets: list[int] = []
    cut = 0
    for start, end in step_result_spans(step):
        start = len(step[:start].rstrip())
        ids += piece(step[cut:start])
        result = piece(step[start:end])
        offsets += range(len(ids), len(ids) + len(result))
        ids += result
        cut = end
    ids += piece(step[cut:] + separator)
    whole = encode_step(tokenizer, step, separator)
    if ids != whole:
        raise ValueError(
            f"result_likelihood: the step {step!r} tokenizes to {whole} whole but to {ids} cut at its results; "
            f"a token crosses a result's edge, so the result's tokens cannot be told apart (docs/prm.md, "
            f"result_likelihood)"
        )
    return offsets


def policy_prompt_kind(kind: str | None, tokenizer, format_config) -> str:
    """The prompt kind the policy's prompts were built with: ``kind`` (prm.kind) when given; else
    any, when the prompt builder gives every kind the same prompt (a plain template without
    few-shot exemplars); else an error (the instruction of a chat template depends on it)."""
    if kind:
        return kind
    prompts = {prompt_from_config("?", name, tokenizer, format_config) for name in INSTRUCTIONS}
    if len(prompts) > 1:
        raise ValueError(
            f"model.prm_format=result_likelihood: the policy's prompt depends on the problems' kind (chat template "
            f"or few-shot exemplars); set prm.kind to one of {', '.join(INSTRUCTIONS)}"
        )
    return next(iter(INSTRUCTIONS))


class ResultLikelihoodScorer(AdapterScorer):
    """A causal LM (the policy) scoring a step by its probability of the results the step writes.

    format_config: the policy's FormatConfig (prompt template, separator)
    kind:          the prompt kind the policy's prompts are built with (policy_prompt_kind)
    """

    def __init__(self, model, tokenizer, format_config=None, kind: str | None = None, **kwargs):
        super().__init__(model, tokenizer, **kwargs)
        self.format_config = format_config if format_config is not None else FormatConfig()
        self.kind = kind
        self.prompt_kind = policy_prompt_kind(kind, tokenizer, self.format_config)

    auto_class = AutoModelForCausalLM

    @classmethod
    def from_pretrained(cls, path: str, config) -> ResultLikelihoodScorer:
        return cls(
            *cls.load(path, config),
            format_config=config.format,
            kind=config.prm.kind,
            batch_size=config.prm.score_batch_size,
        )

    def encode_results(self, question: str, steps: Sequence[str]) -> tuple[list[int], list[int], list[int]]:
        """(ids, positions, owners): the policy's ids of prompt + steps, the position of every
        result token, and the step each belongs to."""
        prompt = prompt_from_config(question, self.prompt_kind, self.tokenizer, self.format_config)
        trajectory = encode_trajectory(self.tokenizer, prompt, steps, self.format_config.separator, add_end=False)
        positions, owners = [], []
        for k, (step, (start, _)) in enumerate(zip(steps, trajectory.step_spans)):
            offsets = result_token_offsets(self.tokenizer, step, self.format_config.separator)
            positions += [start + offset for offset in offsets]
            owners += [k] * len(offsets)
        return trajectory.input_ids, positions, owners

    def token_logprobs(self, input_ids, attention_mask, positions):
        """log p(x_t | x_<t) at positions t (B, S); the LM head at positions t - 1 only."""
        hidden = self.model.base_model(input_ids=input_ids, attention_mask=attention_mask).last_hidden_state
        logits = self.model.get_output_embeddings()(gather(hidden, (positions - 1).clamp(min=0))).float()
        return logits.log_softmax(-1).gather(-1, gather(input_ids, positions).unsqueeze(-1)).squeeze(-1)

    def logits_many(self, solutions: Sequence[Solution]) -> list[torch.Tensor]:
        encoded = [self.encode_results(question, list(steps)) for question, steps in solutions]
        token_logprobs = batched_step_logits(
            [(ids, positions) for ids, positions, _ in encoded],
            self.batch_size,
            self.pad_token_id,
            self.device,
            self.token_logprobs,
        )
        results = []
        for (_, steps), (_, _, owners), logprobs in zip(solutions, encoded, token_logprobs):
            log_u = torch.zeros(len(steps), dtype=torch.float64)
            log_u.index_add_(0, torch.tensor(owners, dtype=torch.long), logprobs.double())
            results.append((log_u - torch.log(-torch.expm1(log_u))).float())  # sigmoid(logit) = exp(log_u)
        return results


ADAPTERS = {
    "token_classification": TokenClassificationScorer,
    "math_shepherd": MathShepherdScorer,
    "qwen_prm": QwenPRMScorer,
    "result_likelihood": ResultLikelihoodScorer,
}
