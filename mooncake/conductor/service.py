"""The conductor role (DESIGN section 3): the request path, from admission to the one terminal state.

For each request: hash the prompt's blocks, place and admit it (decide.py), send `Prefill`, wait for
`PrefillDone` (the first token; the KV is then in decode's inbox), send `Decode`, and relay `Tokens`.
Every wait has a deadline. When an instance of the request dies, hangs or fails it, the request migrates
(flight.py): a new leg resumes from the prompt plus the tokens already streamed, on other instances,
reusing the prompt's KV where the pool or a prefill instance's cache holds it, and the client's stream
goes on. Whatever way a request ends, every instance that held it is told to let it go. The control
socket is control.py's; the pool's index feed is pool_watch.py's."""

import asyncio
import logging
import time
import uuid

from mooncake import messages as m
from mooncake.conductor.colocated import place_colocated
from mooncake.conductor.control import ControlPlane
from mooncake.conductor.cpp import CppSettings
from mooncake.conductor.decide import Decider, cluster_view
from mooncake.conductor.estimators import BandwidthEstimator, DecodeStepModel, PrefillTimeModel
from mooncake.conductor.flight import (Flight, Leg, LegFailed, Rejected, RequestError, StreamEvent, Unavailable,
                                       wire_sampling)
from mooncake.conductor.instances import Instance, InstanceRegistry
from mooncake.conductor.metrics import ConductorMetrics
from mooncake.conductor.policies import Estimators
from mooncake.conductor.pool_watch import PoolWatcher
from mooncake.conductor.timeline import Timelines
from mooncake.conductor.prefix_index import PrefixIndex
from mooncake.conductor.view import Placement, RequestView
from mooncake.config import MooncakeConfig
from mooncake.hashing import hash_blocks, make_namespace
from mooncake.models import resolve_model
from mooncake.runtime import Supervisor
from mooncake.sampling import SamplingParams
from mooncake.text import IncrementalDetokenizer
from mooncake.tokenizer import LightTokenizer

log = logging.getLogger(__name__)

__all__ = ["Conductor", "Rejected", "RequestError", "StreamEvent", "Unavailable"]

SUBMIT_TRIES = 3  # placements tried for a new request whose instance turns out to be unreachable
RETRY_PLACEMENT_S = 0.25  # a migrating request with no instance to go to looks again this often


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
        self.decider = Decider(self.cfg, self.index, self.estimators)
        self.control = ControlPlane(self.cfg, self.registry, self.index, self.estimators, self.metrics, clock,
                                    route=self._route, on_dead=self._on_dead)
        self.flights: dict[str, Flight] = {}  # by the wire id of their current leg
        self.timelines = Timelines(self.cfg.otlp_endpoint, clock=clock)
        self.model = None
        self.tokenizer = None
        self.pool: PoolWatcher | None = None
        self.supervisor: Supervisor | None = None
        self._sends: set[asyncio.Task] = set()

    @property
    def fatal(self):
        return self.supervisor.fatal if self.supervisor else None

    # -- lifecycle ----------------------------------------------------------------------------------

    async def start(self) -> None:
        self.model = await asyncio.to_thread(resolve_model, self.config.engine.model)
        # NOTE: not transformers' AutoTokenizer, which imports torch: the conductor runs no model.
        self.tokenizer = await asyncio.to_thread(LightTokenizer, self.model.path)
        self.block_size = self.config.engine.block_size
        self.namespace = make_namespace(self.model.model_id, self.block_size, self.config.engine.kv_dtype)
        max_positions = self.model.config.get("max_position_embeddings", 2048)
        self.max_model_len = min(self.config.engine.max_model_len or max_positions, max_positions)
        self.block_bytes = self._kv_bytes_per_token() * self.block_size
        dtype_bytes = 4 if self.config.engine.kv_dtype == "float32" else 2
        hidden = self.model.config.get("hidden_size")  # an emulated model may not say: the default then
        self.decider.policy.cpp = CppSettings.from_config(self.cfg, hidden * dtype_bytes if hidden else None)
        self.supervisor = Supervisor(self.name)
        await self.control.start(self.supervisor, self.model.model_id, self.block_size, self.config.engine.kv_dtype)
        self.pool = PoolWatcher(self.config.cache_client.nodes, self.index, self.config.cache_client.timeout_s,
                                on_stats=self.metrics.record_cache_stats)
        self.pool.start(self.supervisor)
        log.info("conductor ready: model %s (%s), control %s, placement %s, admission %s%s",
                 self.config.engine.model, self.model.model_id, self.cfg.control_address, self.cfg.placement,
                 self.cfg.admission, f", CPP groups of {self.cfg.cpp_stages} for prompts over "
                 f"{self.cfg.cpp_threshold_tokens} tokens" if self.decider.policy.cpp else "")

    async def stop(self) -> None:
        if self.supervisor is not None:
            await self.supervisor.stop()
        for flight in list(self.flights.values()):
            flight.inbox.put_nowait(RequestError("the conductor is shutting down"))
        if self._sends:
            await asyncio.wait(list(self._sends), timeout=1.0)
        if self.pool is not None:
            await self.pool.stop()
        await self.control.stop()
        self.timelines.shutdown()

    def _kv_bytes_per_token(self) -> int:
        c = self.model.config
        head_dim = c.get("head_dim") or c["hidden_size"] // c["num_attention_heads"]
        num_kv_heads = c.get("num_key_value_heads") or c["num_attention_heads"]
        dtype_bytes = 4 if self.config.engine.kv_dtype == "float32" else 2
        return 2 * c["num_hidden_layers"] * num_kv_heads * head_dim * dtype_bytes

    def health(self) -> dict:
        return {role: [i.instance_id for i in self.registry.alive(role)] for role in ("prefill", "decode")} | {
            "cache": sorted(self.pool.node_ids.values()) if self.pool else [], "mode": self.cfg.mode}

    # -- the request path ---------------------------------------------------------------------------

    async def submit(self, prompt_token_ids: list[int], params: SamplingParams) -> Flight:
        """Place and admit a request and send it to prefill; raises Unavailable or Rejected. The caller
        then owns it: it must `stream` it to its end or `abandon` it."""
        now = self.clock()
        flight = Flight(uuid.uuid4().hex, list(prompt_token_ids), params, admitted_s=now,
                        deadline_s=now + self.cfg.request_deadline_s)
        avoid: tuple[str, ...] = ()
        for _ in range(SUBMIT_TRIES):
            try:
                await self._start_leg(flight, admit=True, avoid=avoid)
                return flight
            except Rejected as exc:
                self.metrics.rejections.labels(exc.reason).inc()
                log.info("rejected %s: %s", flight.request_id, exc)
                raise
            except Unavailable:  # no instance to place it on: refused before anything of it was counted
                raise
            except LegFailed as exc:  # an instance died and the liveness watch has not seen it yet
                self._end_leg(flight)
                flight.num_legs, avoid = 0, avoid + exc.suspects
                failure = exc
            except BaseException:  # a bug, or a cancelled client: nothing of the request may stay counted
                self._end(flight, "error")
                raise
        self._end(flight, "error")
        raise Unavailable(f"{failure}; retry")

    def abandon(self, flight: Flight) -> None:
        """Let go of a submitted request that will not be streamed (its client went away, or another choice
        of its HTTP request was refused); its instances are told to free it. Does nothing once it ended."""
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

    async def _start_leg(self, flight: Flight, admit: bool, avoid: tuple[str, ...] = ()) -> None:
        """Place the request's next leg (its prompt and every token streamed so far) and send `Prefill`."""
        now = self.clock()
        tokens = flight.leg_token_ids
        remaining = flight.params.max_tokens - len(flight.generated)
        if self.cfg.mode == "colocated":
            return await self._start_colocated_leg(flight, tokens, remaining, now, avoid)
        hashes = hash_blocks(tokens, self.block_size, self.namespace, flight.params.prefix_root)
        view = RequestView(flight.request_id, len(tokens), tuple(hashes), remaining, now)
        pool_nodes = self.pool.live_ids if self.pool is not None else frozenset()
        cpp = self.decider.policy.cpp
        stages = cpp.stages if cpp is not None and len(tokens) > cpp.threshold_tokens else 1
        cluster = cluster_view(self.registry, self.flights, self.block_size, self.block_bytes, pool_nodes, now,
                               avoid, group_stages=stages, idle_step_s=self.estimators.decode_step.predict(1, 0))
        p = self.decider.decide(view, cluster, now, admit)
        # NOTE: all or nothing: the leg's messages are built (and encoded) before anything of it is counted,
        # so a request that cannot be sent leaves no load behind.
        decode = self.registry.get(p.decode_id)
        ships_kv = remaining > 1  # a request that ends with its first token never reaches decode
        sends = self._prefill_sends(flight, self._next_wire_id(flight), p, tokens, hashes, decode, ships_kv,
                                    flight.deadline_s - now)
        self._new_leg(flight, p, now)
        flight.block_hashes, flight.is_decode_sent = hashes, False
        if p.stage_ids:
            group = next(v for v in cluster.prefills if v.member_ids == p.stage_ids)
            # NOTE: every stage reads the reused prefix from the pool before its first chunk
            flight.predicted_prefill_s = self.decider.policy.prefill_s(
                view, group, p.reuse_blocks * self.block_size) + p.transfer_s
        else:
            reused = p.reuse_blocks * self.block_size
            # NOTE: its pool read holds the instance's queue too (requests enter its engine in order), as the
            # simulator charges it.
            flight.predicted_prefill_s = self.estimators.prefill_time.predict(len(tokens), reused) + p.transfer_s
        flight.decode_start_s = now + p.ttft_s
        for instance_id in p.stage_ids or (p.prefill_id,):
            self._hold(flight, instance_id)
        if ships_kv:
            self._hold(flight, p.decode_id)
        for k, (instance_id, msg, frame) in enumerate(sends):
            if not await self.control.send(instance_id, msg, frame):
                what = f" (CPP stage {k})" if p.stage_ids else ""
                raise LegFailed(f"prefill instance {instance_id}{what} is unreachable", (instance_id,))

    def _prefill_sends(self, flight: Flight, wire_id: str, p: Placement, tokens: list[int], hashes: list[int],
                       decode: Instance, ships_kv: bool, time_left_s: float) -> list[tuple[str, object, bytes]]:
        """(instance id, message, its encoding) of a leg's prefill: one `Prefill`, or for a CPP leg a
        `PrefillStage` to every instance of the group, each told where the next stage is."""
        sampling = wire_sampling(flight.params)
        deadline_s = max(0.01, min(self.cfg.prefill_timeout_s, time_left_s))
        decode_address = decode.data_address if ships_kv else ""
        if not p.stage_ids:
            msgs = [(p.prefill_id, m.Prefill(
                request_id=wire_id, token_ids=tokens, block_hashes=hashes, sampling=sampling,
                decode_id=decode.instance_id, decode_transport=decode.transport, decode_address=decode_address,
                reuse_blocks=p.reuse_blocks, deadline_s=deadline_s))]
        else:
            addresses = [self.registry.get(i).data_address for i in p.stage_ids]
            # NOTE: chunked as the conductor predicted it (cpp.chunk_bounds): one chunk when the uncached part is
            # short
            reused = min(p.reuse_blocks, (len(tokens) - 1) // self.block_size) * self.block_size  # the last is computed
            bounds = self.decider.policy.cpp.chunk_bounds(len(tokens), reused)
            msgs = [(instance_id, m.PrefillStage(
                request_id=wire_id, token_ids=tokens, block_hashes=hashes, sampling=sampling, stage=k,
                num_stages=len(p.stage_ids), chunk_tokens=max(1, bounds[1] - bounds[0]),
                next_address=(addresses + [""])[k + 1], decode_id=decode.instance_id, decode_address=decode_address,
                deadline_s=deadline_s, reuse_blocks=p.reuse_blocks)) for k, instance_id in enumerate(p.stage_ids)]
        return [(instance_id, msg, m.encode(msg)) for instance_id, msg in msgs]

    async def _start_colocated_leg(self, flight: Flight, tokens: list[int], remaining: int, now: float,
                                   avoid: tuple[str, ...]) -> None:
        """The colocated baseline: the whole request to one instance, which prefills and decodes it."""
        p = place_colocated(self.registry, self.flights, avoid)
        msg = m.Decode(request_id=self._next_wire_id(flight), token_ids=tokens, block_hashes=[],
                       sampling=wire_sampling(flight.params, max_tokens=remaining))
        frame = m.encode(msg)  # NOTE: before the leg is counted, as _start_leg's
        self._new_leg(flight, p, now)
        flight.block_hashes, flight.is_decode_sent = [], True
        self._hold(flight, p.decode_id)
        if not await self.control.send(p.decode_id, msg, frame):
            raise LegFailed(f"instance {p.decode_id} is unreachable", (p.decode_id,))

    def _new_leg(self, flight: Flight, p: Placement, now: float) -> None:
        flight.num_legs += 1
        flight.num_wire_ids += 1
        if flight.num_legs == 1:
            flight.predicted_ttft_s, flight.predicted_tbt_s = p.ttft_s, p.tbt_s
        flight.wire_id = self._next_wire_id(flight, 0)
        flight.placement, flight.in_prefill = p, True
        self.flights[flight.wire_id] = flight
        flight.legs.append(Leg(flight.wire_id, p.prefill_id, p.decode_id, p.reuse_blocks, now))

    @staticmethod
    def _next_wire_id(flight: Flight, ahead: int = 1) -> str:
        """The wire id of the request's next leg (`ahead` = 1), or of the one just counted (0)."""
        # NOTE: a new id per leg: a late report or Cancel of an old leg never touches the new one.
        n = flight.num_wire_ids + ahead
        return flight.request_id if n == 1 else f"{flight.request_id}.{n - 1}"

    async def _run(self, flight: Flight):
        detok = IncrementalDetokenizer(self.tokenizer, flight.params.stop)
        started, last = self.clock(), None
        while True:
            try:
                msg = await self._next(flight)
                if isinstance(msg, m.PrefillDone):
                    token_ids, reason = self._on_prefill_done(flight, msg)
                    logprobs = None if msg.first_logprob is None else [msg.first_logprob]
                else:
                    token_ids, reason, logprobs = msg.token_ids, msg.finish_reason, msg.logprobs
                    flight.in_prefill = False  # colocated: the instance's first report is its first token
                    if flight.legs[-1].first_decode_token_s is None:
                        flight.legs[-1].first_decode_token_s = self.clock()
                    if reason is not None:
                        self._let_go(flight, flight.placement.decode_id, cancel=False)  # it freed the request
            except LegFailed as exc:
                await self._migrate(flight, exc)
                continue
            now = self.clock()
            flight.token_times_s.append(now)
            if last is None:
                flight.ttft_s = now - started
                self.metrics.ttft.observe(flight.ttft_s)
                if flight.num_legs == 1 and flight.ttft_s > 0 and flight.predicted_ttft_s > 0:
                    self.metrics.ttft_prediction.observe(flight.predicted_ttft_s / flight.ttft_s)
            else:
                self.metrics.tbt.observe(now - last)
                flight.gaps_s.append(now - last)
            last = now
            event = self._event(flight, detok, token_ids, reason, logprobs)
            if event.finish_reason is None and isinstance(msg, m.PrefillDone):
                await self._send_decode(flight)
            yield event
            if event.finish_reason is not None:
                return

    async def _send_decode(self, flight: Flight) -> None:
        decode_id = flight.placement.decode_id
        remaining = flight.params.max_tokens - len(flight.generated)
        flight.is_decode_sent = True
        # NOTE: a CPP group's blocks reach the pool through decode, the first instance to hold them whole.
        p = flight.placement
        if not await self.control.send(decode_id, m.Decode(
                request_id=flight.wire_id, token_ids=flight.leg_token_ids, block_hashes=flight.block_hashes,
                sampling=wire_sampling(flight.params, max_tokens=remaining),
                pool_first_block=p.reuse_blocks if p.stage_ids and self.pool is not None else None)):
            flight.inbox.put_nowait(LegFailed(f"decode instance {decode_id} is unreachable", (decode_id,)))

    async def _next(self, flight: Flight):
        """The next report of the current leg: PrefillDone or Tokens. Raises LegFailed when the leg cannot
        go on and RequestError when the request cannot."""
        decode_id = flight.placement.decode_id
        timeout_s = self.cfg.prefill_timeout_s if flight.in_prefill else self.cfg.token_timeout_s
        time_left_s = flight.deadline_s - self.clock()
        try:
            msg = await asyncio.wait_for(flight.inbox.get(), max(0.0, min(timeout_s, time_left_s)))
        except asyncio.TimeoutError:
            if timeout_s >= time_left_s:
                raise RequestError(f"request {flight.request_id} did not finish within conductor.request_deadline_s"
                                   f" = {self.cfg.request_deadline_s:g} s") from None
            if flight.in_prefill:
                raise RequestError(f"request {flight.request_id}: no first token within "
                                   f"conductor.prefill_timeout_s = {timeout_s:g} s") from None
            raise LegFailed(f"decode instance {decode_id} sent no token of request {flight.request_id} for "
                            f"{timeout_s:g} s (conductor.token_timeout_s)", (decode_id,)) from None
        if isinstance(msg, (RequestError, LegFailed)):
            raise msg
        return msg

    def _on_prefill_done(self, flight: Flight, done: m.PrefillDone) -> tuple[list[int], str | None]:
        p = flight.placement
        flight.in_prefill = False
        for instance_id in p.stage_ids or (p.prefill_id,):
            self._let_go(flight, instance_id, cancel=False)  # it released the request itself
            if (instance := self.registry.get(instance_id)) is not None:
                instance.last_done_s = self.clock()
        leg = flight.legs[-1]
        leg.prefill_done_s, leg.fetch_s, leg.compute_s, leg.kv_transfer_s = (
            self.clock(), done.fetch_seconds, done.compute_seconds, done.kv_seconds)
        leg.queue_s = max(0.0, done.prefill_seconds - done.compute_seconds - done.fetch_seconds)
        n = flight.num_leg_tokens
        if flight.num_legs == 1:
            flight.num_cached_tokens = done.num_cached_tokens
            self.metrics.prompt_tokens.inc(n)
        self.metrics.cached_tokens.inc(done.num_cached_tokens)
        self.metrics.computed_tokens.labels(p.prefill_id).inc(done.num_computed_tokens)
        self.metrics.kv_bytes.labels(p.prefill_id).inc(done.kv_bytes)
        self.metrics.kv_seconds.labels(p.prefill_id).inc(done.kv_seconds)
        self.metrics.fetch_bytes.labels(p.prefill_id).inc(done.fetched_bytes)
        self.metrics.queue.observe(leg.queue_s)
        # NOTE: compute time, not receipt-to-hand-off: queueing is what T_queue adds on top. A CPP group's
        # time is a pipeline's, not one instance's: it does not fit the model.
        if not p.stage_ids:
            self.estimators.prefill_time.observe(n, done.num_cached_tokens, done.compute_seconds)
        if p.fetch_from and done.fetched_bytes:
            self.estimators.bandwidth.observe(p.fetch_from, p.prefill_id, done.fetched_bytes, done.fetch_seconds)
        remaining = flight.params.max_tokens - len(flight.generated)
        reason = done.finish_reason if done.finish_reason == "stop" or remaining == 1 else None
        return [done.first_token], reason

    def _event(self, flight: Flight, detok: IncrementalDetokenizer, token_ids: list[int],
               finish_reason: str | None, logprobs=None) -> StreamEvent:
        flight.generated += token_ids
        self.metrics.completion_tokens.inc(len(token_ids))
        text = detok.add(token_ids, final=finish_reason is not None)
        if detok.stopped:
            finish_reason = "stop"
        return StreamEvent(text, token_ids, finish_reason, logprobs)

    async def _migrate(self, flight: Flight, failure: LegFailed) -> None:
        """Move the request to other instances, resuming after the tokens already streamed; raises
        RequestError when it may not move again or has nowhere to go before its deadline."""
        if flight.num_migrations >= self.cfg.migration_limit:
            self.metrics.migrations.labels("limit").inc()
            raise RequestError(f"{failure}; request {flight.request_id} failed (it moved {flight.num_migrations} "
                               f"times; conductor.migration_limit = {self.cfg.migration_limit})")
        self._end_leg(flight, failure=str(failure))
        # NOTE: a role that is being restarted comes back within seconds; wait for it as long as a token may take.
        give_up_s = min(flight.deadline_s, self.clock() + self.cfg.token_timeout_s)
        avoid = failure.suspects
        while True:
            try:
                await self._start_leg(flight, admit=False, avoid=avoid)
                break
            except Unavailable as exc:
                if self.clock() + RETRY_PLACEMENT_S > give_up_s:
                    self.metrics.migrations.labels("no_instance").inc()
                    raise RequestError(f"{failure}; request {flight.request_id} could not move: {exc}") from None
            except LegFailed as exc:
                self._end_leg(flight)
                avoid += exc.suspects
            await asyncio.sleep(RETRY_PLACEMENT_S)
        self.metrics.migrations.labels("moved").inc()
        p = flight.placement
        log.warning("request %s: %s; moved to prefill %s and decode %s, resuming after %d tokens "
                    "(%d of the prompt's blocks reused)", flight.request_id, failure, p.prefill_id, p.decode_id,
                    len(flight.generated), p.reuse_blocks)

    def _end_leg(self, flight: Flight, failure: str = "") -> None:
        """Forget the current leg and tell whoever still holds it to free it."""
        self.flights.pop(flight.wire_id, None)
        if flight.legs and flight.legs[-1].ended_s is None:
            flight.legs[-1].ended_s, flight.legs[-1].failure = self.clock(), failure
        for instance_id in list(flight.holders):
            self._let_go(flight, instance_id, cancel=True)
        while not flight.inbox.empty():  # reports of the old leg
            flight.inbox.get_nowait()

    def _end(self, flight: Flight, outcome: str) -> None:
        """The request's one terminal state: count it, forget it, and free it wherever it is held."""
        if flight.ended:
            return
        flight.ended = True
        self._end_leg(flight)
        self.metrics.requests.labels(outcome).inc()
        self.timelines.record(flight, outcome, self.clock())
        if outcome == "ok":
            self.metrics.e2e.observe(self.clock() - flight.admitted_s)
            if flight.num_legs == 1 and flight.predicted_tbt_s > 0 and flight.gaps_s and (mean_gap := sum(flight.gaps_s) / len(flight.gaps_s)) > 0:
                self.metrics.tbt_prediction.observe(flight.predicted_tbt_s / mean_gap)
            self.metrics.slo.labels(str(self._within_slo(flight)).lower()).inc()

    def _hold(self, flight: Flight, instance_id: str) -> None:
        flight.holders.add(instance_id)
        self.registry.get(instance_id).request_ids.add(flight.wire_id)
        self.metrics.in_flight.labels(instance_id).inc()

    def _let_go(self, flight: Flight, instance_id: str, cancel: bool) -> None:
        if instance_id not in flight.holders:
            return
        flight.holders.discard(instance_id)
        self.metrics.in_flight.labels(instance_id).dec()
        instance = self.registry.get(instance_id)
        if instance is not None:
            instance.request_ids.discard(flight.wire_id)
        if cancel:
            # NOTE: until `Decode` claims them, the leg's blocks wait in decode's inbox: name them.
            is_unclaimed = instance_id == flight.placement.decode_id and not flight.is_decode_sent
            unclaimed = flight.block_hashes if is_unclaimed else []
            self._send_soon(instance_id, m.Cancel(request_id=flight.wire_id, block_hashes=unclaimed))

    def _send_soon(self, instance_id: str, msg) -> None:
        task = asyncio.ensure_future(self.control.send(instance_id, msg))
        self._sends.add(task)
        task.add_done_callback(self._sends.discard)

    def _within_slo(self, flight: Flight) -> bool:
        """TTFT within its SLO, and TBT as the paper measures it: the mean of the slowest 10% of gaps."""
        slowest = sorted(flight.gaps_s, reverse=True)[:max(1, len(flight.gaps_s) // 10)]
        tbt_s = sum(slowest) / len(slowest) if slowest else 0.0
        return flight.ttft_s <= self.cfg.ttft_slo_s and tbt_s <= self.cfg.tbt_slo_s

    # -- what the control plane hands over ------------------------------------------------------------

    def _route(self, msg, sender: str):
        """A report of a request from instance `sender`: into its flight's inbox if it holds the current
        leg; a report of a leg that is over is answered with `Cancel` so the instance frees it."""
        flight = self.flights.get(msg.request_id)
        if flight is None:
            if isinstance(msg, m.RequestFailed) or msg.finish_reason is not None:
                return None
            return m.Cancel(request_id=msg.request_id)
        p = flight.placement
        expected = {m.PrefillDone: p.prefill_id, m.Tokens: p.decode_id}.get(type(msg))
        if sender not in flight.holders or expected not in (None, sender):
            log.warning("ignored %s of request %s from %r, which does not hold it", msg.TAG, msg.request_id, sender)
            return None
        if isinstance(msg, m.RequestFailed):
            if msg.is_invalid:
                flight.inbox.put_nowait(RequestError(msg.error, is_invalid=True))
            else:
                role = self.registry.get(sender).role
                flight.inbox.put_nowait(LegFailed(f"{role} instance {sender}: {msg.error}", tuple(flight.holders)))
            return None
        flight.inbox.put_nowait(msg)
        return None

    def _on_dead(self, instance: Instance, why: str) -> None:
        """Every request with a leg on the instance moves on (its flight migrates or fails)."""
        for wire_id in list(instance.request_ids):
            if (flight := self.flights.get(wire_id)) is not None:
                flight.inbox.put_nowait(LegFailed(f"{instance.role} instance {instance.instance_id} {why}",
                                                  (instance.instance_id,)))
