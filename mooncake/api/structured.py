"""Structured outputs at the door: a request's `response_format` (chat: `json_object`, `json_schema`), vLLM's
`structured_outputs` (`json`, `regex`, `choice`, `grammar`, `json_object`) or its older `guided_json`,
`guided_regex`, `guided_choice`, `guided_grammar`, made into one llguidance grammar (`SamplingParams.grammar`)
and checked here, so a bad schema or regex is a 400 naming its field before anything is placed. The engine
masks every sampled token with it (mooncake/engine/grammar.py).

JSON is generated without optional whitespace (llguidance's `whitespace_flexible` off, as a schema may turn
back on with `x-guidance`): a model that may put any whitespace between tokens can pad forever."""

import json

import llguidance

from mooncake.errors import InvalidRequestError
from mooncake.sampling import MAX_GRAMMAR_CHARS

KINDS = ("json", "regex", "choice", "grammar", "json_object")  # structured_outputs' keys, one at most
GUIDED = {"guided_json": "json", "guided_regex": "regex", "guided_choice": "choice", "guided_grammar": "grammar"}
FIELDS = frozenset({"structured_outputs", *GUIDED})
JSON_DEFAULTS = {"whitespace_flexible": False}


def grammar_of(body: dict) -> str | None:
    """The grammar a request's body asks its output to follow, or None; raises InvalidRequestError naming the
    field that is wrong."""
    asked = []  # (field, kind, value)
    response_format = body.get("response_format")
    if response_format not in (None, {"type": "text"}):
        asked.append(_response_format(response_format))
    outputs = body.get("structured_outputs")
    if outputs is not None:
        if not isinstance(outputs, dict):
            raise InvalidRequestError("'structured_outputs' must be an object", "structured_outputs")
        for key, value in outputs.items():
            if key not in KINDS:
                raise InvalidRequestError(f"'structured_outputs.{key}' is not supported by this server (it takes "
                                          f"one of {', '.join(KINDS)})", f"structured_outputs.{key}")
            if value is not None and value is not False:
                asked.append((f"structured_outputs.{key}", key, value))
    asked += [(name, kind, body[name]) for name, kind in GUIDED.items() if body.get(name) is not None]
    if not asked:
        return None
    if len(asked) > 1:
        raise InvalidRequestError(f"one structured output at a time: {' and '.join(a[0] for a in asked)} were "
                                  "both given", asked[1][0])
    field, kind, value = asked[0]
    try:
        grammar = _grammar(field, kind, value)
    except (ValueError, RuntimeError) as exc:  # llguidance's own refusal of what it was given
        raise InvalidRequestError(f"'{field}' is not a grammar this server can follow: {exc}", field) from None
    if len(grammar) > MAX_GRAMMAR_CHARS:
        raise InvalidRequestError(f"'{field}' is too large: at most {MAX_GRAMMAR_CHARS} characters", field)
    if error := llguidance.LLMatcher.validate_grammar(grammar):
        raise InvalidRequestError(f"'{field}' is not a grammar this server can follow: {error.strip()}", field)
    return grammar


def _response_format(value) -> tuple[str, str, object]:
    if not isinstance(value, dict) or value.get("type") not in ("text", "json_object", "json_schema"):
        raise InvalidRequestError("'response_format' must be {\"type\": \"text\"}, {\"type\": \"json_object\"} or "
                                  "{\"type\": \"json_schema\", \"json_schema\": {\"name\": ..., \"schema\": ...}}",
                                  "response_format")
    if value["type"] == "json_object":
        return "response_format", "json_object", True
    spec = value.get("json_schema")
    if not isinstance(spec, dict) or not isinstance(spec.get("schema", {}), dict):
        raise InvalidRequestError("'response_format.json_schema' must be an object with a 'schema' object",
                                  "response_format.json_schema")
    # NOTE: strict or not, the schema is enforced (OpenAI's strict mode is what every reply here gets)
    return "response_format.json_schema.schema", "json", spec.get("schema", {})


def _grammar(field: str, kind: str, value) -> str:
    if kind == "json_object":
        return llguidance.LLMatcher.grammar_from_json_schema({"type": "object"}, defaults=JSON_DEFAULTS)
    if kind == "json":
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except ValueError as exc:
                raise InvalidRequestError(f"'{field}' is not valid JSON: {exc}", field) from None
        if not isinstance(value, (dict, bool)):
            raise InvalidRequestError(f"'{field}' must be a JSON schema (an object)", field)
        return llguidance.LLMatcher.grammar_from_json_schema(value, defaults=JSON_DEFAULTS)
    if kind == "choice":
        if not isinstance(value, list) or not value or not all(isinstance(c, str) and c for c in value):
            raise InvalidRequestError(f"'{field}' must be a non-empty list of non-empty strings", field)
        return llguidance.grammar_from("choice", json.dumps(value))
    if not isinstance(value, str) or not value:
        raise InvalidRequestError(f"'{field}' must be a non-empty string", field)
    return llguidance.grammar_from("regex" if kind == "regex" else "grammar", value)
