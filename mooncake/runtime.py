"""Service lifecycle: run one service under asyncio (uvloop when installed) until SIGINT or SIGTERM,
then stop it within a deadline, in a process set up as every role's is (malloc thresholds, below).
Signal handling lives here and nowhere else."""

import asyncio
import ctypes
import logging
import signal
from typing import Coroutine, Protocol

from mooncake.errors import MooncakeError

log = logging.getLogger(__name__)

# glibc's malloc hands a freed allocation over its mmap threshold back to the OS, so the next multi-MiB
# buffer (a KV block being exported, copied or received) faults every 4 KiB page in again. Serving
# processes allocate and free such buffers all the time; measured here, exporting a SmolLM2 block took
# 1.3 ms with glibc's defaults and 0.6 ms with these. Up to TRIM_THRESHOLD_BYTES of freed memory stays in
# the process for reuse.
MMAP_THRESHOLD_BYTES = 64 << 20
TRIM_THRESHOLD_BYTES = 256 << 20
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3  # mallopt parameters, from glibc's malloc.h


def tune_allocator() -> bool:
    """Have malloc keep and reuse freed block-sized memory; False where malloc is not glibc's."""
    try:
        mallopt = ctypes.CDLL("libc.so.6").mallopt
    except (OSError, AttributeError):
        return False
    return bool(mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD_BYTES)) and \
        bool(mallopt(_M_TRIM_THRESHOLD, TRIM_THRESHOLD_BYTES))


class Service(Protocol):
    name: str
    # Optional: `fatal`, a future the service fails when it cannot go on (run_service then stops it and
    # raises that error).

    async def start(self) -> None: ...

    async def stop(self) -> None: ...


class Supervisor:
    """The long-lived tasks of one service. Each loop survives a bad message on its own (it catches,
    logs and answers per message); a task that still ends by an exception cannot go on, so it is logged
    and fails `fatal`, and run_service stops the process with a non-zero exit instead of leaving a zombie
    that answers nothing."""

    def __init__(self, name: str):
        self.name = name
        self.fatal: asyncio.Future = asyncio.get_running_loop().create_future()
        self._tasks: list[asyncio.Task] = []

    def spawn(self, coro: Coroutine, what: str) -> asyncio.Task:
        task = asyncio.create_task(coro, name=f"{self.name}: {what}")
        task.add_done_callback(lambda t: self._ended(t, what))
        self._tasks.append(task)
        return task

    def fail(self, error: BaseException) -> None:
        """End the service: run_service stops it and exits non-zero with `error`."""
        if not self.fatal.done():
            self.fatal.set_exception(error)

    def _ended(self, task: asyncio.Task, what: str) -> None:
        self._tasks = [t for t in self._tasks if t is not task]
        if task.cancelled() or task.exception() is None:
            return
        exc = task.exception()
        log.critical("%s: %s failed and cannot go on", self.name, what, exc_info=exc)
        self.fail(MooncakeError(f"{self.name}: {what} failed: {exc!r}"))

    async def stop(self) -> None:
        tasks, self._tasks = self._tasks, []
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        if not self.fatal.done():
            self.fatal.cancel()


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
    if not tune_allocator():
        log.debug("malloc is not glibc's: its thresholds are left as they are")
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
