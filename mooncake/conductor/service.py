"""The conductor role's control plane and request path (DESIGN section 3).

Instances register and heartbeat over one ROUTER socket; the registry marks the silent ones dead and
their requests fail with a clear error. For each request: hash the prompt's blocks, place it with the
configured policy (Algorithm 1 by default), ask admission (early rejection), send `Prefill`, wait for
`PrefillDone` (the first token; the KV is then in decode's inbox), send `Decode`, and relay `Tokens`.
Every wait has a deadline; whatever way a request ends, its instances are told to let it go."""

import asyncio
import logging
import time
import uuid
from dataclasses import dataclass, field

import zmq
import zmq.asyncio

from mooncake import messages as m
from mooncake import security
from mooncake.conductor.admission import make_admission_policy
from mooncake.conductor.estimators import BandwidthEstimator, DecodeStepModel, PrefillTimeModel
from mooncake.conductor.metrics import ConductorMetrics
from mooncake.conductor.policies import Estimators, make_placement_policy
from mooncake.conductor.pool_watch import PoolWatcher
from mooncake.conductor.prefix_index import PrefixIndex
from mooncake.conductor.instances import Instance, InstanceRegistry
from mooncake.conductor.view import ClusterView, DecodeLoad, DecodeView, Placement, PrefillView, RequestView
from mooncake.config import MooncakeConfig
from mooncake.sampling import SamplingParams
from mooncake.errors import MooncakeError
from mooncake.hashing import hash_blocks, make_namespace
from mooncake.models import resolve_model
from mooncake.runtime import Supervisor
from mooncake.text import IncrementalDetokenizer

log = logging.getLogger(__name__)


class Unavailable(MooncakeError):
    """No live instance can take the request (HTTP 503)."""


class Rejected(MooncakeError):
    """Admission predicts an SLO miss (HTTP 429 with Retry-After)."""

    def __init__(self, reason: str, message: str, retry_after_s: float):
        super().__init__(message)
        self.reason = reason
        self.retry_after_s = retry_after_s


class RequestError(MooncakeError):
    """The request ended in an error on the way (dead instance, deadline, refused by an instance)."""

    def __init__(self, message: str, is_invalid: bool = False):
        super().__init__(message)
        self.is_invalid = is_invalid


@dataclass(frozen=True)
class StreamEvent:
    text: str  # new text since the last event
    token_ids: list[int]
    finish_reason: str | None = None


@dataclass
class Flight:
    """A request between admission and its end, with the inbox its instances' reports land in."""

    request_id: str
    prompt_token_ids: list[int]
    block_hashes: list[int]
    params: SamplingParams
    placement: Placement
    predicted_prefill_s: float
    decode_load: DecodeLoad
    inbox: asyncio.Queue = field(default_factory=asyncio.Queue)
    in_prefill: bool = True
    num_cached_tokens: int = 0
    num_completion_tokens: int = 0
    finished: bool = False
    admitted_s: float = 0.0  # the conductor's clock
    ttft_s: float = 0.0
    gaps_s: list[float] = field(default_factory=list)  # between consecutive token messages


def _wire_sampling(params: SamplingParams) -> dict:
    """The sampling fields instances need; stop strings stay here (the conductor matches them on text)."""
    return {"temperature": params.temperature, "top_p": params.top_p, "top_k": params.top_k,
            "seed": params.seed, "ignore_eos": params.ignore_eos, "stop_token_ids": list(params.stop_token_ids)}


class Conductor:
    def __init__(self, config: MooncakeConfig, clock=time.monotonic):
        self.config = config
        self.cfg = config.conductor
        self.clock = clock
        self.name = "conductor"
        self.metrics = ConductorMetrics(config.api.model_name or config.engine.model)
        self.registry = InstanceRegistry(self.cfg.heartbeat_timeout_s)
        self.index = PrefixIndex()
        self.estimators = Estimators(
            PrefillTimeModel(self.cfg.prefill_c0_s, self.cfg.prefill_s_per_token, self.cfg.prefill_s_per_token2),
            DecodeStepModel(self.cfg.decode_step_s, self.cfg.decode_s_per_seq, self.cfg.decode_s_per_context_token),
            BandwidthEstimator(self.cfg.bandwidth_bytes_per_s))
        kwargs = {"balancing_threshold": self.cfg.balancing_threshold} if self.cfg.placement == "kvcache-centric" else {}
        self.policy = make_placement_policy(self.cfg.placement, self.index, self.estimators, **kwargs)
        self.admission = make_admission_policy(self.cfg.admission, self.estimators.decode_step,
                                               self.cfg.ttft_slo_s, self.cfg.tbt_slo_s)
        self.flights: dict[str, Flight] = {}
        self.model = None
        self.tokenizer = None
        self.ctx: zmq.asyncio.Context | None = None
        self.router = None
        self.pool: PoolWatcher | None = None
        self.supervisor: Supervisor | None = None

    @property
    def fatal(self):
        return self.supervisor.fatal if self.supervisor else None

    # -- lifecycle ----------------------------------------------------------------------------------

    async def start(self) -> None:
        from transformers import AutoTokenizer
        self.model = await asyncio.to_thread(resolve_model, self.config.engine.model)
        self.tokenizer = await asyncio.to_thread(AutoTokenizer.from_pretrained, self.model.path)
        self.block_size = self.config.engine.block_size
        self.namespace = make_namespace(self.model.model_id, self.block_size)
        max_positions = self.model.config.get("max_position_embeddings", 2048)
        self.max_model_len = min(self.config.engine.max_model_len or max_positions, max_positions)
        self.block_bytes = self._kv_bytes_per_token() * self.block_size
        self.ctx = zmq.asyncio.Context()
        self.router = security.server(self.ctx.socket(zmq.ROUTER))
        self.router.setsockopt(zmq.LINGER, 0)
        self.router.setsockopt(zmq.ROUTER_MANDATORY, 1)
        try:
            self.router.bind(self.cfg.control_address)
        except zmq.ZMQError as exc:
            await self.stop()
            raise MooncakeError(f"conductor: cannot listen on conductor.control_address = "
                                f"{self.cfg.control_address}: {exc}") from None
        self.pool = PoolWatcher(self.config.cache_client.nodes, self.index, self.config.cache_client.timeout_s,
                                on_stats=self.metrics.record_cache_stats)
        self.pool.start()
        self.supervisor = Supervisor(self.name)
        self.supervisor.spawn(self._receive(), "the control-plane receive loop")
        self.supervisor.spawn(self._watch_liveness(), "the liveness watch")
        log.info("conductor ready: model %s (%s), control %s, placement %s, admission %s",
                 self.config.engine.model, self.model.model_id, self.cfg.control_address, self.cfg.placement,
                 self.cfg.admission)

    async def stop(self) -> None:
        if self.supervisor is not None:
            await self.supervisor.stop()
        for flight in list(self.flights.values()):
            flight.inbox.put_nowait(RequestError("the conductor is shutting down"))
        if self.pool is not None:
            await self.pool.stop()
        if self.ctx is not None:
            self.router.close(linger=0)
            security.release(self.ctx)
            self.ctx.term()
            self.ctx = None

    def _kv_bytes_per_token(self) -> int:
        c = self.model.config
        head_dim = c.get("head_dim") or c["hidden_size"] // c["num_attention_heads"]
        num_kv_heads = c.get("num_key_value_heads") or c["num_attention_heads"]
        dtype_bytes = 4 if self.config.engine.dtype == "float32" else 2
        return 2 * c["num_hidden_layers"] * num_kv_heads * head_dim * dtype_bytes

    # -- the request path ---------------------------------------------------------------------------

    async def submit(self, prompt_token_ids: list[int], params: SamplingParams) -> Flight:
        """Place and admit a request and send it to prefill; raises Unavailable or Rejected."""
        now = self.clock()
        request_id = uuid.uuid4().hex
        hashes = hash_blocks(prompt_token_ids, self.block_size, self.namespace)
        view = RequestView(request_id, len(prompt_token_ids), tuple(hashes), params.max_tokens, now)
        cluster = self.cluster_view(now)
        placement = self.policy.place(view, cluster, now)
        if placement is None:
            missing = " and ".join(r for r in ("prefill", "decode") if not self.registry.alive(r))
            raise Unavailable(f"no live {missing} instance to serve the request; retry when one has registered")
        rejection = self.admission.admit(view, placement, cluster, now)
        if rejection is not None:
            self.metrics.rejections.labels(rejection.reason).inc()
            log.info("rejected %s: %s (TTFT %.2f s, TBT %.3f s predicted)", request_id, rejection.reason,
                     rejection.ttft_s, rejection.tbt_s)
            if rejection.reason == "ttft_slo":
                what = f"time to first token {rejection.ttft_s:.2f} s exceeds conductor.ttft_slo_s = {self.cfg.ttft_slo_s:g} s"
            else:
                what = f"time between tokens {rejection.tbt_s:.3f} s exceeds conductor.tbt_slo_s = {self.cfg.tbt_slo_s:g} s"
            raise Rejected(rejection.reason, f"the cluster is overloaded: the predicted {what}; retry later",
                           retry_after_s=max(1.0, placement.ttft_s))
        reused_tokens = placement.reuse_blocks * self.block_size
        predicted_prefill_s = self.estimators.prefill_time.predict(len(prompt_token_ids), reused_tokens)
        start = now + placement.ttft_s
        flight = Flight(request_id, list(prompt_token_ids), hashes, params, placement, predicted_prefill_s,
                        DecodeLoad(start, start + params.max_tokens * max(placement.tbt_s, 1e-3),
                                   len(prompt_token_ids) + params.max_tokens), admitted_s=now)
        self.flights[request_id] = flight
        for instance_id in (placement.prefill_id, placement.decode_id):
            self.registry.get(instance_id).request_ids.add(request_id)
            self.metrics.in_flight.labels(instance_id).inc()
        decode = self.registry.get(placement.decode_id)
        ok = await self._send(placement.prefill_id, m.Prefill(
            request_id=request_id, token_ids=flight.prompt_token_ids, block_hashes=hashes,
            sampling=_wire_sampling(params), decode_id=decode.instance_id, decode_transport=decode.transport,
            decode_address=decode.data_address, reuse_blocks=placement.reuse_blocks,
            deadline_s=self.cfg.prefill_timeout_s))
        if not ok:
            self._end(flight, "error")
            raise Unavailable(f"prefill instance {placement.prefill_id} is unreachable; retry")
        return flight

    def abandon(self, flight: Flight) -> None:
        """Let go of a submitted request that will not be streamed (another choice of its HTTP request was
        refused): its instances are told to free it."""
        self._end(flight, "cancelled")

    async def stream(self, flight: Flight):
        """Yield StreamEvents until the request ends; raises RequestError. Always releases the request."""
        outcome = "cancelled"
        try:
            async for event in self._run(flight):
                yield event
            outcome = "ok"
        except RequestError:
            outcome = "error"
            raise
        finally:
            self._end(flight, outcome)

    async def _run(self, flight: Flight):
        params, request_id = flight.params, flight.request_id
        detok = IncrementalDetokenizer(self.tokenizer, params.stop)
        started = self.clock()
        done = await self._next(flight, self.cfg.prefill_timeout_s, "the first token")
        flight.in_prefill = False
        self._on_prefill_done(flight, done)
        self.registry.get(flight.placement.prefill_id).request_ids.discard(request_id)
        self.metrics.in_flight.labels(flight.placement.prefill_id).dec()
        last = self.clock()
        flight.ttft_s = last - started
        self.metrics.ttft.observe(flight.ttft_s)
        reason = done.finish_reason if done.finish_reason == "stop" or params.max_tokens == 1 else None
        event = self._event(flight, detok, [done.first_token], reason)
        yield event
        if event.finish_reason is not None:
            return
        decode_id = flight.placement.decode_id
        sampling = {**_wire_sampling(params), "max_tokens": params.max_tokens - 1}  # the first token is out
        if not await self._send(decode_id, m.Decode(request_id=request_id,
                                                    token_ids=flight.prompt_token_ids + [done.first_token],
                                                    block_hashes=flight.block_hashes, sampling=sampling)):
            raise RequestError(f"decode instance {decode_id} is unreachable")
        while True:
            tokens = await self._next(flight, self.cfg.token_timeout_s, "the next token")
            now = self.clock()
            self.metrics.tbt.observe(now - last)
            flight.gaps_s.append(now - last)
            last = now
            event = self._event(flight, detok, tokens.token_ids, tokens.finish_reason)
            yield event
            if event.finish_reason is not None:
                return

    def _event(self, flight: Flight, detok: IncrementalDetokenizer, token_ids: list[int],
               finish_reason: str | None) -> StreamEvent:
        flight.num_completion_tokens += len(token_ids)
        self.metrics.completion_tokens.inc(len(token_ids))
        text = detok.add(token_ids, final=finish_reason is not None)
        if detok.stopped:
            finish_reason = "stop"
        if finish_reason is not None:
            flight.finished = True
        return StreamEvent(text, token_ids, finish_reason)

    async def _next(self, flight: Flight, timeout_s: float, what: str):
        try:
            msg = await asyncio.wait_for(flight.inbox.get(), timeout_s)
        except asyncio.TimeoutError:
            raise RequestError(f"request {flight.request_id}: no {what} within {timeout_s:g} s") from None
        if isinstance(msg, RequestError):
            raise msg
        if isinstance(msg, m.RequestFailed):
            raise RequestError(msg.error, msg.is_invalid)
        return msg

    def _on_prefill_done(self, flight: Flight, done: m.PrefillDone) -> None:
        p = flight.placement
        flight.num_cached_tokens = done.num_cached_tokens
        n = len(flight.prompt_token_ids)
        self.metrics.prompt_tokens.inc(n)
        self.metrics.cached_tokens.inc(done.num_cached_tokens)
        self.metrics.computed_tokens.labels(p.prefill_id).inc(done.num_computed_tokens)
        self.metrics.kv_bytes.labels(p.prefill_id).inc(done.kv_bytes)
        self.metrics.kv_seconds.labels(p.prefill_id).inc(done.kv_seconds)
        self.metrics.fetch_bytes.labels(p.prefill_id).inc(done.fetched_bytes)
        self.metrics.queue.observe(max(0.0, done.prefill_seconds - done.compute_seconds - done.fetch_seconds))
        # NOTE: compute time, not receipt-to-hand-off: queueing is what T_queue adds on top.
        self.estimators.prefill_time.observe(n, done.num_cached_tokens, done.compute_seconds)
        if p.fetch_from and done.fetched_bytes:
            self.estimators.bandwidth.observe(p.fetch_from, p.prefill_id, done.fetched_bytes, done.fetch_seconds)
        # NOTE: the decode load was predicted at placement; now the real start is known.
        flight.decode_load = DecodeLoad(self.clock(), flight.decode_load.finish_s, flight.decode_load.context_tokens)

    def _end(self, flight: Flight, outcome: str) -> None:
        """Forget the request and, unless it ended cleanly, tell its instances to free what it holds."""
        if self.flights.pop(flight.request_id, None) is None:
            return
        self.metrics.requests.labels(outcome).inc()
        if outcome == "ok":
            self.metrics.e2e.observe(self.clock() - flight.admitted_s)
            self.metrics.slo.labels(str(self._within_slo(flight)).lower()).inc()
        holders = [flight.placement.decode_id] + ([flight.placement.prefill_id] if flight.in_prefill else [])
        for instance_id in holders:
            instance = self.registry.get(instance_id)
            if instance is not None and flight.request_id in instance.request_ids:
                instance.request_ids.discard(flight.request_id)
                self.metrics.in_flight.labels(instance_id).dec()
        if not flight.finished:
            for instance_id in (flight.placement.prefill_id, flight.placement.decode_id):
                asyncio.ensure_future(self._send(instance_id, m.Cancel(request_id=flight.request_id)))

    def _within_slo(self, flight: Flight) -> bool:
        """TTFT within its SLO, and TBT as the paper measures it: the mean of the slowest 10% of gaps."""
        slowest = sorted(flight.gaps_s, reverse=True)[:max(1, len(flight.gaps_s) // 10)]
        tbt_s = sum(slowest) / len(slowest) if slowest else 0.0
        return flight.ttft_s <= self.cfg.ttft_slo_s and tbt_s <= self.cfg.tbt_slo_s

    # -- what the policies see ------------------------------------------------------------------------

    def cluster_view(self, now: float) -> ClusterView:
        prefills, decodes = [], []
        for instance in self.registry.alive("prefill"):
            queued = [self.flights[r] for r in instance.request_ids if r in self.flights]
            prefills.append(PrefillView(instance.instance_id, sum(f.predicted_prefill_s for f in queued if f.in_prefill),
                                        len(queued)))
        for instance in self.registry.alive("decode"):
            decodes.append(DecodeView(instance.instance_id, [self.flights[r].decode_load
                                                             for r in instance.request_ids if r in self.flights]))
        return ClusterView(prefills, decodes, self.block_size, self.block_bytes)

    # -- control plane --------------------------------------------------------------------------------

    async def _send(self, instance_id: str, msg) -> bool:
        try:
            await self.router.send_multipart([instance_id.encode(), m.encode(msg)])
            return True
        except zmq.ZMQError as exc:  # EHOSTUNREACH under ROUTER_MANDATORY: not connected
            log.warning("cannot reach %s with %s: %s", instance_id, msg.TAG, exc)
            return False

    async def _receive(self) -> None:
        while True:
            identity, *frames = await self.router.recv_multipart()
            sender = identity.decode(errors="replace")
            try:
                reply = self._on_frames(sender, frames)
            except Exception:  # noqa: BLE001  one message must not end the control plane
                log.exception("handling a control message from %r failed", sender)
                reply = m.ErrorReply(error="internal error; see the conductor's log")
            if reply is not None:
                try:
                    await self.router.send_multipart([identity, m.encode(reply)])
                except zmq.ZMQError as exc:  # the sender is gone (ROUTER_MANDATORY)
                    log.debug("cannot answer %r: %s", sender, exc)

    def _on_frames(self, sender: str, frames: list[bytes]):
        try:
            if len(frames) != 1:
                raise m.MessageError(f"expected 1 frame after the identity, got {len(frames)}")
            msg = m.decode(frames[0])
        except m.MessageError as exc:
            log.warning("malformed control message from %r: %s", sender, exc)
            return m.ErrorReply(error=str(exc))
        return self._handle(msg, sender)

    def _handle(self, msg, sender: str):
        """One control message from the connection whose identity is `sender`. A message that names an
        instance counts only from that instance's own connection (the identity it registered with);
        ZeroMQ refuses a second connection under an identity already connected."""
        now = self.clock()
        if isinstance(msg, m.Register):
            return self._register(msg, sender, now)
        if isinstance(msg, (m.Heartbeat, m.Leave)) and msg.instance_id != sender:
            log.warning("ignored %s naming %r from the connection of %r", msg.TAG, msg.instance_id, sender)
            return m.ErrorReply(error=f"{msg.TAG} may name only the sender's own instance")
        if isinstance(msg, m.Heartbeat):
            instance = self.registry.heartbeat(msg, now)
            if instance is None:
                return m.RegisterReply(accepted=False, error="unregistered")
            self._on_heartbeat(instance, msg)
            return None
        if isinstance(msg, m.Leave):
            instance = self.registry.get(msg.instance_id)
            if instance is not None and instance.is_alive:
                self.registry.leave(msg.instance_id)
                self._on_dead(instance, "left the cluster")
            return None
        if isinstance(msg, (m.PrefillDone, m.Tokens, m.RequestFailed)):
            flight = self.flights.get(msg.request_id)
            if flight is None:
                if isinstance(msg, m.RequestFailed) or msg.finish_reason is not None:
                    return None
                return m.Cancel(request_id=msg.request_id)  # a request we gave up on: free it there
            placed = flight.placement
            holders = {m.PrefillDone: (placed.prefill_id,), m.Tokens: (placed.decode_id,)}.get(
                type(msg), (placed.prefill_id, placed.decode_id))
            if sender not in holders:
                log.warning("ignored %s of request %s from %r, which does not hold it", msg.TAG,
                            msg.request_id, sender)
                return None
            flight.inbox.put_nowait(msg)
            return None
        log.warning("unexpected %s from %r", type(msg).__name__, sender)
        return m.ErrorReply(error=f"the conductor does not take {msg.TAG!r}")

    def _register(self, msg: m.Register, identity: str, now: float):
        problem = None
        if msg.role not in ("prefill", "decode"):
            problem = f"unknown role {msg.role!r}"
        elif identity != msg.instance_id:
            problem = f"socket identity {identity!r} differs from instance id {msg.instance_id!r}"
        elif msg.model_id != self.model.model_id:
            problem = f"it runs model {msg.model_id}, which this conductor does not serve"
        elif msg.block_size != self.block_size:
            problem = f"its block_size {msg.block_size} is not the system's"
        if problem:
            # NOTE: the reply tells the instance what of its own is wrong and nothing of the cluster's;
            # the conductor's log has both sides.
            log.error("refused %s: %s (this conductor: model %s, block_size %d)", msg.instance_id, problem,
                      self.model.model_id, self.block_size)
            return m.RegisterReply(accepted=False, error=problem)
        self.registry.register(msg, now)
        self.metrics.up.labels(msg.instance_id, msg.role).set(1)
        self.metrics.kv_total.labels(msg.instance_id).set(msg.num_kv_blocks)
        log.info("%s instance %s joined (%d KV blocks%s)", msg.role, msg.instance_id, msg.num_kv_blocks,
                 f", KV inbox {msg.data_address} over {msg.transport}" if msg.data_address else "")
        return m.RegisterReply(accepted=True, heartbeat_interval_s=self.cfg.heartbeat_interval_s)

    def _on_heartbeat(self, instance: Instance, msg: m.Heartbeat) -> None:
        if msg.cached_blocks:
            self.index.add(instance.instance_id, msg.cached_blocks)
        if msg.evicted_blocks:
            self.index.remove(instance.instance_id, msg.evicted_blocks)
        for batch, context, seconds in msg.step_samples:
            if instance.role == "decode":
                self.estimators.decode_step.observe(batch, context, seconds)
        i = instance.instance_id
        self.metrics.waiting.labels(i).set(msg.num_waiting)
        self.metrics.running.labels(i).set(msg.num_running)
        self.metrics.kv_used.labels(i).set(msg.num_kv_blocks_used)
        self.metrics.index_blocks.set(len(self.index))

    async def _watch_liveness(self) -> None:
        while True:
            await asyncio.sleep(self.cfg.heartbeat_interval_s / 2)
            for instance in self.registry.expire(self.clock()):
                try:
                    self._on_dead(instance, f"stopped responding (no heartbeat for "
                                            f"{self.cfg.heartbeat_timeout_s:g} s)")
                except Exception:  # noqa: BLE001  the next instance's expiry must still happen
                    log.exception("failing the requests of %s failed", instance.instance_id)

    def _on_dead(self, instance: Instance, why: str) -> None:
        """It gets no more work, its cached blocks leave the index, and its requests fail."""
        level = logging.INFO if why == "left the cluster" else logging.ERROR
        log.log(level, "%s instance %s %s: failing its %d requests", instance.role, instance.instance_id, why,
                len(instance.request_ids))
        self.metrics.up.labels(instance.instance_id, instance.role).set(0)
        self.index.drop_holder(instance.instance_id)
        for request_id in list(instance.request_ids):
            if (flight := self.flights.get(request_id)) is not None:
                flight.inbox.put_nowait(RequestError(
                    f"{instance.role} instance {instance.instance_id} {why}; request {request_id} failed"))

    def health(self) -> dict:
        return {role: [i.instance_id for i in self.registry.alive(role)] for role in ("prefill", "decode")} | {
            "cache": sorted(self.pool.node_ids.values()) if self.pool else []}
