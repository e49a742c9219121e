"""The conductor's control plane: one ROUTER socket that instances and API processes register, heartbeat
and leave on, and the liveness watch that declares a silent one dead.

A message that names an instance counts only from that instance's own connection (the identity it
registered with); ZeroMQ refuses a second connection under an identity already connected. An API process
registers as an instance of role "api" and sends its requests' legs (Place, HandOff, LegEnded, Cluster):
those go to `on_api`. A request report that reaches the conductor (an instance told no API process) goes
to `route`, joins to `on_join`, deaths to `on_dead`; all are the conductor's."""

import asyncio
import logging
from typing import Callable

import zmq
import zmq.asyncio

from mooncake import messages as m
from mooncake import security
from mooncake.conductor.instances import Instance, InstanceRegistry
from mooncake.conductor.metrics import ConductorMetrics
from mooncake.conductor.policies import Estimators
from mooncake.conductor.prefix_index import PrefixIndex
from mooncake.config import ConductorConfig
from mooncake.errors import MooncakeError
from mooncake.runtime import Supervisor

log = logging.getLogger(__name__)

LEFT = "left the cluster"
API_MESSAGES = (m.Place, m.HandOff, m.LegEnded, m.Cluster)


class ControlPlane:
    def __init__(self, cfg: ConductorConfig, registry: InstanceRegistry, index: PrefixIndex,
                 estimators: Estimators, metrics: ConductorMetrics, clock,
                 route: Callable[[object, str], object], on_dead: Callable[[Instance, str], None],
                 on_api: Callable[[object, str], object] = lambda msg, sender: None,
                 on_join: Callable[[Instance, object], None] = lambda instance, msg: None,
                 on_progress: Callable[[Instance, list], None] = lambda instance, progress: None):
        self.cfg = cfg
        self.registry = registry
        self.index = index
        self.estimators = estimators
        self.metrics = metrics
        self.clock = clock
        self.route = route
        self.on_dead = on_dead
        self.on_api = on_api
        self.on_join = on_join
        self.on_progress = on_progress
        self.model_id = ""
        self.block_size = 0
        self.kv_dtype = ""
        self.ctx: zmq.asyncio.Context | None = None
        self.router = None
        self._handshakes: asyncio.Future | None = None

    async def start(self, supervisor: Supervisor, model_id: str, block_size: int, kv_dtype: str) -> None:
        self.model_id, self.block_size, self.kv_dtype = model_id, block_size, kv_dtype
        self.ctx = zmq.asyncio.Context()
        self.router = security.server(self.ctx.socket(zmq.ROUTER), role="conductor")
        self.router.setsockopt(zmq.LINGER, 0)
        self.router.setsockopt(zmq.ROUTER_MANDATORY, 1)
        try:
            self.router.bind(self.cfg.control_address)
        except zmq.ZMQError as exc:
            await self.stop()
            raise MooncakeError(f"conductor: cannot listen on conductor.control_address = "
                                f"{self.cfg.control_address}: {exc}") from None
        supervisor.spawn(self._receive(), "the control-plane receive loop")
        supervisor.spawn(self._watch_liveness(), "the liveness watch")
        self._handshakes = asyncio.ensure_future(security.watch_handshakes(
            self.router, "a peer failed the CURVE handshake on the control socket: it holds another cluster's keys "
            "(or none), so it cannot register", logging.WARNING))

    async def stop(self) -> None:
        if self.ctx is not None:
            if self._handshakes is not None:  # NOTE: its monitor socket must close before the context ends
                self._handshakes.cancel()
                await asyncio.gather(self._handshakes, return_exceptions=True)
            self.router.close(linger=0)
            security.release(self.ctx)
            self.ctx.term()
            self.ctx = None

    async def send(self, instance_id: str, msg, frame: bytes | None = None) -> bool:
        """False when the instance is not connected (ROUTER_MANDATORY) or the socket is gone. An instance
        that is not connected is dead from now on, not a heartbeat timeout later; it re-registers when
        it is back. `frame`: `msg` already encoded."""
        if self.ctx is None:
            return False
        try:
            await self.router.send_multipart([instance_id.encode(), m.encode(msg) if frame is None else frame])
            return True
        except zmq.ZMQError as exc:  # EHOSTUNREACH under ROUTER_MANDATORY: not connected
            log.warning("cannot reach %s with %s: %s", instance_id, msg.TAG, exc)
            instance = self.registry.get(instance_id)
            if instance is not None and instance.is_alive:
                self.registry.leave(instance_id)
                self._dead(instance, "is not connected")
            return False

    async def _receive(self) -> None:
        while True:
            identity, *parts = await self.router.recv_multipart(copy=False)
            sender = identity.bytes.decode(errors="replace")
            frames = [part.bytes for part in parts]
            try:
                reply = self._on_frames(sender, frames, security.key_role(parts))
            except Exception:  # noqa: BLE001  one message must not end the control plane
                log.exception("handling a control message from %r failed", sender)
                reply = m.ErrorReply(error="internal error; see the conductor's log")
            for answer in reply if isinstance(reply, list) else () if reply is None else (reply,):
                try:
                    await self.router.send_multipart([identity.bytes, m.encode(answer)])
                except zmq.ZMQError as exc:  # the sender is gone (ROUTER_MANDATORY)
                    log.debug("cannot answer %r: %s", sender, exc)
                    break

    def _on_frames(self, sender: str, frames: list[bytes], key_role: str | None = None):
        try:
            if len(frames) != 1:
                raise m.MessageError(f"expected 1 frame after the identity, got {len(frames)}")
            msg = m.decode(frames[0])
        except m.MessageError as exc:
            log.warning("malformed control message from %r: %s", sender, exc)
            return m.ErrorReply(error=str(exc))
        return self._handle(msg, sender, key_role)

    def _handle(self, msg, sender: str, key_role: str | None = None):
        """One control message from the connection whose identity is `sender` and whose key is `key_role`'s
        (None without keys); returns the reply, if any (a list of them for a `StepTokens`)."""
        now = self.clock()
        if isinstance(msg, m.Register):
            if security.is_secured() and key_role != msg.role:
                log.error("refused %s: it registers as a %s with a %s's key", msg.instance_id, msg.role, key_role)
                return m.RegisterReply(accepted=False, error=f"this connection's key is a {key_role}'s; it may not "
                                                             f"register a {msg.role} instance")
            return self._register(msg, sender, now)
        if security.is_secured() and (known := self.registry.get(sender)) is not None and key_role != known.role:
            # NOTE: a holder of another role's key, connected under the id of an instance whose connection
            # closed, may not speak for it (nor may any key but its own role's)
            log.warning("ignored %s from %r: its connection holds a %s's key, and %r is a %s", msg.TAG, sender,
                        key_role, sender, known.role)
            return m.ErrorReply(error=f"this connection's key is a {key_role}'s; {sender!r} is a {known.role}")
        if isinstance(msg, (m.Heartbeat, m.Leave)) and msg.instance_id != sender:
            log.warning("ignored %s naming %r from the connection of %r", msg.TAG, msg.instance_id, sender)
            return m.ErrorReply(error=f"{msg.TAG} may name only the sender's own instance")
        if isinstance(msg, m.Heartbeat):
            instance = self.registry.heartbeat(msg, now)
            if instance is None:
                return m.RegisterReply(accepted=False, error="unregistered")
            return self._on_heartbeat(instance, msg)
        if isinstance(msg, m.Leave):
            instance = self.registry.get(msg.instance_id)
            if instance is not None and instance.is_alive:
                self.registry.leave(msg.instance_id)
                self._dead(instance, LEFT)
            return None
        if isinstance(msg, API_MESSAGES):
            instance = self.registry.get(sender)
            if instance is None or not instance.is_alive or instance.role != "api":
                return m.RegisterReply(accepted=False, error="unregistered")  # NOTE: it registers, then asks again
            return self.on_api(msg, sender)
        if isinstance(msg, (m.PrefillDone, m.Tokens, m.RequestFailed)):
            return self.route(msg, sender)
        if isinstance(msg, m.StepTokens):
            return [answer for report in msg.reports if (answer := self.route(report, sender)) is not None]
        log.warning("unexpected %s from %r", type(msg).__name__, sender)
        return m.ErrorReply(error=f"the conductor does not take {msg.TAG!r}")

    def _register(self, msg: m.Register, identity: str, now: float):
        problem = None
        if msg.role not in ("prefill", "decode", "api"):
            problem = f"unknown role {msg.role!r}"
        elif identity != msg.instance_id:
            problem = f"socket identity {identity!r} differs from instance id {msg.instance_id!r}"
        elif msg.model_id != self.model_id:
            problem = f"it runs model {msg.model_id}, which this conductor does not serve"
        elif msg.block_size != self.block_size:
            problem = f"its block_size {msg.block_size} is not the system's"
        elif msg.kv_dtype != self.kv_dtype:
            problem = (f"its KV dtype {msg.kv_dtype} is not the system's {self.kv_dtype} (engine.dtype; "
                       f"\"auto\" resolves by the host's CPU: set it explicitly across hosts)")
        if problem:
            # NOTE: the reply tells the instance what of its own is wrong and nothing of the cluster's;
            # the conductor's log has both sides.
            log.error("refused %s: %s (this conductor: model %s, block_size %d, KV dtype %s)", msg.instance_id,
                      problem, self.model_id, self.block_size, self.kv_dtype)
            return m.RegisterReply(accepted=False, error=problem)
        old = self.registry.get(msg.instance_id)
        if old is not None and old.is_alive and old.role != msg.role:
            # NOTE: another role's key holder may not take over a live instance's id (and free its requests)
            log.error("refused %s as a %s: that id is a live %s instance", msg.instance_id, msg.role, old.role)
            return m.RegisterReply(accepted=False, error=f"{msg.instance_id!r} is the id of a live {old.role} "
                                                         f"instance")
        if old is not None and old.is_alive and msg.role != "api":
            # NOTE: it restarted faster than the heartbeat timeout: what it held is gone with its process. (An
            # API process's id is new in every process: the same id registering again is the same process.)
            self.registry.leave(msg.instance_id)
            self._dead(old, "restarted")
        instance = self.registry.register(msg, now)
        self.metrics.up.labels(msg.instance_id, msg.role).set(1)
        self.on_join(instance, msg)
        if msg.role == "api":
            log.info("API process %s joined (reports to %s)", msg.instance_id, msg.data_address)
            return m.RegisterReply(accepted=True, heartbeat_interval_s=self.cfg.heartbeat_interval_s)
        est = self.estimators
        for model, coef in ((est.prefill_time, msg.prefill_coef), (est.decode_step, msg.decode_coef)):
            coef = [c * self.cfg.estimator_prior_scale for c in coef]  # != 1 only to show the refits converge
            if len(coef) == 3 and model.seed(coef):
                log.info("%s seeds the %s model: %s", msg.instance_id, type(model).__name__,
                         ", ".join(f"{c:.3g}" for c in coef))
        self.metrics.kv_total.labels(msg.instance_id).set(msg.num_kv_blocks)
        log.info("%s instance %s joined (%d KV blocks%s)", msg.role, msg.instance_id, msg.num_kv_blocks,
                 f", {'KV' if msg.role == 'decode' else 'CPP stage'} inbox {msg.data_address} over {msg.transport}"
                 if msg.data_address else "")
        return m.RegisterReply(accepted=True, heartbeat_interval_s=self.cfg.heartbeat_interval_s)

    def _on_heartbeat(self, instance: Instance, msg: m.Heartbeat):
        """Its load and cache changes into the registry and the index; a Resync if reports were lost."""
        if instance.role == "api":
            return None
        if msg.decode is not None and msg.decode.progress:
            self.on_progress(instance, msg.decode.progress)
        reply = None
        if msg.seq != instance.last_seq + 1 and instance.role == "prefill":
            log.warning("%s: heartbeat %d after %d; asking for its whole prefix cache", instance.instance_id,
                        msg.seq, instance.last_seq)
            reply = m.Resync()
        instance.last_seq = msg.seq
        cache = msg.cache or m.CacheChanges()
        if cache.is_snapshot:
            self.index.drop_holder(instance.instance_id)
            log.info("%s: %d cached blocks indexed from its snapshot", instance.instance_id, len(cache.added))
        if cache.added:
            self.index.add(instance.instance_id, cache.added)
        if cache.evicted:
            self.index.remove(instance.instance_id, cache.evicted)
        # NOTE: no holder claims more blocks than its KV cache holds (one instance cannot fill the index): what
        # is over, after this report's evictions, goes from its newest additions.
        if (excess := self.index.count(instance.instance_id) - instance.num_kv_blocks) > 0:
            log.warning("%s reports %d cached blocks beyond its %d KV blocks; not indexed", instance.instance_id,
                        excess, instance.num_kv_blocks)
            self.index.remove(instance.instance_id, cache.added[-excess:])
        for sample in msg.step_samples:
            if instance.role == "decode":
                self.estimators.decode_step.observe(sample.batch_size, sample.context_tokens, sample.seconds)
        for step in msg.emulated_steps:
            if step.modelled_s > 0:  # a malformed report is dropped, not divided by
                self.metrics.emulated_step.labels(instance.role).observe(step.measured_s / step.modelled_s)
        i = instance.instance_id
        self.metrics.waiting.labels(i).set(msg.num_waiting)
        self.metrics.running.labels(i).set(msg.num_running)
        self.metrics.kv_used.labels(i).set(msg.num_kv_blocks_used)
        if instance.role == "decode":
            self.metrics.kv_inbox.labels(i).set(msg.decode.num_inbox_blocks if msg.decode else 0)
        self.metrics.index_blocks.set(len(self.index))
        return reply

    async def _watch_liveness(self) -> None:
        while True:
            await asyncio.sleep(self.cfg.heartbeat_interval_s / 2)
            for instance in self.registry.expire(self.clock()):
                self._dead(instance, f"stopped responding (no heartbeat for {self.cfg.heartbeat_timeout_s:g} s)")

    def _dead(self, instance: Instance, why: str) -> None:
        """It gets no more work and its cached blocks leave the index; the conductor moves its requests."""
        level = logging.INFO if why == LEFT else logging.ERROR
        log.log(level, "%s instance %s %s (%d requests in flight there)", instance.role, instance.instance_id,
                why, len(instance.request_ids))
        self.metrics.up.labels(instance.instance_id, instance.role).set(0)
        self.index.drop_holder(instance.instance_id)
        try:
            self.on_dead(instance, why)
        except Exception:  # noqa: BLE001  the next instance's expiry must still happen
            log.exception("moving the requests of %s failed", instance.instance_id)

