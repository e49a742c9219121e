"""Supervised loops: a task that dies takes its service down loudly (run_service raises, so the process
exits non-zero with a log line); cancelled and finished tasks do not."""

import asyncio
import logging

import pytest

from mooncake.errors import MooncakeError
from mooncake.runtime import Supervisor, _serve


class Dying:
    """A service whose one loop fails after a few rounds, as a control loop with a bug would."""

    name = "dying"

    def __init__(self):
        self.stopped = False

    async def start(self):
        self.supervisor = Supervisor(self.name)
        self.supervisor.spawn(self._loop(), "the control loop")

    @property
    def fatal(self):
        return self.supervisor.fatal

    async def _loop(self):
        await asyncio.sleep(0.05)
        raise RuntimeError("a bug")

    async def stop(self):
        self.stopped = True
        await self.supervisor.stop()


def test_a_dead_loop_ends_the_service_with_an_error_naming_it(caplog):
    service = Dying()
    with caplog.at_level(logging.CRITICAL), pytest.raises(MooncakeError, match="dying: the control loop failed"):
        asyncio.run(asyncio.wait_for(_serve(service, 5.0), 10))
    assert service.stopped
    assert "the control loop failed and cannot go on" in caplog.text


def test_cancelled_or_finished_tasks_are_not_failures():
    async def run():
        supervisor = Supervisor("calm")
        supervisor.spawn(asyncio.sleep(0), "a short task")
        supervisor.spawn(asyncio.sleep(60), "a long loop")
        await asyncio.sleep(0.05)
        assert not supervisor.fatal.done()
        await supervisor.stop()
        assert supervisor.fatal.cancelled()
    asyncio.run(run())
