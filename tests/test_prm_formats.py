"""PRM formats: our saved PRM is a standard transformers token-classification model (its model
card's recipe gives our scorer's scores), and the PRMs of other formats (TRL's PRMTrainer output,
Math-Shepherd, Qwen2.5-Math-PRM) score through the same API, read at the right tokens. Every
model is a small random-init one with a tokenizer built here: nothing is downloaded."""

from __future__ import annotations

import importlib.util
import json
import math
import random
import re
import sys

import numpy as np
import pytest
import torch
from test_prm import FORMAT, arithmetic_solution, make_prm, make_tokenizer, tiny_config
from tokenizers import Regex, Tokenizer, models, pre_tokenizers
from transformers import (
    AutoModelForTokenClassification,
    LlamaConfig,
    LlamaForCausalLM,
    LlamaForTokenClassification,
    PreTrainedTokenizerFast,
    Qwen2Config,
)

from pipeline.config.schema import FormatConfig
from pipeline.tinyworld.tokenizer import train_tokenizer
from prm import model as prm_model
from prm.adapters import MathShepherdScorer, QwenPRMScorer, ResultLikelihoodScorer, TokenClassificationScorer
from prm.formats import detect_format, is_hub_id, load_scorer
from prm.model import ProcessRewardModel
from prm.scorer import PRMScorer
from prm.validation import corrupt_step

WORDS = ["Question:", "Answer:", "What", "is", "x", "=", "+", "-", "?", "Step", "ки", "system", "user", "assistant"]
SPECIAL = ["<|im_start|>", "<|im_end|>", "<extra_0>"]
CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


pytestmark = pytest.mark.usefixtures("one_torch_thread")


def word_tokenizer(bos: bool = False) -> PreTrainedTokenizerFast:
    """Words split on spaces, newline a token of its own, 'k:' step numbers, chat special tokens."""
    vocab = ["[PAD]", "[UNK]", "[EOS]", "[BOS]", "\n", *WORDS, *map(str, range(40)), *(f"{k}:" for k in range(1, 10))]
    backend = Tokenizer(models.WordLevel({t: i for i, t in enumerate(vocab)}, unk_token="[UNK]"))
    backend.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(r"[^\S\n]+"), behavior="removed"),
            pre_tokenizers.Split(Regex("\n"), behavior="isolated"),
        ]
    )
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend,
        pad_token="[PAD]",
        eos_token="[EOS]",
        unk_token="[UNK]",
        bos_token="[BOS]" if bos else None,
    )
    tokenizer.add_special_tokens({"additional_special_tokens": SPECIAL})
    tokenizer.chat_template = CHAT_TEMPLATE
    return tokenizer


def llama_config(tokenizer, **extra) -> LlamaConfig:
    return LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=4,
        max_position_embeddings=512,
        attn_implementation="eager",
        **extra,
    )


def solutions(n: int = 5) -> list[tuple[str, list[str]]]:
    return [arithmetic_solution(random.Random(i), 1 + i % 4) for i in range(n)]


def config_for(prm_format: str = "auto", **model):
    config = tiny_config(score_batch_size=2)  # batches of 2: padding inside every batch
    config.model.prm_format = prm_format
    for key, value in model.items():
        setattr(config.model, key, value)
    return config


# ----------------------------------------------------------------------------- our PRM as a transformers model


def card_recipe(directory):
    """The python block of the model card (README.md), executed: its step_scores function."""
    code = re.search(r"```python\n(.*?)```", (directory / "README.md").read_text(), re.S).group(1)
    namespace: dict = {}
    exec(code, namespace)
    return namespace["step_scores"]


def test_a_saved_prm_loads_with_auto_model_for_token_classification_and_scores_the_same(tmp_path):
    tokenizer = make_tokenizer()
    model = make_prm(tokenizer, seed=4)
    torch.nn.init.normal_(model.head.weight, std=0.5)
    torch.nn.init.constant_(model.head.bias, 0.3)
    ours = PRMScorer(model, tokenizer, FORMAT, "tiny").score_many(solutions())
    model.save_pretrained(tmp_path / "prm", tokenizer=tokenizer)

    standard = AutoModelForTokenClassification.from_pretrained(tmp_path / "prm")
    assert type(standard).__name__ == "LlamaForTokenClassification" and standard.config.id2label == {
        0: "wrong",
        1: "correct",
    }
    step_scores = card_recipe(tmp_path / "prm")
    for (question, steps), expected in zip(solutions(), ours):
        assert np.allclose(step_scores(str(tmp_path / "prm"), question, steps), expected, atol=1e-5)

    reloaded = load_scorer(tmp_path / "prm", config_for())  # auto: prm_config.json -> ours
    assert isinstance(reloaded, PRMScorer)
    assert np.allclose(
        np.concatenate(reloaded.score_many(solutions())), np.concatenate(ours), atol=1e-6
    )  # other batches, other padding


def test_an_architecture_without_a_token_classification_class_keeps_the_backbone_and_head_layout(tmp_path, monkeypatch):
    tokenizer = make_tokenizer()
    model = make_prm(tokenizer, seed=5)
    torch.nn.init.normal_(model.head.weight, std=0.5)
    ours = PRMScorer(model, tokenizer, FORMAT, "tiny").score_many(solutions())
    model.save_pretrained(tmp_path / "prm", tokenizer=tokenizer)  # first the standard layout, then over it the other
    with monkeypatch.context() as patch:
        patch.setattr(prm_model, "token_classification_layout", lambda base, keys: None)
        model.save_pretrained(tmp_path / "prm", tokenizer=tokenizer)
    saved = sorted(p.name for p in (tmp_path / "prm").iterdir())
    assert (
        "backbone" in saved
        and "head.safetensors" in saved
        and "model.safetensors" not in saved
        and "config.json" not in saved
    )
    assert json.loads((tmp_path / "prm" / "prm_config.json").read_text())["layout"] == "backbone_and_head"
    assert "no transformers token-classification class" in (tmp_path / "prm" / "README.md").read_text()
    assert ProcessRewardModel.from_pretrained(tmp_path / "prm").info.kind == "tiny"
    assert np.allclose(
        np.concatenate(load_scorer(tmp_path / "prm", config_for()).score_many(solutions())),
        np.concatenate(ours),
        atol=1e-6,
    )


# ----------------------------------------------------------------------------- (a) TRL's PRMTrainer output


def trl_tokenize_row(tokenizer, prompt, completions, separator="\n"):
    """TRL's PRMTrainer.tokenize_row (train_on_last_step_only off, no truncation), as written there:
    the positions it puts labels at are where its PRM learned to score."""
    prompt_ids = tokenizer(prompt, add_special_tokens=False)["input_ids"]
    completions_ids = [
        tokenizer(c, add_special_tokens=False)["input_ids"] + tokenizer.encode(separator, add_special_tokens=False)
        for c in completions
    ]
    labels = [[-100] * (len(c) - 1) + [1] for c in completions_ids]
    if tokenizer.bos_token_id is not None:
        prompt_ids = [tokenizer.bos_token_id] + prompt_ids
    input_ids = prompt_ids + [t for c in completions_ids for t in c]
    labels = [-100] * len(prompt_ids) + [label for c in labels for label in c]
    return input_ids, [i for i, label in enumerate(labels) if label != -100]


@pytest.mark.parametrize("num_labels", [2, 1])
def test_token_classification_prm_is_read_at_the_step_separators(tmp_path, num_labels):
    tokenizer = word_tokenizer(bos=True)
    torch.manual_seed(0)
    model = LlamaForTokenClassification(llama_config(tokenizer, num_labels=num_labels)).eval()
    model.save_pretrained(tmp_path / "trl")
    tokenizer.save_pretrained(tmp_path / "trl")
    assert detect_format(str(tmp_path / "trl")) == "token_classification"
    scorer = load_scorer(tmp_path / "trl", config_for())
    assert isinstance(scorer, TokenClassificationScorer)
    scores = scorer.score_many(solutions())
    for (question, steps), got in zip(solutions(), scores):
        ids, positions = trl_tokenize_row(tokenizer, question, steps)
        assert scorer.encode(question, steps) == (ids, positions)
        assert all(tokenizer.convert_ids_to_tokens(ids[p]) == "\n" for p in positions)
        with torch.no_grad():
            logits = model(input_ids=torch.tensor([ids])).logits[0, positions]
        expected = logits.softmax(-1)[:, 1] if num_labels == 2 else torch.sigmoid(logits[:, 0])
        assert np.allclose(got, expected.tolist(), atol=1e-5)
    assert scorer.score_many([("What is 1 + 1 ?", [])]) == [[]]


# ----------------------------------------------------------------------------- (b) Math-Shepherd


def test_math_shepherd_prm_scores_each_step_tag_by_good_against_bad(tmp_path):
    tokenizer = word_tokenizer(bos=True)
    torch.manual_seed(1)
    model = LlamaForCausalLM(llama_config(tokenizer)).eval()
    model.save_pretrained(tmp_path / "shepherd")
    tokenizer.save_pretrained(tmp_path / "shepherd")
    with pytest.raises(ValueError, match="model.prm_format=math_shepherd|set model.prm_format"):
        load_scorer(tmp_path / "shepherd", config_for())  # a causal LM could be anything: the format must be named
    scorer = load_scorer(tmp_path / "shepherd", config_for("math_shepherd"))
    assert isinstance(scorer, MathShepherdScorer)
    good, bad, tag = (tokenizer.convert_tokens_to_ids(t) for t in ("+", "-", "ки"))
    for (question, steps), got in zip(solutions(), scorer.score_many(solutions())):
        # the model card's recipe: "Step k: ... ки" lines, softmax over the good and bad tokens' logits at every tag
        output = "\n".join(f"Step {k}: {step} ки" for k, step in enumerate(steps, 1))
        input_ids = torch.tensor([tokenizer.encode(f"{question} {output}")])
        with torch.no_grad():
            logits = model(input_ids).logits[:, :, [good, bad]]
        expected = logits.softmax(dim=-1)[:, :, 0][input_ids == tag]
        assert len(expected) == len(steps) and np.allclose(got, expected.tolist(), atol=1e-5)
    with pytest.raises(ValueError, match="single token"):
        MathShepherdScorer(model, tokenizer, good="+ +")


# ----------------------------------------------------------------------------- (c) Qwen2.5-Math-PRM

REMOTE_CODE = '''
import torch
from torch import nn
from transformers import Qwen2Model, Qwen2PreTrainedModel


class Qwen2ForProcessRewardModel(Qwen2PreTrainedModel):
    """The shape of Qwen2.5-Math-PRM's remote code: a Qwen2 backbone, a two-layer two-class head."""

    def __init__(self, config):
        super().__init__(config)
        self.model = Qwen2Model(config)
        self.score = nn.Sequential(nn.Linear(config.hidden_size, config.hidden_size), nn.ReLU(), nn.Linear(config.hidden_size, 2))
        self.post_init()

    def forward(self, input_ids=None, attention_mask=None, **kwargs):
        hidden = self.model(input_ids=input_ids, attention_mask=attention_mask).last_hidden_state
        return (self.score(hidden),)
'''


def test_qwen_prm_reads_the_two_class_head_at_each_extra_0(tmp_path):
    tokenizer = word_tokenizer()
    folder = tmp_path / "qwen-prm"
    folder.mkdir()
    (folder / "modeling_tiny_prm.py").write_text(REMOTE_CODE)
    spec = importlib.util.spec_from_file_location("modeling_tiny_prm", folder / "modeling_tiny_prm.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    torch.manual_seed(2)
    config = Qwen2Config(
        vocab_size=len(tokenizer),
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
    )
    model = module.Qwen2ForProcessRewardModel(config).eval()
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    saved = json.loads((folder / "config.json").read_text())
    saved["auto_map"] = {"AutoModel": "modeling_tiny_prm.Qwen2ForProcessRewardModel"}
    (folder / "config.json").write_text(json.dumps(saved))
    sys.modules.pop("modeling_tiny_prm", None)

    assert detect_format(str(folder)) == "qwen_prm"
    scorer = load_scorer(folder, config_for(trust_remote_code=True))
    assert isinstance(scorer, QwenPRMScorer)
    separator = tokenizer.convert_tokens_to_ids("<extra_0>")
    for (question, steps), got in zip(solutions(), scorer.score_many(solutions())):
        # the model card's recipe: steps joined by <extra_0> in the assistant turn, softmax at every <extra_0>, class 1
        messages = [
            {"role": "system", "content": "Please reason step by step, and put your final answer within \\boxed{}."},
            {"role": "user", "content": question},
            {"role": "assistant", "content": "<extra_0>".join(steps) + "<extra_0>"},
        ]
        text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=False)
        input_ids = tokenizer.encode(text, return_tensors="pt")
        with torch.no_grad():
            probabilities = model(input_ids=input_ids)[0].softmax(dim=-1)
        expected = probabilities[0][input_ids[0] == separator][:, 1]
        assert len(expected) == len(steps) and np.allclose(got, expected.tolist(), atol=1e-5)


# ----------------------------------------------------------------------------- the factory


def test_hub_ids_and_missing_folders():
    assert is_hub_id("Qwen/Qwen2.5-Math-PRM-7B") and is_hub_id("peiyi9979/math-shepherd-mistral-7b-prm")
    assert not is_hub_id("runs/demo/prm/model") and not is_hub_id("/abs/path")
    with pytest.raises(FileNotFoundError, match="make prm"):
        load_scorer("runs/nowhere/prm/model", config_for())
    assert detect_format("anything", "math_shepherd") == "math_shepherd"


def test_the_configs_prm_formats_are_ours_and_one_per_adapter():
    """model.prm_format's choices (pipeline.config.schema) name exactly the formats load_scorer reads."""
    from pipeline.config.choices import PRM_FORMATS
    from prm.adapters import ADAPTERS
    from prm.formats import FORMATS

    assert PRM_FORMATS == ("auto", *FORMATS) and FORMATS == ("stepflow", *ADAPTERS)


# ----------------------------------------------------------------------------- (d) the policy's probability of its results


def result_solutions() -> list[tuple[str, list[str]]]:
    """Solutions of 1 to 4 steps (batches with padding), each ended by its stated answer; one step
    with two results of two digits each."""
    rng = random.Random(7)
    found = []
    for n_steps in (3, 1, 4, 2, 1):
        question, steps = arithmetic_solution(rng, n_steps)
        found.append((question, [*steps, f"The answer is {steps[-1].split('= ')[-1]}"]))
    found.insert(1, ("What is 7 * 2 + 9 ?", ["7 * 2 = 14 , and 14 + 9 = 23 apples .", "The answer is 23"]))
    return found


def policy_folder(tmp_path):
    """A random-init causal LM and the tiny world's tokenizer (it writes " 7" as one token)."""
    texts = [f"Question: {q}\nAnswer:\n" + "".join(s + "\n" for s in steps) for q, steps in result_solutions()]
    tokenizer = train_tokenizer(texts, vocab_size=300)
    torch.manual_seed(3)
    model = LlamaForCausalLM(llama_config(tokenizer)).eval()
    model.save_pretrained(tmp_path / "policy")
    tokenizer.save_pretrained(tmp_path / "policy")
    return model, tokenizer


def brute_force_result_logprob(model, tokenizer, question: str, steps: list[str]) -> list[float]:
    """log P of each step's results, in float64, one forward per result token on its own prefix:
    the policy's prompt and earlier steps, the step up to its '=' (or up to "is"), then the tokens
    of the result with the space before it."""
    context = tokenizer(f"Question: {question}\nAnswer:\n")["input_ids"]  # with BOS, as generation starts
    per_step = []
    for step in steps:
        total = 0.0
        for match in re.finditer(r"(?:=|answer is)( -?\d+)(?![\d+*-]| [+*-])", step):
            before = tokenizer(step[: match.start(1)], add_special_tokens=False)["input_ids"]
            result = tokenizer(match.group(1), add_special_tokens=False)["input_ids"]
            for j, token in enumerate(result):
                with torch.no_grad():
                    logits = model(torch.tensor([context + before + result[:j]])).logits[0, -1]
                total += float(logits.log_softmax(-1)[token])
        per_step.append(total)
        context = context + tokenizer(step + "\n", add_special_tokens=False)["input_ids"]
    return per_step


def test_result_likelihood_is_the_policys_probability_of_the_results_a_step_writes(tmp_path):
    model, tokenizer = policy_folder(tmp_path)
    with pytest.raises(ValueError, match="result_likelihood"):
        load_scorer(tmp_path / "policy", config_for())  # a causal LM could be anything: the format must be named
    scorer = load_scorer(tmp_path / "policy", config_for("result_likelihood"))  # batches of 2
    assert isinstance(scorer, ResultLikelihoodScorer) and scorer.kind is None
    reference = model.to(torch.float64)
    got = scorer.log_scores_many(result_solutions())
    for (question, steps), logprobs in zip(result_solutions(), got):
        expected = brute_force_result_logprob(reference, tokenizer, question, steps)
        assert len(logprobs) == len(steps) and all(value < 0 for value in expected)
        assert np.allclose(logprobs, expected, rtol=1e-4, atol=1e-4)
    assert np.allclose(np.exp(got[0]), scorer.score_many(result_solutions())[0], atol=1e-6)  # U = P(results)
    assert scorer.logits_many([("What is 1 + 1 ?", [])])[0].numel() == 0


def test_result_likelihood_changes_with_a_steps_result_and_nothing_before_it(tmp_path):
    policy_folder(tmp_path)
    scorer = load_scorer(tmp_path / "policy", config_for("result_likelihood"))
    question, steps = max(result_solutions(), key=lambda solution: len(solution[1]))
    changed = list(steps)
    changed[1] = corrupt_step(steps[1], seed=0)
    before, after = scorer.log_scores_many([(question, steps), (question, changed)])
    assert before[0] == after[0] and before[1] != after[1]
    wordy = list(steps)
    wordy[1] = steps[1] + " , so x is 9 now"  # the result stays what '=' gives; words after it are not scored
    assert scorer.log_scores(question, wordy)[1] == pytest.approx(before[1], abs=1e-6)
    no_number = scorer.logits_many([(question, ["Let us add them up ."])])[0]
    assert no_number.tolist() == [math.inf]  # U = 1: it writes no result
    assert scorer.score(question, ["Let us add them up ."]) == [1.0]


def test_result_likelihood_refuses_results_it_cannot_locate_and_prompts_it_cannot_rebuild(tmp_path):
    tokenizer = word_tokenizer(bos=True)  # words split on spaces: "x =7" is one unknown word
    torch.manual_seed(4)
    model = LlamaForCausalLM(llama_config(tokenizer)).eval()
    scorer = ResultLikelihoodScorer(model, tokenizer, format_config=config_for().format, batch_size=2)
    assert scorer.score_many([("What is 3 + 4 ?", ["x = 3 + 4 = 7"])])[0][0] < 1
    with pytest.raises(ValueError, match="cut at its results"):
        scorer.score_many([("What is 3 + 4 ?", ["x = 3 + 4 =7"])])
    chat = FormatConfig(use_chat_template=True)  # the chat template's instruction depends on the kind
    with pytest.raises(ValueError, match="prm.kind"):
        ResultLikelihoodScorer(model, tokenizer, format_config=chat)
    assert ResultLikelihoodScorer(model, tokenizer, format_config=chat, kind="tiny").prompt_kind == "tiny"
