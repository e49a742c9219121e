"""Streaming detokenization: deltas add up to the whole text, stop strings cut it, split across tokens."""

import pytest

from mooncake.text import IncrementalDetokenizer


@pytest.fixture(scope="module")
def tokenizer(tiny_dir):
    from transformers import AutoTokenizer
    return AutoTokenizer.from_pretrained(tiny_dir)


def stream(tokenizer, text: str, stop=()):
    detok = IncrementalDetokenizer(tokenizer, tuple(stop))
    ids = tokenizer(text)["input_ids"]
    pieces = [detok.add([i], final=(k == len(ids) - 1)) for k, i in enumerate(ids)]
    return pieces, detok.stopped


def test_deltas_add_up_to_the_text_including_multibyte_characters(tokenizer):
    text = "naïve café — 東京 ok"
    pieces, stopped = stream(tokenizer, text)
    assert "".join(pieces) == text and not stopped
    assert all("\ufffd" not in p for p in pieces)  # a half character is held back, never sent


def test_a_stop_string_split_over_tokens_ends_the_text_before_it(tokenizer):
    pieces, stopped = stream(tokenizer, "answer: 42\nEND of it", stop=["\nEND", "zzz"])
    assert stopped and "".join(pieces) == "answer: 42"


def test_the_held_back_tail_is_flushed_at_the_end(tokenizer):
    pieces, stopped = stream(tokenizer, "almost ENd", stop=["END"])
    assert not stopped and "".join(pieces) == "almost ENd"
