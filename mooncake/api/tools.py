"""Tool calling on chat completions: `tools`, `tool_choice` (`auto`, `none`, `required`, a named function),
`parallel_tool_calls`, and `tool_calls` / `tool` messages in the history.

Two formats, by what the model's chat template knows:
- Hermes (Qwen2, Hermes, and any ChatML model): each call is `<tool_call>{"name": ..., "arguments": {...}}
  </tool_call>` in the answer's text. A template that does not render tools itself (SmolLM2's) gets them
  in the system message, as Qwen2.5's template writes them, and the history's calls and results as text;
- Llama 3 JSON (a template that knows `<|python_tag|>`): the answer is `{"name": ..., "parameters": {...}}`.
`required` and a named function are enforced with a grammar (mooncake/engine/grammar.py): the answer is
that call, or those calls; `auto` lets the model choose and the answer is parsed either way. A parsed answer
has `tool_calls` and finish reason `tool_calls`; streamed, text streams as it comes and each call goes out
whole in one delta once its closing tag is seen (OpenAI's delta shape: index, id, type, name, arguments)."""

import json
import re
import uuid
from dataclasses import dataclass, replace

import llguidance

from mooncake.errors import InvalidRequestError

MAX_TOOLS = 128
NAME = re.compile(r"[A-Za-z0-9_.-]{1,64}")
OPEN, CLOSE, NL = "<tool_call>", "</tool_call>", "\n"
HERMES_SYSTEM = ("# Tools\n\nYou may call one or more functions to assist with the user query.\n\nYou are provided "
                 "with function signatures within <tools></tools> XML tags:\n<tools>\n{tools}\n</tools>\n\nFor each "
                 "function call, return a json object with function name and arguments within <tool_call>"
                 "</tool_call> XML tags:\n<tool_call>\n{{\"name\": <function-name>, \"arguments\": "
                 "<args-json-object>}}\n</tool_call>")


@dataclass(frozen=True)
class ToolSpec:
    tools: tuple[dict, ...]  # each {"type": "function", "function": {"name", "description"?, "parameters"?}}
    choice: str  # "auto" | "none" | "required" | "named"
    named: str = ""  # the function tool_choice names
    parallel: bool = True
    format: str = "hermes"  # or "llama3_json"

    @property
    def parses(self) -> bool:
        return self.choice != "none"


def parse_tools(body: dict, chat_template: str | None) -> ToolSpec | None:
    """The request's tools and how they may be called; None without tools. Raises InvalidRequestError."""
    tools, choice = body.get("tools"), body.get("tool_choice")
    if not tools:
        if choice not in (None, "none", "auto"):
            raise InvalidRequestError("'tool_choice' needs 'tools'", "tool_choice")
        return None
    if not isinstance(tools, list) or len(tools) > MAX_TOOLS:
        raise InvalidRequestError(f"'tools' must be a list of at most {MAX_TOOLS} tools", "tools")
    for i, tool in enumerate(tools):
        fn = tool.get("function") if isinstance(tool, dict) else None
        if not isinstance(tool, dict) or tool.get("type") != "function" or not isinstance(fn, dict):
            raise InvalidRequestError(f"'tools[{i}]' must be {{\"type\": \"function\", \"function\": {{...}}}}",
                                      f"tools[{i}]")
        if not isinstance(fn.get("name"), str) or not NAME.fullmatch(fn["name"]):
            raise InvalidRequestError(f"'tools[{i}].function.name' must be 1 to 64 of a-z, A-Z, 0-9, _ . -",
                                      f"tools[{i}].function.name")
        if not isinstance(fn.get("parameters", {}), dict):
            raise InvalidRequestError(f"'tools[{i}].function.parameters' must be a JSON schema",
                                      f"tools[{i}].function.parameters")
    names = [t["function"]["name"] for t in tools]
    if len(set(names)) < len(names):
        raise InvalidRequestError("'tools' names a function twice", "tools")
    named = ""
    if isinstance(choice, dict):
        named = (choice.get("function") or {}).get("name") if choice.get("type") == "function" else None
        if named not in names:
            raise InvalidRequestError(f"'tool_choice' must name one of the tools ({', '.join(names)})", "tool_choice")
        choice = "named"
    elif choice is None:
        choice = "auto"
    elif choice not in ("auto", "none", "required"):
        raise InvalidRequestError("'tool_choice' must be \"auto\", \"none\", \"required\" or {\"type\": \"function\", "
                                  "\"function\": {\"name\": ...}}", "tool_choice")
    parallel = body.get("parallel_tool_calls", True)
    if not isinstance(parallel, bool):
        raise InvalidRequestError("'parallel_tool_calls' must be true or false", "parallel_tool_calls")
    fmt = "llama3_json" if chat_template and "<|python_tag|>" in chat_template else "hermes"
    return ToolSpec(tuple(tools), choice, named, parallel, fmt)


def template_renders_tools(chat_template: str | None) -> bool:
    return bool(chat_template) and "tools" in chat_template


def render_turns(turns: list[dict], spec: ToolSpec | None, chat_template: str | None) -> list[dict]:
    """The messages as the template is given them: for a template that does not render tools, the tools go
    into the system message and calls and results into the text, in the Hermes format."""
    if spec is None and not any(t.get("tool_calls") or t["role"] == "tool" for t in turns):
        return turns
    if template_renders_tools(chat_template):
        return turns
    out = []
    for turn in turns:
        if turn.get("tool_calls"):
            calls = "".join(f"{OPEN}\n{json.dumps(c['function'])}\n{CLOSE}" for c in turn["tool_calls"])
            out.append({"role": "assistant", "content": (turn.get("content") or "") + calls})
        elif turn["role"] == "tool":
            out.append({"role": "user", "content": f"<tool_response>\n{turn['content']}\n</tool_response>"})
        else:
            out.append({"role": turn["role"], "content": turn["content"]})
    if spec is not None and spec.tools:
        listed = "\n".join(json.dumps(t) for t in spec.tools)
        system = HERMES_SYSTEM.format(tools=listed)
        if out and out[0]["role"] == "system":
            out[0] = {"role": "system", "content": out[0]["content"] + "\n\n" + system}
        else:
            out.insert(0, {"role": "system", "content": system})
    return out


def history_calls(msg: dict, where: str) -> list[dict]:
    """An assistant message's `tool_calls` as chat templates take them (arguments an object, not text)."""
    calls = msg.get("tool_calls")
    if not isinstance(calls, list):
        raise InvalidRequestError(f"'{where}.tool_calls' must be a list", f"{where}.tool_calls")
    out = []
    for k, call in enumerate(calls):
        fn = call.get("function") if isinstance(call, dict) else None
        try:
            arguments = json.loads(fn["arguments"]) if isinstance(fn["arguments"], str) else fn["arguments"]
            assert isinstance(fn["name"], str) and isinstance(arguments, dict)
        except (TypeError, KeyError, ValueError, AssertionError):
            raise InvalidRequestError(f"'{where}.tool_calls[{k}]' must be {{\"type\": \"function\", \"function\": "
                                      f"{{\"name\": ..., \"arguments\": a JSON object}}}}",
                                      f"{where}.tool_calls[{k}]") from None
        out.append({"id": call.get("id", ""), "type": "function", "function": {"name": fn["name"],
                                                                              "arguments": arguments}})
    return out


def grammar_for(spec: ToolSpec) -> str | None:
    """The grammar that enforces `required` or a named function; None for `auto` and `none`."""
    if spec.choice not in ("required", "named"):
        return None
    tools = [t for t in spec.tools if spec.choice == "required" or t["function"]["name"] == spec.named]
    args = "arguments" if spec.format == "hermes" else "parameters"
    calls = [{"type": "object", "additionalProperties": False, "required": ["name", args],
              "properties": {"name": {"const": t["function"]["name"]},
                             args: t["function"].get("parameters") or {"type": "object"}}} for t in tools]
    schema = json.dumps({"oneOf": calls, "x-guidance": {"whitespace_flexible": False}})
    many = spec.parallel and spec.choice == "required"
    if spec.format == "hermes":
        more = ' ("\\n" call)*' if many else ""
        lark = f"start: call{more}\ncall: {json.dumps(OPEN + NL)} body {json.dumps(NL + CLOSE)}\nbody: %json {schema}"
    else:
        more = ' ("; " body)*' if many else ""
        lark = f"start: body{more}\nbody: %json {schema}"
    grammar = llguidance.grammar_from("lark", lark)
    if error := llguidance.LLMatcher.validate_grammar(grammar):
        raise InvalidRequestError(f"the tools' parameters are not a schema this server can follow: {error.strip()}",
                                  "tools")
    return grammar


def _call(index: int, name: str, arguments) -> dict:
    return {"index": index, "id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
            "function": {"name": name, "arguments": json.dumps(arguments)}}


def _parsed(text: str, fmt: str, index: int) -> dict | None:
    """One call's text as a tool call, or None when it is not one."""
    try:
        value = json.loads(text)
    except ValueError:
        return None
    args = "arguments" if fmt == "hermes" else "parameters"
    if not isinstance(value, dict) or not isinstance(value.get("name"), str) or not isinstance(value.get(args), dict):
        return None
    return _call(index, value["name"], value[args])


class ToolCallParser:
    """An answer's text, fed as it streams: what to send as content, and each tool call once it is whole."""

    def __init__(self, fmt: str):
        self.fmt = fmt
        self.buffer = ""
        self.in_call = False
        self.calls: list[dict] = []
        self.mode = ""  # llama3_json: "json" (it began with "{": held until its end) or "text"

    def feed(self, text: str, final: bool = False) -> tuple[str, list[dict]]:
        self.buffer += text
        if self.fmt == "llama3_json":
            return self._feed_json(final)
        content, calls = "", []
        while True:
            if not self.in_call:
                at = self.buffer.find(OPEN)
                between = self.buffer if at < 0 else self.buffer[:at]
                if self.calls and not between.strip():  # NOTE: whitespace between calls (or after) is not text
                    if at < 0:
                        self.buffer = "" if final else self.buffer
                        break
                    between = ""
                if at < 0:
                    keep = 0 if final else _partial_suffix(self.buffer, OPEN)
                    if self.calls and not final and not self.buffer[:len(self.buffer) - keep].strip():
                        keep = len(self.buffer)  # whitespace after a call, then maybe the next one's tag
                    content += self.buffer[:len(self.buffer) - keep]
                    self.buffer = self.buffer[len(self.buffer) - keep:]
                    break
                content += between
                self.buffer, self.in_call = self.buffer[at + len(OPEN):], True
            end = self.buffer.find(CLOSE)
            if end < 0 and not final:
                break
            body = self.buffer if end < 0 else self.buffer[:end]
            call = _parsed(body.strip(), self.fmt, len(self.calls))
            if call is None:  # not a call after all: it was text
                content += OPEN + (self.buffer if end < 0 else self.buffer[:end + len(CLOSE)])
            else:
                calls.append(call)
                self.calls.append(call)
            self.buffer, self.in_call = ("" if end < 0 else self.buffer[end + len(CLOSE):]), False
            if end < 0:
                break
        return content, calls

    def _feed_json(self, final: bool) -> tuple[str, list[dict]]:
        if not self.mode and self.buffer.lstrip():
            self.mode = "json" if self.buffer.lstrip().startswith("{") else "text"
        if self.mode == "text" or not self.mode and final:
            text, self.buffer = self.buffer, ""
            return text, []
        if not final:
            return "", []
        parts = [_parsed(p.strip(), self.fmt, i) for i, p in enumerate(self.buffer.split(";"))]
        if all(parts):
            self.calls, self.buffer = parts, ""
            return "", parts
        text, self.buffer = self.buffer, ""
        return text, []


class ToolCalls:
    """Each chat choice's events as the client sees them when it may call tools: its text less the calls,
    and each call as it completes; the last event's finish reason is `tool_calls` when there were any."""

    def __init__(self, spec: ToolSpec | None):
        self.spec = spec if spec is not None and spec.parses else None
        self.parsers: dict[int, ToolCallParser] = {}

    def __call__(self, index: int, event):
        if self.spec is None:
            return event
        parser = self.parsers.setdefault(index, ToolCallParser(self.spec.format))
        final = event.finish_reason is not None
        text, calls = parser.feed(event.text, final)
        reason = "tool_calls" if final and parser.calls and event.finish_reason == "stop" else event.finish_reason
        return replace(event, text=text, finish_reason=reason, tool_calls=calls or None)


def _partial_suffix(text: str, tag: str) -> int:
    """The length of the longest end of `text` that begins `tag`."""
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:n]):
            return n
    return 0
