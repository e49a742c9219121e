"""Copy-and-checksum in one pass (mooncake/transfer/passes.py), below and above one checksum chunk and
the size where half the chunks move to the worker thread."""

import os
import select
import signal

import numpy as np
import pytest

from mooncake.hashing import CHECKSUM_CHUNK_BYTES, checksum
from mooncake.transfer import passes

PARALLEL = passes.PARALLEL_COPY_MIN_BYTES
SIZES = [0, 1, 4096, CHECKSUM_CHUNK_BYTES, CHECKSUM_CHUNK_BYTES + 1, PARALLEL - 1, PARALLEL,
         3 * CHECKSUM_CHUNK_BYTES + PARALLEL + 7]


@pytest.mark.parametrize("size", SIZES)
def test_copy_summed_copies_and_returns_the_checksum_of_the_source(size):
    source = os.urandom(size)
    target = np.zeros(size + 2, dtype=np.uint8)
    assert passes.copy_summed(target[1:size + 1], memoryview(source)) == checksum(source)
    assert target[1:size + 1].tobytes() == source and target[0] == 0 and target[-1] == 0


@pytest.mark.parametrize("size", SIZES)
def test_copy_checked_returns_a_private_copy_and_the_checksum_of_that_copy(size):
    source = bytearray(os.urandom(size))
    copy, digest = passes.copy_checked(memoryview(source))
    assert bytes(copy) == bytes(source) and digest == checksum(bytes(source))
    if size:
        source[size // 2] ^= 0xFF  # the source changing afterwards does not reach the copy
        assert bytes(copy) != bytes(source) and checksum(bytes(copy)) == digest


def test_a_forked_child_gets_its_own_worker():
    big = os.urandom(PARALLEL)
    passes.copy_checked(big)  # the parent's worker thread exists now
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # the parent's thread did not survive the fork: the child must not wait on it
        ok = passes.copy_checked(big)[1] == checksum(big)
        os.write(write, b"1" if ok else b"0")
        os._exit(0)
    os.close(write)
    ready, _, _ = select.select([read], [], [], 10)  # a child stuck on a dead worker never answers
    answer = os.read(read, 1) if ready else b""
    if not ready:
        os.kill(pid, signal.SIGKILL)
    os.waitpid(pid, 0)
    assert answer == b"1"
