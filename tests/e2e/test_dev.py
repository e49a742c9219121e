"""`mooncake dev` as a user runs it: the real default model behind the whole cluster."""

import signal
import socket
import subprocess
import sys
import time

import pytest

from mooncake.config import load_config, resolve_dtype


@pytest.mark.real_model
def test_mooncake_dev_answers_paris_and_stops_cleanly_on_sigterm(real_dir, tmp_path):
    proc = subprocess.Popen([sys.executable, "-m", "mooncake", "dev", "--port", "0", "--workdir", str(tmp_path),
                             "--ask", "What is the capital of France?"], stdout=subprocess.PIPE,
                            stderr=subprocess.DEVNULL, text=True)
    try:
        url = answer = None
        deadline = time.monotonic() + 300
        while answer is None and time.monotonic() < deadline:
            line = proc.stdout.readline()
            assert line, f"mooncake dev ended early with status {proc.poll()}"
            if "serving" in line:
                url = line.split(" at ")[1].split()[0]
            if line.startswith("A: "):
                answer = line
        assert url and "Paris" in answer, answer
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=60) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
    port = int(url.rsplit(":", 1)[1].split("/")[0])
    with pytest.raises(OSError):  # the API process is gone with it
        socket.create_connection(("127.0.0.1", port), timeout=2).close()
    assert {p.name for p in tmp_path.glob("*.toml")} == {"cache-0.toml", "conductor.toml", "api-0.toml", "prefill-0.toml",
                                                         "decode-0.toml"}
    # Without --config, sizes fit one box (less KV per instance and less pool DRAM than the defaults), in
    # the fastest dtype this CPU has.
    written = load_config(tmp_path / "prefill-0.toml")
    assert written.engine.dtype == "auto" and written.engine.kv_dtype == resolve_dtype("auto", "cpu")
    kv_bytes = (512 if written.engine.kv_dtype == "float32" else 256) << 20
    assert written.engine.kv_cache_bytes == kv_bytes and written.store.dram_bytes == kv_bytes


def test_mooncake_dev_exits_with_a_clear_error_when_its_port_is_taken(tmp_path):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        done = subprocess.run([sys.executable, "-m", "mooncake", "dev", "--model", "tiny-llama", "--port",
                               str(port)], capture_output=True, text=True, timeout=60)
    assert done.returncode != 0
    assert f"port {port}" in done.stderr and "already in use" in done.stderr and "Traceback" not in done.stderr


def test_a_dev_cluster_removes_the_work_directory_it_made_and_keeps_one_it_was_given(tmp_path):
    from mooncake.config import load_config, resolve_dtype
    from mooncake.dev import DevCluster
    config = load_config(None, {"engine.model": "tiny-llama", "api.port": 0})
    own = DevCluster(config)
    assert own.workdir.is_dir()
    own.stop()
    assert not own.workdir.exists()
    given = DevCluster(config, workdir=tmp_path / "w")
    given.stop()
    assert (tmp_path / "w" / "conductor.toml").exists()
