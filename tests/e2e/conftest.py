"""Clusters for the end-to-end tests: every role a separate process (`mooncake dev`'s launcher), the
tiny model, small blocks and chunks so short prompts span several of each."""

import json
import time
import urllib.error
import urllib.request

import pytest

from mooncake.config import load_config
from mooncake.dev import DevCluster

E2E_SETTINGS = {
    "engine.model": "tiny-llama", "engine.block_size": 16, "engine.prefill_chunk": 32,
    "engine.kv_cache_bytes": 32 << 20, "engine.num_threads": 1,
    "store.dram_bytes": 128 << 20, "cache.read_lease_s": 1.0,
    "api.port": 0, "api.model_name": "tiny",
    "conductor.heartbeat_interval_s": 0.2, "conductor.heartbeat_timeout_s": 1.5,
}


def make_cluster(tmp_path_factory, transport: str, num_prefill: int = 1, num_decode: int = 1, num_api: int = 1,
                 num_standby: int = 0, **settings) -> DevCluster:
    config = load_config(None, {**E2E_SETTINGS, "instance.transport": transport, **settings})
    workdir = tmp_path_factory.mktemp(f"cluster-{transport}")
    return DevCluster(config, num_prefill=num_prefill, num_decode=num_decode, num_cache=1, workdir=workdir,
                      log_to_files=True, num_api=num_api, num_standby=num_standby)


@pytest.fixture(scope="module", params=["tcp", "shm"])
def cluster(request, tiny_dir, tmp_path_factory):
    with make_cluster(tmp_path_factory, request.param) as c:
        c.transport = request.param
        yield c


def post(url: str, body: dict, timeout: float = 60):
    req = urllib.request.Request(url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read())


def metrics(url: str) -> dict[str, float]:
    """The Prometheus exposition as {series: value}."""
    text = urllib.request.urlopen(url + "/metrics", timeout=10).read().decode()
    out = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            series, value = line.rsplit(" ", 1)
            out[series] = float(value)
    return out


def indexed(url: str, holders: str) -> float:
    """Blocks the conductor's prefix index has heard of from the holders whose id starts with `holders`."""
    series = f'mooncake_prefix_index_holder_blocks{{holder="{holders}'
    return sum(v for k, v in metrics(url).items() if k.startswith(series))


def wait_for(condition, timeout_s: float, what: str) -> None:
    """Poll `condition` until it holds; fail naming `what` after `timeout_s`."""
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"not within {timeout_s} s: {what}")
        time.sleep(0.05)
