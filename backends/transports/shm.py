"""Same-host transport: block bytes go through a shared-memory file (/dev/shm), written once by the
sender and read in place by the receiver; the ZeroMQ request/reply of the tcp transport is only the
doorbell carrying the file name, offsets and checksums. The side that creates a file unlinks it: the
sender once the reply is in, the server after `REPLY_TTL_S` for fetch replies that nobody collected."""

import mmap
import os
import time
import uuid
from contextlib import contextmanager
from pathlib import Path

from backends.transports.tcp import TcpTransport
from mooncake.hashing import checksum

SHM_DIR = Path("/dev/shm") if Path("/dev/shm").is_dir() else Path("/tmp")
REPLY_TTL_S = 60.0


class ShmTransport(TcpTransport):
    name = "shm"

    def __init__(self, tamper=None, host: str = "127.0.0.1"):
        super().__init__(tamper=tamper, host=host)
        self._reply_files: list[tuple[float, Path]] = []

    def _outgoing(self, blocks, request_id):
        views = [(key, memoryview(data).cast("B")) for key, data in blocks]
        sizes = [len(v) for _, v in views]
        sums = [checksum(v) for _, v in views]
        path = SHM_DIR / f"mooncake-{os.getpid()}-{request_id}-{uuid.uuid4().hex[:8]}"
        total = sum(sizes)
        with open(path, "w+b") as f:
            f.truncate(max(total, 1))
            with mmap.mmap(f.fileno(), max(total, 1)) as region:
                offset = 0
                for key, view in views:
                    data = self.tamper(key, bytes(view)) if self.tamper else view
                    region[offset:offset + len(view)] = data
                    offset += len(view)
        self._reply_files.append((time.monotonic(), path))
        self._expire_reply_files()
        return {"keys": [k for k, _ in views], "sums": sums, "sizes": sizes, "shm": str(path)}, []

    def _sent(self, fields):
        path = Path(fields["shm"])
        path.unlink(missing_ok=True)
        self._reply_files = [(t, p) for t, p in self._reply_files if p != path]

    def _expire_reply_files(self) -> None:
        now = time.monotonic()
        while self._reply_files and now - self._reply_files[0][0] > REPLY_TTL_S:
            _, path = self._reply_files.pop(0)
            path.unlink(missing_ok=True)

    @contextmanager
    def _incoming(self, header, frames, keep=False):
        path = Path(header["shm"])
        if path.parent != SHM_DIR or not path.name.startswith("mooncake-"):
            raise ValueError(f"refusing shared-memory path {path}")
        with open(path, "rb") as f:
            size = os.fstat(f.fileno()).st_size
            # NOTE: not closed explicitly: the mapping lives while a block view does, then goes with it.
            view = memoryview(mmap.mmap(f.fileno(), size, access=mmap.ACCESS_READ))
        blocks, offset = [], 0
        for n in header["sizes"]:
            blocks.append(bytes(view[offset:offset + n]) if keep else view[offset:offset + n])
            offset += n
        yield blocks
        if keep:  # a fetch reply: we were its only reader
            path.unlink(missing_ok=True)

    async def stop(self) -> None:
        await super().stop()
        for _, path in self._reply_files:
            path.unlink(missing_ok=True)
        self._reply_files.clear()
