"""The shipped multi-host configs (configs/multi-host/) on four hosts made of network namespaces: the
conductor and an API process, two cache nodes, two prefill and two decode instances, each `mooncake serve
--role` in its host, over tcp and over the mooncake transport (Transfer Engine, protocol tcp). Greedy output
matches `mooncake generate`, a shared prefix is served from the pool, and the streams a cut link carried
move to another decode host and finish, after which the cut host serves again without a restart."""

import json
import os
import re
import subprocess
import sys
import time
import urllib.error
import urllib.request
import uuid
from pathlib import Path

import pytest

from mooncake.config import dump_config, load_config
from mooncake.security import generate_keys
from tests.e2e.conftest import E2E_SETTINGS, indexed, wait_for
from tests.transfer.test_transport_contract import available

pytestmark = pytest.mark.slow  # make test skips it; make test-all and .ci/run run it

ROOT = Path(__file__).resolve().parents[2]
CONFIGS = ROOT / "configs" / "multi-host"
BLOCK = E2E_SETTINGS["engine.block_size"]
API_KEY = "multi-host-test-" + uuid.uuid4().hex  # what the README says to put in configs/multi-host/api.toml
# host index (its address is 198.18.N.(10 + index), as in the shipped files), role, shipped file
LAYOUT = [(0, "conductor", "conductor.toml"), (0, "api", "api.toml"),
          (1, "cache", "cache-0.toml"), (1, "prefill", "prefill.toml"),
          (2, "cache", "cache-1.toml"), (2, "decode", "decode.toml"),
          (3, "prefill", "prefill.toml"), (3, "decode", "decode.toml")]


def lab_or_skip():
    from mooncake.netns import netns_unavailable
    why = netns_unavailable()
    if why is not None:
        if os.environ.get("MOONCAKE_REQUIRE_ALL_BACKENDS"):
            pytest.fail(f"multi-host tests need network namespaces: {why}")
        pytest.skip(why)


class MultiHost:
    def __init__(self, lab, transport: str, workdir: Path):
        self.lab, self.transport, self.workdir = lab, transport, workdir
        self.subnet = lab.hosts[0].address.rsplit(".", 1)[0]  # "198.18.N"
        self.url = f"http://{lab.hosts[0].address}:8000"
        self.procs: list[tuple[int, str, subprocess.Popen]] = []
        self.keys_dir = workdir / "keys"
        generate_keys(self.keys_dir)

    def config_for(self, name: str, role: str) -> Path:
        """The shipped file with this lab's addresses, the tiny model and the transport under test."""
        text = (CONFIGS / name).read_text().replace("198.18.0.", f"{self.subnet}.")
        shipped = self.workdir / f"shipped-{name}"
        shipped.write_text(text)
        settings = {k: v for k, v in E2E_SETTINGS.items() if k != "api.port"}
        if role == "api":
            settings["api.api_key"] = API_KEY
        config = load_config(shipped, {**settings, "instance.transport": self.transport,
                                       "cache.transport": self.transport,
                                       "security.keys_dir": str(self.keys_dir)})
        path = self.workdir / f"{role}-{len(self.procs)}.toml"
        path.write_text(dump_config(config))
        return path

    def start(self, timeout_s: float = 300) -> None:
        for index, role, name in LAYOUT:
            path = self.config_for(name, role)
            log = open(self.workdir / f"{path.stem}.log", "ab")
            proc = self.lab.popen(self.lab.hosts[index], [sys.executable, "-m", "mooncake", "serve", "--role", role,
                                                          "--config", str(path)], stdout=log, stderr=log, cwd=ROOT)
            log.close()
            self.procs.append((index, role, proc))
        self.wait_ready(timeout_s)

    def wait_ready(self, timeout_s: float) -> dict:
        deadline, health = time.monotonic() + timeout_s, {}
        while time.monotonic() < deadline:
            for _, role, proc in self.procs:
                assert proc.poll() is None, f"{role} (pid {proc.pid}) exited: {self.logs()}"
            health = self.health()
            if len(health.get("prefill", [])) == 2 and len(health.get("decode", [])) == 2 and \
                    len(health.get("cache", [])) == 2:
                return health
            time.sleep(0.25)
        raise AssertionError(f"not ready within {timeout_s} s: {health}\n{self.logs()}")

    def health(self) -> dict:
        try:
            with urllib.request.urlopen(self.url + "/health", timeout=2) as r:
                return json.loads(r.read())
        except urllib.error.HTTPError as exc:
            return json.loads(exc.read() or b"{}")
        except (OSError, ValueError):
            return {}

    def host_of(self, instance_id: str):
        pid = int(instance_id.rsplit("-", 1)[1])
        return next(self.lab.hosts[i] for i, _, p in self.procs if p.pid == pid)

    def logs(self) -> str:
        return "\n".join(f"== {p.name}\n" + "\n".join(p.read_text(errors="replace").splitlines()[-12:])
                         for p in sorted(self.workdir.glob("*.log")))

    def stop(self) -> None:
        for _, _, proc in reversed(self.procs):
            if proc.poll() is None:
                proc.terminate()
        for _, _, proc in self.procs:
            try:
                proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()

    def request(self, body: dict, timeout_s: float = 120):
        req = urllib.request.Request(self.url + "/v1/completions", data=json.dumps({"model": "tiny", **body}).encode(),
                                     headers={"Content-Type": "application/json",
                                              "Authorization": f"Bearer {API_KEY}"})
        return urllib.request.urlopen(req, timeout=timeout_s)

    def completion(self, prompt: str, **extra) -> dict:
        with self.request({"prompt": prompt, "temperature": 0, "return_token_ids": True, **extra}) as r:
            return json.loads(r.read())

    def migrations(self) -> float:
        text = urllib.request.urlopen(self.url + "/metrics", timeout=10).read().decode()
        found = re.search(r'^mooncake_migrations_total\{outcome="moved"\} (\S+)$', text, re.M)
        return float(found[1]) if found else 0.0

    def in_flight(self) -> dict[str, float]:
        """The conductor's count of requests placed on each instance, by instance id."""
        text = urllib.request.urlopen(self.url + "/metrics", timeout=10).read().decode()
        return {m[1]: float(m[2]) for m in
                re.finditer(r'^mooncake_requests_in_flight\{instance="([^"]+)"\} (\S+)$', text, re.M)}


@pytest.fixture(scope="module", params=["tcp", "mooncake"])
def cluster(request, tiny_dir, tmp_path_factory):
    lab_or_skip()
    available(request.param)  # the mooncake transport needs its Transfer Engine (CI requires it)
    from mooncake.netns import NetnsLab
    with NetnsLab(4) as lab:
        c = MultiHost(lab, request.param, tmp_path_factory.mktemp(f"multi-host-{request.param}"))
        try:
            c.start()
            yield c
        finally:
            c.stop()


def test_every_role_advertises_its_own_host_address(cluster):
    health = cluster.health()
    assert sorted(health["cache"]) == ["cache-0", "cache-1"]
    log = "\n".join(p.read_text() for p in cluster.workdir.glob("conductor-*.log"))
    for decode_id in health["decode"]:
        host = cluster.host_of(decode_id)
        assert re.search(rf"instance {re.escape(decode_id)} joined .*KV inbox tcp://{re.escape(host.address)}:", log)
    assert "0.0.0.0" not in log and "127.0.0.1" not in log


def test_greedy_completion_is_token_identical_to_mooncake_generate(cluster):
    prompt = f"[{cluster.transport} across hosts] The quick brown fox jumps over the lazy dog, " * 3
    reply = cluster.completion(prompt, max_tokens=24, ignore_eos=True)
    config = cluster.config_for("prefill.toml", "generate")
    out = subprocess.run([sys.executable, "-m", "mooncake", "generate", "--config", str(config), "--prompt", prompt,
                          "--max-tokens", "24", "--json"], capture_output=True, text=True, timeout=300, check=True)
    assert reply["choices"][0]["token_ids"] == json.loads(out.stdout)["token_ids"]


def test_a_shared_prefix_is_served_as_cached_tokens(cluster):
    shared = f"{uuid.uuid4().hex} a system prompt shared by everyone, long enough to fill blocks. " * 2
    known = indexed(cluster.url, "cache-")
    first = cluster.completion(shared + "First?", max_tokens=2)
    assert first["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    wait_for(lambda: indexed(cluster.url, "cache-") >= known + len(shared.encode()) // BLOCK, 10,
             "the pool's add events reach the conductor's index")
    second = cluster.completion(shared + "Second, other question?", max_tokens=2)
    assert second["usage"]["prompt_tokens_details"]["cached_tokens"] == len(shared.encode()) // BLOCK * BLOCK


def test_a_cut_link_moves_its_streams_to_another_host_and_the_cluster_recovers(cluster):
    stream = cluster.request({"prompt": "Go on and on: " * 4, "max_tokens": 3000, "ignore_eos": True,
                              "temperature": 0, "stream": True, "return_token_ids": True}, timeout_s=30)
    assert stream.readline().startswith(b"data: ")  # the first token is out: decoding has begun
    (decode_id,) = [i for i, n in cluster.in_flight().items() if n and i.startswith("decode-")]
    host = cluster.host_of(decode_id)
    moved = cluster.migrations()
    cluster.lab.cut(host)
    try:
        events = []
        for line in stream:  # the conductor moves the stream once the cut host misses its heartbeats
            if line.startswith(b"data: {"):
                events.append(json.loads(line[6:]))
    finally:
        cluster.lab.restore(host)
        stream.close()
    assert "error" not in events[-1], events[-1]
    assert events[-1]["choices"][0]["finish_reason"] == "length"
    assert sum(len(e["choices"][0]["token_ids"]) for e in events) == 3000 - 1  # the first was read above
    assert cluster.migrations() == moved + 1
    # Nothing restarted: the cut instances rejoin, and every decode instance serves again.
    cluster.wait_ready(60)
    # NOTE: ignore_eos: a model may end a short reply by itself, which says nothing of the cluster.
    served = {cluster.completion(f"{uuid.uuid4().hex} after the cut", max_tokens=2,
                                 ignore_eos=True)["choices"][0]["finish_reason"] for _ in range(4)}
    assert served == {"length"}
    assert all(proc.poll() is None for _, _, proc in cluster.procs)
