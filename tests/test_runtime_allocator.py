"""The allocator tuning every role process applies (mooncake/runtime.py): freed KV-block-sized buffers
are reused instead of being faulted in afresh."""

import subprocess
import sys

import pytest

PROGRAM = """
import resource, sys
import torch
from mooncake.engine.kv_cache import PagedKVCache
from mooncake.kv_geometry import KVSpec
from mooncake.runtime import tune_allocator
if sys.argv[1] == "tuned":
    assert tune_allocator()
cache = PagedKVCache(KVSpec(30, 3, 64), 8, 64, torch.float32, torch.device("cpu"))  # SmolLM2's blocks
def churn():  # what prefill does per block: export it and make its wire bytes, then let both go
    for i in range(40):
        cache.export_blocks([(i % 8, i)], b"ns")[0].to_bytes()
churn()  # warm-up: the heap grows once
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
churn()
print(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
"""


def faults(mode: str) -> int:
    out = subprocess.run([sys.executable, "-c", PROGRAM, mode], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    return int(out.stdout)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc malloc")
def test_tuned_processes_reuse_freed_block_buffers_instead_of_faulting_them_in_again():
    plain, tuned = faults("plain"), faults("tuned")
    assert tuned * 10 < plain, (plain, tuned)
