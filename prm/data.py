"""PRM training data: sequences with several labelled steps, their encoding, the collator.

A PRM example (pipeline.records.PRMExample) labels one step given its prefix. Its path is
prefix_steps + [step] and its label belongs at the last token of that step. Because the PRM is
causal, an example whose path is a prefix of another example's path (same question) can ride in
the longer one's sequence: the label sits at its own step's last token and sees exactly the
tokens it would see alone. ``group_records`` packs examples this way (``merge_prefixes``);
examples with the same path share one position, whose label is their mean and whose weight is
their count -- the summed BCE is the same, because BCE is linear in the label.

Sibling pairs (``sibling_pairs``): two labelled steps of one question that share their prefix and
whose labels differ -- in MCTS records, two rollouts' steps from one tree state, or the
first-error search's step beside another branch's. The pair loss (prm.train.prm_pair_loss)
ranks them; ``PRMDataset.pairs_within`` hands a micro-batch the pairs it holds, and
``iter_training_batches(groups=...)`` keeps siblings in one micro-batch.
"""

from __future__ import annotations

import difflib
import random
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field

import torch

from pipeline.prompts import prompt_from_config
from pipeline.records import PRMExample
from pipeline.steps import encode_prompt, encode_trajectory, join_steps

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


def group_records(
    records: Sequence[PRMExample], merge_prefixes: bool = True
) -> tuple[list[PRMSequence], list[tuple[int, int]]]:
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


@dataclass(frozen=True)
class SiblingPair:
    """Two labelled steps under the same prefix of one question, the first labelled higher.

    better, worse: (sequence index, step index) of each step in group_records' sequences
    gap:           label(better) - label(worse) > 0 (the mean labels of the merged records)
    """

    better: tuple[int, int]
    worse: tuple[int, int]
    gap: float


def sibling_pairs(sequences: Sequence[PRMSequence], min_gap: float = 0.0) -> list[SiblingPair]:
    """Every pair of distinct labelled steps that share (problem_id, question, prefix) and whose
    labels differ by more than ``min_gap``, in the order the sequences list them.

    A labelled position is a distinct path (group_records gives each path one position), so the
    children of one prefix are distinct step texts; a prefix with n labelled children gives up to
    n (n - 1) / 2 pairs.
    """
    children: dict[tuple[str, str, tuple[str, ...]], list[tuple[int, int, float]]] = {}
    for seq_index, sequence in enumerate(sequences):
        for step_index, (label, _) in sequence.labels.items():
            key = (sequence.problem_id, sequence.question, tuple(sequence.steps[:step_index]))
            children.setdefault(key, []).append((seq_index, step_index, label))
    pairs = []
    for siblings in children.values():
        for a in range(len(siblings)):
            for b in range(a + 1, len(siblings)):
                (seq_a, step_a, label_a), (seq_b, step_b, label_b) = siblings[a], siblings[b]
                if abs(label_a - label_b) <= min_gap:
                    continue
                high, low = (
                    ((seq_a, step_a), (seq_b, step_b)) if label_a > label_b else ((seq_b, step_b), (seq_a, step_a))
                )
                pairs.append(SiblingPair(high, low, abs(label_a - label_b)))
    return pairs


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
        segmented = encode_trajectory(
            self.tokenizer, "", steps, self.format_config.separator, add_end=False, prompt_ids=prompt_ids
        )
        return segmented.input_ids, [end - 1 for _, end in segmented.step_spans]


def encoding_problem(tokenizer, format_config, kind: str, question: str, steps: Sequence[str]) -> str | None:
    """What keeps ``tokenizer`` from reading the policy's text as the PRM encodes it (SolutionEncoder):
    None when the ids of the prompt (the one prompt builder's) and the steps (each with the separator)
    decode back to that text, else what changed, e.g. "decodes '7' as '<unk>' in 'has 7 apples'" (a
    vocabulary without the character: the step would be scored on <unk>s), or "has neither a pad nor
    an eos token to pad batches with"."""
    try:
        pad_token_id(tokenizer)
        ids, _ = SolutionEncoder(tokenizer, format_config, kind).encode(question, steps)
    except ValueError as error:  # no pad token; a step that encodes to no tokens
        return str(error).removeprefix("the tokenizer ")
    text = prompt_from_config(question, kind, tokenizer, format_config) + join_steps(steps, format_config.separator)
    decoded = tokenizer.decode(ids, skip_special_tokens=False, clean_up_tokenization_spaces=False)
    bos = tokenizer.bos_token
    if bos and decoded.startswith(bos) and not text.startswith(bos):  # the BOS encode_prompt adds
        decoded = decoded[len(bos) :]
    if decoded == text:
        return None
    matcher = difflib.SequenceMatcher(None, text, decoded, autojunk=False)
    _, start, end, decoded_start, decoded_end = next(op for op in matcher.get_opcodes() if op[0] != "equal")
    context = text[max(0, start - 20) : end + 20]
    return f"decodes {text[start:end]!r} as {decoded[decoded_start:decoded_end]!r} in {context!r}"


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

    def __init__(
        self,
        records: Sequence[PRMExample],
        tokenizer,
        format_config,
        kind: str,
        max_length: int,
        merge_prefixes: bool = True,
    ):
        self.sequences, _ = group_records(records, merge_prefixes)
        self.n_records = len(records)
        encoder = SolutionEncoder(tokenizer, format_config, kind)
        self.items: list[EncodedSequence] = []
        self.dropped_labels = 0.0
        item_of_sequence: dict[int, int] = {}
        slot_of_step: dict[int, dict[int, int]] = {}  # sequence -> {step index: label slot in its item}
        for seq_index, sequence in enumerate(self.sequences):
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
                kept = [k for k in sequence.labels if ends[k] < max_length]
                item_of_sequence[seq_index] = len(self.items) - 1
                slot_of_step[seq_index] = {k: slot for slot, k in enumerate(kept)}
        # sibling pairs whose two steps both kept their label, as (item, slot) of each
        self.pairs: list[tuple[int, int, int, int, float]] = []
        for pair in sibling_pairs(self.sequences):
            (seq_b, step_b), (seq_w, step_w) = pair.better, pair.worse
            slot_b = slot_of_step.get(seq_b, {}).get(step_b)
            slot_w = slot_of_step.get(seq_w, {}).get(step_w)
            if slot_b is not None and slot_w is not None:
                self.pairs.append((item_of_sequence[seq_b], slot_b, item_of_sequence[seq_w], slot_w, pair.gap))
        self._pairs_of_item: dict[int, list[int]] = {}
        for index, (item_b, _, _, _, _) in enumerate(self.pairs):
            self._pairs_of_item.setdefault(item_b, []).append(index)

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

    def pairs_within(self, indices: Sequence[int]) -> list[tuple[int, int, int, int, float]]:
        """The sibling pairs whose two steps are both in the micro-batch of items ``indices``, as
        (row of the better step, its slot, row of the worse step, its slot, label gap)."""
        row_of = {item: row for row, item in enumerate(indices)}
        found = []
        for item in indices:
            for index in self._pairs_of_item.get(item, ()):
                item_b, slot_b, item_w, slot_w, gap = self.pairs[index]
                if item_w in row_of:
                    found.append((row_of[item_b], slot_b, row_of[item_w], slot_w, gap))
        return found

    def sibling_groups(self) -> list[list[int]]:
        """The items linked by sibling pairs, as connected groups (every item in exactly one; an
        item without siblings alone), each in increasing order, groups by their first item."""
        parent = list(range(len(self.items)))

        def root(i: int) -> int:
            while parent[i] != i:
                parent[i] = parent[parent[i]]
                i = parent[i]
            return i

        for item_b, _, item_w, _, _ in self.pairs:
            parent[root(item_b)] = root(item_w)
        groups: dict[int, list[int]] = {}
        for i in range(len(self.items)):
            groups.setdefault(root(i), []).append(i)
        return sorted(groups.values(), key=lambda members: members[0])


class PRMCollator:
    """A list of EncodedSequence -> right-padded tensors.

    input_ids (B, T), attention_mask (B, T), score_positions (B, S) (padding: 0),
    labels (B, S) soft labels, label_mask (B, S) float weights (0 at padding); with ``pairs``
    (PRMDataset.pairs_within of the same items) also pair_better (P, 2) and pair_worse (P, 2),
    (row, slot) of each pair's two steps, and pair_gap (P,) their label gap.
    """

    def __init__(self, pad_token_id: int):
        self.pad_token_id = pad_token_id

    def __call__(
        self, items: Sequence[EncodedSequence], pairs: Sequence[tuple[int, int, int, int, float]] | None = None
    ) -> dict[str, torch.Tensor]:
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
        batch = {
            "input_ids": input_ids,
            "attention_mask": attention_mask,
            "score_positions": score_positions,
            "labels": labels,
            "label_mask": label_mask,
        }
        if pairs is not None:
            batch["pair_better"] = torch.tensor([[p[0], p[1]] for p in pairs], dtype=torch.long).reshape(-1, 2)
            batch["pair_worse"] = torch.tensor([[p[2], p[3]] for p in pairs], dtype=torch.long).reshape(-1, 2)
            batch["pair_gap"] = torch.tensor([p[4] for p in pairs], dtype=torch.float32)
        return batch


def pad_token_id(tokenizer) -> int:
    """The tokenizer's pad id, else its eos id (padding is masked out either way)."""
    pad = tokenizer.pad_token_id
    if pad is None:
        pad = tokenizer.eos_token_id
    if pad is None:
        raise ValueError("the tokenizer has neither a pad nor an eos token to pad batches with")
    return int(pad[0] if isinstance(pad, (list, tuple)) else pad)


# ----------------------------------------------------------------------------- batching


def length_bucketed_batches(
    lengths: Sequence[int], batch_size: int, rng: random.Random, bucket_batches: int = 50
) -> list[list[int]]:
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


def sibling_group_batches(groups: Sequence[Sequence[int]], batch_size: int, rng: random.Random) -> list[list[int]]:
    """Micro-batches that keep sibling groups together: the groups in random order, their items
    laid end to end and sliced every ``batch_size`` (a group that straddles a cut loses the pairs
    across it), then the batches shuffled."""
    order = list(range(len(groups)))
    rng.shuffle(order)
    flat = [item for g in order for item in groups[g]]
    batches = [flat[i : i + batch_size] for i in range(0, len(flat), batch_size)]
    rng.shuffle(batches)
    return batches


def iter_training_batches(
    lengths: Sequence[int],
    micro_batch_size: int,
    n_micro_batches: int,
    seed: int,
    group_by_length: bool = False,
    groups: Sequence[Sequence[int]] | None = None,
) -> Iterator[list[int]]:
    """``n_micro_batches`` micro-batches over as many epochs as that takes; epoch e is shuffled
    with Random(seed * 1_000_003 + e), so a resumed run sees the same stream.

    group_by_length=False (default): uniformly shuffled micro-batches. True: length-bucketed
    (length_bucketed_batches), less padding but each micro-batch holds sequences of one length,
    and a PRM sequence's length predicts its labels (later steps, shorter corrupted branches),
    so its gradient is biased batch by batch (docs/prm.md, "Batching"). ``groups`` (sibling
    groups, PRMDataset.sibling_groups; not with group_by_length): shuffled groups, each kept in
    one micro-batch where the cuts allow (sibling_group_batches), so the pair loss sees its pairs.
    """
    if groups is not None and group_by_length:
        raise ValueError("iter_training_batches: sibling groups and group_by_length cannot be combined")
    bucket_batches = 50 if group_by_length else 1  # a bucket of one batch is a plain shuffle
    produced, epoch = 0, 0
    while produced < n_micro_batches:
        rng = random.Random(seed * 1_000_003 + epoch)
        batches = (
            sibling_group_batches(groups, micro_batch_size, rng)
            if groups is not None
            else length_bucketed_batches(lengths, micro_batch_size, rng, bucket_batches)
        )
        for batch in batches:
            if produced >= n_micro_batches:
                return
            yield batch
            produced += 1
        epoch += 1
