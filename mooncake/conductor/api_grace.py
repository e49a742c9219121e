"""An API process past the heartbeat timeout keeps its legs for `conductor.api_grace_s`. One that was only slow
(an overloaded event loop) registers again in time, names the legs it holds, and they go on untouched; one that
is gone has them freed everywhere when the grace ends. Bookkeeping only: the conductor frees a leg."""

import asyncio
import logging
from typing import Callable

log = logging.getLogger(__name__)


class ApiGrace:
    def __init__(self, grace_s: float, free: Callable[[str], None]):
        self.grace_s = grace_s
        self.free = free  # frees one leg, by wire id, wherever it is held
        self.kept: dict[str, set[str]] = {}  # by API process: the wire ids of its legs
        self._timers: dict[str, asyncio.TimerHandle] = {}

    def keep(self, api_id: str, wire_ids: set[str]) -> bool:
        """False when there is no grace: the caller frees the legs now."""
        if self.grace_s <= 0:
            return False
        self._cancel(api_id)
        if wire_ids:
            self.kept[api_id] = set(wire_ids)
            self._timers[api_id] = asyncio.get_running_loop().call_later(self.grace_s, self._expire, api_id)
            log.warning("keeping the %d legs of API process %s for %g s (conductor.api_grace_s) in case it is only "
                        "slow", len(wire_ids), api_id, self.grace_s)
        return True

    def back(self, api_id: str, named: set[str]) -> None:
        """It registered again naming the legs it holds: kept legs it no longer names are freed."""
        self._cancel(api_id)
        kept = self.kept.pop(api_id, set())
        if kept:
            log.warning("API process %s is back within conductor.api_grace_s: %d of its %d legs go on", api_id,
                        len(kept & named), len(kept))
        for wire_id in kept - named:
            self.free(wire_id)

    def close(self) -> None:
        for api_id in list(self._timers):
            self._cancel(api_id)

    def _cancel(self, api_id: str) -> None:
        if (timer := self._timers.pop(api_id, None)) is not None:
            timer.cancel()

    def _expire(self, api_id: str) -> None:
        self._timers.pop(api_id, None)
        kept = self.kept.pop(api_id, set())
        log.error("API process %s did not come back within %g s (conductor.api_grace_s): freeing its %d legs", api_id,
                  self.grace_s, len(kept))
        for wire_id in kept:
            self.free(wire_id)
