"""`mooncake dev` as a user runs it: the real default model behind the whole cluster."""

import signal
import socket
import subprocess
import sys
import time

import pytest


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
    with pytest.raises(OSError):  # the conductor's API is gone with it
        socket.create_connection(("127.0.0.1", port), timeout=2).close()
    assert {p.name for p in tmp_path.glob("*.toml")} == {"cache-0.toml", "conductor.toml", "prefill-0.toml",
                                                         "decode-0.toml"}
