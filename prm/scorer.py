"""The one PRM scorer: step scores U(s_k|s_{k-1}) of whole solutions, batched.

Search, the GFlowNet and PPO call it. Every solution is scored in one forward pass (the head
reads each step's last token); solutions are sorted by length into batches, so little compute
goes to padding, and the results come back in the input order.
"""

from __future__ import annotations

from pathlib import Path
from typing import Sequence

import torch
import torch.nn.functional as F

from pipeline.modeling import load_tokenizer
from prm.data import SolutionEncoder, pad_token_id, sorted_batches
from prm.model import ProcessRewardModel

Solution = tuple[str, Sequence[str]]  # (question, steps)


class PRMScorer:
    """Scores solutions with a ProcessRewardModel.

    format_config: the FormatConfig the PRM was trained with (None: the one saved with it)
    kind:          the prompt kind (None: the one saved with it)
    batch_size:    solutions per forward pass
    device:        where inputs go (None: the model's device)
    """

    def __init__(self, model: ProcessRewardModel, tokenizer, format_config=None, kind: str | None = None,
                 batch_size: int = 64, device: str | torch.device | None = None):
        self.model = model.eval()
        self.tokenizer = tokenizer
        self.format_config = format_config if format_config is not None else model.info.format_config()
        self.kind = kind if kind is not None else model.info.kind
        self.batch_size = max(1, int(batch_size))
        self.device = torch.device(device) if device is not None else model.device
        self.encoder = SolutionEncoder(tokenizer, self.format_config, self.kind)
        self.pad_token_id = pad_token_id(tokenizer)

    @classmethod
    def from_pretrained(cls, path: str | Path, config) -> "PRMScorer":
        """A scorer for the PRM saved at ``path`` (config: the pipeline Config; its model section
        gives device, dtype and trust_remote_code, prm.score_batch_size the batch size)."""
        model = ProcessRewardModel.from_pretrained(path, config.model)
        tokenizer = load_tokenizer(str(path), trust_remote_code=config.model.trust_remote_code)
        return cls(model, tokenizer, batch_size=config.prm.score_batch_size)

    # ------------------------------------------------------------------ public

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

    @torch.inference_mode()
    def logits_many(self, solutions: Sequence[Solution]) -> list[torch.Tensor]:
        """Head logits (float32, CPU) per step of each solution; U = sigmoid(logit)."""
        encoded = [self.encoder.encode(question, list(steps)) for question, steps in solutions]
        results: list[torch.Tensor] = [torch.empty(0)] * len(encoded)
        lengths = [len(ids) for ids, _ in encoded]
        for batch in sorted_batches(lengths, self.batch_size):
            batch = [i for i in batch if encoded[i][1]]  # solutions without steps score nothing
            if not batch:
                continue
            width = max(lengths[i] for i in batch)
            n_steps = max(len(encoded[i][1]) for i in batch)
            input_ids = torch.full((len(batch), width), self.pad_token_id, dtype=torch.long)
            attention_mask = torch.zeros((len(batch), width), dtype=torch.long)
            positions = torch.zeros((len(batch), n_steps), dtype=torch.long)
            for row, i in enumerate(batch):
                ids, ends = encoded[i]
                input_ids[row, : len(ids)] = torch.tensor(ids)
                attention_mask[row, : len(ids)] = 1
                positions[row, : len(ends)] = torch.tensor(ends)
            logits = self.model(input_ids.to(self.device), attention_mask.to(self.device), positions.to(self.device))
            logits = logits.float().cpu()
            for row, i in enumerate(batch):
                results[i] = logits[row, : len(encoded[i][1])].clone()
        return results
