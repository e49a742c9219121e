"""Streaming detokenization: deltas add up to the whole text, stop strings cut it, split across tokens."""

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from mooncake.text import IncrementalDetokenizer, decode_completion


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


@pytest.fixture(scope="module", params=["tiny", pytest.param("real", marks=pytest.mark.real_model)])
def any_tokenizer(request, tiny_dir, real_dir):
    from transformers import AutoTokenizer
    return AutoTokenizer.from_pretrained(tiny_dir if request.param == "tiny" else real_dir)


SAMPLE = "Hello, world! naïve café — 東京 ok 🙂 END\n  x = [1, 2]; 's don't . , ! ?" * 3


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_streamed_deltas_equal_the_whole_decode_whatever_the_tokens_and_their_grouping(any_tokenizer, data):
    """Deltas (each decoding only the latest tokens) add up to what one decode of the whole completion
    gives, cut at the first stop string, for text-like and arbitrary token ids (special ones included),
    however the tokens are grouped into messages."""
    tok = any_tokenizer
    text_ids = tok(SAMPLE)["input_ids"]
    pieces = st.one_of(st.sampled_from(text_ids), st.integers(0, len(tok) - 1))
    ids = data.draw(st.lists(pieces, min_size=1, max_size=60) | st.just(text_ids), label="ids")
    stop = tuple(data.draw(st.lists(st.sampled_from(["END", "\n", "café", "zz", "'s"]), max_size=2), label="stop"))
    cuts = data.draw(st.lists(st.integers(1, len(ids)), max_size=8), label="cuts")
    bounds = sorted({0, len(ids), *cuts})
    detok = IncrementalDetokenizer(tok, stop)
    out = [detok.add(ids[a:b], final=b == len(ids)) for a, b in zip(bounds, bounds[1:])]
    assert "".join(out) == decode_completion(tok, ids, stop)
    if not stop:
        assert not detok.stopped
