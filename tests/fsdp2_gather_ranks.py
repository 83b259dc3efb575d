"""One process of a 2-process FSDP2 gather (run under torchrun by tests/test_gathered_weights.py).

    python -m torch.distributed.run --nproc_per_node 2 tests/fsdp2_gather_ranks.py <out folder>

Each process builds the same tiny Llama (tied embeddings), shards it with FSDP2 as the training
base does (each decoder layer, then the root; gloo), gathers its state dict with
pipeline.training.gathering.gathered_state_dict in bf16 and in the trained dtype (and so a copy sharded
with bf16 mixed precision, whose units all-gather bf16), counting FSDP2's
all-gathers and DTensor full_tensor calls, and writes <out folder>/rank<r>.json: whether every
gathered tensor equals the unsharded model's (cast), the counts, whether the tied weights stayed
one tensor and whether the model was sharded again and still computes the unsharded logits."""

from __future__ import annotations

import gc
import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist

TESTS = Path(__file__).resolve().parent
sys.path.insert(0, str(TESTS))
torch.set_num_threads(1)

from test_gathered_weights import tiny_llama  # noqa: E402
from torch.distributed.device_mesh import init_device_mesh  # noqa: E402
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard  # noqa: E402
from torch.distributed.fsdp._fully_shard._fsdp_collectives import DefaultAllGather  # noqa: E402
from torch.distributed.tensor import DTensor  # noqa: E402

from pipeline.training.gathering import gathered_state_dict  # noqa: E402


def main(out: Path) -> None:
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    model = tiny_llama()
    expected = {name: value.detach().clone() for name, value in model.state_dict().items()}
    ids = torch.arange(12).reshape(2, 6)
    with torch.no_grad():
        logits = model(input_ids=ids).logits
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    counts = {"all_gathers": 0, "full_tensor": 0}

    class CountedAllGather(DefaultAllGather):
        def __call__(self, *args, **kwargs):
            counts["all_gathers"] += 1
            return super().__call__(*args, **kwargs)

    def shard(module, policy=None):
        for layer in module.model.layers:
            fully_shard(layer, mesh=mesh, mp_policy=policy or MixedPrecisionPolicy())
        fully_shard(module, mesh=mesh, mp_policy=policy or MixedPrecisionPolicy())
        units = [unit for unit in module.modules() if isinstance(unit, FSDPModule)]
        for unit in units:
            unit.set_custom_all_gather(CountedAllGather())
        return units

    units = shard(model)
    # mixed precision: its units all-gather bf16 weights over float32 master shards
    mixed = tiny_llama()
    shard(mixed, MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32))
    full_tensor = DTensor.full_tensor

    def counted_full_tensor(self, *args, **kwargs):
        counts["full_tensor"] += 1
        return full_tensor(self, *args, **kwargs)

    DTensor.full_tensor = counted_full_tensor
    result = {"rank": rank, "units": len(units), "tensors": len({id(p) for p in model.parameters()})}
    for label, sharded, dtype in (
        ("bf16", model, torch.bfloat16),
        ("own", model, None),
        ("mixed_bf16", mixed, torch.bfloat16),
        ("mixed_own", mixed, None),
    ):
        counts.update(all_gathers=0, full_tensor=0)
        state = gathered_state_dict(sharded, dtype)
        result[label] = {
            **counts,
            "names": list(state) == list(expected),
            "equal": all(
                torch.equal(state[name], value.to(dtype or value.dtype)) and state[name].dtype == (dtype or value.dtype)
                for name, value in expected.items()
            ),
            "tied_once": state["lm_head.weight"] is state["model.embed_tokens.weight"],
        }
    result["sharded_again"] = all(isinstance(p, DTensor) for p in model.parameters())
    with torch.no_grad():
        result["same_logits"] = bool(torch.allclose(model(input_ids=ids).logits, logits, atol=1e-6))
    (out / f"rank{rank}.json").write_text(json.dumps(result))
    # both processes done with every collective, and nothing left holding the group, before it goes
    dist.barrier()
    del model, mixed, units, state
    gc.collect()
    dist.destroy_process_group()


if __name__ == "__main__":
    main(Path(sys.argv[1]))
