"""Service lifecycle: run one service under asyncio (uvloop when installed) until SIGINT or SIGTERM,
then stop it within a deadline. Signal handling lives here and nowhere else."""

import asyncio
import logging
import signal
from typing import Protocol

log = logging.getLogger(__name__)


class Service(Protocol):
    name: str
    # Optional: `fatal`, a future the service fails when it cannot go on (run_service then stops it and
    # raises that error).

    async def start(self) -> None: ...

    async def stop(self) -> None: ...


class ServiceStack:
    """Several services run as one: started in order, stopped in reverse (a half-started stack too)."""

    def __init__(self, name: str, services: list):
        self.name = name
        self.services = services
        self._started: list = []

    @property
    def fatal(self):
        futures = [f for s in self._started if (f := getattr(s, "fatal", None)) is not None]
        return futures[0] if futures else None

    async def start(self) -> None:
        for service in self.services:
            try:
                await service.start()
            except BaseException:
                await self.stop()
                raise
            self._started.append(service)

    async def stop(self) -> None:
        while self._started:
            await self._started.pop().stop()


def run_service(service: Service, stop_timeout_s: float = 10.0) -> None:
    try:
        import uvloop
        uvloop.install()
    except ImportError:
        pass
    asyncio.run(_serve(service, stop_timeout_s))


async def _serve(service: Service, stop_timeout_s: float) -> None:
    stopping = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stopping.set)
    await service.start()
    waits = [asyncio.ensure_future(stopping.wait())]
    fatal = getattr(service, "fatal", None)
    if fatal is not None:
        waits.append(fatal)
    try:
        await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
        log.info("%s: stopping", service.name)
        if fatal is not None and fatal.done() and fatal.exception() is not None:
            raise fatal.exception()
    finally:
        waits[0].cancel()
        try:
            await asyncio.wait_for(service.stop(), stop_timeout_s)
        except asyncio.TimeoutError:
            log.error("%s: did not stop within %g s; exiting anyway", service.name, stop_timeout_s)
    log.info("%s: stopped", service.name)
