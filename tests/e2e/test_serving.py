"""End to end over real processes (cache, conductor, prefill, decode), over tcp and over shm."""

import json
import re
import subprocess
import sys
import time
import urllib.request
import uuid
from pathlib import Path

import pytest

from tests.e2e.conftest import metrics, post

BLOCK = 16  # engine.block_size in E2E_SETTINGS


def completion(cluster, prompt, **extra):
    status, reply = post(cluster.url + "/v1/completions", {"model": "tiny", "prompt": prompt, "temperature": 0,
                                                           "return_token_ids": True, **extra})
    assert status == 200, reply
    return reply


def test_greedy_completion_is_token_identical_to_mooncake_generate(cluster):
    prompt = f"[{cluster.transport}] The quick brown fox jumps over the lazy dog, " * 3  # > 4 chunks, 8 blocks
    reply = completion(cluster, prompt, max_tokens=24, ignore_eos=True)
    config = cluster.process("prefill-0").config_path
    out = subprocess.run([sys.executable, "-m", "mooncake", "generate", "--config", str(config), "--prompt", prompt,
                          "--max-tokens", "24", "--json"], capture_output=True, text=True, timeout=300, check=True)
    local = json.loads(out.stdout)
    choice = reply["choices"][0]
    assert choice["token_ids"] == local["token_ids"]
    assert len(choice["token_ids"]) == 24 and choice["finish_reason"] == "length"
    assert reply["usage"]["prompt_tokens"] == local["prompt_tokens"]
    assert reply["usage"]["completion_tokens"] == 24


def test_a_shared_prefix_is_reused_and_only_the_rest_computed(cluster):
    shared = f"{uuid.uuid4().hex} shared system prompt for everyone, long enough to fill blocks. " * 2
    before = metrics(cluster.url)
    first = completion(cluster, shared + "First question?", max_tokens=4)
    assert first["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    mid = metrics(cluster.url)
    second = completion(cluster, shared + "Second, different question?", max_tokens=4)
    after = metrics(cluster.url)

    n = second["usage"]["prompt_tokens"]
    cached = second["usage"]["prompt_tokens_details"]["cached_tokens"]
    assert cached == len(shared.encode()) // BLOCK * BLOCK  # byte-level tokenizer: a token per byte
    computed = 'mooncake_prefill_computed_tokens_total{instance="prefill-0"}'
    assert after[computed] - mid[computed] == n - cached  # prefill ran only the uncached part
    assert mid[computed] - before.get(computed, 0) == first["usage"]["prompt_tokens"]
    hits = "mooncake_prefix_hit_tokens_total"
    assert after[hits] - mid[hits] == cached
    assert after['mooncake_kv_transfer_bytes_total{instance="prefill-0"}'] > mid[
        'mooncake_kv_transfer_bytes_total{instance="prefill-0"}']


def test_metrics_cover_the_cache_nodes(cluster):
    completion(cluster, f"{uuid.uuid4().hex} fills a few blocks of the pool, " * 2, max_tokens=2)
    deadline = time.monotonic() + 10  # the conductor polls cache nodes every couple of seconds
    while time.monotonic() < deadline:
        m = metrics(cluster.url)
        if m.get('mooncake_cache_blocks{node="cache-0",tier="dram"}', 0) > 0:
            break
        time.sleep(0.2)
    assert m['mooncake_cache_blocks{node="cache-0",tier="dram"}'] > 0
    assert m['mooncake_cache_bytes_total{direction="in",node="cache-0"}'] > 0
    assert m['mooncake_cache_capacity_bytes{node="cache-0",tier="dram"}'] == 128 << 20


def test_the_openai_client_works_for_chat_and_completions(cluster):
    openai = pytest.importorskip("openai")
    client = openai.OpenAI(base_url=cluster.url + "/v1", api_key="unused", timeout=60, max_retries=0)
    assert [m.id for m in client.models.list()] == ["tiny"]

    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Say something."}]
    whole = client.chat.completions.create(model="tiny", messages=messages, max_tokens=12, temperature=0)
    assert whole.choices[0].message.role == "assistant"
    assert whole.usage.completion_tokens == 12 or whole.choices[0].finish_reason == "stop"
    chunks = list(client.chat.completions.create(model="tiny", messages=messages, max_tokens=12, temperature=0,
                                                 stream=True, stream_options={"include_usage": True}))
    streamed = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert streamed == whole.choices[0].message.content
    assert chunks[-1].usage.total_tokens == whole.usage.total_tokens

    text = client.completions.create(model="tiny", prompt="Once upon a time", max_tokens=10, temperature=0)
    pieces = list(client.completions.create(model="tiny", prompt="Once upon a time", max_tokens=10,
                                            temperature=0, stream=True))
    assert "".join(p.choices[0].text for p in pieces) == text.choices[0].text
    assert pieces[-1].choices[0].finish_reason == text.choices[0].finish_reason


def test_bad_input_gets_400s_and_every_role_keeps_serving(cluster):
    for body, expect in (({"model": "tiny", "prompt": "x", "max_tokens": -3}, 400),
                         ({"model": "tiny", "prompt": "x" * 4100}, 400),
                         ({"model": "nope", "prompt": "x"}, 404), ({"model": "tiny", "prompt": 12}, 400)):
        status, reply = post(cluster.url + "/v1/completions", body)
        assert status == expect and reply["error"]["message"], reply
    assert completion(cluster, "still fine?", max_tokens=3)["usage"]["completion_tokens"] == 3
    assert all(p.popen.poll() is None for p in cluster.processes)


def test_stop_strings_end_the_text_before_them(cluster):
    full = completion(cluster, "Stop test: ", max_tokens=16, ignore_eos=True)["choices"][0]["text"]
    # The random model writes random bytes: stop at its first ASCII letter after the start.
    stop = next((c for c in full[2:] if c.isascii() and c.isalpha()), None)
    if stop is None:
        pytest.skip("the random model wrote no ASCII letter here")
    cut = completion(cluster, "Stop test: ", max_tokens=16, ignore_eos=True, stop=[stop])["choices"][0]
    assert cut["finish_reason"] == "stop" and cut["text"] == full[:full.index(stop)]


def test_vllm_named_series_and_goodput_count_what_was_served(cluster):
    before = metrics(cluster.url)
    reply = completion(cluster, f"{uuid.uuid4().hex} counted once under two names", max_tokens=5, ignore_eos=True)
    after = metrics(cluster.url)

    def grew(series):
        return after.get(series, 0) - before.get(series, 0)
    tiny = '{model_name="tiny"}'
    assert grew(f"vllm:prompt_tokens_total{tiny}") == reply["usage"]["prompt_tokens"] == grew(
        "mooncake_prompt_tokens_total")
    assert grew(f"vllm:generation_tokens_total{tiny}") == 5
    assert grew(f"vllm:time_to_first_token_seconds_count{tiny}") == 1
    assert grew(f"vllm:e2e_request_latency_seconds_count{tiny}") == 1
    assert grew(f"vllm:request_queue_time_seconds_count{tiny}") == 1
    assert grew('mooncake_slo_requests_total{within_slo="true"}') + grew(
        'mooncake_slo_requests_total{within_slo="false"}') == 1
    assert 0 <= after[f"vllm:kv_cache_usage_perc{tiny}"] <= 1


def test_n_choices_with_the_openai_client_whole_and_streamed(cluster):
    openai = pytest.importorskip("openai")
    client = openai.OpenAI(base_url=cluster.url + "/v1", api_key="unused", timeout=60, max_retries=0)
    prompt = f"{uuid.uuid4().hex} several ways to go on: "
    sampled = dict(model="tiny", prompt=prompt, max_tokens=6, temperature=1.0, seed=7, extra_body={"ignore_eos": True})
    whole = client.completions.create(n=3, **sampled)
    assert [c.index for c in whole.choices] == [0, 1, 2]
    single = client.completions.create(n=1, **sampled)
    assert whole.usage.completion_tokens == 18 and whole.usage.prompt_tokens == single.usage.prompt_tokens
    assert len({c.text for c in whole.choices}) > 1  # sampled choices differ
    assert single.choices[0].text == whole.choices[0].text  # choice i samples with seed + i
    assert client.completions.create(n=3, **sampled).choices[2].text == whole.choices[2].text
    texts = {}
    for chunk in client.completions.create(n=3, stream=True, **sampled):
        for choice in chunk.choices:
            texts[choice.index] = texts.get(choice.index, "") + choice.text
    assert texts == {c.index: c.text for c in whole.choices}
    greedy = client.chat.completions.create(model="tiny", n=2, max_tokens=5, temperature=0,
                                            messages=[{"role": "user", "content": prompt}])
    assert len(greedy.choices) == 2 and greedy.choices[0].message.content == greedy.choices[1].message.content


def test_a_batch_of_prompts_gets_each_prompts_choices_in_order_whole_and_streamed(cluster):
    """Completions take a list of prompts (strings or token-id lists, as lm-eval and the OpenAI API send
    them): prompt j's choice i is choice j * n + i, each the same as the prompt asked alone."""
    openai = pytest.importorskip("openai")
    client = openai.OpenAI(base_url=cluster.url + "/v1", api_key="unused", timeout=60, max_retries=0)
    prompts = [f"{uuid.uuid4().hex} first: ", f"{uuid.uuid4().hex} a second, longer prompt: "]
    greedy = dict(model="tiny", max_tokens=5, temperature=0, extra_body={"ignore_eos": True})
    alone = [client.completions.create(prompt=p, **greedy) for p in prompts]
    batch = client.completions.create(prompt=prompts, n=2, **greedy)
    assert [c.index for c in batch.choices] == [0, 1, 2, 3]
    assert [c.text for c in batch.choices] == [alone[0].choices[0].text] * 2 + [alone[1].choices[0].text] * 2
    assert batch.usage.prompt_tokens == sum(a.usage.prompt_tokens for a in alone)
    assert batch.usage.completion_tokens == 20
    as_ids = completion(cluster, [[5, 6, 7, 8], [9, 10, 11]], max_tokens=3, ignore_eos=True)
    assert [c["index"] for c in as_ids["choices"]] == [0, 1] and as_ids["usage"]["prompt_tokens"] == 7
    assert as_ids["choices"][1]["token_ids"] == completion(cluster, [9, 10, 11], max_tokens=3,
                                                           ignore_eos=True)["choices"][0]["token_ids"]
    texts, ends = {}, {}
    for chunk in client.completions.create(prompt=prompts, n=2, stream=True, **greedy):
        for choice in chunk.choices:
            texts[choice.index] = texts.get(choice.index, "") + choice.text
            ends[choice.index] = choice.finish_reason or ends.get(choice.index)
    assert texts == {c.index: c.text for c in batch.choices} and set(ends.values()) == {"length"}


def shown(raw: list[int] | None) -> str:
    """How a token's bytes are shown: as text, as `bytes:\\xNN...` when they split a UTF-8 character, as
    `token_id:N` for an id the tokenizer lacks (the tiny model's vocabulary is larger than its tokenizer's)."""
    if raw is None:
        return "token_id:"
    try:
        return bytes(raw).decode()
    except UnicodeDecodeError:
        return "bytes:" + "".join(f"\\x{b:02x}" for b in raw)


def test_logprobs_with_the_openai_client_are_the_models_across_the_hand_off(cluster, tiny_dir):
    """The first token's log-probabilities come from prefill, the rest from decode: all of them equal
    transformers' over the same tokens, whole and streamed, on completions and chat."""
    openai = pytest.importorskip("openai")
    from tests.conftest import hf_reference
    hf = hf_reference(tiny_dir)
    client = openai.OpenAI(base_url=cluster.url + "/v1", api_key="unused", timeout=60, max_retries=0)
    prompt = f"{uuid.uuid4().hex} and the log-probabilities of what follows: "
    args = dict(model="tiny", prompt=prompt, max_tokens=6, temperature=0, logprobs=2,
                extra_body={"ignore_eos": True, "return_token_ids": True})
    whole = client.completions.create(**args).choices[0]
    lp, ids = whole.logprobs, whole.model_extra["token_ids"]
    ref = hf.logprobs(hf.tokenizer(prompt)["input_ids"], ids)
    assert len(lp.token_logprobs) == len(lp.tokens) == len(ids) == 6
    assert lp.token_logprobs == pytest.approx([ref[i, t].item() for i, t in enumerate(ids)], abs=2e-3)
    assert all(len(top) in (2, 3) and max(top.values()) == pytest.approx(ref[i].max().item(), abs=2e-3)
               for i, top in enumerate(lp.top_logprobs))
    assert lp.text_offset[0] == 0 and lp.text_offset == sorted(lp.text_offset)
    streamed = [c.choices[0].logprobs for c in client.completions.create(stream=True, **args) if c.choices]
    assert [v for s in streamed if s for v in s.token_logprobs] == pytest.approx(lp.token_logprobs, abs=1e-6)
    assert [o for s in streamed if s for o in s.text_offset] == lp.text_offset

    messages = [{"role": "user", "content": prompt}]
    chat = dict(model="tiny", messages=messages, max_tokens=5, temperature=0, logprobs=True, top_logprobs=3,
                extra_body={"ignore_eos": True})  # the random-weight model may pick its EOS early
    content = client.chat.completions.create(**chat).choices[0].logprobs.content
    assert len(content) == 5 and all(len(t.top_logprobs) == 3 for t in content)
    assert all(t.top_logprobs[0].logprob == pytest.approx(t.logprob) for t in content)  # greedy: the likeliest
    assert all(t.token == shown(t.bytes) or t.bytes is None and t.token.startswith(shown(None)) for t in content)
    pieces = [c.choices[0].logprobs for c in client.chat.completions.create(stream=True, **chat) if c.choices]
    assert [t.logprob for p in pieces if p for t in p.content] == pytest.approx([t.logprob for t in content])
    plain = client.completions.create(model="tiny", prompt=prompt, max_tokens=2, temperature=0)
    assert plain.choices[0].logprobs is None


def test_echo_and_prompt_logprobs_are_the_models_over_the_prompt_as_lm_eval_asks(cluster, tiny_dir):
    """lm-evaluation-harness's loglikelihood request (a batch of token-id prompts, echo, max_tokens 1, logprobs
    1) and vLLM's prompt_logprobs: every prompt token's logprob but the first (null) equals transformers', even
    for a prompt whose blocks the prefix cache and the pool hold (they are computed again); the answer's own
    token comes after the hand-off as without echo. Echo with max_tokens 0 is the prompt alone."""
    if cluster.transport != "tcp":
        pytest.skip("prompt logprobs travel in control messages, whatever the KV transport: tested over tcp")
    from tests.conftest import hf_reference
    hf = hf_reference(tiny_dir)
    tail = [hf.tokenizer(f"{uuid.uuid4().hex} {word} and what follows")["input_ids"] for word in ("moon", "cake")]
    shared = hf.tokenizer(f"{uuid.uuid4().hex} " + "a prefix every prompt shares, " * 6)["input_ids"]
    prompts = [shared + t for t in tail]
    completion(cluster, shared, max_tokens=2)  # the shared blocks are cached now
    lm_eval = {"prompt": prompts, "max_tokens": 1, "logprobs": 1, "echo": True, "seed": 1234}
    reply = completion(cluster, **lm_eval)
    assert reply["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    plain = completion(cluster, prompts, max_tokens=1, logprobs=1)
    for prompt, choice, alone in zip(prompts, sorted(reply["choices"], key=lambda c: c["index"]), plain["choices"]):
        lp = choice["logprobs"]
        ref = hf.logprobs(prompt[:1], prompt[1:])
        assert choice["token_ids"] == prompt + alone["token_ids"] and len(lp["tokens"]) == len(prompt) + 1
        assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
        assert lp["token_logprobs"][1:-1] == pytest.approx([ref[i, t].item() for i, t in enumerate(prompt[1:])],
                                                          abs=2e-3)
        assert all(max(top.values()) == pytest.approx(ref[i].max().item(), abs=2e-3)
                   for i, top in enumerate(lp["top_logprobs"][1:-1]))
        assert lp["token_logprobs"][-1] == pytest.approx(alone["logprobs"]["token_logprobs"][0], abs=1e-5)
        assert choice["text"].endswith(alone["text"]) and lp["text_offset"] == sorted(lp["text_offset"])
    only = completion(cluster, prompts[0], max_tokens=0, echo=True, logprobs=0, prompt_logprobs=2)
    choice = only["choices"][0]
    assert choice["token_ids"] == prompts[0] and choice["finish_reason"] == "length"
    assert only["usage"]["completion_tokens"] == 0 and choice["text"] == hf.tokenizer.decode(prompts[0])
    assert choice["logprobs"]["token_logprobs"][1:] == pytest.approx(lp_of(reply, 0)[1:-1], abs=1e-5)
    shown = choice["prompt_logprobs"]
    assert shown[0] is None and len(shown) == len(prompts[0])
    for token, entry, value in zip(prompts[0][1:], shown[1:], lp_of(reply, 0)[1:-1]):
        others = [e["rank"] for key, e in entry.items() if key != str(token)]  # the likeliest two, but itself
        assert entry[str(token)]["logprob"] == pytest.approx(value, abs=1e-5) and entry[str(token)]["rank"] >= 1
        assert set(others) <= {1, 2} and len(others) in (1, 2)
    status, refused = post(cluster.url + "/v1/completions", {"model": "tiny", "prompt": "x", "max_tokens": 0})
    assert status == 400 and refused["error"]["param"] == "max_tokens" and "echo" in refused["error"]["message"]
    streamed = [json.loads(line[6:]) for line in stream_lines(cluster, {**lm_eval, "prompt": prompts[0]})]
    values = [v for e in streamed if e["choices"] for v in e["choices"][0]["logprobs"]["token_logprobs"]]
    assert values[0] is None and values[1:] == pytest.approx(lp_of(reply, 0)[1:], abs=1e-5)


def lp_of(reply: dict, index: int) -> list:
    return next(c for c in reply["choices"] if c["index"] == index)["logprobs"]["token_logprobs"]


def stream_lines(cluster, body: dict) -> list[bytes]:
    """The data lines of a streamed completion, [DONE] left out."""
    req = urllib.request.Request(cluster.url + "/v1/completions", headers={"Content-Type": "application/json"},
                                 data=json.dumps({"model": "tiny", "temperature": 0, **body, "stream": True}).encode())
    with urllib.request.urlopen(req, timeout=60) as r:
        return [line for line in r if line.startswith(b"data: {")]


PERSON = {"type": "object", "additionalProperties": False, "required": ["name", "age", "city"],
          "properties": {"name": {"type": "string", "maxLength": 12},
                         "age": {"type": "integer", "minimum": 0, "maximum": 120},
                         "city": {"enum": ["Paris", "Rome", "Oslo"]}}}


def test_structured_outputs_with_the_openai_client_parse_and_validate_whole_and_streamed(cluster):
    """json_schema (strict) replies, 112 sampled ones (the first token from prefill, the rest from decode),
    and vLLM's guided_choice and guided_regex on completions."""
    if cluster.transport != "tcp":
        pytest.skip("the grammar travels in control messages, whatever the KV transport: tested over tcp")
    openai = pytest.importorskip("openai")
    client = openai.OpenAI(base_url=cluster.url + "/v1", api_key="unused", timeout=120, max_retries=0)
    fmt = {"type": "json_schema", "json_schema": {"name": "person", "strict": True, "schema": PERSON}}
    messages = [{"role": "user", "content": "Describe a person."}]
    replies = []
    for seed in range(7):
        reply = client.chat.completions.create(model="tiny", messages=messages, response_format=fmt, n=16,
                                               temperature=1.0, seed=seed * 16, max_tokens=100)
        replies += [c.message.content for c in reply.choices]
        assert {c.finish_reason for c in reply.choices} == {"stop"}
    people = [json.loads(r) for r in replies]
    assert len(people) == 112 and all(set(p) == {"name", "age", "city"} and len(p["name"]) <= 12
                                      and type(p["age"]) is int and 0 <= p["age"] <= 120
                                      and p["city"] in ("Paris", "Rome", "Oslo") for p in people)
    assert len(set(replies)) > 50
    deltas = [c.choices[0].delta.content or "" for c in client.chat.completions.create(
        model="tiny", messages=messages, response_format=fmt, temperature=1.0, seed=3, max_tokens=100, stream=True)
        if c.choices]
    assert json.loads("".join(deltas))["city"] in ("Paris", "Rome", "Oslo") and len(deltas) > 3
    choice = client.completions.create(model="tiny", prompt="Is it?", max_tokens=10, temperature=1.0, seed=1,
                                       extra_body={"guided_choice": ["yes", "no", "perhaps"]})
    assert choice.choices[0].text in ("yes", "no", "perhaps")
    regex = client.completions.create(model="tiny", prompt="A code:", max_tokens=20, temperature=1.0, seed=2,
                                      extra_body={"structured_outputs": {"regex": "[A-Z]{2}-[0-9]{4}"}})
    assert re.fullmatch("[A-Z]{2}-[0-9]{4}", regex.choices[0].text)
    with pytest.raises(openai.BadRequestError, match="guided_regex"):
        client.completions.create(model="tiny", prompt="x", max_tokens=5, extra_body={"guided_regex": "[a-"})


WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "The weather in a city",
                                            "parameters": {"type": "object", "required": ["city"],
                                                           "properties": {"city": {"type": "string", "maxLength": 10}},
                                                           "additionalProperties": False}}}
CLOCK = {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object", "properties": {},
                                                                            "additionalProperties": False}}}


def test_tool_calls_with_the_openai_client_whole_and_streamed(cluster):
    """A required call and a named one parse (finish reason tool_calls, no content); streamed, the deltas
    assemble to the whole answer; a history with calls and results is taken."""
    if cluster.transport != "tcp":
        pytest.skip("tool calls travel as text and grammars in control messages: tested over tcp")
    openai = pytest.importorskip("openai")
    client = openai.OpenAI(base_url=cluster.url + "/v1", api_key="unused", timeout=120, max_retries=0)
    messages = [{"role": "user", "content": "What is the weather in Paris, and the time?"}]
    args = dict(model="tiny", messages=messages, tools=[WEATHER, CLOCK], temperature=0, max_tokens=150,
                parallel_tool_calls=False)
    for choice, names in (("required", {"get_weather", "get_time"}),
                          ({"type": "function", "function": {"name": "get_weather"}}, {"get_weather"})):
        whole = client.chat.completions.create(tool_choice=choice, **args).choices[0]
        assert whole.finish_reason == "tool_calls" and whole.message.content is None
        [call] = whole.message.tool_calls
        assert call.type == "function" and call.function.name in names and call.id.startswith("call_")
        assert isinstance(json.loads(call.function.arguments), dict)
        if choice != "required":
            continue  # NOTE: streamed once: the deltas' shape does not depend on the choice
        calls, reasons = {}, []
        for chunk in client.chat.completions.create(tool_choice=choice, stream=True, **args):
            for delta in chunk.choices[0].delta.tool_calls or ():
                entry = calls.setdefault(delta.index, {"name": "", "arguments": ""})
                entry["name"] += delta.function.name or ""
                entry["arguments"] += delta.function.arguments or ""
            reasons.append(chunk.choices[0].finish_reason)
        assert calls == {0: {"name": call.function.name, "arguments": call.function.arguments}}
        assert reasons[-1] == "tool_calls"
    named_args = json.loads(whole.message.tool_calls[0].function.arguments)
    assert set(named_args) == {"city"} and len(named_args["city"]) <= 10
    history = messages + [{"role": "assistant", "content": None, "tool_calls": [
        {"id": call.id, "type": "function", "function": {"name": call.function.name,
                                                         "arguments": call.function.arguments}}]},
        {"role": "tool", "tool_call_id": call.id, "content": "18 C and sunny"}]
    answer = client.chat.completions.create(model="tiny", messages=history, tools=[WEATHER, CLOCK], max_tokens=5,
                                            tool_choice="none", temperature=0)
    assert answer.choices[0].message.tool_calls is None and answer.usage.prompt_tokens > 100  # the tools are in it


def test_only_the_roles_that_run_a_model_load_torch(cluster):
    """The cache node, the conductor and the API processes stay small: none maps libtorch."""
    def maps_torch(proc) -> bool:
        return "libtorch" in (Path("/proc") / str(proc.pid) / "maps").read_text()
    assert {p.role: maps_torch(p) for p in cluster.processes} == {
        "cache": False, "conductor": False, "api": False, "prefill": True, "decode": True}
