"""Structured outputs and tool calls on the real default model (SmolLM2) through a dev cluster and the openai
client: 100 json_schema (strict) replies, sampled, each the first token from prefill and the rest from
decode, all parse and validate against the schema; a required tool call parses, whole and streamed."""

import json

import pytest

from mooncake.config import load_config
from mooncake.dev import DevCluster

pytestmark = [pytest.mark.slow, pytest.mark.real_model]  # make test skips it; make test-all and .ci/run run it

PERSON = {"type": "object", "additionalProperties": False, "required": ["name", "age", "city", "hobbies"],
          "properties": {"name": {"type": "string", "maxLength": 20},
                         "age": {"type": "integer", "minimum": 0, "maximum": 120},
                         "city": {"type": "string", "maxLength": 20},
                         "hobbies": {"type": "array", "items": {"type": "string", "maxLength": 20}, "maxItems": 3}}}


def valid(person: dict) -> bool:
    return (set(person) == {"name", "age", "city", "hobbies"} and isinstance(person["name"], str)
            and len(person["name"]) <= 20 and type(person["age"]) is int and 0 <= person["age"] <= 120
            and isinstance(person["city"], str) and len(person["city"]) <= 20 and len(person["hobbies"]) <= 3
            and all(isinstance(h, str) and len(h) <= 20 for h in person["hobbies"]))


@pytest.fixture(scope="module")
def client(real_dir, tmp_path_factory):
    openai = pytest.importorskip("openai")
    config = load_config(None, {"api.port": 0, "conductor.admission": "accept-all"})
    with DevCluster(config, workdir=tmp_path_factory.mktemp("cluster"), log_to_files=True) as cluster:
        yield openai.OpenAI(base_url=cluster.url + "/v1", api_key="unused", timeout=300, max_retries=0)


MODEL = "smollm2-135m-instruct"


def test_smollm2_json_schema_replies_parse_and_validate_100_of_100(client):
    fmt = {"type": "json_schema", "json_schema": {"name": "person", "strict": True, "schema": PERSON}}
    messages = [{"role": "user", "content": "Describe a person who lives in Europe, as JSON."}]
    replies = []
    for seed in range(10):
        reply = client.chat.completions.create(model=MODEL, messages=messages, response_format=fmt, n=10,
                                               temperature=1.0, seed=seed * 10, max_tokens=150)
        replies += [(c.finish_reason, c.message.content) for c in reply.choices]
    assert len(replies) == 100
    assert all(reason == "stop" and valid(json.loads(text)) for reason, text in replies), replies
    assert len({text for _, text in replies}) > 50  # sampled answers, not one forced string


WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The current weather in a city",
    "parameters": {"type": "object", "additionalProperties": False, "required": ["city", "unit"],
                   "properties": {"city": {"type": "string", "maxLength": 30},
                                  "unit": {"enum": ["celsius", "fahrenheit"]}}}}}


def test_smollm2_required_tool_call_parses_whole_and_streamed(client):
    args = dict(model=MODEL, messages=[{"role": "user", "content": "What is the weather like in Paris today?"}],
                tools=[WEATHER], tool_choice="required", temperature=0, max_tokens=100)
    whole = client.chat.completions.create(**args).choices[0]
    assert whole.finish_reason == "tool_calls" and whole.message.content is None
    calls = whole.message.tool_calls
    assert calls and all(c.function.name == "get_weather" for c in calls)
    arguments = json.loads(calls[0].function.arguments)
    assert set(arguments) == {"city", "unit"} and arguments["unit"] in ("celsius", "fahrenheit")
    streamed = {}
    for chunk in client.chat.completions.create(stream=True, **args):
        for delta in chunk.choices[0].delta.tool_calls or ():
            streamed[delta.index] = streamed.get(delta.index, "") + (delta.function.arguments or "")
    assert streamed == {i: c.function.arguments for i, c in enumerate(calls)}
