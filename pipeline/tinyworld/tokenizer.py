"""The tiny world's tokenizer, trained locally with ``tokenizers`` (no download).

Byte-level BPE whose pre-tokenizer first isolates every "\\n" (the step separator is always a
token of its own, so tokenizing a trajectory whole or step by step gives the same ids) and
every single digit (numbers are read digit by digit: DESIGN.md measured BPE over multi-digit
numbers at 2% accuracy). The byte-level decoder restores the text exactly, spaces included.
Special tokens: <pad>, <s> (prepended to every encoded text), </s> (the end-of-solution
token), <unk>. Saved as a plain ``PreTrainedTokenizerFast`` so ``AutoTokenizer`` reloads it
unchanged (docs/tinyworld.md, "Tokenizer").
"""

from __future__ import annotations

from collections.abc import Iterable

from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, processors, trainers
from transformers import PreTrainedTokenizerFast

from pipeline.prompts import prompt_from_config
from pipeline.steps import join_steps

PAD, BOS, EOS, UNK = "<pad>", "<s>", "</s>", "<unk>"
SPECIAL_TOKENS = [PAD, BOS, EOS, UNK]


def train_tokenizer(texts: Iterable[str], vocab_size: int = 384):
    """A PreTrainedTokenizerFast trained on ``texts`` (questions, prompts and solutions)."""
    backend = Tokenizer(models.BPE(unk_token=UNK))
    backend.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex("\n"), behavior="isolated"),
            pre_tokenizers.Split(Regex(" ?[0-9]"), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
        ]
    )
    backend.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),  # any byte stays encodable
        show_progress=False,
    )
    backend.train_from_iterator(texts, trainer=trainer)
    bos_id = backend.token_to_id(BOS)
    backend.post_processor = processors.TemplateProcessing(
        single=f"{BOS} $A", pair=f"{BOS} $A {BOS} $B", special_tokens=[(BOS, bos_id)]
    )
    return PreTrainedTokenizerFast(
        tokenizer_object=backend,
        bos_token=BOS,
        eos_token=EOS,
        pad_token=PAD,
        unk_token=UNK,
        clean_up_tokenization_spaces=False,
        model_max_length=1024,
    )


def tokenizer_corpus(problems, format_config, solutions_per_problem: int = 2) -> list[str]:
    """The texts the tokenizer is trained on: every problem's prompt (the plain template of
    the config, as the from-scratch model has no chat template) and up to
    ``solutions_per_problem`` of its valid solutions in the step format."""
    texts = []
    for problem in problems:
        texts.append(prompt_from_config(problem.question, problem.kind, None, format_config))
        for steps in problem.meta["solutions"][:solutions_per_problem]:
            texts.append(join_steps(steps, format_config.separator))
    return texts
