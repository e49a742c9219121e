"""Structured outputs in the engine (mooncake/engine/grammar.py): every sampled token follows the request's
grammar, greedy or sampled, batched with requests without one; a leg that resumes after generated tokens
(decode after a KV hand-off) replays them and goes on as one engine would; logprobs stay the raw model's."""

import json
import re

import llguidance
import pytest

from mooncake.config import EngineConfig
from mooncake.engine import LLMEngine, SamplingParams
from mooncake.errors import InvalidRequestError
from tests.conftest import REAL, TINY

PERSON = {"type": "object", "additionalProperties": False, "required": ["name", "age", "city", "tags"],
          "properties": {"name": {"type": "string", "maxLength": 10},
                         "age": {"type": "integer", "minimum": 0, "maximum": 120},
                         "city": {"enum": ["Paris", "Rome", "Oslo"]},
                         "tags": {"type": "array", "items": {"type": "boolean"}, "maxItems": 3}}}
JSON = llguidance.LLMatcher.grammar_from_json_schema(PERSON, defaults={"whitespace_flexible": False})


def is_person(text: str) -> bool:
    value = json.loads(text)
    return (set(value) == {"name", "age", "city", "tags"} and isinstance(value["name"], str)
            and len(value["name"]) <= 10 and type(value["age"]) is int and 0 <= value["age"] <= 120
            and value["city"] in ("Paris", "Rome", "Oslo") and len(value["tags"]) <= 3
            and all(isinstance(t, bool) for t in value["tags"]))


# NOTE: SmolLM2's run is in the slow tier (make test's time); tests/e2e/test_structured_real.py covers it there too
@pytest.fixture(scope="module", params=[TINY, pytest.param(REAL, marks=[pytest.mark.real_model, pytest.mark.slow])])
def engine(request):
    from mooncake.models.fetch import fetch_model
    return LLMEngine(EngineConfig(model=str(fetch_model(request.param)), block_size=16, num_kv_blocks=1024))


def prompt(engine, text="Describe a person as JSON:"):
    return engine.tokenizer(text)["input_ids"]


def text_of(engine, out) -> str:
    return engine.tokenizer.decode(out.token_ids, skip_special_tokens=True)


def test_json_schema_outputs_parse_and_validate_sampled_and_greedy_beside_unconstrained_requests(engine):
    ids = prompt(engine)
    free = engine.add_request(ids, SamplingParams(max_tokens=30, ignore_eos=True, temperature=1.0, seed=9))
    rids = [engine.add_request(ids, SamplingParams(max_tokens=120, temperature=1.0, seed=seed, grammar=JSON))
            for seed in range(12)] + [engine.add_request(ids, SamplingParams(max_tokens=120, grammar=JSON))]
    while engine.has_unfinished():
        engine.step()
    outs = [engine.pop_completion(r) for r in rids]
    assert all(o.finish_reason == "stop" and is_person(text_of(engine, o)) for o in outs), \
        [text_of(engine, o) for o in outs]
    assert len({text_of(engine, o) for o in outs}) > 1  # sampled, not one forced string
    assert len(engine.pop_completion(free).token_ids) == 30  # the unconstrained request was not masked


@pytest.mark.parametrize("kind, spec, check", [
    ("regex", r"[0-9]{3}-[a-z]{2,4}", lambda t: re.fullmatch(r"[0-9]{3}-[a-z]{2,4}", t)),
    ("choice", json.dumps(["yes", "no", "it depends"]), lambda t: t in ("yes", "no", "it depends")),
    ("grammar", 'root ::= "(" [a-c]+ ")"', lambda t: re.fullmatch(r"\([a-c]+\)", t)),
])
def test_regex_choice_and_grammar_outputs_match(engine, kind, spec, check):
    grammar = llguidance.grammar_from(kind, spec)
    outs = engine.generate([prompt(engine, "Answer:")] * 4,
                           SamplingParams(max_tokens=40, temperature=1.0, seed=5, grammar=grammar))
    assert all(o.finish_reason == "stop" and check(text_of(engine, o)) for o in outs), \
        [text_of(engine, o) for o in outs]


def test_a_leg_resumed_after_generated_tokens_replays_them_and_goes_on_as_one_engine(engine):
    """Prefill samples the first token and hands its KV to a second engine, which gets prompt + that token
    with grammar_done = 1: the answer is the one engine's, token for token."""
    ids = prompt(engine, "A person, as JSON:")
    greedy = SamplingParams(max_tokens=120, grammar=JSON)
    (whole,) = engine.generate([ids], greedy)
    rid = engine.add_request(ids, SamplingParams(max_tokens=1, grammar=JSON), keep_kv=True)
    while engine.has_unfinished():
        engine.step()
    payloads = engine.export_kv(rid)
    first = engine.pop_completion(rid).token_ids
    decoder = LLMEngine(engine.config)
    rid = decoder.add_request(ids + first, SamplingParams(max_tokens=119, grammar=JSON, grammar_done=1),
                              kv_payloads=payloads)
    while decoder.has_unfinished():
        decoder.step()
    assert first + decoder.pop_completion(rid).token_ids == whole.token_ids and is_person(text_of(engine, whole))
    # Generated tokens that break the grammar are refused when the leg is added, not mid-batch.
    with pytest.raises(InvalidRequestError, match="grammar"):
        decoder.add_request(ids + prompt(engine, "not json"), SamplingParams(grammar=JSON, grammar_done=2))


def test_logprobs_are_the_raw_models_under_a_grammar(engine):
    ids = prompt(engine, "Pick one:")
    choice = llguidance.grammar_from("choice", json.dumps(["maybe"]))
    (free,) = engine.generate([ids], SamplingParams(max_tokens=1, logprobs=3))
    (forced,) = engine.generate([ids], SamplingParams(max_tokens=8, logprobs=3, grammar=choice))
    assert text_of(engine, forced) == "maybe"
    assert forced.logprobs[0].top == free.logprobs[0].top  # the same raw distribution at the first token
