"""The sampler's weights gathered from a sharded policy piece by piece
(pipeline.training.base.gathered_state_dict, what TrainingBase.full_state_dict runs under FSDP2
and DeepSpeed ZeRO-3): FSDP2 one unit at a time, in 2 processes (gloo) under torchrun
(tests/fsdp2_gather_ranks.py); ZeRO-3 one parameter at a time.

DeepSpeed does not run on a CPU (accelerate turns it off with cpu=True), so ZeRO-3's gathering
context is played here by a stand-in that behaves as GatheredParameters(params, modifier_rank=None)
does to the tensors: between gathers a parameter's data is an empty tensor (its values kept aside,
as in ZeRO-3's partitions), inside the with block it is the whole float32 value, and when the block
ends that storage is overwritten and dropped (DeepSpeed frees it). tests/test_gpu.py runs the real
context under a one-process ZeRO-3 launch."""

from __future__ import annotations

import contextlib
import json
import os
import sys
from pathlib import Path

import pytest
import torch
from processes import run_bounded

from pipeline.training.base import gathered_state_dict

TESTS = Path(__file__).resolve().parent

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def tiny_llama(tied: bool = True) -> torch.nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=64,
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=2,
        tie_word_embeddings=tied,
    )
    return LlamaForCausalLM(config).float()


class StandInZero3:
    """Partitions every parameter of ``module`` (its data an empty tensor, the whole value kept
    aside) and gathers like GatheredParameters(params, modifier_rank=None): ``self(params)`` is a
    context in which each of ``params`` holds a freshly gathered whole value; on exit that storage
    is filled with NaN and the parameter partitioned again. It records every gather and the float32
    bytes gathered at once."""

    def __init__(self, module: torch.nn.Module):
        self.kept = {id(p): p.data for p in module.parameters()}
        for p in module.parameters():
            p.data = torch.empty(0, dtype=p.dtype)
        self.gathers: list[list[int]] = []
        self.live_bytes = 0
        self.peak_bytes = 0

    @contextlib.contextmanager
    def __call__(self, params):
        params = list(params)
        self.gathers.append([id(p) for p in params])
        for p in params:
            p.data = self.kept[id(p)].clone()
            self.live_bytes += p.data.numel() * p.data.element_size()
        self.peak_bytes = max(self.peak_bytes, self.live_bytes)
        try:
            yield
        finally:
            for p in params:
                self.live_bytes -= p.data.numel() * p.data.element_size()
                p.data.fill_(float("nan"))  # the gathered storage is reused or freed: nothing may keep it
                p.data = torch.empty(0, dtype=p.dtype)


def test_zero3_weights_are_gathered_one_parameter_at_a_time_and_cast_at_once():
    model = tiny_llama()
    expected = {name: value.detach().clone() for name, value in model.state_dict().items()}
    parameters = {id(p): p for p in model.parameters()}  # the tied embedding and lm_head: one parameter
    largest = max(p.numel() * p.element_size() for p in model.parameters())
    zero3 = StandInZero3(model)
    assert all(p.numel() == 0 for p in model.parameters())  # partitioned: the state dict alone holds nothing

    state = gathered_state_dict(model, torch.bfloat16, gather=zero3)

    assert list(state) == list(expected)  # the model's own names, in its order
    for name, value in expected.items():
        assert state[name].dtype == torch.bfloat16, name  # no float32 copy of any weight is kept
        assert torch.equal(state[name], value.to(torch.bfloat16)), name
    assert all(len(ids) == 1 for ids in zero3.gathers)  # one parameter a gather
    assert sorted(i for ids in zero3.gathers for i in ids) == sorted(parameters)  # each once (tied: once)
    assert zero3.peak_bytes == largest  # the float32 held beyond the result: one parameter at most
    assert state["lm_head.weight"] is state["model.embed_tokens.weight"]  # tied weights stay one tensor
    assert all(p.numel() == 0 for p in model.parameters())  # partitioned again


def test_weights_kept_in_their_own_dtype_are_copies_taken_inside_the_gather():
    """Without a dtype (the sampler takes the trained dtype) each tensor kept is a copy: the
    gathered storage is overwritten when its gather ends and the copy keeps its values."""
    model = tiny_llama(tied=False)
    expected = {name: value.detach().clone() for name, value in model.state_dict().items()}
    zero3 = StandInZero3(model)
    state = gathered_state_dict(model, gather=zero3)
    assert list(state) == list(expected)
    for name, value in expected.items():
        assert state[name].dtype == torch.float32 and torch.equal(state[name], value), name
    assert state["lm_head.weight"] is not state["model.embed_tokens.weight"]


def test_lora_weights_are_gathered_under_the_peft_names():
    from peft import LoraConfig, get_peft_model

    model = get_peft_model(tiny_llama(), LoraConfig(r=2, lora_alpha=4, target_modules=["q_proj", "v_proj"]))
    expected = {name: value.detach().clone() for name, value in model.state_dict().items()}
    state = gathered_state_dict(model, torch.bfloat16, gather=StandInZero3(model))
    assert list(state) == list(expected)
    assert any("lora_A" in name for name in state)
    for name, value in expected.items():
        assert torch.equal(state[name], value.to(torch.bfloat16)), name


def test_fsdp2_weights_are_gathered_one_unit_at_a_time_with_one_all_gather_each(tmp_path):
    """Two processes shard a tiny Llama (2 decoder layers and the root: 3 FSDP2 units) and gather
    it: every tensor equals the unsharded model's, in bf16 and in the trained dtype, with one
    all-gather per unit and no per-tensor full_tensor (under bf16 mixed precision, float32 asked
    for: one tensor at a time by full_tensor); the tied weights stay one tensor and the
    model is sharded again afterwards and computes what it did before sharding."""
    command = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc_per_node",
        "2",
        str(TESTS / "fsdp2_gather_ranks.py"),
        str(tmp_path),
    ]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
    returncode, out = run_bounded(command, env=env, timeout=180)
    assert returncode == 0, out[-4000:]
    for rank in (0, 1):
        result = json.loads((tmp_path / f"rank{rank}.json").read_text())
        assert result["units"] == 3
        for label in ("bf16", "own", "mixed_bf16", "mixed_own"):
            gathered = result[label]
            assert gathered["names"] and gathered["equal"] and gathered["tied_once"], (rank, label, gathered)
        for label in ("bf16", "own", "mixed_bf16"):  # the units gather in the dtype kept
            assert result[label]["all_gathers"] == 3 and result[label]["full_tensor"] == 0, (rank, result[label])
        # bf16 mixed precision asked for float32: the first unit's bf16 gather is of no use, so every
        # tensor is gathered whole in float32 by its own full_tensor, the other units left alone
        assert result["mixed_own"] == {**result["mixed_own"], "all_gathers": 1, "full_tensor": result["tensors"]}
        assert result["sharded_again"] and result["same_logits"], result
