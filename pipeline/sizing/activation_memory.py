"""What a training step's activations take, from a model's shape (pipeline.sizing.shapes): the tensors
autograd keeps for the backward pass of each layer (``activation_terms``, ``activation_bytes``,
with or without checkpointing, LoRA and dropout) and the logits (``logits_bytes``), which `make
plan` and each stage's start add to the weights and optimizer state.
"""

from __future__ import annotations

from pipeline.sizing.shapes import ModelShape

LORA_INPUTS = {  # a projection's input width, by its transformers name
    "q_proj": "h",
    "k_proj": "h",
    "v_proj": "h",
    "o_proj": "q",
    "gate_proj": "h",
    "up_proj": "h",
    "down_proj": "i",
}
LOGITS_BYTES_PER_VALUE = 20  # see logits_bytes


def dropout_mask_bytes(device_type: str) -> int:
    """Bytes a value of what dropout keeps for its backward: on CUDA ``native_dropout``'s boolean
    mask (1); on CPU torch's composite dropout multiplies by a float32 noise tensor and keeps it (4)."""
    return 1 if device_type == "cuda" else 4


def activation_terms(
    shape: ModelShape,
    sequences: int,
    tokens: int,
    checkpointing: bool = False,
    bytes_per_value: int = 2,
    lora_modules: tuple[str, ...] | list[str] | None = None,
    lora_rank: int = 0,
    lora_dropout: bool = False,
    padded: bool = True,
    mask_bytes: int = 1,
) -> dict[str, int]:
    """What autograd keeps for the backward pass of ``sequences`` x ``tokens`` through the decoder
    layers, term by term (bytes): transformers' Llama / Qwen2 layers with sdpa attention, weights
    in ``bytes_per_value`` (bf16: 2).

    lora_modules: None = full fine-tuning; else the projections peft wraps over a frozen base
    (each adapter float32, rank ``lora_rank``, ``lora_dropout`` > 0 or not); ``padded``: the
    micro-batch has padding, so sdpa gets a mask (transformers then repeats k and v to every
    head and sdpa keeps an additive mask per layer) instead of ``is_causal`` with grouped k/v;
    ``mask_bytes``: dropout_mask_bytes of the device.

    Per layer and token (h hidden, q = heads x head_dim, kv = kv heads x head_dim, i intermediate,
    b = bytes_per_value):
    - RMSNorm x 2: its float32 copy of the input (4h) and the reciprocal RMS (4);
    - attention: q, k and v as sdpa receives them and its output (b(2q + 2kv), kv = q when
      padded), the float32 log-sum-exp per head (4 x heads), plus b x tokens when padded (the mask);
    - MLP with a frozen base: the gate output (kept by SiLU), SiLU's output and the up output
      (kept by their product): 3bi;
    - each LoRA projection of input width d: peft's float32 copy of its input after dropout (4d,
      kept by lora_A), dropout's mask (mask_bytes x d) and lora_A's output (4r); a frozen base
      linear keeps no input (its weight needs no gradient);
    - full fine-tuning instead: every projection's input in b bytes (q/k/v share one, gate/up
      another): b(2h + q + i).
    The first layer's input norm keeps nothing when the embeddings are frozen (its input needs
    no gradient); the final norm keeps 4h + 4. With activation checkpointing only each layer's
    input (bh) is kept, plus one layer's whole set while it is recomputed.
    """
    h, q, kv, i = (
        shape.hidden_size,
        shape.num_heads * shape.head_dim,
        shape.num_kv_heads * shape.head_dim,
        shape.intermediate_size,
    )
    b, n, layers = bytes_per_value, sequences * tokens, shape.num_layers
    norm = 4 * h + 4
    kv_seen = q if padded else kv
    attention = b * (2 * q + 2 * kv_seen) + 4 * shape.num_heads
    mask = b * sequences * tokens * tokens if padded else 0  # sdpa's additive mask, one per layer
    lora = lora_modules is not None
    if lora:
        width = {"h": h, "q": q, "i": i}
        adapters = sum(
            4 * width[LORA_INPUTS[m]] + (mask_bytes * width[LORA_INPUTS[m]] if lora_dropout else 0) + 4 * lora_rank
            for m in lora_modules
            if m in LORA_INPUTS
        )
        mlp_inputs = 0
    else:
        adapters = 0
        mlp_inputs = b * (2 * h + q + i)
    per_layer = {
        "RMSNorm float32 inputs": 2 * norm * n,
        "attention (sdpa q, k, v, output, log-sum-exp; mask when padded)": attention * n + mask,
        "MLP (gate, SiLU, up)": 3 * b * i * n,
        "LoRA inputs (float32, dropout mask, lora_A output)": adapters * n,
        "projection inputs (full fine-tuning)": mlp_inputs * n,
    }
    if checkpointing:
        terms = {"layer inputs (checkpointed)": layers * b * h * n}
        terms.update({f"one layer recomputed: {k}": v for k, v in per_layer.items() if v})
        return terms
    terms = {k: layers * v for k, v in per_layer.items() if v}
    if not lora:  # the final norm; with LoRA it equals layer 0's input norm, which keeps nothing
        terms["RMSNorm float32 inputs"] += norm * n
    return terms


def activation_bytes(shape: ModelShape, sequences: int, tokens: int, checkpointing: bool, **settings) -> int:
    """The sum of activation_terms (bytes kept for the backward pass of the decoder layers)."""
    return sum(activation_terms(shape, sequences, tokens, checkpointing, **settings).values())


def logits_bytes(shape: ModelShape, sequences: int, positions: int) -> int:
    """The peak the log-probabilities over the vocabulary add, per value of the (sequences x
    positions x vocabulary) logits (pipeline.generation.step_logprobs.trajectory_logprobs; positions:
    from the shortest prompt's last token on): the backward of the float32 logsumexp, the first
    backward step, while every layer's activations are still kept, holds the float32 logits kept
    for it (4), the gradient already accumulated from the token and end-token gathers (4) and the
    three float32 temporaries of logsumexp's backward, ``grad * (logits - lse).exp()`` (12):
    20 bytes. (The forward holds at most 10: bf16 logits 2, their float32 cast 4, logsumexp's own
    temporary 4; the entropy PPO adds reuses these buffers in its backward and peaks at 20 too.)"""
    return LOGITS_BYTES_PER_VALUE * sequences * positions * shape.vocab_size
