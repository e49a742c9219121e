"""Same-host transport: each endpoint owns one shared-memory segment (a file in /dev/shm, mapped once
and reused); a sender stages block bytes there and the receiver reads them in place through its own
mapping of the sender's segment. ZeroMQ carries only the doorbell. Segments of processes that died
without cleaning up are removed by the next endpoint that starts.

Puts go through write windows (mooncake/transfer/windows.py) where the peer lends them: the sender copies
each block once, into the window, and the peer only verifies it where it lies. A cache node lends
ranges of its shared DRAM tier (blocks become cache entries in place); an endpoint whose service keeps
what it is given (the decode inbox) lends ranges of its own segment, and the service holds the blocks
there until it lets go of them. Reads from a cache node copy straight out of its DRAM tier.

Peer files are mapped with their page tables filled up front (up to POPULATE_MAX_BYTES): a first touch
of each 4 KiB page otherwise costs a fault that, on this kind of host, takes longer than copying it."""

import asyncio
import mmap
import os
import stat
import time
import uuid
import weakref
from collections import deque
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from backends.transports.staged import StagedTransport
from mooncake.kv_payload import bound_digest
from mooncake.transfer.contract import BlockResult, TransferError, TransferResult, new_request_id
from mooncake.transfer.framing import pack_header
from mooncake.transfer.windows import WriteWindows

SHM_DIR = Path("/dev/shm") if Path("/dev/shm").is_dir() else Path("/tmp")


def _boot_id() -> str:
    """This kernel's boot id: two endpoints share /dev/shm only if they run on one kernel."""
    try:
        return Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    except OSError:
        return ""


BOOT_ID = _boot_id()


def check_same_host(header: dict, peer: str | None = None) -> None:
    """Refuse a shared-memory locator from another host, with a message that says what to use instead."""
    if header.get("boot", BOOT_ID) != BOOT_ID:
        who = f"peer {peer}" if peer else "the sending peer"
        raise TransferError(f"shm transport: {who} runs on another host, and shared memory works only "
                            f"between roles on one host; select tcp or mooncake (instance.transport, "
                            f"cache.transport) across hosts")


def open_private(path: Path | str):
    """A new segment file, mode 0600: only processes of our own user may map the blocks in it."""
    return os.fdopen(os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600), "w+b")
PREFIX = "mooncake-shm-"
POPULATE_MAX_BYTES = 4 << 30  # larger peer files fault their pages in as they are touched
WINDOW_BYTES = 32 << 20  # write window asked of a cache node, or 4 puts' worth if more (it may lend less)


WINDOW_MARGIN_S = 2.0  # stop writing into a window this long before the lender may take it back


@dataclass
class _Window:
    """A range of a peer's shared DRAM tier lent to this endpoint; filled front to back. The lender
    takes an idle window back after its TTL and may reuse the bytes, so it is written to only while
    surely still lent: until TTL - margin after the last request that renewed it was sent (same host,
    same monotonic clock)."""

    window_id: int
    path: str  # the peer's shared DRAM file
    view: memoryview  # all of it, writable
    end: int
    cursor: int
    ttl_s: float
    usable_until: float

    def renew(self, sent_at: float) -> None:
        self.usable_until = sent_at + self.ttl_s - WINDOW_MARGIN_S


class ShmTransport(StagedTransport):
    name = "shm"

    def __init__(self, tamper=None, host: str = "127.0.0.1", segment_bytes: int = 256 << 20):
        super().__init__(tamper=tamper, host=host)
        remove_stale_segments()
        self.path = SHM_DIR / f"{PREFIX}{os.getpid()}-{uuid.uuid4().hex[:12]}"
        with open_private(self.path) as f:
            f.truncate(segment_bytes)
            # Populated up front, as peers' files are: writers' windows and staging move through all of it.
            self._mapping = mmap.mmap(f.fileno(), segment_bytes, flags=mmap.MAP_SHARED | mmap.MAP_POPULATE)
        self._init_staging(np.frombuffer(self._mapping, dtype=np.uint8), 0)
        self._peer_maps: dict[tuple[str, bool], mmap.mmap] = {}  # (path, writable) -> mapping
        self._windows: dict[str, _Window] = {}  # peer -> its current window
        self._window_locks: dict[str, asyncio.Lock] = {}
        self._no_windows: set[str] = set()  # peers whose service lends none
        self._placing: set[str] = set()  # ids of sends between their start and their window's reply
        self._lender = None  # what lends windows to this endpoint's writers: its service, its segment, or none
        self._let_go: deque[tuple[int, int]] = deque()  # ranges of kept blocks let go of, to free

    @classmethod
    def from_config(cls, config, host):
        return cls(host=host, segment_bytes=config.shm_segment_bytes)

    def _locator(self):
        return {"shm": str(self.path), "boot": BOOT_ID}

    def _peer_view(self, path_text: str, writable: bool = False) -> memoryview:
        mapping = self._peer_maps.get((path_text, writable))
        if mapping is not None:
            return memoryview(mapping)
        path = Path(path_text)
        if path.parent != SHM_DIR or not path.name.startswith(PREFIX):
            raise ValueError(f"refusing shared-memory path {path}")
        self._unmap_gone_peers()
        # NOTE: never through a link, and only a regular file of our own user: /dev/shm is writable by everyone.
        fd = os.open(path, (os.O_RDWR if writable else os.O_RDONLY) | os.O_NOFOLLOW | os.O_CLOEXEC)
        with open(fd, "r+b" if writable else "rb") as f:
            info = os.fstat(f.fileno())
            if not stat.S_ISREG(info.st_mode) or info.st_uid != os.geteuid():
                raise ValueError(f"refusing shared-memory path {path}: not a regular file of this user")
            size = info.st_size
            flags = mmap.MAP_SHARED | (mmap.MAP_POPULATE if size <= POPULATE_MAX_BYTES else 0)
            prot = mmap.PROT_READ | (mmap.PROT_WRITE if writable else 0)
            mapping = self._peer_maps[(path_text, writable)] = mmap.mmap(f.fileno(), 0, flags=flags, prot=prot)
        return memoryview(mapping)

    def _outgoing_located(self, located, request_id):
        # One copy: blocks already in a shared-memory file (the cache node's DRAM tier) are read by the
        # peer straight from there; the store's lease keeps them in place meanwhile.
        if self.tamper or not located or any(loc.shm_path is None for _, loc in located):
            return super()._outgoing_located(located, request_id)
        return {"boot": BOOT_ID, "keys": [k for k, _ in located], "sums": [loc.checksum for _, loc in located],
                "sizes": [len(memoryview(loc.data).cast("B")) for _, loc in located],
                "locs": [[loc.shm_path, loc.offset] for _, loc in located]}, []

    def _unmap_gone_peers(self) -> None:
        """Unmap files their owner has deleted (it stopped or restarted): a mapping would otherwise keep
        the whole of a dead cache node's DRAM in memory for as long as this endpoint lives."""
        for peer in [p for p, w in self._windows.items() if not os.path.exists(w.path)]:
            self._windows.pop(peer).view.release()
        for key in [k for k in self._peer_maps if not os.path.exists(k[0])]:
            try:
                self._peer_maps.pop(key).close()
            except BufferError:  # a view is still out: the mapping goes when the view does
                pass

    @contextmanager
    def _incoming(self, header, frames):
        check_same_host(header)
        if "locs" in header:
            places = [(self._peer_view(path), offset) for path, offset in header["locs"]]
        else:
            view = self._peer_view(header["shm"])
            places, cursor = [], header["addr"]
            for n in header["sizes"]:
                places.append((view, cursor))
                cursor += n
        blocks = [v[o:o + n] for (v, o), n in zip(places, header["sizes"])]
        try:
            yield blocks
        finally:
            blocks.clear()
            for v, _ in places:
                v.release()

    # -- write windows: the server side --------------------------------------------------------------

    async def start(self, service=None, address=None) -> str:
        if service is not None and service.lends_windows:  # a cache node: its DRAM tier lends windows
            self._lender = service
        elif service is not None and service.keeps_blocks:  # the decode inbox: this segment lends them
            self._lender = _OwnSegment(self, service)
        return await super().start(service, address)

    def _stage(self, size: int) -> int:
        self._free_let_go()
        return super()._stage(size)

    def _free_let_go(self) -> None:
        while self._let_go:
            self.arena.free(*self._let_go.popleft())

    def _handle_op(self, header, request_id, data):
        op, lender = header["op"], self._lender
        if op == "open-window":
            opened = lender.open_window(int(header["want"]), int(header["need"])) if lender is not None else None
            fields = {"supported": lender is not None, "boot": BOOT_ID}
            if opened is not None:
                fields.update(zip(("window", "shm", "offset", "size", "ttl_s"), opened))
            return [pack_header("window-reply", request_id, **fields)]
        if op == "put-placed":
            start = time.perf_counter()
            blocks = list(zip(header["keys"], header["offsets"], header["sizes"], header["sums"]))
            try:
                errors = lender.commit_window(int(header["window"]), blocks)
            except KeyError:  # closed, expired, or lent before a restart: the sender puts the usual way
                return [pack_header("put-reply", request_id, errors=[], unknown_window=True)]
            served = self.served["put"]
            served["requests"] += 1
            served["bytes"] += sum(header["sizes"])
            served["seconds"] += time.perf_counter() - start
            return [pack_header("put-reply", request_id, errors=errors)]
        if op == "close-window":
            lender.close_window(int(header["window"]))
            return []
        return super()._handle_op(header, request_id, data)

    # -- write windows: the sender side ---------------------------------------------------------------

    async def send(self, peer, blocks, timeout_s, request_id=None, self_checked=False):
        request_id = request_id or new_request_id()
        if peer in self._no_windows:
            return await super().send(peer, blocks, timeout_s, request_id, self_checked)
        if request_id in self._placing:  # as in _request: an id names one transfer at a time
            raise TransferError(f"transfer {request_id} to {peer}: a transfer with this id is already in flight")
        self._placing.add(request_id)
        try:
            deadline = self._now() + timeout_s
            result = await self._send_placed(peer, blocks, deadline, request_id, self_checked)
        finally:
            self._placing.discard(request_id)
        if result is not None:
            return result
        return await super().send(peer, blocks, self._left(deadline), request_id, self_checked)

    async def _send_placed(self, peer, blocks, deadline, request_id, self_checked):
        """Write `blocks` into the peer's window and have it adopt them; None when the peer lends no
        window now (the caller then puts the usual way)."""
        views = [(key, memoryview(data).cast("B")) for key, data in blocks]
        need = sum(len(v) for _, v in views)
        if need == 0:
            return None
        window = await self._window(peer, need, deadline, request_id)
        if window is None:
            return None
        start = time.perf_counter()
        offsets, sums = [], []
        cursor, window.cursor = window.cursor, window.cursor + need  # taken now: no await in between
        target = np.frombuffer(window.view, dtype=np.uint8)
        for key, view in views:
            sums.append(self._place(target[cursor:cursor + len(view)], key, view,
                                    bound_digest(view) if self_checked else None))
            offsets.append(cursor)
            cursor += len(view)
        frames = [pack_header("put-placed", request_id, window=window.window_id, keys=[k for k, _ in views],
                              sums=sums, offsets=offsets, sizes=[len(v) for _, v in views])]
        window.renew(self._now())  # the lender renews it on receipt, later than this
        header, _ = await self._request(peer, request_id, frames, self._left(deadline))
        if header.get("unknown_window"):
            if self._windows.get(peer) is window:
                del self._windows[peer]
            return None
        results = [BlockResult(k, error=e) for (k, _), e in zip(views, header["errors"])]
        return TransferResult(peer, request_id, results, need, time.perf_counter() - start)

    async def _window(self, peer, need, deadline, request_id) -> _Window | None:
        """The peer's window with `need` bytes free, opening a new one when the current one is full."""
        window = self._windows.get(peer)
        if window is not None and window.cursor + need <= window.end and self._now() < window.usable_until:
            return window  # the usual case: room left, nothing to wait for (no lock, no timeout scope)
        lock = self._window_locks.setdefault(peer, asyncio.Lock())
        try:
            async with asyncio.timeout_at(deadline), lock:
                now = self._now()
                window = self._windows.pop(peer, None)
                if window is not None and window.cursor + need <= window.end and now < window.usable_until:
                    self._windows[peer] = window
                    return window
                if window is not None:
                    self._close_window(peer, window)
                open_id = f"{request_id}.window"
                header, _ = await self._request(peer, open_id, [pack_header(
                    "open-window", open_id, want=max(WINDOW_BYTES, 4 * need), need=need)], self._left(deadline))
                if not header.get("supported"):
                    self._no_windows.add(peer)
                    return None
                if header.get("window") is None:  # no room now: this put goes the usual way
                    return None
                check_same_host(header, peer)
                view = self._peer_view(header["shm"], writable=True)
                window = _Window(header["window"], header["shm"], view, header["offset"] + header["size"],
                                 header["offset"], float(header["ttl_s"]), 0.0)
                window.renew(now)  # the lender started its TTL on receipt, after `now`
                self._windows[peer] = window
                return window
        except TimeoutError:
            raise TransferError(f"transfer {request_id} to {peer}: no write window within the deadline (peer "
                                f"down or overloaded)") from None

    def _close_window(self, peer, window) -> None:
        self._notify(peer, [pack_header("close-window", new_request_id(), window=window.window_id)])

    @staticmethod
    def _now() -> float:
        return asyncio.get_running_loop().time()

    def _left(self, deadline: float) -> float:
        return max(0.0, deadline - self._now())

    async def stop(self) -> None:
        for peer, window in list(self._windows.items()):  # hand the unused bytes back, if the peer listens
            self._close_window(peer, window)
        self._windows.clear()
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


class _OwnSegment:
    """An shm endpoint's own segment as a window lender (mooncake/transfer/windows.py), for a service that
    keeps the blocks it is given (the decode inbox): a block written into a window is handed to the
    service where it lies, and its range returns to the arena once the service lets go of it. A finalizer
    on the array the service holds queues the range, since that may happen on any thread; the endpoint
    frees queued ranges before it next allocates."""

    KEEP_FREE = 4  # lend only while a quarter of the segment stays free for the endpoint's own staging

    def __init__(self, transport: ShmTransport, service):
        self.transport, self.service = transport, service
        self.lendable_bytes = len(transport.buffer)
        self.windows = WriteWindows(self, max_share=4)

    # What a cache node's StoreService offers, for the write-window ops.

    def open_window(self, want: int, need: int) -> tuple[int, str, int, int, float] | None:
        opened = self.windows.open(want, need)
        return None if opened is None else (opened[0], str(self.transport.path), *opened[1:], self.windows.ttl_s)

    def commit_window(self, window_id: int, blocks: list[tuple[int, int, int, int]]) -> list[str | None]:
        return self.windows.commit(window_id, blocks)

    def close_window(self, window_id: int) -> None:
        self.windows.close(window_id)

    # The Lender protocol.

    def reserve(self, size: int) -> int | None:
        self.transport._free_let_go()
        arena = self.transport.arena
        if arena.largest_free_extent() - size < self.lendable_bytes // self.KEEP_FREE:
            return None
        return arena.alloc(size)

    def reserved_view(self, offset: int, size: int) -> memoryview:
        return memoryview(self.transport.buffer[offset:offset + size])

    def adopt(self, key: int, offset: int, size: int, checksum: int, position: int) -> str | None:
        held = self.transport.buffer[offset:offset + size]  # an array of its own: its finalizer frees the range
        weakref.finalize(held, self.transport._let_go.append, (offset, size))
        return self.service.put_block(key, memoryview(held))

    def release_reserved(self, offset: int, size: int) -> None:
        self.transport.arena.free(offset, size)


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
