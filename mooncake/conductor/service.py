"""The conductor role (DESIGN sections 3 and 13): the paper's global scheduler, off the token path.

An API process owns each request's stream and sends the conductor three messages per leg: `Place` (the
conductor places and admits the leg, decide.py, sends `Prefill` naming the API process's report address,
and answers `Placed`), `HandOff` (prefill's `PrefillDone` reached the API process: the conductor learns
from it and sends `Decode`) and `LegEnded` (it frees the leg wherever it is still held, and records the
request's outcome). Tokens go from the instances straight to the API process. When an instance dies, the
conductor tells each of its legs' API process (`LegLost`), which moves the request (a new leg on other
instances, resuming from the prompt and the tokens streamed). An API process that dies is an instance of
role "api": its legs are freed everywhere, unless it is back within `conductor.api_grace_s` (api_grace.py). The
control socket is control.py's, what its joins and deaths mean membership.py's; the pool's index feed is
pool_watch.py's."""

import asyncio
import collections
import logging
import time

from mooncake import messages as m
from mooncake.conductor.colocated import place_colocated
from mooncake.conductor.api_grace import ApiGrace
from mooncake.conductor.control import ControlPlane
from mooncake.conductor.cpp import CppSettings
from mooncake.conductor.decide import Decider, cluster_view
from mooncake.conductor.flight import Flight
from mooncake.conductor.instances import Instance, InstanceRegistry
from mooncake.conductor.leadership import Leadership
from mooncake.conductor.membership import Membership
from mooncake.conductor.metrics import ConductorMetrics
from mooncake.conductor.policies import Estimators
from mooncake.conductor.pool_watch import PoolWatcher
from mooncake.conductor.prefix_index import PrefixIndex
from mooncake.conductor.view import Placement, RequestView
from mooncake.config import MooncakeConfig
from mooncake.errors import InvalidRequestError, LegFailed, Rejected, Unavailable
from mooncake.kv_geometry import KVSpec, dtype_bytes
from mooncake.models import resolve_model
from mooncake.runtime import Supervisor
from mooncake.sampling import SamplingParams, WireSampling, wire_sampling

log = logging.getLogger(__name__)
ENDED_KEPT = 65536  # legs over lately whose request record may still come (their owners)

__all__ = ["Conductor"]


class Conductor(Membership):
    def __init__(self, config: MooncakeConfig, clock=time.monotonic):
        self.config = config
        self.cfg = config.conductor
        self.clock = clock
        self.name = "conductor"
        self.metrics = ConductorMetrics(config.api.model_name or config.engine.model)
        self.registry = InstanceRegistry(self.cfg.heartbeat_timeout_s)
        self.index = PrefixIndex()
        self.metrics.watch_index(self.index)
        self.estimators = Estimators.from_config(
            self.cfg, (self.cfg.prefill_c0_s, self.cfg.prefill_s_per_token, self.cfg.prefill_s_per_token2),
            (self.cfg.decode_step_s, self.cfg.decode_s_per_seq, self.cfg.decode_s_per_context_token),
            self.cfg.bandwidth_bytes_per_s)
        self.decider = Decider(self.cfg, self.index, self.estimators)
        self.control = ControlPlane(self.cfg, self.registry, self.index, self.estimators, self.metrics, clock,
                                    route=self._route, on_dead=self._on_dead, on_api=self._on_api,
                                    on_join=self._on_join, on_progress=self._on_progress)
        self.flights: dict[str, Flight] = {}  # by wire id
        # Legs over (or refused) lately, by wire id: their owners, whose record of the request may come after
        self.ended: collections.OrderedDict[str, str] = collections.OrderedDict()
        self.grace = ApiGrace(self.cfg.api_grace_s, lambda wire_id: self._end_leg(self.flights.get(wire_id)))
        self.model = None
        self.pool: PoolWatcher | None = None
        self.supervisor: Supervisor | None = None
        self.leadership: Leadership | None = None
        self._sends: set[asyncio.Task] = set()

    @property
    def fatal(self):
        return self.supervisor.fatal if self.supervisor else None

    # -- lifecycle ----------------------------------------------------------------------------------

    async def start(self) -> None:
        # NOTE: no tokenizer: the API processes tokenize and hash; the conductor reads the model's shape only.
        self.model = await asyncio.to_thread(resolve_model, self.config.engine.model)
        self.block_size = self.config.engine.block_size
        max_positions = self.model.config.get("max_position_embeddings", 2048)
        self.max_model_len = min(self.config.engine.max_model_len or max_positions, max_positions)
        kv_dtype = self.config.engine.kv_dtype
        self.block_bytes = KVSpec.from_model_config(self.model.config).block_bytes(self.block_size, kv_dtype)
        hidden = self.model.config.get("hidden_size")  # an emulated model may not say: the default then
        self.decider.policy.cpp = CppSettings.from_config(self.cfg, hidden * dtype_bytes(kv_dtype) if hidden else None)
        self.supervisor = Supervisor(self.name)
        if self.cfg.etcd_endpoints:
            self.leadership = Leadership(self.cfg.etcd_endpoints, self.cfg.etcd_key, self.cfg.leader_ttl_s,
                                         self.cfg.control_address)
            self.supervisor.spawn(self._lead(), "the leadership (etcd)")
        else:
            await self._serve()

    async def _lead(self) -> None:
        """A standby until etcd says this conductor leads; then serve until it cannot renew its lease."""
        await self.leadership.acquire()
        await self._serve()
        await self.leadership.keep()  # NOTE: raises when the lease was not renewed in time: the process ends

    async def _serve(self) -> None:
        await self.control.start(self.supervisor, self.model.model_id, self.block_size, self.config.engine.kv_dtype)
        self.pool = PoolWatcher(self.config.cache_client.nodes, self.index, self.config.cache_client.timeout_s,
                                on_stats=self.metrics.record_cache_stats)
        self.pool.start(self.supervisor)
        log.info("conductor ready: model %s (%s), control %s, placement %s, admission %s%s",
                 self.config.engine.model, self.model.model_id, self.cfg.control_address, self.cfg.placement,
                 self.cfg.admission, f", CPP groups of {self.cfg.cpp_stages} for prompts over "
                 f"{self.cfg.cpp_threshold_tokens} tokens" if self.decider.policy.cpp else "")

    async def stop(self) -> None:
        self.grace.close()
        if self.supervisor is not None:
            await self.supervisor.stop()
        if self._sends:
            await asyncio.wait(list(self._sends), timeout=1.0)
        if self.pool is not None:
            await self.pool.stop()
        await self.control.stop()
        if self.leadership is not None:
            await self.leadership.close()  # NOTE: after the socket closed: a standby may listen at once

    def health(self) -> dict:
        return {role: [i.instance_id for i in self.registry.alive(role)] for role in ("prefill", "decode")} | {
            "cache": sorted(self.pool.node_ids.values()) if self.pool else [], "mode": self.cfg.mode}

    # -- the request path ---------------------------------------------------------------------------

    # -- what the API processes ask ------------------------------------------------------------------

    def _on_api(self, msg, sender: str):
        """A message from API process `sender`; returns the reply, if it has one at once."""
        if isinstance(msg, m.Place):
            self._spawn(self._place(msg, sender))
        elif isinstance(msg, m.HandOff):
            self._spawn(self._hand_off(msg, sender))
        elif isinstance(msg, m.LegEnded):
            self._leg_ended(msg, sender)
        elif isinstance(msg, m.Cluster):
            return m.ClusterReply(health=self.health(), metrics=self.metrics.exposition().decode())
        return None

    async def _place(self, msg: m.Place, owner: str) -> None:
        """Place and admit a leg and send it to prefill; the API process hears where, or why not."""
        placed = await self._placement(msg, owner)
        if placed.refusal:
            self._ended(msg.request_id, owner)
        if not await self.control.send(owner, placed) and not placed.refusal:
            self._end_leg(self.flights.get(msg.request_id))  # NOTE: its owner is gone: nobody streams it

    async def _placement(self, msg: m.Place, owner: str) -> m.Placed:
        rid = msg.request_id
        try:
            params = msg.sampling.params()
        except (InvalidRequestError, TypeError) as exc:
            return m.Placed(request_id=rid, refusal="invalid", error=str(exc))
        if rid in self.flights or len(msg.block_hashes) != len(msg.token_ids) // self.block_size:
            return m.Placed(request_id=rid, refusal="invalid", error="a leg already placed, or its block hashes "
                                                                      "do not match its tokens")
        flight = Flight(rid, list(msg.token_ids), params, owner, msg.reply_to, list(msg.block_hashes))
        try:
            await self._start_leg(flight, msg.admit, tuple(msg.avoid), msg.deadline_s)
        except Rejected as exc:
            self.metrics.rejections.labels(exc.reason).inc()
            log.info("rejected %s: %s", rid, exc)
            return m.Placed(request_id=rid, refusal="rejected", reason=exc.reason, error=str(exc),
                            retry_after_s=exc.retry_after_s)
        except Unavailable as exc:  # no instance to place it on: refused before anything of it was counted
            return m.Placed(request_id=rid, refusal="unavailable", error=str(exc))
        except LegFailed as exc:  # an instance died and the liveness watch has not seen it yet
            self._end_leg(flight)
            return m.Placed(request_id=rid, refusal="unreachable", error=str(exc), suspects=list(exc.suspects))
        except Exception:  # a bug: nothing of the leg may stay counted
            log.exception("placing %s failed", rid)
            self._end_leg(flight)
            return m.Placed(request_id=rid, refusal="error", error="internal error; see the conductor's log")
        if msg.moved_from:
            self.metrics.migrations.labels("moved").inc()
        p = flight.placement
        return m.Placed(request_id=rid, prefill_ids=[i for i in p.stage_ids or (p.prefill_id,) if i],
                        decode_id=p.decode_id,
                        reuse_blocks=p.reuse_blocks, predicted_ttft_s=p.ttft_s, predicted_tbt_s=p.tbt_s)

    async def _start_leg(self, flight: Flight, admit: bool, avoid: tuple[str, ...], time_left_s: float) -> None:
        """Place the leg (its prompt: the request's and every token streamed so far) and send `Prefill`."""
        now = self.clock()
        tokens, hashes = flight.prompt_token_ids, flight.block_hashes
        remaining = flight.params.max_tokens
        if self.cfg.mode == "colocated":
            return await self._start_colocated_leg(flight, now, avoid)
        # NOTE: a prompt whose logprobs are wanted is computed whole, on one instance (no reuse, no CPP)
        whole = flight.params.prompt_logprobs is not None
        view = RequestView(flight.request_id, len(tokens), () if whole else tuple(hashes), remaining, now)
        pool_nodes = self.pool.live_ids if self.pool is not None else frozenset()
        cpp = self.decider.policy.cpp
        stages = cpp.stages if cpp is not None and len(tokens) > cpp.threshold_tokens and not whole else 1
        cluster = cluster_view(self.registry, self.flights, self.block_size, self.block_bytes, pool_nodes, now,
                               avoid, group_stages=stages, idle_step_s=self.estimators.decode_step.predict(1, 0),
                               output_lengths=self.estimators.output_length)
        p = self.decider.decide(view, cluster, now, admit)
        # NOTE: all or nothing: the leg's messages are built (and encoded) before anything of it is counted,
        # so a leg that cannot be sent leaves no load behind.
        decode = self.registry.get(p.decode_id)
        ships_kv = remaining > 1  # a request that ends with its first token never reaches decode
        sends = self._prefill_sends(flight, p, decode, ships_kv, time_left_s)
        self._new_leg(flight, p, now)
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

    def _prefill_sends(self, flight: Flight, p: Placement, decode: Instance, ships_kv: bool,
                       time_left_s: float) -> list[tuple[str, object, bytes]]:
        """(instance id, message, its encoding) of a leg's prefill: one `Prefill`, or for a CPP leg a
        `PrefillStage` to every instance of the group, each told where the next stage is."""
        tokens, hashes, wire_id = flight.prompt_token_ids, flight.block_hashes, flight.request_id
        sampling = _wire(flight.params)  # NOTE: prefill samples the first token only, whatever max_tokens says
        deadline_s = max(0.01, min(self.cfg.prefill_timeout_s, time_left_s))
        decode_address = decode.data_address if ships_kv else ""
        if not p.stage_ids:
            msgs = [(p.prefill_id, m.Prefill(
                request_id=wire_id, token_ids=tokens, block_hashes=hashes, sampling=sampling,
                decode_id=decode.instance_id, decode_transport=decode.transport, decode_address=decode_address,
                reuse_blocks=p.reuse_blocks, deadline_s=deadline_s, reply_to=flight.reply_to))]
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
                deadline_s=deadline_s, reuse_blocks=p.reuse_blocks, reply_to=flight.reply_to))
                for k, instance_id in enumerate(p.stage_ids)]
        return [(instance_id, msg, m.encode(msg)) for instance_id, msg in msgs]

    async def _start_colocated_leg(self, flight: Flight, now: float, avoid: tuple[str, ...]) -> None:
        """The colocated baseline: the whole request to one instance, which prefills and decodes it."""
        p = place_colocated(self.registry, self.flights, avoid)
        msg = m.Decode(request_id=flight.request_id, token_ids=flight.prompt_token_ids, block_hashes=[],
                       sampling=_wire(flight.params), reply_to=flight.reply_to)
        frame = m.encode(msg)  # NOTE: before the leg is counted, as _start_leg's
        self._new_leg(flight, p, now)
        flight.block_hashes, flight.is_decode_sent = [], True
        self._hold(flight, p.decode_id)
        if not await self.control.send(p.decode_id, msg, frame):
            raise LegFailed(f"instance {p.decode_id} is unreachable", (p.decode_id,))

    def _new_leg(self, flight: Flight, p: Placement, now: float) -> None:
        flight.placement, flight.in_prefill = p, True
        self.flights[flight.request_id] = flight
        flight.placed_s = now
        if (owner := self.registry.get(flight.owner)) is not None:
            owner.request_ids.add(flight.request_id)  # NOTE: if the owner dies, its legs are freed

    async def _hand_off(self, msg: m.HandOff, owner: str) -> None:
        """Prefill's `PrefillDone` of a leg, from the API process it reached: learn from it and send `Decode`."""
        done = msg.done
        flight = self.flights.get(done.request_id)
        if flight is not None and flight.owner != owner:
            log.warning("ignored the hand-off of %s from %r, which does not own it", done.request_id, owner)
            return
        if flight is not None and flight.is_handed_off:  # NOTE: sent again by an API process back from silence
            return
        if flight is None:  # NOTE: placed by a conductor before this one (it restarted): adopt the leg
            if not msg.go_on or (decode := self.registry.get(msg.decode_id)) is None or not decode.is_alive:
                if msg.go_on:
                    await self.control.send(owner, m.LegLost(request_id=done.request_id, suspects=[msg.decode_id],
                                                             error=f"decode instance {msg.decode_id} is not in the "
                                                                   f"cluster"))
                return
            try:
                params = msg.sampling.params()
            except (InvalidRequestError, TypeError):
                return
            flight = Flight(done.request_id, list(msg.token_ids[:-1]), params, owner, msg.reply_to,
                            list(msg.block_hashes))
            self._new_leg(flight, Placement("", msg.decode_id, 0, None, 0.0, 0.0), self.clock())
            self._hold(flight, msg.decode_id)
        else:
            self._on_prefill_done(flight, done)
        flight.in_prefill = False
        if not msg.go_on:
            return  # NOTE: LegEnded follows; it frees the KV waiting in decode's inbox
        decode_id = flight.placement.decode_id
        flight.is_decode_sent = flight.is_handed_off = True
        # NOTE: a CPP group's blocks reach the pool through decode, the first instance to hold them whole.
        if not await self.control.send(decode_id, m.Decode(
                request_id=flight.request_id, token_ids=list(msg.token_ids), block_hashes=list(msg.block_hashes),
                sampling=msg.sampling, pool_first_block=msg.pool_first_block, reply_to=msg.reply_to)):
            await self.control.send(owner, m.LegLost(request_id=flight.request_id, suspects=[decode_id],
                                                     error=f"decode instance {decode_id} is unreachable"))

    def _on_prefill_done(self, flight: Flight, done: m.PrefillDone) -> None:
        p = flight.placement
        for instance_id in p.stage_ids or (p.prefill_id,):
            self._let_go(flight, instance_id, cancel=False)  # it released the request itself
            if (instance := self.registry.get(instance_id)) is not None:
                instance.last_done_s = self.clock()
        queue_s = max(0.0, done.prefill_seconds - done.compute_seconds - done.fetch_seconds)
        self.metrics.cached_tokens.inc(done.num_cached_tokens)
        self.metrics.computed_tokens.labels(p.prefill_id).inc(done.num_computed_tokens)
        self.metrics.kv_bytes.labels(p.prefill_id).inc(done.kv_bytes)
        self.metrics.kv_seconds.labels(p.prefill_id).inc(done.kv_seconds)
        self.metrics.fetch_bytes.labels(p.prefill_id).inc(done.fetched_bytes)
        self.metrics.queue.observe(queue_s)
        # NOTE: compute time, not receipt-to-hand-off: queueing is what T_queue adds on top. A CPP group's
        # time is a pipeline's, not one instance's: it does not fit the model.
        if not p.stage_ids:
            self.estimators.prefill_time.observe(len(flight.prompt_token_ids), done.num_cached_tokens,
                                                 done.compute_seconds)
        if p.fetch_from and done.fetched_bytes:
            self.estimators.bandwidth.observe(p.fetch_from, p.prefill_id, done.fetched_bytes, done.fetch_seconds)

    def _leg_ended(self, msg: m.LegEnded, owner: str) -> None:
        flight = self.flights.get(msg.request_id)
        if flight is None:  # NOTE: placed by a conductor before this one: free it where its owner says it may be
            for instance_id in msg.holders:
                self._send_soon(instance_id, m.Cancel(request_id=msg.request_id, block_hashes=list(msg.block_hashes)))
        elif flight.owner == owner:
            if msg.is_finished:
                self._let_go(flight, flight.placement.decode_id, cancel=False)  # it freed the request
            self._end_leg(flight)
        # NOTE: a request's record counts once, and only from the API process its leg was placed for
        if not msg.outcome or self.ended.get(msg.request_id) != owner:
            if msg.outcome:
                log.warning("ignored the record of request %s from %s: not a leg placed for it", msg.request_id,
                            owner)
            return
        del self.ended[msg.request_id]
        if msg.migration:  # the request could not move (it is over: `outcome` says so)
            self.metrics.migrations.labels(msg.migration).inc()
        self.metrics.record_request(msg)
        if msg.outcome == "ok":
            self.estimators.output_length.observe(msg.num_completion_tokens)
            within = msg.ttft_s <= self.cfg.ttft_slo_s and msg.slow_gap_s <= self.cfg.tbt_slo_s
            self.metrics.slo.labels(str(within).lower()).inc()

    def _end_leg(self, flight: Flight | None) -> None:
        """Forget the leg and tell whoever still holds it to free it."""
        if flight is None or self.flights.get(flight.request_id) is not flight:
            return
        del self.flights[flight.request_id]
        self._ended(flight.request_id, flight.owner)
        if (owner := self.registry.get(flight.owner)) is not None:
            owner.request_ids.discard(flight.request_id)
        for instance_id in list(flight.holders):
            self._let_go(flight, instance_id, cancel=True)

    def _ended(self, request_id: str, owner: str) -> None:
        self.ended[request_id] = owner
        while len(self.ended) > ENDED_KEPT:
            self.ended.popitem(last=False)

    def _hold(self, flight: Flight, instance_id: str) -> None:
        flight.holders.add(instance_id)
        if (instance := self.registry.get(instance_id)) is not None:
            instance.request_ids.add(flight.request_id)
        self.metrics.in_flight.labels(instance_id).inc()

    def _let_go(self, flight: Flight, instance_id: str, cancel: bool) -> None:
        if instance_id not in flight.holders:
            return
        flight.holders.discard(instance_id)
        self.metrics.in_flight.labels(instance_id).dec()
        instance = self.registry.get(instance_id)
        if instance is not None:
            instance.request_ids.discard(flight.request_id)
        if cancel:
            # NOTE: until `Decode` claims them, the leg's blocks wait in decode's inbox: name them.
            is_unclaimed = instance_id == flight.placement.decode_id and not flight.is_decode_sent
            unclaimed = flight.block_hashes if is_unclaimed else []
            self._send_soon(instance_id, m.Cancel(request_id=flight.request_id, block_hashes=unclaimed))

    def _send_soon(self, instance_id: str, msg) -> None:
        self._spawn(self.control.send(instance_id, msg))

    def _spawn(self, coro) -> None:
        task = asyncio.ensure_future(coro)
        self._sends.add(task)
        task.add_done_callback(self._sends.discard)


def _wire(params: SamplingParams) -> WireSampling:
    return wire_sampling(params, max_tokens=params.max_tokens, resumed=params.grammar_done)
