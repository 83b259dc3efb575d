"""PRM training data: sequences with several labelled steps, their encoding, the collator.

A PRM example (pipeline.records.PRMExample) labels one step given its prefix. Its path is
prefix_steps + [step] and its label belongs at the last token of that step. Because the PRM is
causal, an example whose path is a prefix of another example's path (same question) can ride in
the longer one's sequence: the label sits at its own step's last token and sees exactly the
tokens it would see alone. ``group_records`` packs examples this way (``merge_prefixes``);
examples with the same path share one position, whose label is their mean and whose weight is
their count -- the summed BCE is the same, because BCE is linear in the label.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from typing import Iterator, Sequence

import torch

from pipeline.prompts import prompt_from_config
from pipeline.records import PRMExample
from pipeline.steps import encode_prompt, encode_trajectory

# ----------------------------------------------------------------------------- sequences


@dataclass
class PRMSequence:
    """One solution path scored in one forward pass, with the labels of the records it carries.

    steps:   the path (question's steps s_1..s_n)
    labels:  {step index (0-based): (mean label, weight = number of records)}
    """

    problem_id: str
    question: str
    steps: list[str]
    labels: dict[int, tuple[float, float]] = field(default_factory=dict)


def group_records(records: Sequence[PRMExample], merge_prefixes: bool = True) -> tuple[list[PRMSequence], list[tuple[int, int]]]:
    """Pack records into sequences; returns (sequences, slots) with slots[i] = (sequence index,
    step index) of record i.

    With merge_prefixes, each question's paths are taken longest first and a path that is a
    prefix of one already taken joins it; otherwise only identical paths share a sequence.
    """
    order = sorted(range(len(records)), key=lambda i: -len(records[i].path)) if merge_prefixes else range(len(records))
    sequences: list[PRMSequence] = []
    owner: dict[tuple[str, str, tuple[str, ...]], int] = {}  # (problem, question, path) -> sequence
    slots: list[tuple[int, int]] = [(-1, -1)] * len(records)
    sums: list[dict[int, list[float]]] = []
    for i in order:
        record = records[i]
        path = record.path
        key = (record.problem_id, record.question, path)
        seq = owner.get(key)
        if seq is None:
            seq = len(sequences)
            sequences.append(PRMSequence(record.problem_id, record.question, list(path)))
            sums.append({})
            prefixes = range(1, len(path) + 1) if merge_prefixes else [len(path)]
            for n in prefixes:
                owner.setdefault((record.problem_id, record.question, path[:n]), seq)
        step_index = len(path) - 1
        total = sums[seq].setdefault(step_index, [0.0, 0.0])
        total[0] += record.label
        total[1] += 1.0
        slots[i] = (seq, step_index)
    for sequence, label_sums in zip(sequences, sums):
        sequence.labels = {k: (s / n, n) for k, (s, n) in sorted(label_sums.items())}
    return sequences, slots


# ----------------------------------------------------------------------------- encoding


class SolutionEncoder:
    """prompt + steps -> (input_ids, index of each step's last token), the PRM's one input format.

    The prompt ids of a question are cached: many sequences share a question.
    """

    def __init__(self, tokenizer, format_config, kind: str, cache_size: int = 4096):
        self.tokenizer, self.format_config, self.kind = tokenizer, format_config, kind
        self._prompt_ids: dict[str, list[int]] = {}
        self._cache_size = cache_size

    def prompt_ids(self, question: str) -> list[int]:
        ids = self._prompt_ids.get(question)
        if ids is None:
            prompt = prompt_from_config(question, self.kind, self.tokenizer, self.format_config)
            ids = encode_prompt(self.tokenizer, prompt)
            if len(self._prompt_ids) >= self._cache_size:
                self._prompt_ids.clear()
            self._prompt_ids[question] = ids
        return ids

    def encode(self, question: str, steps: Sequence[str]) -> tuple[list[int], list[int]]:
        prompt_ids = self.prompt_ids(question)
        segmented = encode_trajectory(self.tokenizer, "", steps, self.format_config.separator, add_end=False, prompt_ids=prompt_ids)
        return segmented.input_ids, [end - 1 for _, end in segmented.step_spans]


@dataclass
class EncodedSequence:
    input_ids: list[int]
    score_positions: list[int]
    labels: list[float]
    weights: list[float]

    def __len__(self) -> int:
        return len(self.input_ids)


class PRMDataset(torch.utils.data.Dataset):
    """Encoded PRM sequences. Labels of steps ending beyond ``max_length`` tokens are dropped
    (counted in ``dropped_labels``); a sequence is cut after its last kept labelled step."""

    def __init__(self, records: Sequence[PRMExample], tokenizer, format_config, kind: str, max_length: int, merge_prefixes: bool = True):
        self.sequences, _ = group_records(records, merge_prefixes)
        self.n_records = len(records)
        encoder = SolutionEncoder(tokenizer, format_config, kind)
        self.items: list[EncodedSequence] = []
        self.dropped_labels = 0.0
        for sequence in self.sequences:
            ids, ends = encoder.encode(sequence.question, sequence.steps)
            positions, labels, weights = [], [], []
            for step_index, (label, weight) in sequence.labels.items():
                if ends[step_index] < max_length:
                    positions.append(ends[step_index])
                    labels.append(label)
                    weights.append(weight)
                else:
                    self.dropped_labels += weight
            if positions:
                self.items.append(EncodedSequence(ids[: max(positions) + 1], positions, labels, weights))

    def __len__(self) -> int:
        return len(self.items)

    def __getitem__(self, index: int) -> EncodedSequence:
        return self.items[index]

    @property
    def lengths(self) -> list[int]:
        return [len(item) for item in self.items]

    @property
    def n_labels(self) -> float:
        return sum(sum(item.weights) for item in self.items)


class PRMCollator:
    """A list of EncodedSequence -> right-padded tensors.

    input_ids (B, T), attention_mask (B, T), score_positions (B, S) (padding: 0),
    labels (B, S) soft labels, label_mask (B, S) float weights (0 at padding).
    """

    def __init__(self, pad_token_id: int):
        self.pad_token_id = pad_token_id

    def __call__(self, items: Sequence[EncodedSequence]) -> dict[str, torch.Tensor]:
        width = max(len(item) for item in items)
        steps = max(len(item.score_positions) for item in items)
        batch = len(items)
        input_ids = torch.full((batch, width), self.pad_token_id, dtype=torch.long)
        attention_mask = torch.zeros((batch, width), dtype=torch.long)
        score_positions = torch.zeros((batch, steps), dtype=torch.long)
        labels = torch.zeros((batch, steps), dtype=torch.float32)
        label_mask = torch.zeros((batch, steps), dtype=torch.float32)
        for row, item in enumerate(items):
            n, s = len(item.input_ids), len(item.score_positions)
            input_ids[row, :n] = torch.tensor(item.input_ids, dtype=torch.long)
            attention_mask[row, :n] = 1
            score_positions[row, :s] = torch.tensor(item.score_positions, dtype=torch.long)
            labels[row, :s] = torch.tensor(item.labels, dtype=torch.float32)
            label_mask[row, :s] = torch.tensor(item.weights, dtype=torch.float32)
        return {"input_ids": input_ids, "attention_mask": attention_mask, "score_positions": score_positions,
                "labels": labels, "label_mask": label_mask}


def pad_token_id(tokenizer) -> int:
    """The tokenizer's pad id, else its eos id (padding is masked out either way)."""
    pad = tokenizer.pad_token_id
    if pad is None:
        pad = tokenizer.eos_token_id
    if pad is None:
        raise ValueError("the tokenizer has neither a pad nor an eos token to pad batches with")
    return int(pad[0] if isinstance(pad, (list, tuple)) else pad)


# ----------------------------------------------------------------------------- batching


def length_bucketed_batches(lengths: Sequence[int], batch_size: int, rng: random.Random, bucket_batches: int = 50) -> list[list[int]]:
    """Micro-batches of indices with similar lengths, in random order.

    Shuffle, cut into buckets of ``batch_size * bucket_batches`` items, sort each bucket by
    length, slice it into batches, shuffle the batches: little padding, yet every epoch mixes.
    """
    order = list(range(len(lengths)))
    rng.shuffle(order)
    bucket = max(1, batch_size * bucket_batches)
    batches: list[list[int]] = []
    for start in range(0, len(order), bucket):
        chunk = sorted(order[start : start + bucket], key=lambda i: lengths[i])
        batches.extend(chunk[i : i + batch_size] for i in range(0, len(chunk), batch_size))
    rng.shuffle(batches)
    return batches


def sorted_batches(lengths: Sequence[int], batch_size: int) -> list[list[int]]:
    """Deterministic batches for inference: indices sorted by length (longest first), sliced."""
    order = sorted(range(len(lengths)), key=lambda i: -lengths[i])
    return [order[i : i + batch_size] for i in range(0, len(order), batch_size)]


def iter_training_batches(
    lengths: Sequence[int], micro_batch_size: int, n_micro_batches: int, seed: int, group_by_length: bool = False
) -> Iterator[list[int]]:
    """``n_micro_batches`` micro-batches over as many epochs as that takes; epoch e is shuffled
    with Random(seed * 1_000_003 + e), so a resumed run sees the same stream.

    group_by_length=False (default): uniformly shuffled micro-batches. True: length-bucketed
    (length_bucketed_batches), less padding but each micro-batch holds sequences of one length,
    and a PRM sequence's length predicts its labels (later steps, shorter corrupted branches),
    so its gradient is biased batch by batch (docs/prm.md, "Batching").
    """
    bucket_batches = 50 if group_by_length else 1  # a bucket of one batch is a plain shuffle
    produced, epoch = 0, 0
    while produced < n_micro_batches:
        rng = random.Random(seed * 1_000_003 + epoch)
        for batch in length_bucketed_batches(lengths, micro_batch_size, rng, bucket_batches):
            if produced >= n_micro_batches:
                return
            yield batch
            produced += 1
        epoch += 1
