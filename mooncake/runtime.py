"""Service lifecycle: run one service under asyncio (uvloop when installed) until SIGINT or SIGTERM,
then stop it within a deadline. Signal handling lives here and nowhere else."""

import asyncio
import logging
import signal
from typing import Protocol

log = logging.getLogger(__name__)


class Service(Protocol):
    name: str

    async def start(self) -> None: ...

    async def stop(self) -> None: ...


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
    try:
        await stopping.wait()
        log.info("%s: stopping", service.name)
    finally:
        try:
            await asyncio.wait_for(service.stop(), stop_timeout_s)
        except asyncio.TimeoutError:
            log.error("%s: did not stop within %g s; exiting anyway", service.name, stop_timeout_s)
    log.info("%s: stopped", service.name)
