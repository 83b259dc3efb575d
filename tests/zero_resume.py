"""Processes of DeepSpeed ZeRO engines saving or resuming whole-tensor checkpoints (run by
tests/test_distributed_finetune.py on CPU with gloo, alone or under torchrun, and by
tests/test_gpu.py in one process on a CUDA GPU with DS_ACCELERATOR=cuda and NCCL; needs deepspeed
installed).

    python tests/zero_resume.py <zero stages, e.g. 1,2,3> save|load <folder>

For each ZeRO stage in turn, in the same processes: a tiny two-layer model with AdamW in two
groups (weight decay on matrices only, as the training base builds it) trains on batches that
depend on the step only, so any number of processes computes the same update. save: 2 steps, the
checkpoint (pipeline.training.zero_state through checkpoint_io.write_full) into <folder>/zero-<stage>,
2 more steps, the final weights into <folder>/zero-<stage>/straight.safetensors. load: another
initialisation, the checkpoint loaded, 2 steps; then a third initialisation given the checkpoint's
weights alone, 2 steps; and <folder>/zero-<stage>/load-<processes>.json: for each, the largest
difference from the straight weights and the AdamW step count.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
torch.set_num_threads(1)
for name, value in (("MASTER_ADDR", "127.0.0.1"), ("MASTER_PORT", "29631"), ("RANK", "0"), ("WORLD_SIZE", "1")):
    os.environ.setdefault(name, value)
os.environ.setdefault("LOCAL_RANK", "0")

import deepspeed  # noqa: E402
from safetensors.torch import load_file, save_file  # noqa: E402

from pipeline.training import checkpoint_io, zero_state  # noqa: E402

stages, mode, root = [int(s) for s in sys.argv[1].split(",")], sys.argv[2], Path(sys.argv[3])
# The collectives go through gloo alone: DeepSpeed's CPU backend would otherwise compile its
# shared-memory all-reduce (C++ with g++ and ninja) when the process group starts, a CPU-only fast
# path that GPU runs (NCCL) never take, and about 27 s on 2 cores the first time on a machine.
deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False
deepspeed.init_distributed(dist_backend="gloo" if deepspeed.get_accelerator().device_name() == "cpu" else "nccl")
rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])


def engine(stage: int, seed: int):
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(5, 7), torch.nn.Tanh(), torch.nn.Linear(7, 3))  # 35 + 7 + 21 + 3
    groups = [
        {"params": [p for p in model.parameters() if p.ndim > 1], "weight_decay": 0.01},
        {"params": [p for p in model.parameters() if p.ndim < 2], "weight_decay": 0.0},
    ]
    config = {
        "train_micro_batch_size_per_gpu": 4,
        "gradient_accumulation_steps": 1,
        "gradient_clipping": 1.0,
        "zero_optimization": {"stage": stage},
        "zero_allow_untested_optimizer": True,
    }
    return deepspeed.initialize(model=model, optimizer=torch.optim.AdamW(groups, lr=0.05), config=config)[0]


def train(e, start: int, stop: int) -> None:
    for step in range(start, stop):
        x = torch.randn(4, 5, generator=torch.Generator().manual_seed(100 + step)).to(e.device)
        e.backward(((e(x) - 2 * x[:, :3]) ** 2).mean())
        e.step()


def weights(e, names: list[str]) -> dict[str, torch.Tensor]:
    return {k: v.detach().cpu().clone() for k, v in zero_state.gathered(e, e.module, names) if k.startswith("model.")}


def save(stage: int, folder: Path) -> None:
    e = engine(stage, 0)
    names = [n for n, _ in e.module.named_parameters()]
    train(e, 0, 2)
    meta = {"processes": world, "optimizer_step": zero_state.optimizer_step(e)}
    checkpoint_io.write_full(folder, zero_state.gathered(e, e.module, names), meta, write=rank == 0)
    train(e, 2, 4)
    final = weights(e, names)
    if rank == 0:
        save_file(final, str(folder / "straight.safetensors"))


def resume(stage: int, folder: Path, seed: int, weights_only: bool) -> dict:
    """Another initialisation (only the checkpoint can bring the run back), the checkpoint loaded
    (its weights alone with ``weights_only``), 2 steps: how far from the straight run it ends."""
    e = engine(stage, seed)
    names = [n for n, _ in e.module.named_parameters()]
    shapes = {k: tuple(getattr(p, "ds_shape", p.shape)) for n, p in e.module.named_parameters() for k in [f"model.{n}"]}
    shapes.update({f"{m}.{n}": shapes[f"model.{n}"] for n in names for m in zero_state.MOMENTS})
    index = checkpoint_io.read_full_index(folder, shapes, f"ZeRO-{stage}, {world} process(es)")
    zero_state.prepare_state(e, index["optimizer_step"])
    wanted = [k for k in zero_state.keys(names) if not weights_only or k.startswith("model.")]
    zero_state.load(e, e.module, checkpoint_io.iter_full(folder, index, wanted), e.device)
    train(e, 2, 4)
    final, straight = weights(e, names), load_file(str(folder / "straight.safetensors"))
    return {
        "max_difference": max((final[k] - straight[k]).abs().max().item() for k in straight),
        "optimizer_step": zero_state.optimizer_step(e),
        "written_by": index["processes"],
    }


for stage in stages:
    folder = root / f"zero-{stage}"
    if mode == "save":
        save(stage, folder)
    else:
        result = {"load": resume(stage, folder, 1, False), "load_weights_only": resume(stage, folder, 2, True)}
        if rank == 0:
            (folder / f"load-{world}.json").write_text(json.dumps(result))
torch.distributed.barrier()
torch.distributed.destroy_process_group()
