"""The REST endpoint in-process over a real API process and conductor (no engines): request validation, auth, limits,
health, and admission's 429. Instances are stand-ins that register over the real control socket."""

import asyncio
import json
import threading
import urllib.error
import urllib.request

import pytest
import zmq

from mooncake import messages as m
from mooncake.api.front_door import FrontDoor
from mooncake.api.server import ApiServer
from mooncake.conductor.service import Conductor
from mooncake.config import load_config
from mooncake.dev import free_port
from mooncake.runtime import ServiceStack


class Served:
    """A conductor and an API process (over the real control socket) on a private event loop thread."""

    def __init__(self, **overrides):
        self.control = f"tcp://127.0.0.1:{free_port()}"
        cfg = load_config(None, {"engine.model": "tiny-llama", "api.port": 0, "api.model_name": "tiny",
                                 "conductor.control_address": self.control,
                                 "instance.conductor_address": self.control,
                                 "cache_client.nodes": [f"tcp://127.0.0.1:{free_port()}"], **overrides})
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        self.conductor = Conductor(cfg)
        self.door = FrontDoor(cfg)
        self.api = ApiServer(cfg, self.door)
        self.stack = ServiceStack("conductor", [self.conductor, self.door, self.api])
        asyncio.run_coroutine_threadsafe(self.stack.start(), self.loop).result(60)
        asyncio.run_coroutine_threadsafe(self.door.link.registered.wait(), self.loop).result(30)
        self.url = self.api.url

    def close(self):
        asyncio.run_coroutine_threadsafe(self.stack.stop(), self.loop).result(30)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)

    def request(self, path, body=None, headers=None, raw: bytes | None = None):
        data = raw if raw is not None else (json.dumps(body).encode() if body is not None else None)
        req = urllib.request.Request(self.url + path, data=data, headers={"Content-Type": "application/json",
                                                                          **(headers or {})})
        try:
            with urllib.request.urlopen(req, timeout=30) as r:
                return r.status, json.loads(r.read()), dict(r.headers)
        except urllib.error.HTTPError as exc:
            return exc.code, json.loads(exc.read()), dict(exc.headers)

    def fake_instances(self):
        """Register a prefill and a decode stand-in; returns their sockets (close them when done)."""
        ctx = zmq.Context.instance()
        socks = []
        for role in ("prefill", "decode"):
            s = ctx.socket(zmq.DEALER)
            s.setsockopt(zmq.LINGER, 0)
            s.setsockopt(zmq.IDENTITY, f"{role}-x".encode())
            s.connect(self.control)
            s.send(m.encode(m.Register(instance_id=f"{role}-x", role=role, model_id=self.conductor.model.model_id,
                                       block_size=64, kv_dtype="float32", transport="tcp",
                                       data_address="tcp://127.0.0.1:1")))
            assert s.poll(10_000), "the conductor did not answer a registration"
            assert m.decode(s.recv()).accepted
            socks.append(s)
        return socks


@pytest.fixture(scope="module")
def served(tiny_dir):
    s = Served()
    yield s
    s.close()


CHAT = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}]}


def ok_body(**extra):
    return {"model": "tiny", "prompt": "hello", "max_tokens": 4, **extra}


@pytest.mark.parametrize("path, body, param", [
    ("/v1/completions", {"prompt": "hi"}, "model"),
    ("/v1/completions", {"model": "tiny"}, "prompt"),
    ("/v1/completions", ok_body(max_tokens="4"), "max_tokens"),
    ("/v1/completions", ok_body(max_tokens=-1), "max_tokens"),
    ("/v1/completions", ok_body(max_tokens=0), "max_tokens"),
    ("/v1/completions", ok_body(max_tokens=5000), "max_tokens"),
    ("/v1/completions", ok_body(temperature="hot"), "temperature"),
    ("/v1/completions", ok_body(stream="yes"), "stream"),
    ("/v1/completions", ok_body(n=0), "n"),
    ("/v1/completions", ok_body(n=17), "n"),
    ("/v1/completions", ok_body(n="2"), "n"),
    ("/v1/completions", ok_body(prompt=[1, 2, 999999]), "prompt"),
    ("/v1/completions", ok_body(prompt="x" * 5000), "prompt"),
    ("/v1/completions", ok_body(stop=[""]), "stop"),
    ("/v1/completions", ok_body(stop_token_ids=[1, "2"]), "stop_token_ids"),
    ("/v1/completions", ok_body(stop_token_ids=[999999]), "stop_token_ids"),
    ("/v1/completions", ok_body(logprobs=21), "logprobs"),
    ("/v1/completions", ok_body(logprobs=True), "logprobs"),
    ("/v1/completions", ok_body(prompt=[]), "prompt"),
    ("/v1/completions", ok_body(prompt=["a", [1, 2]]), "prompt"),
    ("/v1/completions", ok_body(prompt=[[1, 2], []]), "prompt"),
    ("/v1/completions", ok_body(prompt=["a", "x" * 5000]), "prompt"),
    ("/v1/completions", ok_body(prompt=["a"] * 20, n=16), "prompt"),
    ("/v1/chat/completions", {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "top_logprobs": 2},
     "top_logprobs"),
    ("/v1/chat/completions", {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "logprobs": True,
                              "top_logprobs": -1}, "top_logprobs"),
    ("/v1/chat/completions", {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "logprobs": 3},
     "logprobs"),
    ("/v1/completions", ok_body(guided_regex="[a-z"), "guided_regex"),
    ("/v1/completions", ok_body(guided_json="{not json"), "guided_json"),
    ("/v1/completions", ok_body(guided_json={"type": "objectx"}), "guided_json"),
    ("/v1/completions", ok_body(guided_choice=[]), "guided_choice"),
    ("/v1/completions", ok_body(structured_outputs={"regex": "a+", "choice": ["a"]}), "structured_outputs.choice"),
    ("/v1/completions", ok_body(structured_outputs={"whitespace_pattern": " "}),
     "structured_outputs.whitespace_pattern"),
    ("/v1/completions", ok_body(structured_outputs={"grammar": "start: (("}), "structured_outputs.grammar"),
    ("/v1/completions", ok_body(guided_json={"type": "object", "properties": {"a": {"$ref": "#/nowhere"}}}),
     "guided_json"),
    ("/v1/chat/completions", {**CHAT, "response_format": {"type": "xml"}}, "response_format"),
    ("/v1/chat/completions", {**CHAT, "response_format": {"type": "json_schema", "json_schema": {"schema": 3}}},
     "response_format.json_schema"),
    ("/v1/chat/completions", {**CHAT, "response_format": {"type": "json_schema", "json_schema": {
        "name": "x", "schema": {"type": "string", "pattern": "(("}}}}, "response_format.json_schema.schema"),
    ("/v1/chat/completions", {**CHAT, "response_format": {"type": "json_object"}, "guided_regex": "a"},
     "guided_regex"),
    ("/v1/chat/completions", {**CHAT, "tool_choice": "required"}, "tool_choice"),
    ("/v1/chat/completions", {**CHAT, "tools": [{"type": "function", "function": {"name": "f"}}],
                              "tool_choice": {"type": "function", "function": {"name": "g"}}}, "tool_choice"),
    ("/v1/chat/completions", {**CHAT, "tools": [{"type": "function", "function": {"name": "a b"}}]},
     "tools[0].function.name"),
    ("/v1/chat/completions", {**CHAT, "tools": [{"type": "retrieval"}]}, "tools[0]"),
    ("/v1/chat/completions", {**CHAT, "tools": [{"type": "function", "function": {"name": "f", "parameters": {
        "type": "objectx"}}}], "tool_choice": "required"}, "tools"),
    ("/v1/chat/completions", {**CHAT, "tools": [{"type": "function", "function": {"name": "f"}}],
                              "tool_choice": "required", "guided_regex": "a"}, "tool_choice"),
    ("/v1/chat/completions", {**CHAT, "tools": [{"type": "function", "function": {"name": "f"}}],
                              "parallel_tool_calls": "yes"}, "parallel_tool_calls"),
    ("/v1/chat/completions", {"model": "tiny", "messages": [
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": None, "tool_calls": [{"id": "1", "type": "function"}]}]},
     "messages[1].tool_calls[0]"),
    ("/v1/chat/completions", {"model": "tiny"}, "messages"),
    ("/v1/chat/completions", {"model": "tiny", "messages": []}, "messages"),
    ("/v1/chat/completions", {"model": "tiny", "messages": [{"role": "wizard", "content": "hi"}]},
     "messages[0].role"),
    ("/v1/chat/completions", {"model": "tiny", "messages": [{"role": "user", "content": 7}]},
     "messages[0].content"),
    ("/v1/chat/completions", {"model": "tiny", "messages": "hi"}, "messages"),
])
def test_bad_requests_get_a_400_naming_the_field(served, path, body, param):
    status, reply, _ = served.request(path, body)
    assert status == 400, reply
    assert reply["error"]["param"] == param and reply["error"]["type"] == "invalid_request_error"
    assert reply["error"]["message"]


@pytest.mark.parametrize("path, body, param", [
    ("/v1/completions", ok_body(foo_bar=1), "foo_bar"),
    ("/v1/completions", ok_body(min_p=0.1), "min_p"),
    ("/v1/completions", ok_body(repetition_penalty=1.2), "repetition_penalty"),
    ("/v1/completions", ok_body(presence_penalty=0.5), "presence_penalty"),
    ("/v1/completions", ok_body(frequency_penalty=0.5), "frequency_penalty"),
    ("/v1/completions", ok_body(logit_bias={"5": 10}), "logit_bias"),
    ("/v1/completions", ok_body(stream=True, stream_options={"continuous_usage_stats": True}),
     "stream_options.continuous_usage_stats"),
    ("/v1/completions", ok_body(stream=True, stream_options={"include_usage": True, "bogus": 1}),
     "stream_options.bogus"),
    ("/v1/chat/completions", {**CHAT, "reasoning_effort": "high"}, "reasoning_effort"),
    ("/v1/chat/completions", {**CHAT, "echo": True}, "echo"),
    ("/v1/chat/completions", {"model": "tiny", "messages": [{"role": "user", "content": "hi", "mood": "x"}]},
     "messages[0].mood"),
])
def test_a_field_the_server_does_not_honour_is_a_400_naming_it(served, path, body, param):
    """Refused, never silently ignored: options this server does not do (at any but their neutral value)
    and fields it does not know."""
    status, reply, _ = served.request(path, body)
    assert status == 400, reply
    assert reply["error"]["param"] == param and reply["error"]["code"] == "unsupported_parameter", reply


@pytest.mark.parametrize("path, body", [
    ("/v1/completions", ok_body(min_p=0, repetition_penalty=1.0, presence_penalty=0, user="u-1",
                                skip_special_tokens=True, stream=True, stream_options={"include_usage": True})),
    ("/v1/chat/completions", {**CHAT, "response_format": {"type": "text"}, "tool_choice": "none",
                              "parallel_tool_calls": False, "reasoning_effort": None}),
    ("/v1/chat/completions", {**CHAT, "response_format": {"type": "json_schema", "json_schema": {
        "name": "x", "strict": True, "schema": {"type": "object", "properties": {"a": {"type": "integer"}}}}}}),
    ("/v1/completions", ok_body(structured_outputs={"choice": ["yes", "no"], "regex": None})),
    ("/v1/completions", ok_body(guided_grammar='root ::= "yes" | "no"')),
])
def test_neutral_values_of_options_the_server_does_not_do_are_taken(served, path, body):
    status, reply, _ = served.request(path, body)
    assert status == 503 and reply["error"]["code"] == "no_instance", reply  # parsed: no instance to run it


def test_without_strict_fields_an_unknown_field_is_ignored(tiny_dir):
    lenient = Served(**{"api.strict_fields": False})
    try:
        status, reply, _ = lenient.request("/v1/completions", ok_body(foo_bar=1))
        assert status == 503 and reply["error"]["code"] == "no_instance", reply
        status, reply, _ = lenient.request("/v1/completions", ok_body(min_p=0.5))  # known: still refused
        assert status == 400 and reply["error"]["param"] == "min_p", reply
    finally:
        lenient.close()


@pytest.mark.parametrize("raw", [b"{not json", b"[1, 2]", b"\xff\xfe"])
def test_malformed_bodies_are_400(served, raw):
    status, reply, _ = served.request("/v1/completions", raw=raw)
    assert status == 400 and "error" in reply


def test_oversized_body_is_413(served):
    status, reply, _ = served.request("/v1/completions", raw=b"{" + b" " * (2 << 20) + b"}")
    assert status == 413 and "error" in reply


def test_no_instance_is_503_and_health_says_so(served):
    status, reply, _ = served.request("/v1/completions", ok_body())
    assert status == 503 and reply["error"]["code"] == "no_instance"
    status, health, _ = served.request("/health")
    assert status == 503 and health["prefill"] == [] and health["decode"] == []


def test_models_lists_the_served_name(served):
    status, reply, _ = served.request("/v1/models")
    assert status == 200 and [d["id"] for d in reply["data"]] == ["tiny"]
    assert reply["data"][0]["max_model_len"] == 4096


def test_api_key_is_required_when_set(tiny_dir):
    s = Served(**{"api.api_key": "sesame"})
    try:
        status, reply, _ = s.request("/v1/models")
        assert status == 401 and reply["error"]["code"] == "invalid_api_key"
        status, _, _ = s.request("/v1/models", headers={"Authorization": "Bearer wrong"})
        assert status == 401
        status, _, _ = s.request("/v1/models", headers={"Authorization": "Bearer sesame"})
        assert status == 200
        assert s.request("/health")[0] == 503  # health needs no key
    finally:
        s.close()


def test_predicted_ttft_over_the_slo_is_429_with_retry_after(tiny_dir):
    s = Served(**{"conductor.ttft_slo_s": 1e-6})
    socks = s.fake_instances()
    try:
        status, reply, headers = s.request("/v1/completions", ok_body())
        assert status == 429 and reply["error"]["code"] == "ttft_slo", reply
        assert "conductor.ttft_slo_s = 1e-06" in reply["error"]["message"]
        assert int(headers["Retry-After"]) >= 1
        metrics = urllib.request.urlopen(s.url + "/metrics", timeout=10).read().decode()
        assert 'mooncake_rejections_total{reason="ttft_slo"} 1.0' in metrics
    finally:
        for sock in socks:
            sock.close(linger=0)
        s.close()


def test_an_instance_of_another_model_is_refused(served):
    ctx = zmq.Context.instance()
    s = ctx.socket(zmq.DEALER)
    s.setsockopt(zmq.LINGER, 0)
    s.setsockopt(zmq.IDENTITY, b"prefill-y")
    s.connect(served.control)
    try:
        s.send(m.encode(m.Register(instance_id="prefill-y", role="prefill", model_id="other-123", block_size=64,
                                   kv_dtype="float32")))
        assert s.poll(10_000)
        reply = m.decode(s.recv())
        assert not reply.accepted and "other-123" in reply.error
        s.send(m.encode(m.Register(instance_id="prefill-y", role="prefill", model_id=served.conductor.model.model_id,
                                   block_size=64, kv_dtype="bfloat16")))  # the right model, KV of another dtype
        assert s.poll(10_000)
        reply = m.decode(s.recv())
        assert not reply.accepted and "bfloat16" in reply.error and "float32" in reply.error
        s.send(b"\xc1garbage")  # a malformed control message gets an error reply; the conductor goes on
        assert s.poll(10_000) and isinstance(m.decode(s.recv()), m.ErrorReply)
    finally:
        s.close(linger=0)
    assert served.request("/v1/models")[0] == 200


def test_an_unknown_model_is_404_model_not_found_and_the_served_one_can_be_retrieved(served):
    openai = pytest.importorskip("openai")
    client = openai.OpenAI(base_url=served.url + "/v1", api_key="unused", max_retries=0, timeout=30)
    card = client.models.retrieve("tiny")
    assert card.id == "tiny" and card.owned_by == "mooncake"
    with pytest.raises(openai.NotFoundError) as caught:
        client.models.retrieve("gpt-4")
    assert caught.value.code == "model_not_found"
    for create in (lambda: client.completions.create(model="gpt-4", prompt="hi", max_tokens=2),
                   lambda: client.chat.completions.create(model="gpt-4", max_tokens=2,
                                                          messages=[{"role": "user", "content": "hi"}])):
        with pytest.raises(openai.NotFoundError) as caught:
            create()
        assert caught.value.code == "model_not_found" and "'tiny'" in caught.value.message


def test_tokenize_and_detokenize_answer_as_vllm_does(served):
    from mooncake.text import encode_chat
    tokenizer = served.door.tokenizer
    ids = tokenizer("hello world")["input_ids"]
    status, reply, _ = served.request("/tokenize", {"model": "tiny", "prompt": "hello world"})
    assert status == 200 and reply == {"count": len(ids), "max_model_len": 4096, "tokens": ids}
    messages = [{"role": "user", "content": "hi there"}]
    status, reply, _ = served.request("/tokenize", {"model": "tiny", "messages": messages})
    assert status == 200 and reply["tokens"] == encode_chat(tokenizer, messages)
    status, reply, _ = served.request("/detokenize", {"model": "tiny", "tokens": ids})
    assert status == 200 and reply["prompt"] == tokenizer.decode(ids) and "hello world" in reply["prompt"]
    status, reply, _ = served.request("/detokenize", {"tokens": [1, -5]})
    assert status == 400 and reply["error"]["param"] == "tokens"
    status, reply, _ = served.request("/tokenize", {"model": "gpt-4", "prompt": "x"})
    assert status == 404 and reply["error"]["code"] == "model_not_found"


def test_tokenize_needs_the_api_key_when_one_is_set(tiny_dir):
    s = Served(**{"api.api_key": "sesame"})
    try:
        assert s.request("/tokenize", {"prompt": "x"})[0] == 401
        assert s.request("/tokenize", {"prompt": "x"}, headers={"Authorization": "Bearer sesame"})[0] == 200
    finally:
        s.close()


VLLM_SERIES = ("vllm:time_to_first_token_seconds_bucket", "vllm:inter_token_latency_seconds_bucket",
               "vllm:e2e_request_latency_seconds_count", "vllm:request_queue_time_seconds_sum",
               "vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc",
               "vllm:prefix_cache_queries_total", "vllm:prefix_cache_hits_total", "vllm:prompt_tokens_total",
               "vllm:generation_tokens_total")


def exported_families(text: str) -> set[str]:
    """Every series name a scrape can hold: each family's own name and its suffixed samples."""
    families = {line.split()[2] for line in text.splitlines() if line.startswith("# TYPE ")}
    return {f + suffix for f in families for suffix in ("", "_total", "_bucket", "_sum", "_count")}


def test_metrics_export_the_vllm_named_series_with_a_model_name_label(served):
    text = urllib.request.urlopen(served.url + "/metrics", timeout=10).read().decode()
    for series in VLLM_SERIES:
        assert any(line.startswith(series + '{') and 'model_name="tiny"' in line for line in text.splitlines()), series
    types = {line.split()[2]: line.split()[3] for line in text.splitlines() if line.startswith("# TYPE ")}
    assert types["vllm:prompt_tokens_total"] == types["mooncake_cache_hits_total"] == "counter"
    assert types["mooncake_cache_bytes_total"] == types["vllm:prefix_cache_hits_total"] == "counter"


def test_every_query_of_the_shipped_dashboard_names_a_series_we_export(served):
    import re
    from pathlib import Path
    dashboard = json.loads((Path(__file__).parents[2] / "configs" / "grafana" / "mooncake-dashboard.json").read_text())
    exprs = [t["expr"] for panel in dashboard["panels"] for t in panel["targets"]]
    assert len(exprs) >= 8
    exported = exported_families(urllib.request.urlopen(served.url + "/metrics", timeout=10).read().decode())
    for expr in exprs:
        names = re.findall(r"(?:vllm:|mooncake_)[A-Za-z0-9_:]+", expr)
        assert names, expr
        for name in names:
            assert name in exported, f"{name} (in {expr!r}) is not a series /metrics exports"


def test_the_conductor_and_the_api_import_nothing_of_the_engine():
    import subprocess
    import sys
    code = ("import sys, mooncake.api.server, mooncake.conductor.service; "
            "print(sorted(m for m in sys.modules if m.startswith('mooncake.engine')))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0 and out.stdout.strip() == "[]", out.stderr


def test_the_api_role_imports_nothing_of_the_conductor():
    """They speak only messages: an API process runs beside a conductor of the same wire version, not code."""
    import subprocess
    import sys
    code = ("import sys, mooncake.api.server, mooncake.api.front_door; "
            "print(sorted(m for m in sys.modules if m.startswith('mooncake.conductor')))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0 and out.stdout.strip() == "[]", out.stderr
