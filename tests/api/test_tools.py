"""Tool calling at the API (mooncake/api/tools.py): calls parsed out of the answer's text in both formats,
whole or split anywhere as they stream; the history's calls and results and the tools rendered into the prompt
of a template that does not render them (SmolLM2's), and passed to one that does; the grammar that forces
`required` and named calls accepts exactly those calls."""

import json

import llguidance
import pytest

from mooncake.api.schemas import ModelLimits, parse_chat
from mooncake.api.tools import ToolCallParser, ToolSpec, grammar_for
from mooncake.models.fetch import fetch_model
from mooncake.tokenizer import LightTokenizer

WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "The weather in a city",
                                            "parameters": {"type": "object", "required": ["city"],
                                                           "properties": {"city": {"type": "string"}}}}}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object", "properties": {}}}}
HERMES_ANSWER = ('Let me check. <tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n'
                 '<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>')


def feed_in_pieces(parser: ToolCallParser, text: str, size: int) -> tuple[str, list[dict]]:
    content, calls = "", []
    pieces = [text[i:i + size] for i in range(0, len(text), size)]
    for k, piece in enumerate(pieces):
        got, new = parser.feed(piece, final=k == len(pieces) - 1)
        content, calls = content + got, calls + new
    return content, calls


@pytest.mark.parametrize("size", [1, 3, 7, 1000])
def test_hermes_calls_are_parsed_whatever_the_pieces_the_text_streams_in(size):
    content, calls = feed_in_pieces(ToolCallParser("hermes"), HERMES_ANSWER, size)
    assert content == "Let me check. "
    assert [(c["index"], c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls] == [
        (0, "get_weather", {"city": "Paris"}), (1, "get_time", {})]
    assert all(c["type"] == "function" and c["id"].startswith("call_") for c in calls)


def test_text_that_only_looks_like_a_call_stays_text():
    for text in ("a < b and <tool_ is not a tag", "<tool_call>not json</tool_call> done", "<tool_call>{\"name\": 1"):
        content, calls = feed_in_pieces(ToolCallParser("hermes"), text, 2)
        assert calls == [] and content == text


def test_llama3_json_calls_and_plain_text():
    content, calls = feed_in_pieces(ToolCallParser("llama3_json"),
                                    '{"name": "get_weather", "parameters": {"city": "Oslo"}}', 4)
    assert content == "" and calls[0]["function"]["name"] == "get_weather"
    assert json.loads(calls[0]["function"]["arguments"]) == {"city": "Oslo"}
    assert feed_in_pieces(ToolCallParser("llama3_json"), "It is sunny.", 3) == ("It is sunny.", [])


@pytest.fixture(scope="module")
def smol():
    return LightTokenizer(fetch_model("smollm2-135m-instruct"))


def limits() -> ModelLimits:
    return ModelLimits(("m",), 2048, 49152, 64)


def test_a_template_without_tools_gets_them_in_the_system_message_and_the_history_as_text(smol):
    body = {"model": "m", "tools": [WEATHER], "messages": [
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": None, "tool_calls": [{"id": "call_1", "type": "function", "function": {
            "name": "get_weather", "arguments": "{\"city\": \"Paris\"}"}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "18 C, sunny"}]}
    parsed = parse_chat(body, smol, limits())
    text = smol.decode(parsed.prompts[0])
    assert "<tools>" in text and '"name": "get_weather"' in text and "The weather in a city" in text
    assert '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>' in text
    assert "<tool_response>\n18 C, sunny\n</tool_response>" in text
    assert parsed.tools.choice == "auto" and parsed.params.grammar is None


def test_a_template_that_renders_tools_is_given_them(tmp_path, smol):
    template = ("{% for t in tools %}TOOL {{ t.function.name }}\n{% endfor %}{% for m in messages %}{{ m.role }}: "
                "{{ m.content }}{% for c in m.tool_calls or [] %} CALL {{ c.function.name }}"
                "{{ c.function.arguments | tojson }}{% endfor %}\n{% endfor %}")
    smol.chat_template, smol._compiled = template, None
    try:
        body = {"model": "m", "tools": [WEATHER, TIME], "messages": [
            {"role": "user", "content": "hi"},
            {"role": "assistant", "tool_calls": [{"type": "function", "function": {"name": "get_time",
                                                                                  "arguments": "{}"}}]}]}
        text = smol.decode(parse_chat(body, smol, limits()).prompts[0])
    finally:
        smol.__init__(fetch_model("smollm2-135m-instruct"))
    assert text.startswith("TOOL get_weather\nTOOL get_time\nuser: hiassistant:  CALL get_time{}")  # trim_blocks


@pytest.mark.parametrize("choice, parallel, accepted, refused", [
    ("required", True, [HERMES_ANSWER.split("Let me check. ")[1]], ["It is sunny.", "<tool_call>\n{}\n</tool_call>"]),
    ("required", False, ['<tool_call>\n{"name":"get_time","arguments":{}}\n</tool_call>'], [
        '<tool_call>\n{"name":"get_time","arguments":{}}\n</tool_call>\n<tool_call>\n{"name":"get_time",'
        '"arguments":{}}\n</tool_call>']),
    ("named", True, ['<tool_call>\n{"name":"get_weather","arguments":{"city":"Rome"}}\n</tool_call>'],
     ['<tool_call>\n{"name":"get_time","arguments":{}}\n</tool_call>',
      '<tool_call>\n{"name":"get_weather","arguments":{}}\n</tool_call>']),
])
def test_the_grammar_of_required_and_named_calls_accepts_those_calls_only(smol, choice, parallel, accepted, refused):
    import llguidance.hf
    from transformers import AutoTokenizer
    hf = AutoTokenizer.from_pretrained(fetch_model("smollm2-135m-instruct"))
    tokenizer = llguidance.hf.from_tokenizer(hf)
    grammar = grammar_for(ToolSpec((WEATHER, TIME), choice, "get_weather" if choice == "named" else "", parallel))

    def matches(text: str) -> bool:
        matcher = llguidance.LLMatcher(tokenizer, grammar)
        return matcher.consume_tokens(hf(text, add_special_tokens=False)["input_ids"]) and matcher.is_accepting()
    compact = [a.replace('": ', '":').replace(', "', ',"') for a in accepted]  # JSON without optional spaces
    assert all(matches(text) for text in compact), compact
    assert not any(matches(text) for text in refused)
