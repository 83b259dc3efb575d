"""The one PRM scorer API: step scores U(s_k|s_{k-1}) of whole solutions, batched.

Search, the GFlowNet, PPO, evaluation and validation call it. ``StepScorer`` is the interface
(score_many / log_scores_many / logits_many, from one method, logits_many); ``PRMScorer`` scores
our own PRM, and prm.adapters the PRMs of other formats; ``prm.formats.load_scorer`` picks one
from what a folder or hub id holds. Every solution is scored in one forward pass (the head
reads each step's last token); solutions are sorted by length into batches, so little compute
goes to padding, and the results come back in the input order.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path

import torch
import torch.nn.functional as F

from pipeline.modeling import load_tokenizer
from prm.data import SolutionEncoder, pad_token_id, sorted_batches
from prm.model import ProcessRewardModel

Solution = tuple[str, Sequence[str]]  # (question, steps)


class StepScorer:
    """What every PRM scorer offers. A subclass implements ``logits_many``: per solution, one
    float32 CPU logit per step with U = sigmoid(logit) (a two-class head's logit is l_1 - l_0,
    whose sigmoid is exactly its softmax probability of class 1).

    kind: the prompt kind the PRM was trained with, where it has one (None: not ours to say)
    """

    kind: str | None = None

    def score(self, question: str, steps: Sequence[str]) -> list[float]:
        """U(s_k|s_{k-1}) in (0, 1) for every step of one solution."""
        return self.score_many([(question, steps)])[0]

    def log_scores(self, question: str, steps: Sequence[str]) -> list[float]:
        """log U(s_k|s_{k-1}) for every step of one solution."""
        return self.log_scores_many([(question, steps)])[0]

    def score_many(self, solutions: Sequence[Solution]) -> list[list[float]]:
        """Step scores of many solutions, in their order."""
        return [torch.sigmoid(row).tolist() for row in self.logits_many(solutions)]

    def log_scores_many(self, solutions: Sequence[Solution]) -> list[list[float]]:
        """log U of every step of many solutions (logsigmoid of the logit: finite even where U
        rounds to 0 in float32)."""
        return [F.logsigmoid(row).tolist() for row in self.logits_many(solutions)]

    def logits_many(self, solutions: Sequence[Solution]) -> list[torch.Tensor]:
        """Per solution, a (n_steps,) float32 CPU tensor of logits, U = sigmoid(logit)."""
        raise NotImplementedError


class PRMScorer(StepScorer):
    """Scores solutions with a ProcessRewardModel (ours).

    format_config: the FormatConfig the PRM was trained with (None: the one saved with it)
    kind:          the prompt kind (None: the one saved with it)
    batch_size:    solutions per forward pass
    device:        where inputs go (None: the model's device)
    """

    def __init__(
        self,
        model: ProcessRewardModel,
        tokenizer,
        format_config=None,
        kind: str | None = None,
        batch_size: int = 64,
        device: str | torch.device | None = None,
    ):
        self.model = model.eval()
        self.tokenizer = tokenizer
        self.format_config = format_config if format_config is not None else model.info.format_config()
        self.kind = kind if kind is not None else model.info.kind
        self.batch_size = max(1, int(batch_size))
        self.device = torch.device(device) if device is not None else model.device
        self.encoder = SolutionEncoder(tokenizer, self.format_config, self.kind)
        self.pad_token_id = pad_token_id(tokenizer)

    @classmethod
    def from_pretrained(cls, path: str | Path, config) -> PRMScorer:
        """A scorer for the PRM saved at ``path`` (config: the pipeline Config; its model section
        gives device, dtype and trust_remote_code, prm.score_batch_size the batch size)."""
        model = ProcessRewardModel.from_pretrained(path, config.model)
        # the PRM's loader checked the folder
        tokenizer = load_tokenizer(str(path), trust_remote_code=config.model.trust_remote_code, check=False)
        return cls(model, tokenizer, batch_size=config.prm.score_batch_size)

    def logits_many(self, solutions: Sequence[Solution]) -> list[torch.Tensor]:
        """Head logits (float32, CPU) per step of each solution; U = sigmoid(logit)."""
        encoded = [self.encoder.encode(question, list(steps)) for question, steps in solutions]
        return batched_step_logits(
            encoded,
            self.batch_size,
            self.pad_token_id,
            self.device,
            lambda ids, mask, positions: self.model(ids, mask, positions),
        )


StepLogits = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


@torch.inference_mode()
def batched_step_logits(
    encoded: Sequence[tuple[list[int], list[int]]],
    batch_size: int,
    pad_id: int,
    device: torch.device,
    forward: StepLogits,
) -> list[torch.Tensor]:
    """Step logits of encoded solutions, batched by length and returned in their order.

    encoded: per solution (input ids, index of the token each step's score is read at)
    forward(input_ids (B, T), attention_mask (B, T), positions (B, S)) -> (B, S) logits; rows are
             right-padded with ``pad_id``, positions with 0 (ignored)
    returns: per solution a (n_steps,) float32 CPU tensor (empty for a solution without steps)
    """
    results: list[torch.Tensor] = [torch.empty(0)] * len(encoded)
    lengths = [len(ids) for ids, _ in encoded]
    for batch in sorted_batches(lengths, batch_size):
        batch = [i for i in batch if encoded[i][1]]  # solutions without steps score nothing
        if not batch:
            continue
        width = max(lengths[i] for i in batch)
        n_steps = max(len(encoded[i][1]) for i in batch)
        input_ids = torch.full((len(batch), width), pad_id, dtype=torch.long)
        attention_mask = torch.zeros((len(batch), width), dtype=torch.long)
        positions = torch.zeros((len(batch), n_steps), dtype=torch.long)
        for row, i in enumerate(batch):
            ids, ends = encoded[i]
            input_ids[row, : len(ids)] = torch.tensor(ids)
            attention_mask[row, : len(ids)] = 1
            positions[row, : len(ends)] = torch.tensor(ends)
        logits = forward(input_ids.to(device), attention_mask.to(device), positions.to(device)).float().cpu()
        for row, i in enumerate(batch):
            results[i] = logits[row, : len(encoded[i][1])].clone()
    return results
