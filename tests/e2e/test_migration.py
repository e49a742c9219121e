"""Every request ends and nothing is lost, end to end (every role its own process): a decode instance
killed or hung mid-stream and a prefill instance killed before the first token cost the client nothing (its
greedy stream equals an undisturbed one); a dead cache node costs no request a timeout; a request that
ends at prefill ships no KV; a client that goes away while its request is queued leaves nothing behind on
any role."""

import json
import random
import signal
import socket
import threading
import time
import urllib.request
import uuid

import pytest

from tests.e2e.conftest import E2E_SETTINGS, indexed, make_cluster, metrics, post, wait_for
from tests.e2e.test_fault import cache_stats

pytestmark = pytest.mark.slow  # make test skips it; make test-all and .ci/run run it

CACHE_TIMEOUT_S = 20.0


@pytest.fixture(scope="module")
def cluster(tiny_dir, tmp_path_factory):
    # A long pool timeout: a request that waited one out would show.
    with make_cluster(tmp_path_factory, "tcp", num_prefill=2, num_decode=2,
                      **{"cache_client.timeout_s": CACHE_TIMEOUT_S}) as c:
        yield c


class Stream:
    """One streamed completion read on a thread: its token ids and finish reason as they come."""

    def __init__(self, url: str, body: dict):
        self.token_ids, self.finish_reason, self.error, self.done = [], None, None, threading.Event()
        self.logprobs = []  # when the body asks for them
        self.text = ""
        data = json.dumps({**body, "stream": True, "return_token_ids": True}).encode()
        self.req = urllib.request.Request(url + "/v1/completions", data=data,
                                          headers={"Content-Type": "application/json"})
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self):
        try:
            with urllib.request.urlopen(self.req, timeout=120) as r:
                for line in r:
                    if not line.startswith(b"data: ") or line.strip() == b"data: [DONE]":
                        continue
                    event = json.loads(line[6:])
                    if "error" in event:
                        self.error = event["error"]
                        continue
                    choice = event["choices"][0]
                    self.token_ids += choice["token_ids"]
                    self.text += choice["text"]
                    self.logprobs += (choice["logprobs"] or {}).get("token_logprobs", [])
                    self.finish_reason = choice["finish_reason"] or self.finish_reason
        finally:
            self.done.set()

    def result(self, timeout_s: float = 90) -> list[int]:
        assert self.done.wait(timeout_s), "the stream did not end"
        assert self.error is None, f"the stream ended in an error: {self.error}"
        return self.token_ids


def holders(cluster, role: str) -> list[str]:
    """The instances of `role` with a request in flight."""
    values = metrics(cluster.url)
    return [p.name for p in cluster.processes if p.role == role
            and values.get(f'mooncake_requests_in_flight{{instance="{p.name}"}}') == 1]


def busy(cluster) -> dict[str, float]:
    """Requests in flight and KV held or waiting anywhere (as the heartbeats report it)."""
    return {k: v for k, v in metrics(cluster.url).items() if v and k.startswith(
        ("mooncake_requests_in_flight", "mooncake_instance_kv_blocks_used", "mooncake_instance_kv_inbox_blocks"))}


def assert_idle(cluster, timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while held := busy(cluster):
        assert time.monotonic() < deadline, f"not idle after {timeout_s} s: {held}"
        time.sleep(0.1)


def undisturbed(cluster, body: dict) -> list[int]:
    return Stream(cluster.url, body).result()


def migrations(cluster) -> float:
    return metrics(cluster.url).get('mooncake_migrations_total{outcome="moved"}', 0.0)


def story(max_tokens: int = 1500) -> dict:
    words = " ".join(random.choice(["moon", "cake", "tide", "lamp", "river", "stone"]) for _ in range(40))
    # NOTE: a unique start: no instance caches any of it, so an idle cluster places it on prefill-0 (ties by id).
    return {"model": "tiny", "prompt": f"{uuid.uuid4().hex}: a story of {words}:", "max_tokens": max_tokens,
            "ignore_eos": True, "temperature": 0}


@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGSTOP], ids=["kill", "stop"])
def test_a_decode_instance_lost_mid_stream_costs_the_stream_nothing(cluster, sig):
    body = {**story(), "logprobs": 0}
    reference = Stream(cluster.url, body)
    reference.result()
    moved = migrations(cluster)
    stream = Stream(cluster.url, body)
    wait_for(lambda: len(stream.token_ids) >= 50, 60, "the first streamed tokens")
    [victim] = holders(cluster, "decode")
    cluster.kill(victim, sig)
    try:
        tokens = stream.result()
        assert migrations(cluster) == moved + 1
    finally:
        if sig == signal.SIGSTOP:
            cluster.kill(victim, signal.SIGCONT)  # it wakes to find its request gone and frees it
        else:
            cluster.spawn(cluster.process(victim))
    assert len(tokens) == body["max_tokens"] and stream.finish_reason == "length"
    assert tokens == reference.token_ids, "the moved stream differs from the undisturbed one"
    assert stream.logprobs == pytest.approx(reference.logprobs, abs=2e-3) and len(stream.logprobs) == len(tokens)
    # The conductor's one line for the request says what happened to it.
    lines = (cluster.workdir / "api-0.log").read_text().splitlines()
    assert any("outcome=ok" in line and f"completion_tokens={len(tokens)} " in line and "legs=2 " in line
               for line in lines)
    cluster.wait_ready(120)
    assert_idle(cluster, 10)


def test_a_structured_output_keeps_its_grammar_across_a_decode_lost_mid_stream(cluster):
    """The new leg's prefill replays the tokens streamed so far through the grammar and goes on under it: the
    answer is the undisturbed one, and valid."""
    schema = {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 9}, "minItems": 300,
              "maxItems": 300}
    body = {**story(max_tokens=1500), "ignore_eos": False, "guided_json": schema}
    reference = Stream(cluster.url, body)
    reference.result()
    stream = Stream(cluster.url, body)
    wait_for(lambda: len(stream.token_ids) >= 50, 60, "the first streamed tokens")
    [victim] = holders(cluster, "decode")
    moved = migrations(cluster)
    cluster.kill(victim, signal.SIGKILL)
    try:
        tokens = stream.result()
        assert migrations(cluster) == moved + 1
    finally:
        cluster.spawn(cluster.process(victim))
    assert tokens == reference.token_ids and stream.finish_reason == "stop"
    assert len(json.loads(stream.text)) == 300 and all(0 <= v <= 9 for v in json.loads(stream.text))
    cluster.wait_ready(120)
    assert_idle(cluster, 10)


def test_a_prefill_instance_killed_before_the_first_token_costs_the_request_nothing(cluster):
    body = {**story(max_tokens=40), "echo": True, "logprobs": 1}  # the new leg's prefill computes them again
    cluster.kill("prefill-0", signal.SIGSTOP)  # an idle cluster places a new prompt on prefill-0 (ties by id)
    try:
        stream = Stream(cluster.url, body)
        wait_for(lambda: holders(cluster, "prefill") == ["prefill-0"], 10, "the request queued on prefill-0")
        cluster.kill("prefill-0", signal.SIGKILL)
        tokens = stream.result()
    finally:
        cluster.kill("prefill-0", signal.SIGKILL)
        cluster.spawn(cluster.process("prefill-0"))
    cluster.wait_ready(120)
    reference = Stream(cluster.url, body)
    assert tokens == reference.result() and len(tokens) > 40  # echo: the prompt's tokens, then the answer's
    assert stream.logprobs[0] is None and len(stream.logprobs) == len(tokens)
    assert stream.logprobs[1:] == pytest.approx(reference.logprobs[1:], abs=2e-3)
    assert_idle(cluster, 10)


def test_a_request_that_ends_at_prefill_ships_no_kv_to_decode(cluster):
    body = story(max_tokens=1)
    shipped = 'mooncake_kv_transfer_bytes_total{instance="prefill-0"}'
    before = metrics(cluster.url).get(shipped, 0.0)
    status, reply = post(cluster.url + "/v1/completions", {**body, "return_token_ids": True})
    assert status == 200 and reply["usage"]["completion_tokens"] == 1
    assert metrics(cluster.url).get(shipped, 0.0) == before  # max_tokens 1: nothing to decode
    # A stop token as the first token: the KV already went to decode, and its inbox lets it go at once
    # (not at the inbox TTL of a minute).
    first = reply["choices"][0]["token_ids"][0]
    status, reply = post(cluster.url + "/v1/completions", {**body, "max_tokens": 50, "ignore_eos": False,
                                                           "stop_token_ids": [first]})
    assert status == 200 and reply["usage"]["completion_tokens"] == 1
    assert reply["choices"][0]["finish_reason"] == "stop"
    assert_idle(cluster, 5)


@pytest.mark.parametrize("stage, stopped", [("queued", ("prefill-0", "prefill-1")),
                                           ("transferring", ("decode-0", "decode-1"))])
def test_a_client_that_goes_away_before_the_first_token_leaves_nothing_behind(cluster, stage, stopped):
    """Queued: every prefill instance is stopped, so the request waits in one. Transferring: every decode
    instance is stopped, so prefill computes and then waits on its KV push."""
    cancelled = 'mooncake_requests_total{outcome="cancelled"}'
    before = metrics(cluster.url).get(cancelled, 0.0)
    body = json.dumps({**story(max_tokens=20), "stream": True}).encode()
    for name in stopped:
        cluster.kill(name, signal.SIGSTOP)
    try:
        host, port = cluster.url.removeprefix("http://").split(":")
        with socket.create_connection((host, int(port)), timeout=30) as sock:
            sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                         b"Content-Length: %d\r\n\r\n" % len(body) + body)
            wait_for(lambda: len(holders(cluster, "prefill")) == 1, 10, "the request placed on a prefill instance")
            time.sleep(0.3)  # transferring: prefill has computed and is pushing
        wait_for(lambda: metrics(cluster.url).get(cancelled, 0.0) == before + 1, 5, "the request cancelled")
    finally:
        for name in stopped:
            cluster.kill(name, signal.SIGCONT)
    cluster.wait_ready(120)
    assert_idle(cluster, 10)


def test_a_client_that_goes_away_while_its_prefix_is_read_from_the_pool_leaves_nothing_behind(cluster):
    """Fetching: the prefix is only in the pool (its prefill holder is gone) and the cache node hangs, so
    the prefill instance waits on its read when the client leaves."""
    body = story(max_tokens=20)

    def pooled():
        return sum(cache_stats(cluster)["blocks"].values())
    before_blocks, before_indexed = pooled(), indexed(cluster.url, "cache-")
    computed = 'mooncake_prefill_computed_tokens_total{instance="prefill-0"}'
    computed_before = metrics(cluster.url).get(computed, 0.0)
    assert post(cluster.url + "/v1/completions", body)[0] == 200  # on prefill-0 and in the pool
    assert metrics(cluster.url).get(computed, 0.0) > computed_before, "the prompt was not computed on prefill-0"
    wait_for(lambda: pooled() >= before_blocks + 10, 10, "the prompt's blocks in the pool")  # written on the side
    wait_for(lambda: indexed(cluster.url, "cache-") >= before_indexed + 10, 10, "the pool's blocks in the index")
    cancelled = 'mooncake_requests_total{outcome="cancelled"}'
    before = metrics(cluster.url).get(cancelled, 0.0)
    cluster.kill("prefill-0", signal.SIGKILL)
    cluster.kill("cache-0", signal.SIGSTOP)
    try:
        wait_for(lambda: cluster.health().get("prefill") == ["prefill-1"], 10, "prefill-0 gone")
        data = json.dumps({**body, "prompt": body["prompt"] + " again", "stream": True}).encode()
        host, port = cluster.url.removeprefix("http://").split(":")
        with socket.create_connection((host, int(port)), timeout=30) as sock:
            sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                         b"Content-Length: %d\r\n\r\n" % len(data) + data)
            wait_for(lambda: holders(cluster, "prefill") == ["prefill-1"], 10, "the request on prefill-1")
            time.sleep(0.3)
        log = (cluster.workdir / "api-0.log").read_text().splitlines()[-5:]
        wait_for(lambda: metrics(cluster.url).get(cancelled, 0.0) == before + 1, 5, f"the request cancelled: {log}")
    finally:
        cluster.kill("cache-0", signal.SIGCONT)
        cluster.spawn(cluster.process("prefill-0"))
    cluster.wait_ready(120)
    assert_idle(cluster, 10)
    wait_for(lambda: cache_stats(cluster)["leased_blocks"] == 0, 10, "the cache node's read leases released")


def test_a_dead_cache_node_costs_no_request_a_timeout_and_is_used_again_when_back(cluster):
    body = story(max_tokens=4)
    before = indexed(cluster.url, "cache-"), indexed(cluster.url, "prefill-0")
    status, reply = post(cluster.url + "/v1/completions", body)  # its prefix is now in the pool and on prefill-0
    assert status == 200
    blocks = reply["usage"]["prompt_tokens"] // E2E_SETTINGS["engine.block_size"]
    wait_for(lambda: indexed(cluster.url, "cache-") >= before[0] + blocks and
             indexed(cluster.url, "prefill-0") >= before[1] + blocks, 10, "heartbeats and pool events: the index has it")
    cluster.kill("cache-0", signal.SIGKILL)
    cluster.kill("prefill-0", signal.SIGKILL)  # the next request goes where only the pool had the prefix
    try:
        wait_for(lambda: cluster.health().get("cache") == [], 5, "the dead cache node left the index")
        for i in range(3):
            started = time.monotonic()
            status, reply = post(cluster.url + "/v1/completions", {**body, "prompt": body["prompt"] + f" {i}"})
            assert status == 200, reply
            # Well under the pool's timeout: nobody waited on the dead node.
            assert time.monotonic() - started < CACHE_TIMEOUT_S / 2
    finally:
        cluster.spawn(cluster.process("cache-0"))
        cluster.spawn(cluster.process("prefill-0"))
    cluster.wait_ready(120)
    wait_for(lambda: cluster.health().get("cache") == ["cache-0"], 30, "the restarted cache node indexed again")
    assert_idle(cluster, 10)
