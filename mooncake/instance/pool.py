"""An instance's way to the cache pool (the cache nodes' KVCache store): the client, and what it writes
and removes there in the background. Prefill writes the blocks it computes and reads the prefixes it
reuses; decode writes the blocks a CPP group computed, once it holds them whole (each stage holds only its
layers). The pool is an accelerator, not a dependency: an instance serves without it, and a write that
fails or that the pool cannot keep up with is logged and skipped, never a request's failure."""

import asyncio
import logging

from mooncake.store.client import CacheClient
from mooncake.transfer.contract import TransferError, make_transport

log = logging.getLogger(__name__)

MAX_POOL_WRITES = 64  # writes in flight at once; past that, blocks skip the pool


class PoolAccess:
    def __init__(self, name: str, config):
        self.name, self.config = name, config
        self.client: CacheClient | None = None  # None: no pool (off, or no node answered at start)
        self.wrap = lambda transport: transport  # what the client's transports are wrapped in (Worker.modelled)
        self._tasks: set[asyncio.Task] = set()

    async def start(self, supervisor=None) -> CacheClient | None:
        """The client, started, when `instance.use_cache_pool` is on; None otherwise or when the nodes
        cannot be reached (said in the log). `supervisor`: the role's, which watches the client's loops."""
        if not self.config.instance.use_cache_pool:
            return None
        client = CacheClient(self.config.cache_client, lambda name: self.wrap(make_transport(name, self.config)),
                             supervisor)
        try:
            await client.start()  # NOTE: nodes down now are probed until they answer
        except TransferError as exc:
            log.warning("%s: no cache pool (%s); computing every prefix locally", self.name, exc)
            await client.stop()
            return None
        self.client = client
        return client

    async def stop(self) -> None:
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        if self.client is not None:
            await self.client.stop()
            self.client = None

    def write(self, request_id: str, blocks: list[tuple[int, bytes]]) -> None:
        """Put wire blocks (`kv_payload.wire_blocks`, self-checked) into the pool, in the background."""
        if self.client is None or not blocks:
            return
        if len(self._tasks) >= MAX_POOL_WRITES:
            # NOTE: the pool is not keeping up; holding more blocks in memory for it would not help it.
            log.info("%s: %d pool writes pending; %d blocks of %s not written to the pool", self.name,
                     len(self._tasks), len(blocks), request_id)
            return

        def done(t: asyncio.Task) -> None:
            if t.cancelled():
                return
            if t.exception() is not None:
                log.warning("%s: writing %d blocks of %s to the pool failed: %r", self.name, len(blocks),
                            request_id, t.exception())
            elif refused := {k: e for k, e in t.result().items() if e}:
                log.info("%s: the pool did not take %d blocks of %s: %s", self.name, len(refused), request_id,
                         next(iter(refused.values())))
        self._spawn(self.client.put_blocks(blocks, self_checked=True), done)

    def remove(self, key: int, request_id: str, why: str) -> None:
        """Remove a block the pool served corrupted (no transport checks a KV payload: its reader does), so
        that a recomputed copy, written back like any new block, takes its place."""
        if self.client is None:
            return
        log.warning("%s: request %s: pool block %#x unusable (%s); removing it from the pool, recomputing",
                    self.name, request_id, key, why)

        def done(t: asyncio.Task) -> None:
            if not t.cancelled() and t.exception() is not None:
                log.warning("%s: removing pool block %#x failed: %r", self.name, key, t.exception())
        self._spawn(self.client.remove_blocks([key]), done)

    def _spawn(self, coro, done) -> None:
        task = asyncio.ensure_future(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        task.add_done_callback(done)
