"""Transports whose block bytes bypass the ZeroMQ message: the sender stages them in a buffer the
receiver can read (a shared-memory segment, or a Transfer-Engine-registered buffer), and the ZeroMQ
request/reply of the tcp transport carries only the doorbell (where, how long, checksums).

A staged range lives until the reply to its request is in (`_sent`); a fetch reply's range, which the
server cannot know was read, is reclaimed after `REPLY_TTL_S`, or sooner when the buffer runs full."""

import time
from abc import abstractmethod

import numpy as np

from backends.transports.tcp import TcpTransport
from mooncake.arena import Arena
from mooncake.hashing import checksum
from mooncake.kv_payload import bound_digest
from mooncake.transfer.passes import copy_checked, copy_summed

REPLY_TTL_S = 30.0


class StagedTransport(TcpTransport):
    buffer: np.ndarray  # uint8 staging buffer, set by the subclass
    base_address: int  # what peers need to find offset 0 of `buffer` (a pointer, or 0)

    def _init_staging(self, buffer: np.ndarray, base_address: int) -> None:
        self.buffer = buffer
        self.base_address = base_address
        self.arena = Arena(len(buffer))
        self._staged: dict[int, tuple[float, int]] = {}  # offset -> (time staged, size)

    @abstractmethod
    def _locator(self) -> dict:
        """Header fields that let a peer reach this endpoint's buffer."""

    def _stage(self, size: int) -> int:
        size = max(size, 1)
        offset = self.arena.alloc(size)
        if offset is None:  # reclaim fetch replies whose reader never came back, oldest first
            for old in sorted(self._staged, key=lambda o: self._staged[o][0]):
                self._unstage(old)
                offset = self.arena.alloc(size)
                if offset is not None:
                    break
        if offset is None:
            raise ValueError(f"{self.name} staging buffer full: {size} bytes wanted")
        self._staged[offset] = (time.monotonic(), size)
        return offset

    def _unstage(self, offset: int) -> None:
        entry = self._staged.pop(offset, None)
        if entry is not None:
            self.arena.free(offset, entry[1])

    def _outgoing(self, blocks, request_id, sums: list[int] | None = None):
        now = time.monotonic()
        for offset in [o for o, (t, _) in self._staged.items() if now - t > REPLY_TTL_S]:
            self._unstage(offset)
        views = [(key, memoryview(data).cast("B")) for key, data in blocks]
        sizes = [len(v) for _, v in views]
        offset = self._stage(sum(sizes))
        cursor, summed = offset, []
        for i, (key, view) in enumerate(views):
            summed.append(self._place(self.buffer[cursor:cursor + len(view)], key, view,
                                      None if sums is None else sums[i]))
            cursor += len(view)
        sums = summed
        return {"keys": [k for k, _ in views], "sums": sums, "sizes": sizes,
                "addr": self.base_address + offset, "staged": offset, **self._locator()}, []

    def _place(self, place: np.ndarray, key: int, view, known: int | None = None) -> int:
        """Write one block's bytes at `place` (a uint8 array of its length); the block's checksum: `known`
        where given (a checksum the service kept, or a payload's bound digest), a plain copy then, else hashed as
        copied. With a tamper hook, the checksum is of the true bytes and what lands is what the hook made
        of them."""
        if self.tamper:
            np.copyto(place, np.frombuffer(self.tamper(key, bytes(view)), dtype=np.uint8))
            return checksum(view) if known is None else known
        if known is not None:
            np.copyto(place, np.frombuffer(view, dtype=np.uint8))
            return known
        return copy_summed(place, view)

    def _outgoing_located(self, located, request_id):
        return self._outgoing([(k, loc.data) for k, loc in located], request_id,
                              sums=[loc.checksum for _, loc in located])

    def _kept(self, blocks, sums):
        # Views into a buffer that is reused once this transfer is done: copied, and hashed as copied
        # unless the block carries its own check.
        copies = [(copy := memoryview(np.frombuffer(block, dtype=np.uint8).copy()), bound_digest(copy)) if digest < 0
                  else copy_checked(block) for block, digest in zip(blocks, sums)]
        return [copy for copy, _ in copies], [digest for _, digest in copies]

    def _sent(self, fields):
        self._unstage(fields["staged"])

    def _released(self, header):
        self._unstage(int(header["staged"]))
