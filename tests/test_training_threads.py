"""A training loop's own torch thread count (bootstrap.torch_threads, prm.torch_threads)."""

import pytest
import torch

from pipeline.training.threads import training_threads


def test_training_threads_sets_the_count_for_the_block_and_restores_it_even_on_error():
    before = torch.get_num_threads()
    target = 1 if before != 1 else 2
    with training_threads(target, "prm"):
        assert torch.get_num_threads() == target
    assert torch.get_num_threads() == before
    with pytest.raises(RuntimeError), training_threads(target, "prm"):
        raise RuntimeError("a failing training loop")
    assert torch.get_num_threads() == before
    with training_threads(0, "prm"):  # 0: the stage's count stays
        assert torch.get_num_threads() == before
