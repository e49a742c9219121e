"""The part of a prefill or decode instance that is not its role: the engine on its step loop (the
roles reach the engine only through its EngineLoop), the
link to the conductor, the report links to the API processes, the heartbeat with its load, and start/stop
in order."""

import asyncio
import dataclasses
import logging
import os
import socket

from mooncake import messages as m
from mooncake.config import EngineConfig, MooncakeConfig
from mooncake.instance.engine_loop import EngineLoop
from mooncake.link import ConductorLink
from mooncake.instance.reports import ReportLinks
from mooncake.runtime import Supervisor
from mooncake.transfer.modelled import ModelledNetwork

log = logging.getLogger(__name__)


class Worker:
    role = ""
    prefill_batching = "budget"  # what engine.prefill_batching = "auto" means for this role

    def __init__(self, config: MooncakeConfig):
        self.config = config
        # NOTE: the host name keeps default ids apart across containers, where every PID may be 1.
        self.instance_id = config.instance.instance_id or f"{self.role}-{socket.gethostname()}-{os.getpid()}"
        self.name = f"{self.role} instance {self.instance_id}"
        self.loop: EngineLoop | None = None
        self.link: ConductorLink | None = None
        self.reports: ReportLinks | None = None
        self.transport = None
        self.data_address = ""
        self.supervisor: Supervisor | None = None
        self._request_tasks: set[asyncio.Task] = set()
        self._num_heartbeats = 0  # since it last registered

    @property
    def fatal(self):
        return self.supervisor.fatal if self.supervisor else None

    async def start(self) -> None:
        # NOTE: loading weights takes seconds; do it off the event loop's thread all the same.
        self.supervisor = Supervisor(self.name)
        self.loop = await EngineLoop.start_engine(self.engine_config(), self.on_outputs, self.on_failed)
        await self.start_role()
        facts = self.loop.facts
        prefill_coef, decode_coef = facts.time_coefficients or ([], [])
        register = m.Register(instance_id=self.instance_id, role=self.role, model_id=facts.model_id,
                              block_size=facts.block_size, kv_dtype=self.config.engine.kv_dtype,
                              transport=self.config.instance.transport,
                              data_address=self.data_address, num_kv_blocks=facts.num_kv_blocks,
                              prefill_coef=prefill_coef, decode_coef=decode_coef)
        self.link = ConductorLink(self.config.instance.conductor_address, register, self.heartbeat,
                                  self.on_message, self.supervisor, on_registered=self.on_registered)
        self.reports = ReportLinks(self.instance_id, self.link.send, self.on_message, self.supervisor)
        self.loop.start(self.supervisor)
        await self.link.start()
        log.info("%s ready: model %s, %d KV blocks, conductor %s", self.name, self.config.engine.model,
                 facts.num_kv_blocks, self.config.instance.conductor_address)

    def modelled(self, transport):
        """`transport`, taking the modelled network's time where the runner emulates a model whose KV and
        hidden states are larger than its own (mooncake/transfer/modelled.py); as it is for a real model."""
        facts = self.loop.facts
        if not (facts.transfer_s_per_block or facts.activation_s_per_token):
            return transport
        return ModelledNetwork(transport, facts.transfer_s_per_block, facts.num_layers, facts.activation_s_per_token)

    def engine_config(self) -> EngineConfig:
        """The configured engine, with `prefill_batching = "auto"` made this role's choice."""
        engine = self.config.engine
        if engine.prefill_batching == "auto":
            engine = dataclasses.replace(engine, prefill_batching=self.prefill_batching)
        return engine

    async def stop(self) -> None:
        if self.link is not None:
            await self.link.stop()
            self.link = None
        if self.loop is not None:
            await self.loop.stop()
            self.loop = None
        for task in list(self._request_tasks):
            task.cancel()
        await asyncio.gather(*self._request_tasks, return_exceptions=True)
        await self.stop_role()
        if self.reports is not None:
            await self.reports.stop()
        if self.supervisor is not None:
            await self.supervisor.stop()

    def on_registered(self) -> None:
        self._num_heartbeats = 0

    def heartbeat(self) -> m.Heartbeat:
        stats = self.loop.stats  # NOTE: as of the last gap between steps: a step may be running now
        self._num_heartbeats += 1
        return m.Heartbeat(instance_id=self.instance_id, seq=self._num_heartbeats,
                           num_waiting=stats.num_waiting, num_running=stats.num_running,
                           num_kv_blocks_used=stats.num_kv_blocks_used, num_kv_blocks=self.loop.facts.num_kv_blocks,
                           step_samples=[m.StepSample(*sample) for sample in self.loop.drain_step_samples()],
                           emulated_steps=[m.EmulatedStep(*step) for step in self.loop.drain_emulated_steps()],
                           cache=self.cache_changes(), decode=self.decode_load())

    def cache_changes(self) -> m.CacheChanges | None:
        """A prefill instance's prefix cache changes for the heartbeat."""
        return None

    def decode_load(self) -> m.DecodeLoad | None:
        """A decode instance's own load for the heartbeat."""
        return None

    def spawn_for(self, request_id: str, coro, what: str) -> asyncio.Task:
        """Run one request's step as its own task; an unexpected exception in it is logged and ends that
        request with an error (the conductor then moves or fails it), never silently."""
        task = asyncio.create_task(coro, name=f"{self.name}: {what} of {request_id}")
        self._request_tasks.add(task)

        def done(t: asyncio.Task) -> None:
            self._request_tasks.discard(t)
            if t.cancelled() or t.exception() is None:
                return
            log.error("%s: %s of request %s failed", self.name, what, request_id, exc_info=t.exception())
            cleanup = asyncio.ensure_future(self._fail_request(request_id, f"{what} failed: {t.exception()!r}"))
            self._request_tasks.add(cleanup)
            cleanup.add_done_callback(self._request_tasks.discard)
        task.add_done_callback(done)
        return task

    async def _fail_request(self, request_id: str, error: str) -> None:
        try:
            await self.drop(request_id)
        finally:
            await self.report_failure(request_id, error)

    async def report_failure(self, request_id: str, error: str, is_invalid: bool = False) -> None:
        log.warning("%s: request %s failed: %s", self.name, request_id, error)
        await self.reports.send(request_id, m.RequestFailed(request_id=request_id, error=error, is_invalid=is_invalid))
        self.reports.forget(request_id)

    async def on_failed(self, request_ids: list[str], error: str, is_invalid: bool = False) -> None:
        for request_id in request_ids:
            await self.report_failure(request_id, error, is_invalid)

    # -- for the roles ------------------------------------------------------------------------------

    async def start_role(self) -> None: ...

    async def stop_role(self) -> None: ...

    async def on_outputs(self, outputs) -> None: ...

    async def on_message(self, msg) -> None: ...

    async def drop(self, request_id: str) -> None:
        """Free everything the request holds here."""
        await self.loop.abort(request_id)

    async def report(self, request_id: str, msg, is_last: bool = False) -> None:
        """A report of the request to the API process that owns it (the conductor, if none is named)."""
        await self.reports.send(request_id, msg)
        if is_last:
            self.reports.forget(request_id)
