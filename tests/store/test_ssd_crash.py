"""kill -9 a process in the middle of SSD writes; on restart every completed block is served and
verified, and no partial block is ever served."""

import os
import random
import signal
import subprocess
import sys
import time

from backends.storage.ssd import SsdTier

WRITER = """
import random, sys
from backends.storage.ssd import SsdTier
tier = SsdTier(sys.argv[1], 1 << 40)
for key in range(100000):
    tier.put(key, random.Random(key).randbytes(256 * 1024 + key))
    print(key, flush=True)
"""


def expected(key: int) -> bytes:
    return random.Random(key).randbytes(256 * 1024 + key)


def test_kill_9_during_writes_loses_only_the_block_in_flight(tmp_path):
    directory = tmp_path / "ssd"
    proc = subprocess.Popen([sys.executable, "-c", WRITER, str(directory)], stdout=subprocess.PIPE, text=True,
                            cwd=os.path.dirname(os.path.dirname(os.path.dirname(__file__))))
    completed = []
    deadline = time.monotonic() + 60
    try:
        while len(completed) < 30 and time.monotonic() < deadline:
            line = proc.stdout.readline()
            if not line:
                break
            completed.append(int(line))
        time.sleep(random.Random(0).uniform(0.0, 0.01))  # land somewhere inside the next write
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=10)
    assert len(completed) == 30, "the writer did not get going"

    tier = SsdTier(directory, 1 << 40)
    recovered = set(tier.keys())
    assert set(completed) <= recovered  # every acknowledged block survived
    assert recovered <= set(range(max(recovered) + 1))
    for key in recovered:  # and everything served is whole and correct
        assert bytes(tier.get(key)) == expected(key)
    assert tier.num_corrupt_reads == 0
    assert not [p for p in directory.iterdir() if not p.name.endswith(".blk")]
