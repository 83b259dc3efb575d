"""Weight publication's pieces without Ray: the byte buckets, and the trainer's process group with every searcher.

The group's members run in threads of this process (each group has its own TCPStore, outside
torch.distributed's global state, which is what lets them coexist); bounded by short timeouts.
"""

from __future__ import annotations

import datetime
import threading
import time

import pytest
import torch

from pipeline.finetune.tba.weight_buckets import ALIGN, BucketLayout
from pipeline.finetune.tba.weight_transport import PeerGone, WeightGroup, check_transport

SHORT = datetime.timedelta(seconds=5)


def mixed_state() -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(0)
    return {
        "embed.weight": torch.randn(7, 5, generator=generator),
        "layer.0.bias": torch.randn(5, generator=generator, dtype=torch.float64),
        "norm.weight": torch.randn(3, 4, generator=generator).to(torch.bfloat16),
        "steps": torch.tensor(12345678901, dtype=torch.int64),
        "transposed": torch.randn(4, 6, generator=generator).t(),  # not contiguous on the sending side
        "mask": torch.tensor([True, False, True]),
    }


def cast(state: dict[str, torch.Tensor], dtype: torch.dtype | None) -> dict[str, torch.Tensor]:
    return {k: v.to(dtype) if dtype is not None and v.is_floating_point() else v for k, v in state.items()}


@pytest.mark.parametrize("dtype", [None, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("bucket_bytes", [1, 64, 1 << 20])
def test_buckets_give_back_every_tensor_bit_for_bit_in_the_samplers_dtype(dtype, bucket_bytes):
    state = mixed_state()
    layout = BucketLayout.plan(state, dtype=dtype, bucket_bytes=bucket_bytes)
    buckets = layout.pack(state)
    assert all(b.dtype == torch.uint8 for b in buckets) and [b.numel() for b in buckets] == list(layout.sizes)
    if bucket_bytes == 1:  # every tensor is larger than a bucket: one bucket each
        assert len(buckets) == len(state)
    if bucket_bytes == 1 << 20:
        assert len(buckets) == 1
    assert all(slot.offset % ALIGN == 0 for slot in layout.slots)
    for index, size in enumerate(layout.sizes):  # a bucket is over the size only with a single tensor in it
        assert size <= bucket_bytes or sum(slot.bucket == index for slot in layout.slots) == 1
    got = BucketLayout.from_json(layout.to_json()).unpack([b.clone() for b in buckets])
    expected = {k: v.clone() for k, v in cast(state, dtype).items()}
    assert list(got) == list(state)
    for name, value in expected.items():
        assert got[name].dtype == value.dtype and got[name].shape == value.shape, name
        assert torch.equal(got[name], value), name
    state["embed.weight"].add_(1.0)  # the buckets are a snapshot
    assert torch.equal(layout.unpack(buckets)["embed.weight"], expected["embed.weight"])


def test_a_bucket_holds_as_many_tensors_as_fit_and_a_layout_is_reused_only_for_the_same_shapes_and_dtypes():
    state = {f"w{i}": torch.zeros(4) for i in range(5)}  # 16 bytes each
    layout = BucketLayout.plan(state, dtype=None, bucket_bytes=40)
    assert layout.sizes == (32, 32, 16) and [s.bucket for s in layout.slots] == [0, 0, 1, 1, 2]
    assert layout.matches({f"w{i}": torch.ones(4) for i in range(5)}, dtype=None)
    assert not layout.matches({f"w{i}": torch.ones(5) for i in range(5)}, dtype=None)
    # the same names and shapes in another dtype take other bytes: the layout is not reused
    assert not layout.matches({f"w{i}": torch.ones(4, dtype=torch.bfloat16) for i in range(5)}, dtype=None)
    assert not layout.matches(state, dtype=torch.bfloat16)
    halves = BucketLayout.plan(state, dtype=torch.bfloat16, bucket_bytes=40)
    assert halves.matches(state, dtype=torch.bfloat16)  # float32 weights published in bfloat16, as planned
    assert halves.matches({k: v.to(torch.bfloat16) for k, v in state.items()}, dtype=torch.bfloat16)
    steps = {"step": torch.tensor(3, dtype=torch.int64)}  # not floating: keeps its own dtype whatever is asked
    assert not BucketLayout.plan(steps, dtype=None, bucket_bytes=40).matches(
        {"step": torch.tensor(3, dtype=torch.int32)}, dtype=torch.bfloat16
    )
    with pytest.raises(ValueError, match="unknown dtype 'complex_thing'"):
        BucketLayout.from_json({"slots": [["w", [1], "complex_thing", 0, 0]], "sizes": [8]})
    with pytest.raises(ValueError, match="do not match the layout"):
        layout.unpack([torch.zeros(3, dtype=torch.uint8)])


def run_group(buckets: list[torch.Tensor], members: int, versions: list[int]) -> list[list[list[torch.Tensor]]]:
    """The trainer sends ``buckets`` for each version to ``members`` receiving threads; what each received."""
    sender = WeightGroup.host("127.0.0.1", "gloo", 1 + members, timeout=SHORT)
    received = [[] for _ in range(members)]
    errors = []

    def searcher(rank: int):
        try:
            group = WeightGroup(*sender.address, rank=rank, timeout=SHORT).connect()
            for version in versions:
                received[rank - 1].append(group.receive([b.numel() for b in buckets], version))
        except Exception as error:  # reported by the main thread
            errors.append(error)

    threads = [threading.Thread(target=searcher, args=(rank,)) for rank in range(1, members + 1)]
    for thread in threads:
        thread.start()
    sender.connect()
    for version in versions:
        sender.send(buckets, version)
    for thread in threads:
        thread.join(timeout=30)
    assert not any(t.is_alive() for t in threads) and not errors, errors
    return received


def test_one_broadcast_per_bucket_reaches_every_member_bit_for_bit():
    state = mixed_state()
    layout = BucketLayout.plan(state, dtype=torch.bfloat16, bucket_bytes=48)
    buckets = layout.pack(state)
    assert len(buckets) >= 3
    received = run_group(buckets, members=3, versions=[0, 1])
    for per_member in received:
        assert len(per_member) == 2
        for got in per_member:
            assert all(torch.equal(a, b) for a, b in zip(got, buckets))
            unpacked = layout.unpack(got)
            assert all(torch.equal(unpacked[k], v) for k, v in cast(state, torch.bfloat16).items())


def test_a_member_that_never_comes_fails_the_trainer_within_the_timeout_naming_its_rank():
    sender = WeightGroup.host("127.0.0.1", "gloo", 3, timeout=datetime.timedelta(seconds=2))
    outcome = []
    arrived = threading.Thread(target=lambda: outcome.append(_connect_or_error(sender.address, 1)))
    arrived.start()
    with pytest.raises(PeerGone, match=r"no searchers of ranks \[2\] at 'arrived'") as error:
        sender.connect()
    assert error.value.ranks == [2]
    arrived.join(timeout=10)
    assert isinstance(outcome[0], PeerGone) and "called the group off" in str(outcome[0])  # told, not left waiting


def _connect_or_error(address, rank):
    try:
        return WeightGroup(*address, rank=rank, timeout=SHORT).connect()
    except PeerGone as error:
        return error


def test_a_member_known_gone_calls_the_transfer_off_for_all_and_the_group_serves_the_next_version():
    """The trainer watches the searchers' Ray calls: one ended before it said 'ready' is not coming;
    the ready ones return without weights instead of waiting in a broadcast."""
    buckets = [torch.arange(8, dtype=torch.uint8)]
    sender = WeightGroup.host("127.0.0.1", "gloo", 3)  # the ten-minute timeout: the wait below ends by gone()
    members = [WeightGroup(*sender.address, rank=rank, timeout=SHORT) for rank in (1, 2)]
    threads = [threading.Thread(target=m.connect) for m in members]
    for thread in threads:
        thread.start()
    sender.connect()
    for thread in threads:
        thread.join(timeout=30)
    got = []
    ready = threading.Thread(target=lambda: got.append(members[0].receive([8], 7)))
    ready.start()
    start = time.monotonic()
    with pytest.raises(PeerGone, match=r"ranks \[2\] left before 'ready/7'"):
        sender.send(buckets, 7, gone=lambda: [2] if time.monotonic() - start > 0.2 else [])
    ready.join(timeout=10)
    assert got == [None]  # called off
    results = [None, None]
    threads = [threading.Thread(target=lambda i=i: results.__setitem__(i, members[i].receive([8], 8))) for i in (0, 1)]
    for thread in threads:
        thread.start()
    sender.send(buckets, 8)
    for thread in threads:
        thread.join(timeout=30)
    assert all(torch.equal(r[0], buckets[0]) for r in results)


def test_transport_names_are_checked():
    assert check_transport("collective") == "collective"
    with pytest.raises(ValueError, match="object_store | collective"):
        check_transport("nccl")
    with pytest.raises(ValueError, match="gloo or nccl"):
        WeightGroup("127.0.0.1", 1, "mpi", 2)


def blocking_sends(monkeypatch) -> tuple[dict[int, threading.Event], list, dict[int, list[torch.Tensor]]]:
    """WeightPublisher's object-store send replaced by one that records it and blocks until the
    test releases its version: (release events by version, the ordered log, the buckets each got)."""
    from pipeline.finetune.tba.publication import WeightPublisher

    release = {version: threading.Event() for version in (1, 2)}
    log, sent = [], {}

    def send(self, buckets, version):
        log.append(("start", version))
        sent[version] = [bucket.clone() for bucket in buckets]
        release[version].wait(timeout=10)
        log.append(("end", version))

    monkeypatch.setattr(WeightPublisher, "_send_object_store", send)
    return release, log, sent


def test_a_publication_is_sent_in_the_background_from_a_snapshot_of_the_weights(monkeypatch):
    """publish returns while the send is still blocked (the trainer's next update goes on), and what
    is sent is the weights as they were when publish was called, not as training changes them."""
    from pipeline.finetune.tba.publication import WeightPublisher

    release, log, sent = blocking_sends(monkeypatch)
    publisher = WeightPublisher(transport="object_store", weights=None, dtype=torch.bfloat16, bucket_bytes=64)
    state = {"w": torch.ones(8)}
    try:
        publisher.publish(state, 1, [])
        assert ("end", 1) not in log  # publish did not wait for the send
        state["w"].add_(1.0)  # the next update changes the weights
        release[1].set()
        publisher.wait()
        assert log == [("start", 1), ("end", 1)]
        got = publisher.layout.unpack(sent[1])["w"]
        assert got.dtype == torch.bfloat16 and torch.equal(got, torch.ones(8, dtype=torch.bfloat16))
        [publication] = publisher.take_finished()
        assert publication.version == 1 and publication.bytes >= 16
    finally:
        for event in release.values():
            event.set()
        publisher.close()


def test_the_next_publication_starts_only_after_the_previous_one_ended(monkeypatch):
    from pipeline.finetune.tba.publication import WeightPublisher

    release, log, _ = blocking_sends(monkeypatch)
    publisher = WeightPublisher(transport="object_store", weights=None, dtype=None, bucket_bytes=64)
    state = {"w": torch.ones(8)}
    try:
        publisher.publish(state, 1, [])
        second = threading.Thread(target=publisher.publish, args=(state, 2, []))
        second.start()
        # were the second send not held back, it would start meanwhile (bounded wait, not a timing claim)
        deadline = time.monotonic() + 1.0
        while ("start", 2) not in log and time.monotonic() < deadline:
            time.sleep(0.01)
        release[1].set()
        second.join(timeout=10)
        release[2].set()
        publisher.wait()
        assert log == [("start", 1), ("end", 1), ("start", 2), ("end", 2)]
        assert [p.version for p in publisher.take_finished()] == [1, 2]
    finally:
        for event in release.values():
            event.set()
        publisher.close()


def test_a_publisher_forms_a_new_group_when_the_layout_changes_as_when_its_members_do(monkeypatch):
    """Over the collective, members receive into buckets of the layout they were given when the
    group formed: a publication with another layout (here a tensor's dtype changed) forms a new group."""
    from pipeline.finetune.tba.publication import WeightPublisher

    monkeypatch.setattr(WeightPublisher, "_run", lambda self, buckets, version, searchers, start: None)  # no send
    publisher = WeightPublisher(transport="collective", weights=None, dtype=None, bucket_bytes=64)
    members = {0: 101, 1: 102}
    publisher.publish({"w": torch.ones(8), "steps": torch.tensor(1)}, 1, [])
    publisher.group, publisher.members, publisher.group_layout = object(), dict(members), publisher.layout  # formed
    assert not publisher.needs_new_group(members)
    assert publisher.needs_new_group({0: 101, 1: 999})  # a searcher restarted
    publisher.publish({"w": torch.ones(8), "steps": torch.tensor(2)}, 2, [])  # same layout: the group serves it
    assert not publisher.needs_new_group(members)
    publisher.publish({"w": torch.ones(8, dtype=torch.float64), "steps": torch.tensor(3)}, 3, [])
    assert publisher.needs_new_group(members)
    publisher.close()
