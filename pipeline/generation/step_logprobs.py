"""Teacher-forced step log-probabilities: ONE forward pass per batch of trajectories.

For a trajectory s_0 -> s_1 -> ... -> s_n (-> s_f) encoded segment by segment
(pipeline.steps.SegmentedIds), with b_k the token index where state s_k ends (b_0 =
prompt_len, b_k = end of step k's span):

- log pi(s_k | s_{k-1}) = sum over t in step k's span of log p(x_t | x_<t)   (separator included)
- log pi(s_f | s_k)     = log p(end token at index b_k | x_<b_k)   (read from logits at b_k - 1)
- entropy of step k     = sum over t in step k's span of H(p(. | x_<t))
- boundary hidden of s_k = last-layer hidden state at index b_k - 1 (the position whose output
  decides between continuing and stopping; a PPO value head reads it)

All come from one forward over the right-padded batch. Logits are computed only from the
shortest prompt's last position on (``logits_to_keep``), and the log-softmax normaliser is a
float32 logsumexp, so the only (B, L, V) float32 tensor ever built is that one cast (none at all
for a float32 model); the token and end-token log-probs are gathered from it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from pipeline.steps import SegmentedIds


@dataclass
class TrajectoryLogprobs:
    """Per-step log-probs of a batch of B trajectories with at most T steps (model's device).

    step_logprobs:        (B, T)   log pi(s_k | s_{k-1}) for k = 1..T; 0 where mask is False
    termination_logprobs: (B, T+1) log pi(s_f | s_k) for k = 0..T; 0 for k > num_steps
    mask:                 (B, T)   True where step k exists
    num_steps:            (B,)     n of each trajectory
    step_entropy:         (B, T)   summed token entropies of each step (only when asked)
    boundary_hidden:      (B, T+1, H) last-layer hidden state at b_k - 1 (only when asked)
    """

    step_logprobs: torch.Tensor
    termination_logprobs: torch.Tensor
    mask: torch.Tensor
    num_steps: torch.Tensor
    step_entropy: torch.Tensor | None = None
    boundary_hidden: torch.Tensor | None = None


def _model_device(model) -> torch.device:
    return next(model.parameters()).device


def resolve_end_token(model, batch: Sequence[SegmentedIds], end_token_id: int | None) -> int:
    """The end-of-solution token: the one given, else the token at ``end_position`` of the
    finished trajectories (encode_trajectory puts pipeline.steps.end_token_id there), else the
    model config's eos."""
    if end_token_id is not None:
        return int(end_token_id)
    ends = {seg.input_ids[seg.end_position] for seg in batch if seg.end_position is not None}
    if len(ends) > 1:
        raise ValueError(
            f"trajectory_logprobs: trajectories end with different tokens {sorted(ends)}; pass end_token_id"
        )
    if ends:
        return int(ends.pop())
    eos = getattr(getattr(model, "config", None), "eos_token_id", None)
    if isinstance(eos, (list, tuple)):
        eos = eos[0] if eos else None
    if eos is None:
        raise ValueError(
            "trajectory_logprobs: no trajectory has an end token and the model config has no eos_token_id; pass end_token_id"
        )
    return int(eos)


def trajectory_logprobs(
    model,
    batch: Sequence[SegmentedIds],
    pad_token_id: int,
    *,
    end_token_id: int | None = None,
    with_grad: bool = False,
    return_entropy: bool = False,
    return_boundary_hidden: bool = False,
) -> TrajectoryLogprobs:
    """Step and termination log-probs of every trajectory in ``batch`` from one forward pass.

    batch:        SegmentedIds from pipeline.steps.encode_trajectory (with or without an end token)
    pad_token_id: id written in the right padding (masked out; its value never matters)
    end_token_id: the end-of-solution token (pipeline.steps.end_token_id); by default the token
                  at ``end_position`` of the finished trajectories (see resolve_end_token)
    with_grad:    keep the autograd graph (the trainer's loss); otherwise run under no_grad
    """
    if not batch:
        raise ValueError("trajectory_logprobs: empty batch")
    end_id = resolve_end_token(model, batch, end_token_id)
    context = torch.enable_grad() if with_grad else torch.no_grad()
    with context:
        return _trajectory_logprobs(model, batch, pad_token_id, int(end_id), return_entropy, return_boundary_hidden)


def _trajectory_logprobs(
    model, batch, pad_token_id, end_id, return_entropy, return_boundary_hidden
) -> TrajectoryLogprobs:
    device = _model_device(model)
    batch_size = len(batch)
    length = max(len(seg.input_ids) for seg in batch)
    max_steps = max(seg.num_steps for seg in batch)
    for i, seg in enumerate(batch):
        if seg.prompt_len < 1:
            raise ValueError(f"trajectory_logprobs: trajectory {i} has an empty prompt; the first step needs a context")
    # Logits are needed from the last prompt token of the shortest prompt onwards.
    first = min(seg.prompt_len for seg in batch) - 1

    input_ids = torch.full((batch_size, length), pad_token_id, dtype=torch.long)
    attention_mask = torch.zeros((batch_size, length), dtype=torch.long)
    # step_of_token[b, t] = k (0-based step) for tokens inside step k's span, -1 elsewhere.
    step_of_token = torch.full((batch_size, length), -1, dtype=torch.long)
    # boundary[b, k] = b_k - 1: the logit position that predicts what follows state s_k.
    boundary = torch.zeros((batch_size, max_steps + 1), dtype=torch.long)
    boundary_mask = torch.zeros((batch_size, max_steps + 1), dtype=torch.bool)
    for b, seg in enumerate(batch):
        ids = seg.input_ids
        input_ids[b, : len(ids)] = torch.tensor(ids, dtype=torch.long)
        attention_mask[b, : len(ids)] = 1
        boundary[b, 0] = seg.prompt_len - 1
        for k, (start, end) in enumerate(seg.step_spans):
            step_of_token[b, start:end] = k
            boundary[b, k + 1] = end - 1
        boundary_mask[b, : seg.num_steps + 1] = True
    num_steps = torch.tensor([seg.num_steps for seg in batch], dtype=torch.long)
    mask = torch.arange(max_steps)[None, :] < num_steps[:, None]

    input_ids, attention_mask = input_ids.to(device), attention_mask.to(device)
    # The last position is kept too: it holds the termination logit of an unfinished trajectory.
    keep = torch.arange(first, length, device=device)
    out = model(
        input_ids=input_ids,
        attention_mask=attention_mask,
        use_cache=False,
        logits_to_keep=keep,
        output_hidden_states=return_boundary_hidden,
    )
    logits = out.logits  # (B, L', V): position first + j predicts token first + j + 1
    logits32 = logits.float()
    log_normaliser = torch.logsumexp(logits32, dim=-1)  # (B, L')

    # Token first + j + 1 is predicted at kept position j; the last kept position predicts nothing.
    targets = torch.cat([input_ids[:, first + 1 :], input_ids.new_full((batch_size, 1), pad_token_id)], dim=1)
    token_logprobs = logits32.gather(-1, targets.unsqueeze(-1)).squeeze(-1) - log_normaliser
    end_logprobs = logits32[..., end_id] - log_normaliser

    step_index = torch.cat([step_of_token[:, first + 1 :], step_of_token.new_full((batch_size, 1), -1)], dim=1).to(
        device
    )
    in_step = step_index >= 0
    scatter_index = step_index.clamp(min=0)
    step_logprobs = torch.zeros((batch_size, max_steps), dtype=torch.float32, device=device)
    step_logprobs = step_logprobs.scatter_add(1, scatter_index, token_logprobs.masked_fill(~in_step, 0.0))

    boundary_dev = (boundary - first).clamp(min=0).to(device)
    boundary_mask_dev = boundary_mask.to(device)
    termination_logprobs = end_logprobs.gather(1, boundary_dev).masked_fill(~boundary_mask_dev, 0.0)

    step_entropy = None
    if return_entropy:
        probs = (logits32 - log_normaliser.unsqueeze(-1)).exp()
        token_entropy = log_normaliser - (probs * logits32).sum(-1)
        step_entropy = torch.zeros((batch_size, max_steps), dtype=torch.float32, device=device)
        step_entropy = step_entropy.scatter_add(1, scatter_index, token_entropy.masked_fill(~in_step, 0.0))

    boundary_hidden = None
    if return_boundary_hidden:
        hidden = out.hidden_states[-1]  # (B, L, H), after the final norm
        index = boundary.clamp(min=0).to(device)
        boundary_hidden = hidden.gather(1, index.unsqueeze(-1).expand(-1, -1, hidden.shape[-1]))
        boundary_hidden = boundary_hidden * boundary_mask_dev.unsqueeze(-1).to(hidden.dtype)

    return TrajectoryLogprobs(
        step_logprobs=step_logprobs,
        termination_logprobs=termination_logprobs,
        mask=mask.to(device),
        num_steps=num_steps.to(device),
        step_entropy=step_entropy,
        boundary_hidden=boundary_hidden,
    )


def trajectory_logprobs_chunked(
    model,
    batch: Sequence[SegmentedIds],
    pad_token_id: int,
    micro_batch_size: int,
    *,
    end_token_id: int | None = None,
    return_entropy: bool = False,
    return_boundary_hidden: bool = False,
) -> TrajectoryLogprobs:
    """``trajectory_logprobs`` without gradients, ``micro_batch_size`` trajectories per forward.

    The pieces are padded to the batch's largest step count and concatenated, so the result is
    the same as one call over the whole batch (up to floating-point batching effects).
    """
    if micro_batch_size < 1:
        raise ValueError(f"trajectory_logprobs_chunked: micro_batch_size must be >= 1, got {micro_batch_size}")
    if not batch:
        raise ValueError("trajectory_logprobs_chunked: empty batch")
    end_token_id = resolve_end_token(model, batch, end_token_id)
    max_steps = max(seg.num_steps for seg in batch)
    parts = [
        trajectory_logprobs(
            model,
            batch[i : i + micro_batch_size],
            pad_token_id,
            end_token_id=end_token_id,
            with_grad=False,
            return_entropy=return_entropy,
            return_boundary_hidden=return_boundary_hidden,
        )
        for i in range(0, len(batch), micro_batch_size)
    ]

    def cat(name: str, width: int) -> torch.Tensor | None:
        tensors = [getattr(p, name) for p in parts]
        if tensors[0] is None:
            return None
        padded = []
        for t in tensors:
            missing = width - t.shape[1]
            if missing:
                pad_shape = (t.shape[0], missing) + tuple(t.shape[2:])
                t = torch.cat([t, t.new_zeros(pad_shape)], dim=1)
            padded.append(t)
        return torch.cat(padded, dim=0)

    return TrajectoryLogprobs(
        step_logprobs=cat("step_logprobs", max_steps),
        termination_logprobs=cat("termination_logprobs", max_steps + 1),
        mask=cat("mask", max_steps),
        num_steps=torch.cat([p.num_steps for p in parts]),
        step_entropy=cat("step_entropy", max_steps),
        boundary_hidden=cat("boundary_hidden", max_steps + 1),
    )
