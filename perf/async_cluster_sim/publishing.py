"""Weight publication in the simulation: the trainer's own WeightPublisher (object store), the
sweep's bf16 payload, and the 1B-parameter publication fetched by one reader."""

from __future__ import annotations

import time

import torch

from pipeline.finetune.tba.publication import WeightPublisher, WeightReceiver, bucket_bytes


def publisher_for(weights, *, bucket_mb: float = 256.0) -> WeightPublisher:
    """The asynchronous trainer's own publisher (pipeline.finetune.tba.publication.WeightPublisher) with
    the object-store transport: bf16 buckets of ``bucket_mb`` MiB put in Ray's object store once,
    their references handed to the weights actor, from which every searcher fetches at the start of
    its next round. ``publish`` returns once the snapshot is packed and sends it in the background,
    as ``AsyncFinetuneTrainer.publish`` does; the next ``publish`` waits for the previous one."""
    return WeightPublisher(
        transport="object_store", weights=weights, dtype=torch.bfloat16, bucket_bytes=bucket_bytes(bucket_mb)
    )


def publish_weights(weights, searchers: list, state: dict, version: int, *, bucket_mb: float = 256.0) -> dict:
    """One publication waited for (the 1B-parameter measurement): {"seconds", "bytes", "buckets"},
    from the call until the references are handed out (packing included)."""

    publisher = publisher_for(weights, bucket_mb=bucket_mb)
    start = time.monotonic()
    publisher.publish(state, version, searchers)
    publisher.wait()
    seconds = time.monotonic() - start
    (publication,) = publisher.take_finished()
    publisher.close()
    return {"seconds": seconds, "bytes": publication.bytes, "buckets": publication.buckets}


def bf16_state(parameters: int, *, tensor_parameters: int = 64 * 2**20) -> dict:
    """A bf16 state dict of ``parameters`` values (tensors of at most ``tensor_parameters``, ones)."""
    state, left, index = {}, parameters, 0
    while left > 0:
        size = min(left, tensor_parameters)
        state[f"layer{index}.weight"] = torch.ones(size, dtype=torch.bfloat16)
        left, index = left - size, index + 1
    return state


def fetch_seconds(version: int, refs: list, layout: dict) -> dict:
    """One reader's fetch of a published version (a Ray task on this node, through the searchers'
    own WeightReceiver): seconds and bytes."""

    receiver = WeightReceiver("reader")
    start = time.monotonic()
    receiver.fetch(version, refs, layout)
    _, state = receiver.take()
    seconds = time.monotonic() - start
    return {"seconds": seconds, "bytes": sum(v.numel() * v.element_size() for v in state.values())}


def full_publication(weights, searchers: list, state: dict, version: int) -> dict:
    """The 1B-parameter bf16 payload published with the searchers stopped (each would fetch a copy, and
    N copies of 2 GB do not fit one machine; the object-store transport puts it once whatever N),
    then fetched by one reader."""
    import ray  # the optional extra (extra `distributed`)

    publication = publish_weights(weights, searchers, state, version)
    published, refs, layout, _ = ray.get(weights.latest.remote(-1))
    fetched = ray.get(ray.remote(num_cpus=0)(fetch_seconds).remote(published, refs, layout))
    ray.get(weights.publish.remote(version, None, None))  # drop the 2 GB object before the next point
    return {
        "full_publish_seconds": publication["seconds"],
        "full_publish_bytes": publication["bytes"],
        "full_fetch_seconds": fetched["seconds"],
    }
