"""Same-host transport: each endpoint owns one shared-memory segment (a file in /dev/shm, mapped once
and reused); a sender stages block bytes there and the receiver reads them in place through its own
mapping of the sender's segment. ZeroMQ carries only the doorbell. Segments of processes that died
without cleaning up are removed by the next endpoint that starts."""

import mmap
import os
import uuid
from contextlib import contextmanager
from pathlib import Path

import numpy as np

from backends.transports.staged import StagedTransport

SHM_DIR = Path("/dev/shm") if Path("/dev/shm").is_dir() else Path("/tmp")
PREFIX = "mooncake-shm-"


class ShmTransport(StagedTransport):
    name = "shm"

    def __init__(self, tamper=None, host: str = "127.0.0.1", segment_bytes: int = 256 << 20):
        super().__init__(tamper=tamper, host=host)
        remove_stale_segments()
        self.path = SHM_DIR / f"{PREFIX}{os.getpid()}-{uuid.uuid4().hex[:12]}"
        with open(self.path, "w+b") as f:
            f.truncate(segment_bytes)
            self._mapping = mmap.mmap(f.fileno(), segment_bytes)
        self._init_staging(np.frombuffer(self._mapping, dtype=np.uint8), 0)
        self._peer_maps: dict[str, mmap.mmap] = {}

    def _locator(self):
        return {"shm": str(self.path)}

    def _peer_view(self, path_text: str) -> memoryview:
        path = Path(path_text)
        if path.parent != SHM_DIR or not path.name.startswith(PREFIX):
            raise ValueError(f"refusing shared-memory path {path}")
        if path_text not in self._peer_maps:
            with open(path, "rb") as f:
                self._peer_maps[path_text] = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        return memoryview(self._peer_maps[path_text])

    def _outgoing_located(self, located, request_id):
        # One copy: blocks already in a shared-memory file (the cache node's DRAM tier) are read by the
        # peer straight from there; the store's lease keeps them in place meanwhile.
        if self.tamper or not located or any(loc.shm_path is None for _, loc in located):
            return super()._outgoing_located(located, request_id)
        return {"keys": [k for k, _ in located], "sums": [loc.checksum for _, loc in located],
                "sizes": [len(memoryview(loc.data).cast("B")) for _, loc in located],
                "locs": [[loc.shm_path, loc.offset] for _, loc in located]}, []

    @contextmanager
    def _incoming(self, header, frames, keep=False):
        if "locs" in header:
            places = [(self._peer_view(path), offset) for path, offset in header["locs"]]
        else:
            view = self._peer_view(header["shm"])
            places, cursor = [], header["addr"]
            for n in header["sizes"]:
                places.append((view, cursor))
                cursor += n
        blocks = [bytes(v[o:o + n]) if keep else v[o:o + n] for (v, o), n in zip(places, header["sizes"])]
        try:
            yield blocks
        finally:
            blocks.clear()
            for v, _ in places:
                v.release()

    async def stop(self) -> None:
        await super().stop()
        self.buffer = None
        for mapping in self._peer_maps.values():
            try:
                mapping.close()
            except BufferError:  # a caller still holds a view; the mapping goes when it does
                pass
        self._peer_maps.clear()
        try:
            self._mapping.close()
        except BufferError:
            pass
        self.path.unlink(missing_ok=True)


def remove_stale_segments() -> None:
    """Delete segments whose owning process is gone (it died without cleaning up)."""
    for path in SHM_DIR.glob(f"{PREFIX}*"):
        try:
            pid = int(path.name[len(PREFIX):].split("-")[0])
            os.kill(pid, 0)
        except ProcessLookupError:
            path.unlink(missing_ok=True)
        except (ValueError, PermissionError):
            continue
