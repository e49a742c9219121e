"""The conductor's LightTokenizer against transformers' AutoTokenizer, on the tiny model and SmolLM2: the
same ids (with and without special tokens), the same text back, the same chat prompts; and the conductor's
process never imports torch for it."""

import subprocess
import sys

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from transformers import AutoTokenizer

from mooncake.tokenizer import LightTokenizer

TEXT = st.text(alphabet=st.characters(codec="utf-8", exclude_categories=("Cs",)), max_size=80) | st.sampled_from(
    ["Hello, world!", "What is the capital of France?", "I can't, you're right. It's 3.14 ?", "  spaced  out ",
     "<|im_start|>user\nhi<|im_end|>", "naïve café 東京 🙂", "line\nbreak\ttab", ""])
MESSAGES = st.lists(st.fixed_dictionaries({"role": st.sampled_from(["system", "user", "assistant"]),
                                           "content": TEXT}), min_size=1, max_size=4)
SETTINGS = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])


@pytest.fixture(scope="module", params=["tiny", "real"])
def pair(request, tiny_dir, real_dir):
    path = tiny_dir if request.param == "tiny" else real_dir
    return LightTokenizer(path), AutoTokenizer.from_pretrained(path)


@SETTINGS
@given(text=TEXT)
def test_the_same_ids_and_text_as_transformers(pair, text):
    light, hf = pair
    for special in (True, False):
        ids = light(text, add_special_tokens=special)["input_ids"]
        assert ids == hf(text, add_special_tokens=special)["input_ids"]
        for skip in (True, False):
            assert light.decode(ids, skip_special_tokens=skip) == hf.decode(ids, skip_special_tokens=skip)


@SETTINGS
@given(ids=st.lists(st.integers(min_value=0, max_value=48), max_size=30))
def test_decoding_any_ids_special_ones_included_matches(pair, ids):
    light, hf = pair
    ids = [i * 997 % min(hf.vocab_size, 49152) for i in ids]
    assert light.decode(ids, skip_special_tokens=True) == hf.decode(ids, skip_special_tokens=True)


@SETTINGS
@given(text=TEXT)
def test_token_bytes_spell_the_text_even_where_a_token_splits_a_character(pair, text):
    """What logprobs show per token: their bytes, concatenated, are the decoded text's UTF-8 (bytes the
    vocabulary lacks are lost on the way in, and decode as U+FFFD)."""
    light, _ = pair
    ids = light(text, add_special_tokens=False)["input_ids"]
    assert b"".join(light.token_bytes(i) for i in ids).decode(errors="replace") == light.decode(ids)
    assert light.token_bytes(10 ** 9) is None  # an id past the tokenizer's vocabulary


@SETTINGS
@given(messages=MESSAGES)
def test_the_same_chat_prompts_as_transformers(pair, messages):
    light, hf = pair
    for generation in (True, False):
        assert light.apply_chat_template(messages, add_generation_prompt=generation) == \
            hf.apply_chat_template(messages, tokenize=False, add_generation_prompt=generation)


def test_the_conductor_and_its_api_import_no_torch(tiny_dir):
    code = ("import sys; from mooncake.tokenizer import LightTokenizer; import mooncake.conductor.service, "
            f"mooncake.api.server; t = LightTokenizer({str(tiny_dir)!r}); t('hi'); "
            "t.apply_chat_template([{'role': 'user', 'content': 'hi'}], add_generation_prompt=True); "
            "print('torch' in sys.modules, 'transformers' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["False", "False"]
