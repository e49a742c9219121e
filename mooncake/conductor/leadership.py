"""Which conductor leads, from etcd (DESIGN section 13): a standby conductor takes over from a dead one
faster than a restart, with leadership from the coordination service Mooncake's own store uses, never a
home-made election.

Each conductor campaigns by creating `conductor.etcd_key` under a lease of `conductor.leader_ttl_s`
(etcd's compare-and-create: at most one succeeds); the winner keeps the lease alive and serves, the others
look again every STANDBY_POLL_S. A leader that cannot renew its lease within two thirds of the TTL
steps down (its process ends; what restarts it makes it a standby) before anyone else can win, so two
never serve at once. A dead leader's key goes with its lease, at most a TTL later. Only the leader
listens on its control address: instances and API processes, given every conductor's address, reach
whichever listens."""

import asyncio
import logging
import time
from urllib.parse import urlsplit

from mooncake.errors import ConfigError, MooncakeError

log = logging.getLogger(__name__)

STANDBY_POLL_S = 0.25  # a standby tries to take the lead this often (one small etcd transaction each time)


class LostLeadership(MooncakeError):
    """This conductor could not renew its lease in time: another may lead now."""


class Leadership:
    def __init__(self, endpoints: tuple[str, ...], key: str, ttl_s: float, identity: str):
        try:
            from async_etcd3gw import AsyncEtcd3Client
        except ImportError:
            raise ConfigError("config key 'conductor.etcd_endpoints' needs the etcd client: pip install "
                              "'mooncake[ha]' (async-etcd3gw)") from None
        self._client_class = AsyncEtcd3Client
        self.endpoints = endpoints
        self.key = key
        self.ttl_s = ttl_s
        self.identity = identity  # what the key holds: who leads (its control address)
        self.client = None
        self.lease = None
        self._next = 0

    def _connect(self):
        url = urlsplit(self.endpoints[self._next % len(self.endpoints)])
        self._next += 1
        return self._client_class(host=url.hostname, port=url.port or 2379, protocol=url.scheme or "http",
                                  timeout=max(1, int(self.ttl_s / 3)))

    async def acquire(self) -> None:
        """Return once this conductor leads; until then, a standby."""
        said = False
        while True:
            try:
                if self.client is None:
                    self.client = self._connect()
                lease = await asyncio.wait_for(self.client.lease(ttl=max(1, round(self.ttl_s))), self.ttl_s)
                if await asyncio.wait_for(self.client.create(self.key, self.identity, lease), self.ttl_s):
                    self.lease, self.renewed_s = lease, time.monotonic()
                    log.info("leading: %s holds %s in etcd (lease %g s)", self.identity, self.key, self.ttl_s)
                    return
                await _quietly(lease.revoke())
                if not said:
                    leader = await _quietly(self.client.get(self.key))
                    log.info("standby: %s leads; taking over when its lease ends", leader[0] if leader else "another")
                    said = True
            except Exception as exc:  # noqa: BLE001  etcd away or slow: try again
                log.warning("etcd at %s: %s; trying again", ", ".join(self.endpoints), exc)
                await self.close()
            await asyncio.sleep(STANDBY_POLL_S)

    async def keep(self) -> None:
        """Renew the lease until it cannot be renewed in time; then raise LostLeadership."""
        while True:
            await asyncio.sleep(self.ttl_s / 4)
            try:
                ttl = await asyncio.wait_for(self.lease.refresh(), self.ttl_s / 4)
                if ttl > 0:
                    self.renewed_s = time.monotonic()
            except Exception as exc:  # noqa: BLE001  etcd away or slow: the deadline below decides
                log.warning("renewing the leader's lease in etcd failed: %s", exc)
            if time.monotonic() - self.renewed_s > self.ttl_s * 2 / 3:
                raise LostLeadership(f"the leader's lease in etcd was not renewed for {self.ttl_s * 2 / 3:.2g} s; "
                                     f"stepping down (another conductor may lead now)")

    async def close(self) -> None:
        """Let go: the key goes now (a standby takes over at once), not a TTL later."""
        if self.lease is not None:
            await _quietly(asyncio.wait_for(self.lease.revoke(), 1.0))
            self.lease = None
        if self.client is not None:
            await _quietly(self.client.close())
            self.client = None


async def _quietly(coro):
    try:
        return await coro
    except Exception:  # noqa: BLE001  best effort
        return None
