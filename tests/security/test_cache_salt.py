"""Tenants share no prefix (issue: the prefix cache was shared by every client, and `cached_tokens` told one
client whether another had sent a prefix). A key's `cache_salt` and vLLM's request field `cache_salt` root
the block hash chain, on every role that hashes (conductor, prefill, pool, decode), so a salted request
reuses only blocks of its own salt. On a live cluster, every role its own process."""

import json
import urllib.error
import urllib.request
import uuid

import pytest

from tests.e2e.conftest import make_cluster

KEY_A, KEY_B, KEY_C = ("team-a-" + "a" * 24, "team-b-" + "b" * 24, "shared-" + "c" * 24)


@pytest.fixture(scope="module")
def cluster(tiny_dir, tmp_path_factory):
    keys = [{"key": KEY_A, "name": "team-a", "cache_salt": "team-a"},
            {"key": KEY_B, "name": "team-b", "cache_salt": "team-b"},
            {"key": KEY_C, "name": "shared"}]
    with make_cluster(tmp_path_factory, "tcp", **{"api.keys": keys}) as c:
        yield c


def _ask(cluster, key: str, prompt: str, **extra) -> tuple[int, list[int]]:
    status, reply = post_keyed(cluster, key, {"model": "tiny", "prompt": prompt, "max_tokens": 6, "temperature": 0,
                                              "return_token_ids": True, **extra})
    assert status == 200, reply
    return reply["usage"]["prompt_tokens_details"]["cached_tokens"], reply["choices"][0]["token_ids"]


def post_keyed(cluster, key: str, body: dict):
    req = urllib.request.Request(cluster.url + "/v1/completions", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json", "Authorization": f"Bearer {key}"})
    try:
        with urllib.request.urlopen(req, timeout=60) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read())


def test_a_salted_key_shares_its_prefixes_with_no_other_key(cluster):
    prompt = f"{uuid.uuid4().hex}: a long system prompt that spans several blocks of sixteen tokens each. "
    first, tokens = _ask(cluster, KEY_A, prompt)
    assert first == 0
    again, tokens_again = _ask(cluster, KEY_A, prompt)
    assert again > 0 and tokens_again == tokens  # a key reuses its own prefix
    # another salted key, and the shared cache, find none of it: cached_tokens says nothing of team-a
    assert _ask(cluster, KEY_B, prompt) == (0, tokens)
    assert _ask(cluster, KEY_C, prompt) == (0, tokens)
    assert _ask(cluster, KEY_C, prompt)[0] > 0  # the shared cache works for those who share it
    # a request's own salt divides a key's cache further, and cannot reach another key's
    assert _ask(cluster, KEY_A, prompt, cache_salt="project-x")[0] == 0
    assert _ask(cluster, KEY_C, prompt, cache_salt="team-a")[0] == 0


def test_cache_salt_is_checked(cluster):
    status, reply = post_keyed(cluster, KEY_C, {"model": "tiny", "prompt": "hi", "cache_salt": 7})
    assert status == 400 and reply["error"]["param"] == "cache_salt"
    status, reply = post_keyed(cluster, KEY_C, {"model": "tiny", "prompt": "hi", "cache_salt": "x" * 257})
    assert status == 400 and reply["error"]["param"] == "cache_salt"
