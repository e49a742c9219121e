"""OpenAI request bodies -> a checked `ParsedRequest`; every problem is an ApiError naming the field,
answered as HTTP 400 with an OpenAI-style error body. Unsupported options are refused, not ignored."""

from dataclasses import dataclass, replace

import jinja2

from mooncake.api import structured
from mooncake.api.tools import ToolSpec, grammar_for, history_calls, parse_tools, render_turns, template_renders_tools
from mooncake.sampling import MAX_LOGPROBS, MAX_STOP_TOKEN_IDS, SEED_LIMIT, SamplingParams
from mooncake.errors import InvalidRequestError, MooncakeError
from mooncake.text import encode_chat


class ApiError(MooncakeError):
    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 type_: str = "invalid_request_error", headers: dict | None = None):
        super().__init__(message)
        self.status, self.param, self.code, self.type, self.headers = status, param, code, type_, headers or {}

    def body(self) -> dict:
        return {"error": {"message": str(self), "type": self.type, "param": self.param, "code": self.code}}


def bad(message: str, param: str | None = None, code: str | None = None) -> ApiError:
    return ApiError(400, message, param, code)


@dataclass(frozen=True)
class ParsedRequest:
    model: str
    prompts: list[list[int]]  # token ids of each prompt (completions take a batch of them; chat one)
    params: SamplingParams
    stream: bool
    include_usage: bool
    n: int = 1  # choices per prompt: each its own request (with seed + i when a seed is given)
    cache_salt: str = ""  # vLLM's: a prefix cache of its own, shared only with requests of the same salt
    # completions only (mooncake/api/echo.py)
    echo: bool = False  # each choice's text, token ids and logprobs start with its prompt's
    generates: bool = True  # False (`max_tokens: 0` with echo): the prompt alone; the token computed is dropped
    shows_prompt_logprobs: bool = False  # vLLM's `prompt_logprobs`: each choice lists its prompt's
    tools: ToolSpec | None = None  # chat: the tools it may call (mooncake/api/tools.py)

    @property
    def num_choices(self) -> int:
        return len(self.prompts) * self.n  # prompt j's choice i has index j * n + i


MAX_CHOICES = 16  # `n` at most
MAX_BATCH_CHOICES = 256  # prompts times `n`, at most
MAX_CACHE_SALT_CHARS = 256


@dataclass(frozen=True)
class ModelLimits:
    """What a request is checked against."""

    names: tuple[str, ...]  # names "model" may take; the first is what /v1/models lists
    max_model_len: int
    vocab_size: int
    default_max_tokens: int
    strict_fields: bool = True  # api.strict_fields: a field this server does not know is a 400 naming it


_MISSING = object()
# The fields each endpoint knows. A field that changes what is generated and that this server does not do
# is refused unless it has its neutral value (NEUTRAL, _refuse); `user` is an end-user id (no effect here).
_COMMON = {"model", "n", "max_tokens", "stream", "stream_options", "temperature", "top_p", "top_k", "seed", "stop",
           "stop_token_ids", "ignore_eos", "logprobs", "return_token_ids", "cache_salt", "user", "best_of",
           "presence_penalty", "frequency_penalty", "logit_bias", *structured.FIELDS}
COMPLETION_FIELDS = frozenset(_COMMON | {"prompt", "echo", "suffix", "prompt_logprobs"})
CHAT_FIELDS = frozenset(_COMMON | {"messages", "max_completion_tokens", "top_logprobs", "response_format", "tools",
                                   "tool_choice", "parallel_tool_calls"})
NEUTRAL = {"min_p": (0, 0.0), "repetition_penalty": (1, 1.0), "min_tokens": (0,), "skip_special_tokens": (True,),
           "spaces_between_special_tokens": (True,), "include_stop_str_in_output": (False,),
           "reasoning_effort": (None,)}
MESSAGE_FIELDS = frozenset({"role", "content", "name", "tool_calls", "tool_call_id"})


def check_model(model: str, limits: ModelLimits) -> str:
    """`model` if this server serves it; else a 404 model_not_found, as OpenAI and vLLM answer."""
    if model not in limits.names:
        raise ApiError(404, f"the model '{model}' does not exist; this server serves '{limits.names[0]}'",
                       "model", "model_not_found")
    return model


def parse_tokenize(body, tokenizer, limits: ModelLimits) -> list[int]:
    """vLLM's /tokenize body: {"model", "prompt"} or {"model", "messages"} (chat template applied)."""
    if not isinstance(body, dict):
        raise bad("the request body must be a JSON object")
    if "model" in body:
        check_model(_field(body, "model", (str,)), limits)
    if "messages" in body:
        return chat_prompt_ids(body, tokenizer, limits.strict_fields)
    prompt = _field(body, "prompt", (str,))
    add_special = _field(body, "add_special_tokens", (bool,), True)
    return tokenizer(prompt, add_special_tokens=add_special)["input_ids"]


def parse_detokenize(body, limits: ModelLimits) -> list[int]:
    """vLLM's /detokenize body: {"model", "tokens": [ids]}."""
    if not isinstance(body, dict):
        raise bad("the request body must be a JSON object")
    if "model" in body:
        check_model(_field(body, "model", (str,)), limits)
    tokens = _field(body, "tokens", (list,))
    if not all(isinstance(t, int) and not isinstance(t, bool) and 0 <= t < limits.vocab_size for t in tokens):
        raise bad(f"'tokens' must be token ids in [0, {limits.vocab_size})", "tokens", "invalid_value")
    return tokens


def _field(body: dict, name: str, kinds, default=_MISSING, what: str = ""):
    value = body.get(name, _MISSING)
    if value is _MISSING or value is None:
        if default is _MISSING:
            raise bad(f"'{name}' is required", name, "missing_required_parameter")
        return default
    # NOTE: bool is an int in Python; a JSON true is never a valid number here.
    if isinstance(value, bool) and bool not in kinds or not isinstance(value, kinds):
        raise bad(f"'{name}' must be {what or ' or '.join(k.__name__ for k in kinds)}, got {value!r}", name,
                  "invalid_type")
    return value


def _refuse(body: dict, name: str, allowed, where: str = "") -> None:
    if name in body and body[name] not in allowed:
        raise bad(f"'{where}{name}' = {body[name]!r} is not supported by this server", where + name,
                  "unsupported_parameter")


def _known(body: dict, fields, strict: bool, where: str = "") -> None:
    """A 400 naming the first field of `body` not in `fields` (with `strict`); at the top level (no `where`)
    NEUTRAL ones are known, at their neutral value."""
    neutral = {} if where else NEUTRAL
    for name, allowed in neutral.items():
        _refuse(body, name, allowed)
    unknown = sorted(k for k in body if k not in fields and k not in neutral)
    if unknown and strict:
        raise bad(f"unknown field{'s' if len(unknown) > 1 else ''} {', '.join(repr(where + k) for k in unknown)}: "
                  f"this server does not support {'them' if len(unknown) > 1 else 'it'} (a server with "
                  f"api.strict_fields = false ignores unknown fields)", where + unknown[0], "unsupported_parameter")


def _stop(body: dict) -> tuple[str, ...]:
    stop = body.get("stop")
    if stop is None:
        return ()
    if isinstance(stop, str):
        stop = [stop]
    if not isinstance(stop, list) or not all(isinstance(s, str) and s for s in stop):
        raise bad("'stop' must be a non-empty string or a list of them", "stop", "invalid_type")
    return tuple(stop)


def _stop_token_ids(body: dict, limits: ModelLimits) -> tuple[int, ...]:
    """vLLM's `stop_token_ids`: generation stops after any of these tokens (it is kept in the output)."""
    ids = body.get("stop_token_ids")
    if ids is None:
        return ()
    if not isinstance(ids, list):
        raise bad("'stop_token_ids' must be a list of token ids", "stop_token_ids", "invalid_type")
    if len(ids) > MAX_STOP_TOKEN_IDS:
        raise bad(f"'stop_token_ids' takes at most {MAX_STOP_TOKEN_IDS} ids, got {len(ids)}", "stop_token_ids",
                  "invalid_value")
    if not all(isinstance(i, int) and not isinstance(i, bool) for i in ids):
        raise bad("'stop_token_ids' must be a list of token ids", "stop_token_ids", "invalid_type")
    if limits.vocab_size and any(not 0 <= i < limits.vocab_size for i in ids):
        raise bad(f"'stop_token_ids' must be token ids below {limits.vocab_size}", "stop_token_ids",
                  "invalid_value")
    return tuple(ids)


def _logprobs_count(body: dict, name: str) -> int:
    count = _field(body, name, (int,))
    if not 0 <= count <= MAX_LOGPROBS:
        raise bad(f"'{name}' must be between 0 and {MAX_LOGPROBS}, got {count}", name, "invalid_value")
    return count


def _completion_logprobs(body: dict) -> int | None:
    """Completions' `logprobs`: how many likeliest tokens to list beside each chosen one (absent: none)."""
    return None if body.get("logprobs") is None else _logprobs_count(body, "logprobs")


def _chat_logprobs(body: dict) -> int | None:
    """Chat's `logprobs` (true: each token's) and `top_logprobs` (how many likeliest beside it)."""
    if not _field(body, "logprobs", (bool,), False):
        if body.get("top_logprobs") is not None:
            raise bad("'top_logprobs' needs 'logprobs': true", "top_logprobs", "invalid_value")
        return None
    return 0 if body.get("top_logprobs") is None else _logprobs_count(body, "top_logprobs")


def _common(body: dict, limits: ModelLimits, prompts: list[list[int]], max_tokens_key: str,
            default_max_tokens: int, logprobs: int | None, tools: ToolSpec | None = None) -> ParsedRequest:
    model = check_model(_field(body, "model", (str,)), limits)
    n = _field(body, "n", (int,), 1)
    if not 1 <= n <= MAX_CHOICES:
        raise bad(f"'n' must be between 1 and {MAX_CHOICES}, got {n}", "n", "invalid_value")
    if len(prompts) * n > MAX_BATCH_CHOICES:
        raise bad(f"{len(prompts)} prompts with n = {n} make {len(prompts) * n} choices; at most "
                  f"{MAX_BATCH_CHOICES} in one request", "prompt", "invalid_value")
    for name, allowed in (("best_of", (1, n)), ("presence_penalty", (0, 0.0)),
                          ("frequency_penalty", (0, 0.0)), ("logit_bias", (None, {})), ("suffix", (None,))):
        _refuse(body, name, allowed)
    if not all(prompts):
        raise bad("the prompt is empty", "prompt")
    num_prompt = max(len(p) for p in prompts)  # NOTE: the longest prompt of a batch bounds every choice
    if num_prompt >= limits.max_model_len:
        raise bad(f"the prompt has {num_prompt} tokens; this model's context length is {limits.max_model_len}",
                  "messages" if max_tokens_key == "max_completion_tokens" else "prompt", "context_length_exceeded")
    room = limits.max_model_len - num_prompt
    max_tokens = _field(body, max_tokens_key, (int,), None)
    if max_tokens is None and max_tokens_key == "max_completion_tokens":
        max_tokens = _field(body, "max_tokens", (int,), None)
    if max_tokens is None:
        max_tokens = min(default_max_tokens, room)
    elif max_tokens < 1:
        needs = " (0 only with 'echo': true, for the prompt's logprobs alone)" if max_tokens == 0 else ""
        raise bad(f"'max_tokens' must be at least 1{needs}, got {max_tokens}", "max_tokens", "invalid_value")
    elif max_tokens > room:
        raise bad(f"prompt ({num_prompt} tokens) + max_tokens ({max_tokens}) exceeds the context length "
                  f"{limits.max_model_len}; ask for at most {room}", "max_tokens", "context_length_exceeded")
    stream = _field(body, "stream", (bool,), False)
    options = _field(body, "stream_options", (dict,), {})
    _refuse(options, "continuous_usage_stats", (False, None), "stream_options.")
    _known(options, {"include_usage", "continuous_usage_stats"}, limits.strict_fields, "stream_options.")
    include_usage = _field(options, "include_usage", (bool,), False)
    try:
        grammar = structured.grammar_of(body)
        if tools is not None and (forced := grammar_for(tools)):
            if grammar is not None:
                raise InvalidRequestError("'tool_choice' (required or a named function) and a structured output "
                                          "cannot both constrain the answer", "tool_choice")
            grammar = forced
        params = SamplingParams(
            max_tokens=max_tokens, temperature=float(_field(body, "temperature", (int, float), 1.0)),
            top_p=float(_field(body, "top_p", (int, float), 1.0)), top_k=_field(body, "top_k", (int,), 0),
            seed=_field(body, "seed", (int,), None), stop=_stop(body),
            stop_token_ids=_stop_token_ids(body, limits),
            ignore_eos=_field(body, "ignore_eos", (bool,), False), logprobs=logprobs, grammar=grammar)
    except InvalidRequestError as exc:
        raise bad(str(exc), exc.param, "invalid_value") from None
    if params.temperature > 2:
        raise bad(f"'temperature' must be at most 2, got {params.temperature}", "temperature", "invalid_value")
    if limits.vocab_size and params.top_k > limits.vocab_size:
        raise bad(f"'top_k' must be at most the vocabulary size {limits.vocab_size} (0: no top-k), got "
                  f"{params.top_k}", "top_k", "invalid_value")
    if params.seed is not None and params.seed + n > SEED_LIMIT:  # choice i samples with seed + i
        raise bad(f"'seed' + n - 1 must be below 2**63, got seed {params.seed} with n = {n}", "seed",
                  "invalid_value")
    cache_salt = _field(body, "cache_salt", (str,), "")
    if len(cache_salt) > MAX_CACHE_SALT_CHARS:
        raise bad(f"'cache_salt' must be at most {MAX_CACHE_SALT_CHARS} characters", "cache_salt", "invalid_value")
    return ParsedRequest(model, prompts, params, stream, include_usage, n, cache_salt, tools=tools)


def parse_completion(body, tokenizer, limits: ModelLimits) -> ParsedRequest:
    if not isinstance(body, dict):
        raise bad("the request body must be a JSON object")
    _known(body, COMPLETION_FIELDS, limits.strict_fields)
    prompt = _field(body, "prompt", (str, list))
    # a string, token ids, or a batch: a list of strings or of token-id lists (each prompt its own choices)
    batch = [prompt] if isinstance(prompt, str) or prompt and all(_is_id(t) for t in prompt) else prompt
    if not batch or not (all(isinstance(p, str) for p in batch) or
                         all(isinstance(p, list) and all(_is_id(t) for t in p) for p in batch)):
        raise bad("'prompt' must be a string, token ids, or a non-empty list of strings or one of token-id lists",
                  "prompt", "invalid_type")
    if len(batch) > MAX_BATCH_CHOICES:  # NOTE: before any of them is tokenized
        raise bad(f"{len(batch)} prompts; at most {MAX_BATCH_CHOICES} choices in one request", "prompt",
                  "invalid_value")
    if any(not 0 <= t < limits.vocab_size for p in batch if isinstance(p, list) for t in p):
        raise bad(f"prompt token ids must be in [0, {limits.vocab_size})", "prompt", "invalid_value")
    prompts = [tokenizer(p)["input_ids"] if isinstance(p, str) else list(p) for p in batch]
    echo = _field(body, "echo", (bool,), False)
    generates = not (echo and body.get("max_tokens") == 0)  # NOTE: as vLLM: one token is computed, and dropped
    logprobs = _completion_logprobs(body)
    parsed = _common(body if generates else {**body, "max_tokens": 1}, limits, prompts, "max_tokens", 16, logprobs)
    shown = None if body.get("prompt_logprobs") is None else _logprobs_count(body, "prompt_logprobs")
    wanted = [k for k in (shown, logprobs if echo else None) if k is not None]
    params = replace(parsed.params, prompt_logprobs=max(wanted)) if wanted else parsed.params
    return replace(parsed, params=params, echo=echo, generates=generates, shows_prompt_logprobs=shown is not None)


def _is_id(t) -> bool:
    return isinstance(t, int) and not isinstance(t, bool)


ROLES = ("system", "user", "assistant", "developer", "tool")


def parse_chat(body, tokenizer, limits: ModelLimits) -> ParsedRequest:
    if not isinstance(body, dict):
        raise bad("the request body must be a JSON object")
    _known(body, CHAT_FIELDS, limits.strict_fields)
    try:
        tools = parse_tools(body, tokenizer.chat_template)
    except InvalidRequestError as exc:
        raise bad(str(exc), exc.param, "invalid_value") from None
    ids = chat_prompt_ids(body, tokenizer, limits.strict_fields, tools)
    return _common(body, limits, [ids], "max_completion_tokens", limits.default_max_tokens, _chat_logprobs(body),
                   tools)


def chat_prompt_ids(body: dict, tokenizer, strict: bool = True, tools: ToolSpec | None = None) -> list[int]:
    """The token ids of a chat request's `messages` (and its tools), through the model's chat template."""
    messages = _field(body, "messages", (list,))
    if not messages:
        raise bad("'messages' must not be empty", "messages")
    turns = []
    for i, msg in enumerate(messages):
        where = f"messages[{i}]"
        if not isinstance(msg, dict):
            raise bad(f"'{where}' must be an object with 'role' and 'content'", where, "invalid_type")
        _known(msg, MESSAGE_FIELDS, strict, where + ".")
        role = msg.get("role")
        if role not in ROLES:
            raise bad(f"'{where}.role' must be one of {', '.join(ROLES)}, got {role!r}", f"{where}.role")
        content = msg.get("content")
        if isinstance(content, list):
            parts = []
            for part in content:
                if not (isinstance(part, dict) and part.get("type") == "text" and isinstance(part.get("text"), str)):
                    raise bad(f"'{where}.content' parts must be {{\"type\": \"text\", \"text\": ...}}; "
                              "this server takes text only", f"{where}.content", "invalid_type")
                parts.append(part["text"])
            content = "".join(parts)
        if content is None and role == "assistant":
            content = ""
        turn = {}
        if msg.get("tool_calls") and role == "assistant":
            try:
                turn["tool_calls"] = history_calls(msg, where)
            except InvalidRequestError as exc:
                raise bad(str(exc), exc.param, "invalid_value") from None
        if role == "tool" and isinstance(msg.get("tool_call_id"), str):
            turn["tool_call_id"] = msg["tool_call_id"]
        if not isinstance(content, str):
            raise bad(f"'{where}.content' must be a string or a list of text parts", f"{where}.content",
                      "invalid_type")
        turns.append({"role": "system" if role == "developer" else role, "content": content, **turn})
    template = tokenizer.chat_template
    listed = list(tools.tools) if tools is not None and template_renders_tools(template) else None
    try:
        return encode_chat(tokenizer, render_turns(turns, tools, template), listed)
    except InvalidRequestError as exc:
        raise bad(str(exc), "messages") from None
    except jinja2.TemplateError as exc:  # the model's template refuses this conversation (role order, ...)
        raise bad(f"the model's chat template refused these messages: {exc}", "messages") from None
