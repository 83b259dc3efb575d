"""Teacher-forced step log-probs against a brute-force float64 reference that runs every
trajectory alone and sums the token log-probs of each span, the obvious way."""

from __future__ import annotations

import copy
import random

import pytest
import torch
import transformers

from pipeline.generation.step_logprobs import trajectory_logprobs, trajectory_logprobs_chunked
from pipeline.steps import SegmentedIds, encode_trajectory

VOCAB, PAD, EOS = 30, 0, 2


def make_model(arch: str, seed: int):
    torch.manual_seed(seed)
    common = dict(
        vocab_size=VOCAB,
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=2,
        intermediate_size=64,
        eos_token_id=EOS,
        pad_token_id=PAD,
        initializer_range=0.2,
    )
    if arch == "qwen2":
        return transformers.Qwen2ForCausalLM(transformers.Qwen2Config(num_key_value_heads=1, **common)).eval()
    return transformers.LlamaForCausalLM(transformers.LlamaConfig(**common)).eval()


def random_trajectories(rng: random.Random, count: int) -> list[SegmentedIds]:
    """Prompts of 1-6 tokens, 0-4 steps of 1-4 tokens, finished (end token) or not."""
    batch = []
    for _ in range(count):
        ids = [rng.randrange(3, VOCAB) for _ in range(rng.randint(1, 6))]
        prompt_len, spans = len(ids), []
        for _ in range(rng.randint(0, 4)):
            step = [rng.randrange(3, VOCAB) for _ in range(rng.randint(1, 4))]
            spans.append((len(ids), len(ids) + len(step)))
            ids += step
        end_position = None
        if rng.random() < 0.7:
            end_position = len(ids)
            ids.append(EOS)
        batch.append(SegmentedIds(ids, prompt_len, spans, end_position))
    return batch


def brute_force(model64, seg: SegmentedIds):
    """(step log-probs, termination log-probs k=0..n, step entropies, boundary hidden) in float64."""
    with torch.no_grad():
        out = model64(input_ids=torch.tensor([seg.input_ids]), output_hidden_states=True)
    logp = out.logits[0].log_softmax(-1)
    hidden = out.hidden_states[-1][0]
    steps, entropies = [], []
    for start, end in seg.step_spans:
        steps.append(sum(logp[t - 1, seg.input_ids[t]].item() for t in range(start, end)))
        entropies.append(sum(-(logp[t - 1].exp() * logp[t - 1]).sum().item() for t in range(start, end)))
    boundaries = [seg.prompt_len] + [end for _, end in seg.step_spans]
    terminations = [logp[b - 1, EOS].item() for b in boundaries]
    return steps, terminations, entropies, [hidden[b - 1] for b in boundaries]


@pytest.mark.parametrize("arch,seed", [("llama", 0), ("llama", 1), ("qwen2", 2)])
def test_matches_brute_force_float64(arch, seed):
    model = make_model(arch, seed)
    model64 = copy.deepcopy(model).double()
    batch = random_trajectories(random.Random(seed), 7)
    batch.append(SegmentedIds([5, 6], 2, [], None))  # no steps, unfinished: only log pi(s_f | s_0)
    result = trajectory_logprobs(model, batch, PAD, return_entropy=True, return_boundary_hidden=True)

    T = max(seg.num_steps for seg in batch)
    assert result.step_logprobs.shape == (len(batch), T) and result.termination_logprobs.shape == (len(batch), T + 1)
    assert result.boundary_hidden.shape == (len(batch), T + 1, 32)
    for b, seg in enumerate(batch):
        steps, terminations, entropies, hidden = brute_force(model64, seg)
        n = seg.num_steps
        assert result.num_steps[b].item() == n
        assert result.mask[b].tolist() == [k < n for k in range(T)]
        torch.testing.assert_close(
            result.step_logprobs[b, :n].double(), torch.tensor(steps, dtype=torch.float64), atol=2e-5, rtol=0
        )
        torch.testing.assert_close(
            result.termination_logprobs[b, : n + 1].double(),
            torch.tensor(terminations, dtype=torch.float64),
            atol=2e-5,
            rtol=0,
        )
        torch.testing.assert_close(
            result.step_entropy[b, :n].double(), torch.tensor(entropies, dtype=torch.float64), atol=2e-5, rtol=0
        )
        torch.testing.assert_close(result.boundary_hidden[b, : n + 1].double(), torch.stack(hidden), atol=1e-4, rtol=0)
        # padding holds zeros
        assert not result.step_logprobs[b, n:].any() and not result.termination_logprobs[b, n + 1 :].any()
        assert not result.step_entropy[b, n:].any() and not result.boundary_hidden[b, n + 1 :].any()


def test_gradients_flow_only_with_grad():
    model = make_model("llama", 3)
    batch = random_trajectories(random.Random(3), 5)
    scored = trajectory_logprobs(model, batch, PAD)
    assert not scored.step_logprobs.requires_grad
    result = trajectory_logprobs(model, batch, PAD, with_grad=True, return_entropy=True)
    loss = result.step_logprobs.sum() + result.termination_logprobs.sum() + result.step_entropy.sum()
    loss.backward()
    assert model.lm_head.weight.grad is not None and model.lm_head.weight.grad.abs().sum() > 0
    assert model.model.embed_tokens.weight.grad.abs().sum() > 0
    torch.testing.assert_close(result.step_logprobs.detach(), scored.step_logprobs)


def test_chunked_equals_one_pass():
    model = make_model("llama", 4)
    batch = random_trajectories(random.Random(4), 9)
    whole = trajectory_logprobs(model, batch, PAD, return_entropy=True, return_boundary_hidden=True)
    chunked = trajectory_logprobs_chunked(
        model, batch, PAD, micro_batch_size=4, return_entropy=True, return_boundary_hidden=True
    )
    for name in ("step_logprobs", "termination_logprobs", "step_entropy", "boundary_hidden"):
        torch.testing.assert_close(getattr(chunked, name), getattr(whole, name), atol=1e-5, rtol=0)
    assert torch.equal(chunked.mask, whole.mask) and torch.equal(chunked.num_steps, whole.num_steps)


def test_segments_from_encode_trajectory():
    """The ids the policy builds (pipeline.steps) score the same as the brute force."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    pieces = ["<pad>", "<s>", "</s>"] + list("0123456789+=abc \n")
    tok = Tokenizer(models.WordLevel({p: i for i, p in enumerate(pieces)}, unk_token="<pad>"))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")
    tok.decoder = decoders.Fuse()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="</s>", pad_token="<pad>")
    model = make_model("llama", 5)
    model64 = copy.deepcopy(model).double()
    batch = [
        encode_trajectory(tokenizer, "a 1 + 2 =\n", ["1 + 2 = 3", "ab"], "\n"),
        encode_trajectory(tokenizer, "c =\n", ["c"], "\n", add_end=False),
    ]
    result = trajectory_logprobs(model, batch, tokenizer.pad_token_id)
    for b, seg in enumerate(batch):
        steps, terminations, _, _ = brute_force(model64, seg)
        torch.testing.assert_close(
            result.step_logprobs[b, : seg.num_steps].double(),
            torch.tensor(steps, dtype=torch.float64),
            atol=2e-5,
            rtol=0,
        )
        torch.testing.assert_close(
            result.termination_logprobs[b, : seg.num_steps + 1].double(),
            torch.tensor(terminations, dtype=torch.float64),
            atol=2e-5,
            rtol=0,
        )


def test_peft_wrapped_policy_scores_like_its_merged_weights_and_trains_its_adapter():
    from peft import LoraConfig, get_peft_model

    batch = random_trajectories(random.Random(6), 4)
    peft_model = get_peft_model(
        make_model("llama", 6),
        LoraConfig(r=2, lora_alpha=4, target_modules=["q_proj", "v_proj"], init_lora_weights=False),
    )
    result = trajectory_logprobs(peft_model, batch, PAD, with_grad=True)
    result.step_logprobs.sum().backward()
    lora_grads = [p.grad for name, p in peft_model.named_parameters() if "lora_" in name]
    assert lora_grads and all(g is not None and g.abs().sum() > 0 for g in lora_grads)
    merged = trajectory_logprobs(peft_model.merge_and_unload(), batch, PAD)
    torch.testing.assert_close(result.step_logprobs.detach(), merged.step_logprobs, atol=1e-5, rtol=0)


def test_half_precision_full_fine_tuning_keeps_float32_master_weights():
    """A bf16 policy trained at the paper's lr (5e-6): float32 master weights move, bf16 ones are
    rounded back (the update is below half an ulp); the forward still runs in bf16 (autocast)."""
    from pipeline.finetune.policy import LMPolicy
    from pipeline.modeling import upcast_trainable

    class Tok:
        pad_token_id, eos_token_id = PAD, EOS

        def __call__(self, text, add_special_tokens=False):
            return {"input_ids": [3 + (ord(c) % (VOCAB - 3)) for c in text]}

    def one_step(model, policy):
        optimizer = torch.optim.AdamW(model.parameters(), lr=5e-6, weight_decay=0.0)
        lp = policy.logprobs(["ab"], [["cd\n", "ef\n"]], with_grad=True)
        (-lp.step_logprobs.sum()).backward()
        before = {n: p.detach().clone() for n, p in model.named_parameters()}
        optimizer.step()
        return lp, sum(int((p.detach() != before[n]).sum()) for n, p in model.named_parameters())

    bf16 = make_model("llama", 0).to(torch.bfloat16).train()
    _, moved_bf16 = one_step(bf16, LMPolicy(bf16, Tok(), "\n"))
    master = make_model("llama", 0).to(torch.bfloat16).train()
    half = upcast_trainable(master)
    assert half == torch.bfloat16 and all(p.dtype == torch.float32 for p in master.parameters())
    lp, moved_master = one_step(master, LMPolicy(master, Tok(), "\n", autocast_dtype=half))
    assert moved_master > 10 * max(moved_bf16, 1)
    assert upcast_trainable(master) is None  # already float32: nothing to autocast


def test_ppo_value_head_stays_float32_under_a_bf16_policy():
    from types import SimpleNamespace

    from pipeline.config.schema import PPOConfig
    from pipeline.finetune.objectives import build_objective

    objective = build_objective(PPOConfig(), policy=None, hidden_size=8)
    values = objective.values(SimpleNamespace(boundary_hidden=torch.randn(2, 3, 8, dtype=torch.bfloat16)))
    assert values.dtype == torch.float32 and objective.value_head.weight.dtype == torch.float32
