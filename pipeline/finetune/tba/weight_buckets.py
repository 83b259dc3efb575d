"""Weights as a few flat byte buckets: what the asynchronous mode publishes (docs/async.md, "Weight publication").

A state dict is cast to the sampler's dtype (floating tensors; the others keep their own) and
packed, in its own order, into uint8 buckets of at most ``bucket_bytes`` each (a tensor larger than
that gets a bucket of its own). Each tensor starts at a 16-byte-aligned offset, so the receiving end
reads it back as a view of its dtype without a copy. The layout (names, shapes, dtypes, offsets) is
plain data both ends agree on; the buckets are raw bytes: nothing is pickled.

    >>> state = {"w": torch.zeros(3, 4), "step": torch.tensor(7)}
    >>> layout = BucketLayout.plan(state, dtype=torch.bfloat16, bucket_bytes=16)
    >>> [(s.name, s.dtype, s.bucket, s.offset) for s in layout.slots], layout.sizes
    ([('w', 'bfloat16', 0, 0), ('step', 'int64', 1, 0)], (24, 8))
"""

from __future__ import annotations

import dataclasses

import torch

ALIGN = 16  # bytes: every tensor's offset in its bucket, so a view of any dtype is aligned


def aligned(offset: int) -> int:
    return -(-offset // ALIGN) * ALIGN


def published_dtype(value: torch.Tensor, dtype: torch.dtype | None) -> torch.dtype:
    """The dtype ``value`` is published in: ``dtype`` for a floating tensor (None: its own), its own otherwise."""
    return dtype if dtype is not None and value.is_floating_point() else value.dtype


@dataclasses.dataclass(frozen=True)
class Slot:
    """Where one tensor lives: bucket index and byte offset, its shape and dtype name."""

    name: str
    shape: tuple[int, ...]
    dtype: str
    bucket: int
    offset: int

    @property
    def torch_dtype(self) -> torch.dtype:
        return getattr(torch, self.dtype)

    @property
    def nbytes(self) -> int:
        numel = 1
        for size in self.shape:
            numel *= size
        return numel * self.torch_dtype.itemsize

    def view(self, bucket: torch.Tensor) -> torch.Tensor:
        """This tensor, as a view of the bucket's bytes."""
        return bucket[self.offset : self.offset + self.nbytes].view(self.torch_dtype).view(self.shape)


@dataclasses.dataclass(frozen=True)
class BucketLayout:
    """slots: every tensor, in the state dict's order; sizes: bytes of each bucket."""

    slots: tuple[Slot, ...]
    sizes: tuple[int, ...]

    @classmethod
    def plan(cls, state: dict[str, torch.Tensor], *, dtype: torch.dtype | None, bucket_bytes: int) -> BucketLayout:
        """The layout of ``state`` with floating tensors in ``dtype`` (None: every tensor keeps its
        own), a new bucket started whenever the next tensor would take the current one past
        ``bucket_bytes``."""
        if bucket_bytes < 1:
            raise ValueError(f"bucket_bytes must be positive, got {bucket_bytes}")
        slots, sizes, used = [], [], 0
        for name, value in state.items():
            target = published_dtype(value, dtype)
            nbytes = value.numel() * target.itemsize
            offset = aligned(used)
            if not sizes or (used > 0 and offset + nbytes > bucket_bytes):
                sizes.append(0)
                offset = 0
            slots.append(Slot(name, tuple(value.shape), str(target).removeprefix("torch."), len(sizes) - 1, offset))
            used = offset + nbytes
            sizes[-1] = used
        return cls(tuple(slots), tuple(sizes))

    @property
    def total_bytes(self) -> int:
        return sum(self.sizes)

    def matches(self, state: dict[str, torch.Tensor], *, dtype: torch.dtype | None) -> bool:
        """Whether ``state``, published in ``dtype`` (as ``plan``), has this layout's names, shapes and
        dtypes, in its order (the layout can be reused: a tensor whose dtype changed takes another
        number of bytes, and a receiver would read it back in the old one)."""
        pairs = zip(state.items(), self.slots)
        return len(state) == len(self.slots) and all(
            k == s.name and tuple(v.shape) == s.shape and published_dtype(v, dtype) == s.torch_dtype
            for (k, v), s in pairs
        )

    def pack(self, state: dict[str, torch.Tensor], device: torch.device | str = "cpu") -> list[torch.Tensor]:
        """``state`` cast and copied into new uint8 buckets on ``device`` (a snapshot: the state may change after)."""
        buckets = [torch.empty(size, dtype=torch.uint8, device=device) for size in self.sizes]
        for slot in self.slots:
            slot.view(buckets[slot.bucket]).copy_(state[slot.name].detach())
        return buckets

    def empty(self, device: torch.device | str = "cpu") -> list[torch.Tensor]:
        """Buckets to receive into."""
        return [torch.empty(size, dtype=torch.uint8, device=device) for size in self.sizes]

    def unpack(self, buckets: list[torch.Tensor]) -> dict[str, torch.Tensor]:
        """The state dict, as views of ``buckets`` (which must hold this layout's sizes)."""
        if [int(b.numel()) for b in buckets] != list(self.sizes):
            sizes = [int(b.numel()) for b in buckets]
            raise ValueError(f"buckets of {sizes} bytes do not match the layout's {list(self.sizes)}")
        return {slot.name: slot.view(buckets[slot.bucket]) for slot in self.slots}

    def to_json(self) -> dict:
        slots = [[s.name, list(s.shape), s.dtype, s.bucket, s.offset] for s in self.slots]
        return {"slots": slots, "sizes": list(self.sizes)}

    @classmethod
    def from_json(cls, obj: dict) -> BucketLayout:
        slots = tuple(
            Slot(name, tuple(shape), dtype, bucket, offset) for name, shape, dtype, bucket, offset in obj["slots"]
        )
        for slot in slots:
            if not isinstance(getattr(torch, slot.dtype, None), torch.dtype):
                raise ValueError(f"weight layout: tensor {slot.name!r} has unknown dtype {slot.dtype!r}")
        return cls(slots, tuple(obj["sizes"]))
