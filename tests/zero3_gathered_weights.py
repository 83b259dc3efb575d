"""One process of a DeepSpeed ZeRO-3 launch (run by tests/test_gpu.py on a CUDA GPU):

    accelerate launch --config_file configs/accelerate/deepspeed_zero3.yaml --num_processes 1 \
        tests/zero3_gathered_weights.py <policy folder> <out folder>

Builds the training base on the policy (float32, no mixed precision; every parameter partitioned:
stage3_param_persistence_threshold 0: the tiny policy's tensors are all below DeepSpeed's default
threshold, and such "persistent" parameters are kept whole on every process once gathered), then
writes
<out folder>/verdict.json with what TrainingBase.full_state_dict returned:
- before any update, in bfloat16 (a vLLM sampler's dtype), against the policy's own weights
  as its model.safetensors holds them (each cast to bfloat16): names, dtypes, values, the tied
  embedding and lm_head one tensor, every parameter partitioned before and after the gather;
- after one update, in the trained dtype, against DeepSpeed's own consolidated state dict of the
  engine (accelerator.get_state_dict: GatheredParameters with modifier_rank=0, layer by layer).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path


def main(policy: str, out: str) -> None:
    import torch
    from safetensors.torch import load_file

    from pipeline.config.schema import ModelConfig
    from pipeline.modeling import load_causal_lm
    from pipeline.training import OptimizerSettings, TrainingBase, make_accelerator

    model_config = ModelConfig(device="cuda", dtype="float32")
    accelerator = make_accelerator(model_config)
    plugin = accelerator.state.deepspeed_plugin
    plugin.deepspeed_config["zero_optimization"]["stage3_param_persistence_threshold"] = 0
    model = load_causal_lm(policy, model_config).train()  # transformers builds it under zero.Init here
    # the policy's own weights, read from its file (the tied lm_head is saved as the embedding)
    saved = load_file(Path(policy) / "model.safetensors")
    tied = {"lm_head.weight": "model.embed_tokens.weight"} if model.config.tie_word_embeddings else {}
    unsharded = {name: saved[tied.get(name, name)] for name in model.state_dict()}
    base = TrainingBase(
        accelerator,
        model,
        OptimizerSettings(lr=1e-2, total_steps=1, schedule="constant"),
        Path(out) / "run",
        progress=False,
    )
    parameters = list(base.unwrapped.parameters())
    verdict: dict = {
        "distributed_type": str(accelerator.distributed_type),
        "zero_stage": plugin.zero_stage,
        "processes": accelerator.num_processes,
        "trained_dtype": str(parameters[0].dtype),  # float32: no mixed precision in the engine
        "partitioned_before": all(p.data.numel() == 0 for p in parameters),
    }

    state = base.full_state_dict(torch.bfloat16)
    verdict["partitioned_after"] = all(p.data.numel() == 0 for p in parameters)
    verdict["names_match"] = list(state) == list(unsharded)
    verdict["dtypes"] = sorted({str(value.dtype) for value in state.values()})
    verdict["mismatched"] = [
        name
        for name, value in unsharded.items()
        if name not in state or not torch.equal(state[name].cpu(), value.to(torch.bfloat16))
    ]
    verdict["tied_one_tensor"] = state["lm_head.weight"] is state["model.embed_tokens.weight"]
    del state

    tokens = torch.randint(0, model.config.vocab_size, (2, 8), generator=torch.Generator().manual_seed(0))
    tokens = tokens.to(accelerator.device)
    loss = base.model(input_ids=tokens, labels=tokens).loss
    base.backward(loss)
    base.optimizer_step()
    after = base.full_state_dict()
    reference = accelerator.get_state_dict(base.model)  # DeepSpeed's own gather, on the main process
    verdict["after_update_names_match"] = list(after) == list(reference)
    verdict["after_update_mismatched"] = [
        name
        for name, value in reference.items()
        if name not in after or not torch.equal(after[name].cpu(), value.to(after[name].dtype))
    ]
    verdict["after_update_dtypes"] = sorted({str(value.dtype) for value in after.values()})
    verdict["weights_moved"] = sum(not torch.equal(after[n].cpu().float(), unsharded[n]) for n in unsharded)
    if accelerator.is_main_process:
        (Path(out) / "verdict.json").write_text(json.dumps(verdict, indent=2))
    accelerator.wait_for_everyone()


if __name__ == "__main__":
    main(*sys.argv[1:3])
