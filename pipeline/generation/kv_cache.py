"""The HF backend's KV cache: full-attention layers whose keys and values are written in place
into a buffer that doubles when full (``PreallocatedLayer``), instead of transformers' DynamicLayer,
which re-concatenates the whole cache at every decoded token (docs/generation.md).
"""

from __future__ import annotations

import torch
from transformers.cache_utils import DynamicCache, DynamicLayer

# Decoding positions the cache has room for before its first doubling.
INITIAL_ROOM = 32


class PreallocatedLayer(DynamicLayer):
    """A DynamicLayer whose keys/values live in a buffer with room for ``capacity`` positions.

    DynamicLayer.update re-concatenates the whole cache at every decoded token (O(length) copy
    per step; 35% of decoding time for a tiny-world chunk of 256 rows on CPU). Here a step writes
    only its new positions; ``keys``/``values`` are views of the filled part, so attention still
    reads only what is there. The buffer doubles when full, so room is paid for only as
    sequences actually grow (most stop long before max_new_tokens). Row gathers (expanding
    prompts to samples, dropping finished rows) work as in DynamicLayer.
    """

    def __init__(self, capacity: int):
        super().__init__()
        self.capacity = capacity
        self.length = 0
        self._key_buffer: torch.Tensor | None = None
        self._value_buffer: torch.Tensor | None = None

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        self.dtype, self.device = key_states.dtype, key_states.device
        batch, heads, _, key_dim = key_states.shape
        self._key_buffer = key_states.new_empty((batch, heads, self.capacity, key_dim))
        self._value_buffer = value_states.new_empty(
            (batch, value_states.shape[1], self.capacity, value_states.shape[-1])
        )
        self.length = 0
        self.is_initialized = True
        self._refresh_views()

    def _refresh_views(self) -> None:
        self.keys = self._key_buffer[:, :, : self.length]
        self.values = self._value_buffer[:, :, : self.length]

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        end = self.length + key_states.shape[-2]
        if end > self.capacity:  # grow by doubling: amortised O(1) per token, live rows only
            self.capacity = max(end, 2 * self.capacity)
            for name in ("_key_buffer", "_value_buffer"):
                old = getattr(self, name)
                grown = old.new_empty(old.shape[:2] + (self.capacity,) + old.shape[3:])
                grown[:, :, : self.length] = old[:, :, : self.length]
                setattr(self, name, grown)
        self._key_buffer[:, :, self.length : end] = key_states
        self._value_buffer[:, :, self.length : end] = value_states
        self.length = end
        self._refresh_views()
        return self.keys, self.values

    def get_seq_length(self) -> int:
        return self.length if self.is_initialized else 0

    def get_max_length(self) -> int:
        return -1

    def reset(self) -> None:
        self._key_buffer = self._value_buffer = None
        self.length = 0
        super().reset()

    def crop(self, tokens_to_remove: int) -> None:
        if tokens_to_remove > 0:
            raise ValueError("PreallocatedLayer.crop takes a negative number of tokens to remove")
        if tokens_to_remove and self.is_initialized:
            self.length = max(0, self.length + tokens_to_remove)
            self._refresh_views()

    def batch_repeat_interleave(self, repeats: int) -> None:
        if self.is_initialized:
            self._key_buffer = self._key_buffer.repeat_interleave(repeats, dim=0)
            self._value_buffer = self._value_buffer.repeat_interleave(repeats, dim=0)
            self._refresh_views()

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        # Only the filled positions are copied. Dropping rows (fewer indices than rows) packs the
        # kept rows into the front of the same buffer: fresh multi-megabyte allocations cost
        # more than the copy itself on CPU (first-touch page faults), measured.
        if not self.is_initialized:
            return
        count = len(indices)
        for name in ("_key_buffer", "_value_buffer"):
            buffer = getattr(self, name)
            if count <= buffer.shape[0]:
                gathered = buffer[indices, :, : self.length]
                buffer = buffer[:count]
                buffer[:, :, : self.length] = gathered
            else:  # expanding prompts to samples: the room behind is small (INITIAL_ROOM)
                buffer = buffer.index_select(0, indices)
            setattr(self, name, buffer)
        self._refresh_views()


def preallocated_cache(model, capacity: int) -> DynamicCache:
    """A DynamicCache for ``model`` whose full-attention layers are PreallocatedLayers.

    Layers of any other kind (sliding window, linear attention) are kept as transformers builds
    them, so every architecture still works; only the plain ones get the faster append.
    """
    cache = DynamicCache(config=model.config)
    if cache.layers and all(type(layer) is DynamicLayer for layer in cache.layers):
        cache.layers = [PreallocatedLayer(capacity) for _ in cache.layers]
    return cache
