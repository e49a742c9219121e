"""api.stream_interval: after a choice's first token (sent at once: time to first token), its tokens go in
events of `interval` tokens, its last with whatever is left; the text and tokens are the same as one
event per token. Over the real sockets, with stand-ins for the prefill and decode instances."""

import json
import threading
import urllib.request

import pytest
import zmq

from mooncake import messages as m
from tests.api.test_api import Served
from tests.conductor.test_placement_service import done, recv, register

TOKENS = [5, 6, 7, 8, 9, 10, 11, 12, 13, 14]  # the first from prefill, the rest from decode


def instance(served, role: str) -> zmq.Socket:
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.IDENTITY, f"{role}-a".encode())
    sock.connect(served.control)
    sock.send(m.encode(register(served, f"{role}-a", role, num_kv_blocks=64)))
    assert recv(sock).accepted
    return sock


def reporter(address: str, identity: str) -> zmq.Socket:
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.IDENTITY, identity.encode())
    sock.connect(address)
    return sock


def events(served, interval: int) -> list[list[int]]:
    """The token ids of each SSE event of one streamed completion of TOKENS."""
    prefill, decode = instance(served, "prefill"), instance(served, "decode")
    got = []
    body = json.dumps({"model": "tiny", "prompt": [1, 2, 3], "max_tokens": len(TOKENS), "stream": True,
                       "return_token_ids": True}).encode()

    def client():
        req = urllib.request.Request(served.url + "/v1/completions", data=body,
                                     headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=30) as r:
            for line in r:
                if line.startswith(b"data: {"):
                    got.append(json.loads(line[6:])["choices"][0])
    thread = threading.Thread(target=client, daemon=True)
    thread.start()
    try:
        placed = recv(prefill, kind=m.Prefill)
        to_api = reporter(placed.reply_to, "prefill-a")
        to_api.send(m.encode(done(placed.request_id)))  # the first token, 5
        handed = recv(decode, kind=m.Decode)
        from_decode = reporter(handed.reply_to, "decode-a")
        for i, token in enumerate(TOKENS[1:], 1):
            last = i == len(TOKENS) - 1
            from_decode.send(m.encode(m.Tokens(request_id=handed.request_id, token_ids=[token],
                                               finish_reason="length" if last else None)))
        thread.join(30)
        assert not thread.is_alive()
        return [c["token_ids"] for c in got]
    finally:
        for sock in (prefill, decode, locals().get("to_api"), locals().get("from_decode")):
            if sock is not None:
                sock.close()


@pytest.mark.parametrize("interval, sizes", [(1, [1] * 10), (4, [1, 4, 4, 1]), (3, [1, 3, 3, 3])])
def test_after_the_first_token_a_stream_sends_events_of_interval_tokens(tiny_dir, interval, sizes):
    served = Served(**{"api.stream_interval": interval, "conductor.heartbeat_timeout_s": 600.0,
                       "conductor.admission": "accept-all"})
    try:
        sent = events(served, interval)
        assert [len(ids) for ids in sent] == sizes
        assert [t for ids in sent for t in ids] == TOKENS
    finally:
        served.close()
