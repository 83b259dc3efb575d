import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from tokenizers import Tokenizer, decoders, models, trainers
from transformers import PreTrainedTokenizerFast

from pipeline.steps import calculation_result_spans, encode_trajectory, join_steps, split_steps, step_result_spans

step_text = st.text(alphabet="ab c1=+\t", min_size=1, max_size=12).map(str.strip).filter(bool)


@given(st.lists(step_text, max_size=6))
def test_split_inverts_join(steps):
    assert split_steps(join_steps(steps, "\n"), "\n") == steps


@given(st.lists(step_text, max_size=6))
def test_split_inverts_join_multichar_separator(steps):
    assert split_steps(join_steps(steps, "\n\n"), "\n\n") == steps


def test_empty_steps_dropped():
    assert split_steps("a\n\n  \nb\n", "\n") == ["a", "b"]
    with pytest.raises(ValueError):
        split_steps("a", "")


@pytest.fixture(scope="module")
def crossing_bpe():
    """A BPE without pre-tokenizer, trained so that merges cross the separator ('3\\nT' ...)."""
    corpus = ["Q: 1+2\nA:\n", "ab\n", "1 + 2 = 3\nThe answer is 3\n", "2 + 2 = 4\nThe answer is 4\n"] * 50
    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.train_from_iterator(corpus, trainers.BpeTrainer(vocab_size=120, special_tokens=["<unk>", "</s>", "<pad>"]))
    tok.decoder = decoders.Fuse()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="</s>", pad_token="<pad>", unk_token="<unk>")
    whole = fast("1 + 2 = 3\nThe answer is 3\n")["input_ids"]
    pieces = fast("1 + 2 = 3\n")["input_ids"] + fast("The answer is 3\n")["input_ids"]
    assert whole != pieces, "fixture must produce merges across the separator"
    return fast


@settings(max_examples=40, deadline=None)
@given(
    st.lists(
        st.sampled_from(["1 + 2 = 3", "2 + 2 = 4", "The answer is 3", "The answer is 4", "ab"]), min_size=1, max_size=5
    )
)
def test_spans_index_each_step_exactly(crossing_bpe, steps):
    seg = encode_trajectory(crossing_bpe, "Q: 1+2\nA:\n", steps, "\n")
    assert seg.num_steps == len(steps)
    assert seg.step_spans[0][0] == seg.prompt_len
    for (start, end), step in zip(seg.step_spans, steps):
        assert crossing_bpe.decode(seg.input_ids[start:end]) == step + "\n"
    assert seg.input_ids[seg.end_position] == crossing_bpe.eos_token_id
    assert seg.end_position == len(seg.input_ids) - 1
    assert [e for _, e in seg.step_spans][:-1] == [s for s, _ in seg.step_spans][1:]


def test_unfinished_trajectory_has_no_end(crossing_bpe):
    seg = encode_trajectory(crossing_bpe, "Q: 1+2\nA:\n", ["1 + 2 = 3"], "\n", add_end=False)
    assert seg.end_position is None and crossing_bpe.eos_token_id not in seg.input_ids


@pytest.mark.parametrize(
    "step, results, stated",
    [
        ("3 + 4 = 7, and 7 * 2 = $14", ["7", "14"], ["7", "14"]),
        ("x = 3 + 1 = 4.", ["4"], ["4"]),  # 3 starts an expression: no result
        ("= 2.5 * 3 = 7.5", ["7.5"], ["7.5"]),
        ("y = -3", ["-3"], ["-3"]),
        ("So x = 10 - 4", [], ["4"]),  # an expression, no result: its last number
        ("The answer is 15", [], ["15"]),
        ("Let us add them up.", [], []),
    ],
)
def test_the_results_a_step_writes(step, results, stated):
    assert [step[a:b] for a, b in calculation_result_spans(step)] == results
    assert [step[a:b] for a, b in step_result_spans(step)] == stated
