"""The README's "Across hosts" section followed step by step on three hosts made of network namespaces, with
the shipped files and the default model (SmolLM2): the keys made once and given to each host as the README
says (the public keys, the secrets of the roles it runs, the data secret where it moves KV), the example
addresses replaced by the hosts', the API key set in `api.toml`, each role started with `.venv/bin/mooncake
serve --role <role> --config <its file>` on the host the table in configs/multi-host/README.md names. Then
the README's curl check from a client (with the key, and refused without it) and a chat answer.

Nothing else in the files changes (tests/e2e/test_multi_host.py swaps the model, sizes and transports to
test more in less time)."""

import json
import shutil
import subprocess
import sys
import time
import urllib.error
import urllib.request
import uuid
from pathlib import Path

import pytest

from tests.e2e.test_multi_host import lab_or_skip
from tests.transfer.test_transport_contract import available

pytestmark = [pytest.mark.slow, pytest.mark.real_model]  # make test skips it; make test-all and .ci/run run it

ROOT = Path(__file__).resolve().parents[2]
CONFIGS = ROOT / "configs" / "multi-host"
MOONCAKE = Path(sys.executable).parent / "mooncake"  # .venv/bin/mooncake, as the README runs it
# configs/multi-host/README.md's table: host 198.18.0.(10 + index) runs these roles from these files
TABLE = {0: [("conductor", "conductor.toml"), ("api", "api.toml")],
         1: [("cache", "cache-0.toml"), ("prefill", "prefill.toml")],
         2: [("cache", "cache-1.toml"), ("decode", "decode.toml")]}
MOVES_KV = {"cache", "prefill", "decode"}  # the roles that need data.secret (README step 1)


def host_keys(all_keys: Path, roles: set[str], into: Path) -> Path:
    """README step 1: a 0700 directory with the public keys, the secrets of `roles`, and data.secret if one of
    them moves KV."""
    into.mkdir(mode=0o700, parents=True)
    for public in all_keys.glob("*.key"):
        shutil.copy2(public, into)
    for role in roles:
        shutil.copy2(all_keys / f"{role}.key_secret", into)
    if roles & MOVES_KV:
        shutil.copy2(all_keys / "data.secret", into)
    return into


def get(url: str, key: str | None, body: dict | None = None, timeout_s: float = 120):
    headers = {"Content-Type": "application/json", **({"Authorization": f"Bearer {key}"} if key else {})}
    req = urllib.request.Request(url, data=None if body is None else json.dumps(body).encode(), headers=headers)
    try:
        with urllib.request.urlopen(req, timeout=timeout_s) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read() or b"{}")


def test_the_readme_across_hosts_with_the_shipped_files_and_the_default_model(real_dir, tmp_path):
    lab_or_skip()
    available("mooncake")  # README step 3: `make setup mooncake-te` (the shipped files use its transport)
    from mooncake.netns import NetnsLab
    api_key = uuid.uuid4().hex + uuid.uuid4().hex  # README step 2: `openssl rand -hex 32`
    all_keys = tmp_path / "etc-mooncake-keys"
    subprocess.run([str(MOONCAKE), "keys", "generate", str(all_keys)], check=True, capture_output=True, timeout=60)
    procs = []
    with NetnsLab(3) as lab:
        subnet = lab.hosts[0].address.rsplit(".", 1)[0]
        try:
            for index, roles in TABLE.items():
                keys = host_keys(all_keys, {role for role, _ in roles}, tmp_path / f"host-{index}" / "keys")
                for role, name in roles:
                    text = (CONFIGS / name).read_text().replace("198.18.0.", f"{subnet}.")
                    text = text.replace('keys_dir = "/etc/mooncake/keys"', f'keys_dir = "{keys}"')
                    if role == "api":
                        assert 'api_key = ""' in text
                        text = text.replace('api_key = ""', f'api_key = "{api_key}"')
                    path = tmp_path / f"host-{index}" / name
                    path.write_text(text)
                    log = open(tmp_path / f"host-{index}-{role}.log", "ab")
                    procs.append(lab.popen(lab.hosts[index], [str(MOONCAKE), "serve", "--role", role, "--config",
                                                              str(path)], stdout=log, stderr=log, cwd=tmp_path))
                    log.close()
            url = f"http://{lab.hosts[0].address}:8000"
            deadline, health = time.monotonic() + 300, {}
            while not (health.get("prefill") and health.get("decode") and len(health.get("cache", [])) == 2):
                assert time.monotonic() < deadline, f"not ready: {health}\n{logs(tmp_path)}"
                assert all(p.poll() is None for p in procs), logs(tmp_path)
                time.sleep(0.5)
                health = get(url + "/health", None, timeout_s=5)[1] if _reachable(url) else {}
            status, models = get(url + "/v1/models", api_key)  # README step 3's curl
            assert status == 200 and models["data"][0]["id"] == "smollm2-135m-instruct", models
            assert get(url + "/v1/models", None)[0] == 401
            status, reply = get(url + "/v1/chat/completions", api_key, {
                "model": "smollm2-135m-instruct", "max_tokens": 20, "temperature": 0,
                "messages": [{"role": "user", "content": "What is the capital of France?"}]})
            assert status == 200 and "Paris" in reply["choices"][0]["message"]["content"], reply
        finally:
            for proc in reversed(procs):
                if proc.poll() is None:
                    proc.terminate()
            for proc in procs:
                try:
                    proc.wait(timeout=30)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait()
    assert not any((tmp_path / f"host-{i}" / "keys" / f"{r}.key_secret").exists()
                   for i, roles in TABLE.items() for r in {"conductor", "api", "cache", "prefill", "decode"}
                   - {role for role, _ in roles})  # no host held another role's secret


def _reachable(url: str) -> bool:
    try:
        urllib.request.urlopen(url + "/health", timeout=2).close()
        return True
    except urllib.error.HTTPError:
        return True
    except OSError:
        return False


def logs(tmp_path: Path) -> str:
    return "\n".join(f"== {p.name}\n" + "\n".join(p.read_text(errors="replace").splitlines()[-15:])
                     for p in sorted(tmp_path.glob("*.log")))
