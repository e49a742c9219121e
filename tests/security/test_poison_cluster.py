"""One request cannot hurt another, on a live cluster (every role its own process): while greedy
streams run, poison and overflow parameters are sent. Before, `temperature = 1e-300` made an engine step
fail and every request in that engine with it (the victims migrated or ended in errors), and `seed` of
2**64 got a 500 and stayed counted as load. Now the victims finish token-identical to an undisturbed run,
nothing moves, nothing fails, and nothing stays in flight."""

import concurrent.futures
import json

import pytest

from tests.e2e.conftest import make_cluster, metrics, post, wait_for

VICTIM_TOKENS = 160


@pytest.fixture(scope="module")
def cluster(tiny_dir, tmp_path_factory):
    with make_cluster(tmp_path_factory, "tcp") as c:
        yield c


def _victim(cluster, i: int) -> list[int]:
    status, reply = post(cluster.url + "/v1/completions", {
        "model": "tiny", "prompt": f"victim {i}: the quick brown fox jumps over the lazy dog",
        "max_tokens": VICTIM_TOKENS, "temperature": 0, "ignore_eos": True, "return_token_ids": True})
    assert status == 200, reply
    assert reply["choices"][0]["finish_reason"] == "length"
    return reply["choices"][0]["token_ids"]


POISONS = [  # (extra fields, the status it gets, the field a 400 names)
    ({"temperature": 1e-300, "n": 4, "max_tokens": 64, "ignore_eos": True}, 200, None),  # raised to the floor
    ({"seed": 2**64}, 400, "seed"),
    ({"top_k": 2**64}, 400, "top_k"),
    ({"stop": [f"stop {i}" for i in range(5000)]}, 400, "stop"),
    ({"stop_token_ids": list(range(20000))}, 400, "stop_token_ids"),
]


def _poison(cluster, extra: dict) -> tuple[int, dict]:
    return post(cluster.url + "/v1/completions", {"model": "tiny", "prompt": "poison", "max_tokens": 8, **extra})


def _count(series: dict, name: str) -> float:
    return sum(v for k, v in series.items() if k.startswith(name))


def test_poison_parameters_fail_only_their_own_request(cluster):
    undisturbed = [_victim(cluster, i) for i in range(3)]
    before = metrics(cluster.url)
    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        victims = [pool.submit(_victim, cluster, i) for i in range(3)]
        poisons = [pool.submit(_poison, cluster, extra) for extra, _, _ in POISONS for _ in range(2)]
        for future, (extra, status, param) in zip(poisons, [p for p in POISONS for _ in range(2)]):
            got, reply = future.result(timeout=120)
            assert got == status, (json.dumps(extra)[:80], reply)
            if param is not None:
                assert reply["error"]["param"] == param
        assert [v.result(timeout=120) for v in victims] == undisturbed
    after = metrics(cluster.url)
    assert _count(after, "mooncake_migrations_total") == _count(before, "mooncake_migrations_total")
    error = 'mooncake_requests_total{outcome="error"}'
    assert after.get(error, 0.0) == before.get(error, 0.0)
    wait_for(lambda: _count(metrics(cluster.url), "mooncake_requests_in_flight") == 0, 10,
             "no request left in flight")
    # and nothing counts as load that would make admission refuse the next one
    assert post(cluster.url + "/v1/completions", {"model": "tiny", "prompt": "after", "max_tokens": 4})[0] == 200
