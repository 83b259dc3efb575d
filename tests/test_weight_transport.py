"""The collective weight transport of the asynchronous mode: a two-member gloo group per searcher.

Both ends run in threads of this process (each group has its own TCPStore, outside
torch.distributed's global state, which is what lets them coexist); bounded by short timeouts.
"""

from __future__ import annotations

import datetime
import threading
import time

import pytest
import torch

from pipeline.finetune.weight_transport import PeerGone, WeightChannel, check_transport, state_spec

SHORT = datetime.timedelta(seconds=5)


def run_pair(state: dict[str, torch.Tensor], rounds: int = 1) -> list[dict[str, torch.Tensor]]:
    sender = WeightChannel.host("127.0.0.1", "gloo", timeout=SHORT)
    received, errors = [], []

    def searcher():
        try:
            channel = WeightChannel(*sender.address, timeout=SHORT).connect()
            for version in range(rounds):
                received.append(channel.receive(state_spec(state), "cpu", version))
        except Exception as error:  # reported by the main thread
            errors.append(error)

    thread = threading.Thread(target=searcher)
    thread.start()
    sender.connect()
    for version in range(rounds):
        sender.send(state, version)
    thread.join(timeout=30)
    assert not thread.is_alive() and not errors, errors
    return received


def test_every_tensor_arrives_bit_for_bit_in_its_dtype_and_shape():
    generator = torch.Generator().manual_seed(0)
    state = {
        "embed.weight": torch.randn(7, 5, generator=generator),
        "layer.0.bias": torch.randn(5, generator=generator, dtype=torch.float64),
        "norm.weight": torch.randn(3, 4, generator=generator).to(torch.bfloat16),
        "steps": torch.tensor(12345678901, dtype=torch.int64),
        "transposed": torch.randn(4, 6, generator=generator).t(),  # not contiguous on the sending side
    }
    [got] = run_pair(state)
    assert list(got) == list(state)
    for name, value in state.items():
        assert got[name].dtype == value.dtype and got[name].shape == value.shape, name
        assert torch.equal(got[name], value), name


def test_one_channel_carries_every_publication():
    state = {"w": torch.zeros(3)}
    received = run_pair(state, rounds=1)
    assert torch.equal(received[0]["w"], state["w"])
    second = run_pair({"w": torch.arange(4.0)}, rounds=3)
    assert len(second) == 3 and all(torch.equal(r["w"], torch.arange(4.0)) for r in second)


def test_a_searcher_that_never_comes_fails_the_trainer_within_the_timeout():
    sender = WeightChannel.host("127.0.0.1", "gloo", timeout=datetime.timedelta(seconds=2))
    with pytest.raises(PeerGone, match="within"):
        sender.connect()


def test_a_searcher_known_gone_fails_the_trainer_at_once_not_at_the_timeout():
    """The trainer watches the searcher's Ray call: ended before the handshake means it is not coming."""
    sender = WeightChannel.host("127.0.0.1", "gloo")  # the ten-minute timeout
    polls = []
    with pytest.raises(PeerGone, match="left before 'arrived'"):  # gone's error, not the timeout's ("within")
        sender.connect(gone=lambda: polls.append(1) or len(polls) == 3)
    assert len(polls) == 3  # the wait ended at the poll where gone() said so


def test_a_transfer_waits_for_the_searcher_to_be_ready_for_that_version():
    state = {"w": torch.arange(3.0)}
    sender = WeightChannel.host("127.0.0.1", "gloo", timeout=SHORT)
    receiver = WeightChannel(*sender.address, timeout=SHORT)
    thread = threading.Thread(target=receiver.connect)
    thread.start()
    sender.connect()
    thread.join(timeout=30)
    start = time.monotonic()
    with pytest.raises(PeerGone, match="left before 'ready/7'"):  # nobody receives version 7: no collective is entered
        sender.send(state, 7, gone=lambda: time.monotonic() - start > 0.2)
    got = {}
    thread = threading.Thread(target=lambda: got.update(receiver.receive(state_spec(state), "cpu", 8)))
    thread.start()
    sender.send(state, 8)  # the channel is still good for the next version
    thread.join(timeout=30)
    assert torch.equal(got["w"], state["w"])


def test_transport_names_are_checked():
    assert check_transport("collective") == "collective"
    with pytest.raises(ValueError, match="object_store | collective"):
        check_transport("nccl")
    with pytest.raises(ValueError, match="gloo or nccl"):
        WeightChannel("127.0.0.1", 1, "mpi")
