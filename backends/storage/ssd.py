"""SSD tier: one file per block in a directory the tier owns, written crash-safe (temp file, fsync, rename,
fsync of the directory) and checked on every read against its checksum and, with the cluster's keys, a
keyed MAC of its header (so no file the cluster did not write is served). On start the index is rebuilt
from the directory; temp files, partial, corrupt, oversized and unsealed files are deleted and counted,
never served.

The directory is the tier's alone: created 0700, refused when another user owns it or others may write
it (they could plant blocks, or links for the tier to follow); temp files have random names and are
opened O_EXCL|O_NOFOLLOW, block files are 0600, and reads never follow a link."""

import hmac
import logging
import os
import secrets
import stat
import struct
from pathlib import Path

from mooncake import security
from mooncake.errors import ConfigError
from mooncake.hashing import checksum
from mooncake.store.tier import StorageTier

log = logging.getLogger(__name__)
MAGIC = b"MCKV"
VERSION = 4  # 2: the two-level checksum (mooncake/hashing.py); 3: the header's keyed MAC; 4: payloads with a
# keyed MAC of their bytes (kv_payload version 3). Older files are dropped
HEADER = struct.Struct("<4sHQQQ")  # magic, version, key, data length, checksum of the data
MAC = struct.Struct(f"<{security.MAC_BYTES}s")  # after the header: its MAC under the cluster key (zeros without)
SUFFIX = ".blk"
MAX_BLOCK_BYTES = security.DATA_MAX_BYTES  # no block is larger: a larger file is not one of ours
_MAC_DOMAIN = b"mooncake ssd block header"


def _seal(header: bytes) -> bytes:
    return security.seal(_MAC_DOMAIN + header).ljust(MAC.size, b"\0")


def own_directory(directory: Path, key: str = "store.ssd_dir") -> None:
    """Make `directory` this process's alone: created 0700 if missing; refused (a ConfigError naming `key`)
    if it is not a directory, another user owns it, or group or others may write it; made 0700 if others
    may read it (blocks are other users' prompts)."""
    try:
        directory.parent.mkdir(parents=True, exist_ok=True)
        directory.mkdir(mode=0o700)
    except FileExistsError:
        pass
    except OSError as exc:
        raise ConfigError(f"config key '{key}': cannot create {directory}: {exc}") from None
    info = os.lstat(directory)
    if not stat.S_ISDIR(info.st_mode):
        raise ConfigError(f"config key '{key}': {directory} is not a directory (a link is not followed)")
    if info.st_uid != os.geteuid():
        raise ConfigError(f"config key '{key}': {directory} belongs to uid {info.st_uid}, not to this service's "
                          f"user (uid {os.geteuid()}), who could plant blocks in it; use a directory of your own")
    if info.st_mode & 0o022:
        raise ConfigError(f"config key '{key}': {directory} is writable by others (mode "
                          f"{stat.S_IMODE(info.st_mode):o}), who could plant blocks in it; `chmod 700` it")
    if info.st_mode & 0o077:
        log.warning("%s: readable by others (mode %o); made 0700", directory, stat.S_IMODE(info.st_mode))
        os.chmod(directory, 0o700)


class SsdTier(StorageTier):
    name = "ssd"

    def __init__(self, directory: str | Path, capacity_bytes: int, fsync: bool = True):
        self.directory = Path(directory)
        self.capacity_bytes = capacity_bytes
        self.fsync = fsync
        own_directory(self.directory)
        self._sizes: dict[int, int] = {}  # key -> data length
        self._used = 0
        self.num_dropped_on_start = 0
        self.num_corrupt_reads = 0
        self._rebuild_index()

    @property
    def _max_block_bytes(self) -> int:
        return min(self.capacity_bytes, MAX_BLOCK_BYTES)

    @property
    def used_bytes(self) -> int:
        return self._used

    def _path(self, key: int) -> Path:
        return self.directory / f"{key:016x}{SUFFIX}"

    def _rebuild_index(self) -> None:
        for path in self.directory.iterdir():
            if path.suffix != SUFFIX:
                if ".tmp" in path.name:  # a write that never reached its rename
                    self._drop(path)
                continue
            found = _read_verified(path, self._max_block_bytes)
            if found is None:
                self._drop(path)
                continue
            key, data = found
            size = len(data)
            self._sizes[key] = size
            self._used += size
        if self._sizes or self.num_dropped_on_start:
            log.info("ssd tier %s: %d blocks (%d bytes) recovered, %d partial, corrupt or older-format files dropped",
                     self.directory, len(self._sizes), self._used, self.num_dropped_on_start)

    def _drop(self, path: Path) -> None:
        """Delete a file that is not a block of ours (a link goes, not what it points to)."""
        self.num_dropped_on_start += 1
        try:
            path.unlink(missing_ok=True)
        except OSError as exc:  # a directory, say: never served either way
            log.warning("ssd tier %s: cannot remove %s: %s", self.directory, path.name, exc)

    def put(self, key, data) -> bool:
        if key in self._sizes:
            return True
        view = memoryview(data).cast("B")
        if self._used + len(view) > self.capacity_bytes:
            return False
        final = self._path(key)
        # NOTE: a random name, created here or not at all: nothing planted at a name we would use is written
        # through (a link to a file of someone else's choice), and a rename replaces a link, never follows it.
        tmp = self.directory / f".{secrets.token_hex(8)}.tmp"
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
        try:
            with open(fd, "wb") as f:
                header = HEADER.pack(MAGIC, VERSION, key, len(view), checksum(view))
                f.write(header + _seal(header))
                f.write(view)
                if self.fsync:
                    f.flush()
                    os.fsync(f.fileno())
            os.replace(tmp, final)
        except BaseException:  # a full disk, say: no temp file stays behind to fill it further
            tmp.unlink(missing_ok=True)
            raise
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
        found = _read_verified(self._path(key), self._max_block_bytes)
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


def _read_verified(path: Path, max_bytes: int) -> tuple[int, memoryview] | None:
    """(key, data) of a whole, uncorrupted block file this cluster wrote, else None. A link, anything but a
    regular file, or a file over `max_bytes` of data is not read."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK)  # a FIFO must not block us
    except OSError:
        return None
    with open(fd, "rb") as f:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode) or info.st_size > HEADER.size + MAC.size + max_bytes:
            return None
        raw = f.read()
    if len(raw) < HEADER.size + MAC.size:
        return None
    magic, version, key, length, digest = HEADER.unpack_from(raw)
    (mac,) = MAC.unpack_from(raw, HEADER.size)
    data = memoryview(raw)[HEADER.size + MAC.size:]
    if (magic != MAGIC or version != VERSION or length != len(data) or path.name != f"{key:016x}{SUFFIX}"
            or not hmac.compare_digest(mac, _seal(raw[:HEADER.size])) or checksum(data) != digest):
        return None
    return key, data
