"""The sampler's weights gathered from a sharded policy piece by piece
(pipeline.training.gathering.iter_gathered, what TrainingBase.iter_full_state streams under FSDP2 and
DeepSpeed ZeRO-3, and gathered_state_dict, the stream kept whole): FSDP2 one unit at a time, in 2
processes (gloo) under torchrun (tests/fsdp2_gather_ranks.py); ZeRO-3 one parameter at a time;
streamed into a sampler's copy through LMPolicy.after_update without a second copy of the model.

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
import weakref
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from processes import run_bounded
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from pipeline.training.gathering import gathered_state_dict, iter_gathered

TESTS = Path(__file__).resolve().parent

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def tiny_llama(tied: bool = True, layers: int = 2) -> torch.nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=64,
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=layers,
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


# ---------------------------------------------------------------- streamed into the sampler


class MadeTensors(TorchDispatchMode):
    """Every tensor an operation makes while the mode is on, remembered by a weak reference with
    its storage (data pointer, bytes): what of it is still alive can be asked at any time."""

    def __init__(self):
        super().__init__()
        self.made: list[tuple[weakref.ref, int, int]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for value in tree_leaves(out):
            if isinstance(value, torch.Tensor):
                storage = value.untyped_storage()
                self.made.append((weakref.ref(value), storage.data_ptr(), storage.nbytes()))
        return out

    def live_bytes(self, exclude: set[int]) -> int:
        """Bytes of the storages made and still alive, those in ``exclude`` left out."""
        live = {ptr: size for ref, ptr, size in self.made if ref() is not None and ptr not in exclude}
        return sum(live.values())


class MemoryProbe(StandInZero3):
    """StandInZero3 that, inside every gather (the whole float32 value just made), measures the
    bytes of the tensors made during the sync and alive then, beyond the sampler's own weights
    (which the sync copies into): the gathered tensor itself and whatever the sync still holds of
    the earlier ones."""

    def start(self, made: MadeTensors, sampler_model: torch.nn.Module) -> None:
        self.made, self.peak_extra = made, 0
        self.own = {p.untyped_storage().data_ptr() for p in sampler_model.state_dict().values()}

    @contextlib.contextmanager
    def __call__(self, params):
        with super().__call__(params):
            gathered = {p.untyped_storage().data_ptr(): p.untyped_storage().nbytes() for p in params}
            made = self.made.live_bytes(self.own | set(gathered))  # its Python object is gone: counted here
            self.peak_extra = max(self.peak_extra, made + sum(gathered.values()))
            yield


NO_TOKENIZER = SimpleNamespace(pad_token_id=0)  # the sampler is only loaded here, never generates
LAYERS = 4  # enough that half the model is several times the largest tensor


def trained_and_sampler(kind: str):
    """(trained model, the sampler's plain bf16 copy with other values, LoRA scaling or None)."""
    from peft import LoraConfig, get_peft_model

    trained = tiny_llama(tied=kind != "plain", layers=LAYERS)
    scaling = None
    if kind == "lora":
        trained = get_peft_model(trained, LoraConfig(r=2, lora_alpha=4, target_modules=["q_proj", "v_proj"]))
        scaling = 4 / 2
        with torch.no_grad():  # B starts at zero: a merge that forgot B A would pass unseen
            for name, p in trained.named_parameters():
                if "lora_B" in name:
                    p.copy_(torch.randn_like(p))
    torch.manual_seed(1)
    sampler_model = tiny_llama(tied=kind != "plain", layers=LAYERS).to(torch.bfloat16)
    with torch.no_grad():
        for p in sampler_model.parameters():
            p.normal_()  # every weight differs from the trained one until the sync
    return trained, sampler_model, scaling


@pytest.mark.parametrize("kind", ["plain", "tied", "lora"])
def test_the_sampler_takes_the_gathered_weights_one_tensor_at_a_time(kind):
    """LMPolicy.after_update streams iter_gathered (LoRA merged module by module) into the
    sampler's copy: while any parameter is gathered, the sync holds at most one more tensor (LoRA:
    one module's base weight and adapters), never the whole model; the sampler ends with what the
    whole-dict path gives, bit for bit, each parameter gathered once (tied ones too)."""
    from pipeline.finetune.policy import LMPolicy
    from pipeline.generation.hf import HFGenerator
    from pipeline.modeling import merge_lora_state_dict

    trained, sampler_model, scaling = trained_and_sampler(kind)
    # the whole-dict path, on a second copy of the same trained weights
    dict_trained, dict_sampler, _ = trained_and_sampler(kind)
    dict_state = gathered_state_dict(
        dict_trained, None if scaling else torch.bfloat16, gather=StandInZero3(dict_trained)
    )
    if scaling is not None:
        dict_state = merge_lora_state_dict(dict_state, scaling)
    HFGenerator(dict_sampler, NO_TOKENIZER, end_token_ids=[0]).load_weights(dict_state)
    expected = {name: value.clone() for name, value in dict_sampler.state_dict().items()}
    if scaling is not None:  # the merge written out: W + alpha/r B A, in float32, then the sampler's bf16
        params = dict(trained.named_parameters())
        for layer in range(LAYERS):
            for proj in ("q_proj", "v_proj"):
                prefix = f"base_model.model.model.layers.{layer}.self_attn.{proj}"
                base = params[f"{prefix}.base_layer.weight"]
                delta = params[f"{prefix}.lora_B.default.weight"] @ params[f"{prefix}.lora_A.default.weight"]
                merged = (base + scaling * delta).to(torch.bfloat16)
                assert torch.equal(expected[f"model.layers.{layer}.self_attn.{proj}.weight"], merged)
    del dict_trained, dict_sampler, dict_state

    parameters = {id(p): p for p in trained.parameters()}
    sizes = sorted(p.numel() * 4 for p in trained.parameters())
    probe = MemoryProbe(trained)
    sampler = HFGenerator(sampler_model, NO_TOKENIZER, end_token_ids=[0])
    policy = LMPolicy(trained, None, sampler=sampler, lora_scaling=scaling)
    with MadeTensors() as made:
        probe.start(made, sampler_model)
        policy.after_update(1, lambda dtype=None: iter_gathered(trained, dtype, gather=probe))

    own = sampler_model.state_dict()
    assert list(own) == list(expected)
    for name, value in expected.items():
        assert torch.equal(own[name], value), name
    assert sorted(i for ids in probe.gathers for i in ids) == sorted(parameters)  # each once (tied: once)
    # the gathered float32 tensor and, at most, the previous one in bf16 (LoRA: float32, and a
    # module's W and A besides)
    bound = sizes[-1] + (sizes[-2] + sizes[-3] if scaling else sizes[-2] // 2)
    whole = sum(sizes) // (1 if scaling else 2)  # the whole model in what the sync keeps (bf16; LoRA: float32)
    assert bound < whole / 2  # a copy of most of the model would not fit under the bound
    assert 0 < probe.peak_extra <= bound, (probe.peak_extra, bound, whole)


@pytest.mark.parametrize("tied", [False, True])
def test_weights_that_leave_a_tensor_out_are_refused_naming_it_and_tied_twins_count_once(tied):
    """HFGenerator.load_weights of a stream without one of the model's tensors: an error naming it
    (left as it was, the sampler would sample from a mix of two policies); a tied model's stream
    may give the embeddings under one name only (lm_head shares their storage)."""
    from pipeline.generation.hf import HFGenerator

    trained, sampler_model = tiny_llama(tied=tied), tiny_llama(tied=tied)
    with torch.no_grad():
        for p in sampler_model.parameters():
            p.normal_()  # every weight differs from the trained one until it is loaded
    stream = [(name, value) for name, value in trained.state_dict().items() if "layers.1.mlp.up_proj" not in name]
    with pytest.raises(
        ValueError, match=r"HFGenerator.load_weights: weights missing .*layers\.1\.mlp\.up_proj\.weight"
    ):
        HFGenerator(sampler_model, NO_TOKENIZER, end_token_ids=[0]).load_weights(iter(stream))
    whole = [(name, value) for name, value in trained.state_dict().items() if not (tied and name == "lm_head.weight")]
    HFGenerator(sampler_model, NO_TOKENIZER, end_token_ids=[0]).load_weights(iter(whole))
    for name, value in sampler_model.state_dict().items():
        assert torch.equal(value, trained.state_dict()[name]), name


def test_a_sampler_that_refuses_a_weight_half_way_still_lets_every_gather_run():
    """The gathers are collectives: a process whose sampler raises in the middle of the stream
    gathers the rest before the error is raised, so the other processes are not left waiting."""
    from pipeline.finetune.policy import LMPolicy
    from pipeline.generation.hf import HFGenerator

    trained = tiny_llama(tied=False)
    sampler_model = torch.nn.Module()  # holds the embeddings only: the first layer's weights are refused
    sampler_model.model = torch.nn.Module()
    sampler_model.model.embed_tokens = torch.nn.Embedding(64, 16)
    parameters = {id(p): p for p in trained.parameters()}
    zero3 = StandInZero3(trained)
    policy = LMPolicy(trained, None, sampler=HFGenerator(sampler_model, NO_TOKENIZER, end_token_ids=[0]))
    with pytest.raises(ValueError, match="model.layers.0"):
        policy.after_update(1, lambda dtype=None: iter_gathered(trained, dtype, gather=zero3))
    assert sorted(i for ids in zero3.gathers for i in ids) == sorted(parameters)


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


@pytest.mark.parametrize("targets", [["c_attn"], ["c_proj"]])
def test_a_conv1d_lora_adapter_is_merged_transposed_as_peft_merges_it(targets):
    """GPT-2's Conv1D layers store their weight (in, out): peft sets fan_in_fan_out and merges
    W + s (B A)^T. The stream's merge gives peft's merge_and_unload weights (c_attn: 16 x 48;
    c_proj: attention's 16 x 16, square, where a merge without the transpose has the right shape
    and the wrong values, and the MLP's 64 x 16); told nothing of fan_in_fan_out, c_attn is refused
    naming its module."""
    from peft import LoraConfig, get_peft_model
    from transformers import GPT2Config, GPT2LMHeadModel

    from pipeline.modeling import iter_merged_lora, lora_fan_in_fan_out

    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(vocab_size=64, n_positions=32, n_embd=16, n_layer=1, n_head=2))
    model = get_peft_model(model, LoraConfig(r=2, lora_alpha=4, target_modules=targets))
    with torch.no_grad():  # B starts at zero: a merge that forgot B A would pass unseen
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.copy_(torch.randn_like(p))
    assert lora_fan_in_fan_out(model)
    stream = list(model.state_dict().items())
    merged = dict(iter_merged_lora(stream, 4 / 2, lora_fan_in_fan_out(model)))
    expected = model.merge_and_unload().state_dict()
    assert sorted(merged) == sorted(expected)
    for name, value in expected.items():
        torch.testing.assert_close(merged[name], value, rtol=1e-6, atol=1e-6, msg=name)
    if targets == ["c_attn"]:
        with pytest.raises(ValueError, match=r"'transformer.h.0.attn.c_attn'.*fan_in_fan_out"):
            dict(iter_merged_lora(stream, 4 / 2))
