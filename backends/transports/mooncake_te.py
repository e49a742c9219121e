"""The `mooncake` transport: Mooncake's own Transfer Engine (wheel `mooncake-transfer-engine-non-cuda`)
moves the block bytes, protocol `rdma` where the host has RDMA NICs and `tcp` otherwise; the ZeroMQ
request/reply of the tcp transport carries the doorbell. Each endpoint registers a staging buffer with
the engine; the receiver of data pulls it from the sender's buffer with one `transfer_sync_read`.

The wheel's top-level package is also called `mooncake`, so it cannot be installed beside ours: `make
mooncake-te` unpacks it into its own directory and `load_transfer_engine()` imports its `engine.so` under
a private name."""

import asyncio
import importlib.util
import logging
import sys
import time
import types
from contextlib import contextmanager

import numpy as np

from backends.transports.tcp import TcpTransport
from mooncake.arena import Arena
from mooncake.env import mooncake_te_dir
from mooncake.errors import BackendError
from mooncake.hashing import checksum

log = logging.getLogger(__name__)
INSTALL_HINT = ("run `make mooncake-te` (Debian packages libibverbs1 ibverbs-providers, then pip install "
                "--no-deps --target <venv>/mooncake-te mooncake-transfer-engine-non-cuda==0.3.13.post1)")
REPLY_TTL_S = 30.0
_MODULE = "_mooncake_transfer_engine"


def load_transfer_engine():
    """The Transfer Engine's extension module, or a BackendError saying how to install it."""
    if f"{_MODULE}.engine" in sys.modules:
        return sys.modules[f"{_MODULE}.engine"]
    directory = mooncake_te_dir() / "mooncake"
    library = directory / "engine.so"
    if not library.exists():
        raise BackendError(f"transport 'mooncake' needs Mooncake's Transfer Engine, not found at {library}: "
                           f"{INSTALL_HINT}")
    package = types.ModuleType(_MODULE)
    package.__path__ = [str(directory)]
    sys.modules[_MODULE] = package
    spec = importlib.util.spec_from_file_location(f"{_MODULE}.engine", library)
    module = importlib.util.module_from_spec(spec)
    try:
        spec.loader.exec_module(module)
    except ImportError as exc:
        del sys.modules[_MODULE]
        raise BackendError(f"transport 'mooncake': cannot load {library} ({exc}): {INSTALL_HINT}") from None
    sys.modules[f"{_MODULE}.engine"] = module
    return module


class MooncakeTransport(TcpTransport):
    name = "mooncake"

    def __init__(self, tamper=None, host: str = "127.0.0.1", protocol: str = "tcp",
                 staging_bytes: int = 256 << 20):
        engine = load_transfer_engine()
        super().__init__(tamper=tamper, host=host)
        self.engine = engine.TransferEngine()
        if self.engine.initialize(host, "P2PHANDSHAKE", protocol, "") != 0:
            raise BackendError(f"transport 'mooncake': Transfer Engine failed to start ({protocol} on {host})")
        self.session = f"{host}:{self.engine.get_rpc_port()}"
        self.buffer = np.zeros(staging_bytes, dtype=np.uint8)
        self.base = self.buffer.ctypes.data
        if self.engine.register_memory(self.base, staging_bytes) != 0:
            raise BackendError("transport 'mooncake': cannot register the staging buffer")
        self.arena = Arena(staging_bytes)
        self._staged: dict[int, tuple[float, int]] = {}  # offset -> (time staged, size)

    def _stage(self, size: int) -> int:
        offset = self.arena.alloc(max(size, 1))
        if offset is None:  # reclaim fetch replies whose reader never came, oldest first
            for old in sorted(self._staged, key=lambda o: self._staged[o][0]):
                self._unstage(old)
                offset = self.arena.alloc(max(size, 1))
                if offset is not None:
                    break
        if offset is None:
            raise ValueError(f"staging buffer full: {size} bytes wanted")
        self._staged[offset] = (time.monotonic(), max(size, 1))
        return offset

    def _unstage(self, offset: int) -> None:
        entry = self._staged.pop(offset, None)
        if entry is not None:
            self.arena.free(offset, entry[1])

    def _outgoing(self, blocks, request_id):
        now = time.monotonic()
        for offset in [o for o, (t, _) in self._staged.items() if now - t > REPLY_TTL_S]:
            self._unstage(offset)
        views = [(key, memoryview(data).cast("B")) for key, data in blocks]
        sizes = [len(v) for _, v in views]
        offset = self._stage(sum(sizes))
        cursor = offset
        for key, view in views:
            data = self.tamper(key, bytes(view)) if self.tamper else view
            self.buffer[cursor:cursor + len(view)] = np.frombuffer(data, dtype=np.uint8)
            cursor += len(view)
        return {"keys": [k for k, _ in views], "sums": [checksum(v) for _, v in views], "sizes": sizes,
                "session": self.session, "addr": self.base + offset, "staged": offset}, []

    def _sent(self, fields):
        self._unstage(fields["staged"])

    @contextmanager
    def _incoming(self, header, frames, keep=False):
        total = sum(header["sizes"])
        offset = self._stage(total)
        try:
            if total and self.engine.transfer_sync_read(header["session"], self.base + offset, header["addr"],
                                                        total) != 0:
                raise ValueError(f"Transfer Engine read of {total} bytes from {header['session']} failed")
            view = memoryview(self.buffer)[offset:offset + total]
            blocks, cursor = [], 0
            for n in header["sizes"]:
                blocks.append(bytes(view[cursor:cursor + n]) if keep else view[cursor:cursor + n])
                cursor += n
            yield blocks
        finally:
            self._unstage(offset)

    async def stop(self) -> None:
        await super().stop()
        try:
            self.engine.unregister_memory(self.base)
        except (RuntimeError, AttributeError) as exc:
            log.debug("unregister_memory: %s", exc)
        await asyncio.sleep(0)
