"""SSD tier: one file per block in a directory, written crash-safe (temp file, fsync, rename, fsync of
the directory) and checked against its checksum on every read. On start the index is rebuilt from the
directory; temp files, partial and corrupt files are deleted and counted, never served."""

import logging
import os
import struct
from pathlib import Path

from mooncake.hashing import checksum
from mooncake.store.tier import StorageTier

log = logging.getLogger(__name__)
MAGIC = b"MCKV"
VERSION = 2  # 2: the two-level checksum (mooncake/hashing.py); older files are dropped on start
HEADER = struct.Struct("<4sHQQQ")  # magic, version, key, data length, checksum of the data
SUFFIX = ".blk"


class SsdTier(StorageTier):
    name = "ssd"

    def __init__(self, directory: str | Path, capacity_bytes: int, fsync: bool = True):
        self.directory = Path(directory)
        self.capacity_bytes = capacity_bytes
        self.fsync = fsync
        self.directory.mkdir(parents=True, exist_ok=True)
        self._sizes: dict[int, int] = {}  # key -> data length
        self._used = 0
        self.num_dropped_on_start = 0
        self.num_corrupt_reads = 0
        self._rebuild_index()

    @property
    def used_bytes(self) -> int:
        return self._used

    def _path(self, key: int) -> Path:
        return self.directory / f"{key:016x}{SUFFIX}"

    def _rebuild_index(self) -> None:
        for path in self.directory.iterdir():
            if path.suffix != SUFFIX:
                if ".tmp" in path.name:  # a write that never reached its rename
                    path.unlink(missing_ok=True)
                    self.num_dropped_on_start += 1
                continue
            found = _read_verified(path)
            if found is None:
                path.unlink(missing_ok=True)
                self.num_dropped_on_start += 1
                continue
            key, data = found
            size = len(data)
            self._sizes[key] = size
            self._used += size
        if self._sizes or self.num_dropped_on_start:
            log.info("ssd tier %s: %d blocks (%d bytes) recovered, %d partial, corrupt or older-format files dropped",
                     self.directory, len(self._sizes), self._used, self.num_dropped_on_start)

    def put(self, key, data) -> bool:
        if key in self._sizes:
            return True
        view = memoryview(data).cast("B")
        if self._used + len(view) > self.capacity_bytes:
            return False
        final = self._path(key)
        tmp = final.with_name(f"{final.name}.tmp{os.getpid()}")
        with open(tmp, "wb") as f:
            f.write(HEADER.pack(MAGIC, VERSION, key, len(view), checksum(view)))
            f.write(view)
            if self.fsync:
                f.flush()
                os.fsync(f.fileno())
        os.replace(tmp, final)
        if self.fsync:
            self._fsync_directory()
        self._sizes[key] = len(view)
        self._used += len(view)
        return True

    def _fsync_directory(self) -> None:
        fd = os.open(self.directory, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)

    def get(self, key):
        if key not in self._sizes:
            return None
        found = _read_verified(self._path(key))
        if found is None or found[0] != key:
            log.warning("ssd tier %s: block %016x failed verification; dropped", self.directory, key)
            self.num_corrupt_reads += 1
            self.remove(key)
            return None
        return found[1]

    def remove(self, key) -> bool:
        size = self._sizes.pop(key, None)
        if size is None:
            return False
        self._used -= size
        self._path(key).unlink(missing_ok=True)
        return True

    def size_of(self, key):
        return self._sizes.get(key)

    def keys(self):
        return iter(list(self._sizes))


def _read_verified(path: Path) -> tuple[int, memoryview] | None:
    """(key, data) of a whole, uncorrupted block file, else None."""
    try:
        raw = path.read_bytes()
    except OSError:
        return None
    if len(raw) < HEADER.size:
        return None
    magic, version, key, length, digest = HEADER.unpack_from(raw)
    data = memoryview(raw)[HEADER.size:]
    if (magic != MAGIC or version != VERSION or length != len(data) or checksum(data) != digest
            or path.name != f"{key:016x}{SUFFIX}"):
        return None
    return key, data
