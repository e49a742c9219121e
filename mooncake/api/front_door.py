"""The request path of an API process (DESIGN section 13), from admission to the one terminal state.

For each request: hash the prompt's blocks, ask the conductor to place it (`Place`; it sends `Prefill`
naming this process's report address), wait for `PrefillDone` (the first token; the KV is then in decode's
inbox), hand the leg off (`HandOff`; the conductor sends `Decode`), and stream the `Tokens` decode sends
here. Every wait has a deadline. When an instance of the request dies, hangs or fails it, the request
migrates: a new leg resumes from the prompt plus the tokens already streamed, on other instances, reusing
the prompt's KV where the pool or a prefill instance's cache holds it, and the client's stream goes on.
Whatever way a request ends, the conductor hears that its leg ended (`LegEnded`) and every instance that
held it is told to let it go.

The conductor may be away (restarting, or failing over): running streams do not need it. A new request
waits for it up to `api.conductor_wait_s`, then gets 503 with Retry-After; a hand-off waits for it and is
sent again to the conductor that comes back."""

import asyncio
import logging
import time
import uuid

import msgspec

from mooncake import messages as m
from mooncake.addresses import advertise_host
from mooncake.api.endings import Endings
from mooncake.api.flight import Flight, Leg, StreamEvent
from mooncake.api.inbound import Inbound
from mooncake.api.metrics import ApiMetrics
from mooncake.api.reports import ReportInbox
from mooncake.api.timeline import Timelines
from mooncake.config import MooncakeConfig
from mooncake.errors import LegFailed, Rejected, RequestError, Unavailable
from mooncake.hashing import hash_blocks, make_namespace
from mooncake.link import ConductorLink
from mooncake.models import resolve_model
from mooncake.runtime import Supervisor
from mooncake.sampling import SamplingParams, wire_sampling
from mooncake.text import IncrementalDetokenizer
from mooncake.tokenizer import LightTokenizer

log = logging.getLogger(__name__)

SUBMIT_TRIES = 3  # placements tried for a new request whose instance turns out to be unreachable
RETRY_PLACEMENT_S = 0.25  # a migrating request with no instance to go to looks again this often
RESEND_S = 0.5  # a Place with no answer is sent again this often while the conductor re-registers us


class FrontDoor(Inbound, Endings):
    def __init__(self, config: MooncakeConfig, clock=time.monotonic, role: str = "api"):
        self.config = config
        self.cfg = config.conductor  # the request's deadlines and migration limit are the cluster's
        self.api = config.api
        self.clock = clock
        self.role = role  # the key this process connects with (a test runs the conductor beside it)
        self.api_id = f"api-{uuid.uuid4().hex[:12]}"
        self.name = f"API process {self.api_id}"
        self.metrics = ApiMetrics(self.api_id, lambda: len({id(f) for f in self.streams.values()}))
        self.streams: dict[str, Flight] = {}  # by the wire id of their current leg
        self.is_stopping = False  # a clean stop: no request starts or moves any more
        self.pending: dict[str, asyncio.Future] = {}  # Place awaiting Placed, by wire id
        self.timelines = Timelines(self.cfg.otlp_endpoint, clock=clock)
        self.model = None
        self.tokenizer = None
        self.supervisor: Supervisor | None = None
        self.link: ConductorLink | None = None
        self.inbox: ReportInbox | None = None
        self._cluster_wait: asyncio.Future | None = None
        self._cluster_sent = 0  # the registration the pending query was sent under

    @property
    def fatal(self):
        return self.supervisor.fatal if self.supervisor else None

    # -- lifecycle ----------------------------------------------------------------------------------

    async def start(self) -> None:
        self.model = await asyncio.to_thread(resolve_model, self.config.engine.model)
        # NOTE: not transformers' AutoTokenizer, which imports torch: an API process runs no model.
        self.tokenizer = await asyncio.to_thread(LightTokenizer, self.model.path)
        engine = self.config.engine
        self.block_size = engine.block_size
        self.namespace = make_namespace(self.model.model_id, self.block_size, engine.kv_dtype)
        max_positions = self.model.config.get("max_position_embeddings", 2048)
        self.max_model_len = min(engine.max_model_len or max_positions, max_positions)
        self.supervisor = Supervisor(self.name)
        host = advertise_host(self.config)
        self.inbox = ReportInbox(self.api.report_address or f"tcp://{host}:0", host, self._route)
        report_address = await self.inbox.start(self.supervisor)
        self.register_msg = m.Register(instance_id=self.api_id, role="api", model_id=self.model.model_id,
                                       block_size=self.block_size, kv_dtype=engine.kv_dtype,
                                       data_address=report_address)
        self.link = ConductorLink(self.config.instance.conductor_address, self.register_msg, self._heartbeat,
                                  self._on_conductor, self.supervisor, on_registered=self._on_registered,
                                  role=self.role, registration=self._registration)
        await self.link.start()
        log.info("%s ready: model %s, conductor %s, reports at %s", self.name, engine.model,
                 self.config.instance.conductor_address, report_address)

    def end_streams(self) -> None:
        """Every running stream ends now with an error event (a clean stop of this process)."""
        self.is_stopping = True
        for flight in list(self.streams.values()):
            flight.inbox.put_nowait(RequestError(f"request {flight.request_id}: the API process is shutting down; "
                                                 f"retry"))
        for wire_id, answer in self.pending.items():  # NOTE: a request still being placed is refused (503)
            if not answer.done():
                answer.set_result(m.Placed(request_id=wire_id, refusal="unavailable",
                                           error="the API process is shutting down; retry"))

    async def drained(self, timeout_s: float) -> None:
        """Until every stream has ended (after end_streams), or `timeout_s`."""
        deadline = self.clock() + timeout_s
        while self.streams and self.clock() < deadline:
            await asyncio.sleep(0.02)

    async def stop(self) -> None:
        self.end_streams()
        if self.link is not None:
            await self.link.stop()
        if self.inbox is not None:
            await self.inbox.stop()
        if self.supervisor is not None:
            await self.supervisor.stop()
        self.timelines.shutdown()

    def _heartbeat(self) -> m.Heartbeat:
        return m.Heartbeat(instance_id=self.api_id)

    def _registration(self) -> m.Register:
        """Who we are, and (for a conductor that restarted) the legs we hold and where."""
        legs = [m.HeldLeg(f.wire_id, f.placement.decode_id, f.num_leg_tokens, f.params.max_tokens - len(f.generated),
                          list(f.placement.prefill_ids) if f.in_prefill else [],
                          f.block_hashes if f.in_prefill else [])
                for f in self.streams.values() if f.placement is not None]
        return m.Register(**{**{k: getattr(self.register_msg, k) for k in self.register_msg.__struct_fields__},
                             "legs": legs})

    def _on_registered(self) -> None:
        """A conductor knows us (again): a hand-off it may have missed is sent again."""
        if self.link.num_registrations > 1:
            log.info("%s: registered with the conductor again (%d streams running)", self.name, len(self.streams))
            for flight in self.streams.values():
                if flight.handed_off is not None:
                    asyncio.ensure_future(self.link.send(flight.handed_off))

    async def cluster(self) -> m.ClusterReply:
        """The conductor's view for /health and /metrics (callers at the same time share one answer); raises
        Unavailable without a conductor."""
        if not self.link.registered.is_set():
            raise Unavailable("no conductor answers (it may be restarting)", retry_after_s=self.api.conductor_wait_s)
        # NOTE: a query sent to a conductor that has gone since is asked again of the one that registered us
        if self._cluster_wait is None or self._cluster_wait.done() or self._cluster_sent != self.link.num_registrations:
            self._cluster_wait = asyncio.get_running_loop().create_future()
            self._cluster_sent = self.link.num_registrations
            if not await self.link.send(m.Cluster()):
                self._cluster_wait = None
                raise Unavailable("no conductor is connected (it may be restarting)",
                                  retry_after_s=self.api.conductor_wait_s)
        answer = self._cluster_wait
        try:
            return await asyncio.wait_for(asyncio.shield(answer), self.api.conductor_wait_s)
        except asyncio.TimeoutError:
            if self._cluster_wait is answer:
                self._cluster_wait = None
            raise Unavailable("the conductor did not answer", retry_after_s=self.api.conductor_wait_s) from None

    # -- the request path ---------------------------------------------------------------------------

    async def submit(self, prompt_token_ids: list[int], params: SamplingParams) -> Flight:
        """Have the request placed and sent to prefill; raises Unavailable, Rejected or RequestError (is_invalid).
        The caller then owns it: it must `stream` it to its end or `abandon` it."""
        now = self.clock()
        flight = Flight(uuid.uuid4().hex, list(prompt_token_ids), params, admitted_s=now,
                        deadline_s=now + self.cfg.request_deadline_s)
        avoid: tuple[str, ...] = ()
        try:
            for _ in range(SUBMIT_TRIES):
                placed = await self._place(flight, admit=True, avoid=avoid)
                if not placed.refusal:
                    return flight
                if placed.refusal == "rejected":
                    raise Rejected(placed.reason, placed.error, placed.retry_after_s)
                if placed.refusal == "unavailable":
                    raise Unavailable(placed.error)
                if placed.refusal != "unreachable":
                    raise RequestError(placed.error, is_invalid=placed.refusal == "invalid")
                avoid += tuple(placed.suspects)  # an instance died and the liveness watch has not seen it yet
            raise Unavailable(f"{placed.error}; retry")
        except BaseException as exc:  # NOTE: a refusal, a bug or a cancelled client: nothing of it may stay behind
            self._end(flight, "error", counted=not isinstance(exc, (Rejected, Unavailable)))
            raise

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

    async def _place(self, flight: Flight, admit: bool, avoid: tuple[str, ...], moved_from: str = "") -> m.Placed:
        """Ask the conductor to place the request's next leg (its prompt and every token streamed so far);
        raises Unavailable when no conductor answers within api.conductor_wait_s."""
        if self.is_stopping:
            return m.Placed(request_id=flight.wire_id, refusal="unavailable",
                            error="the API process is shutting down; retry")
        flight.num_wire_ids += 1
        n = flight.num_wire_ids
        wire_id = flight.request_id if n == 1 else f"{flight.request_id}.{n - 1}"
        tokens = flight.leg_token_ids
        flight.wire_id, flight.placement, flight.in_prefill, flight.handed_off = wire_id, None, True, None
        flight.is_finished = False
        flight.block_hashes = hash_blocks(tokens, self.block_size, self.namespace, flight.params.prefix_root)
        self.streams[wire_id] = flight
        remaining = flight.params.max_tokens - len(flight.generated)
        place = m.Place(request_id=wire_id, token_ids=tokens, block_hashes=flight.block_hashes,
                        sampling=wire_sampling(flight.params, remaining, len(flight.generated)), admit=admit,
                        avoid=list(avoid),
                        deadline_s=max(0.01, flight.deadline_s - self.clock()), reply_to=self.inbox.address,
                        moved_from=moved_from)
        answer = self.pending[wire_id] = asyncio.get_running_loop().create_future()
        give_up_s = self.clock() + self.api.conductor_wait_s
        sent_to = 0  # the registration it was sent under
        try:
            while not answer.done():
                left_s = give_up_s - self.clock()
                if left_s <= 0:
                    break
                if not self.link.registered.is_set():
                    await _first(answer, self.link.registered.wait(), left_s)
                    continue
                # NOTE: sent again to a conductor that registered us since: the one before may have lost it
                if self.link.num_registrations != sent_to and await self.link.send(place):
                    sent_to = self.link.num_registrations
                await asyncio.wait([answer], timeout=min(RESEND_S, max(0.0, give_up_s - self.clock())))
        finally:
            self.pending.pop(wire_id, None)
        if not answer.done():
            self.streams.pop(wire_id, None)
            await self.link.send(m.LegEnded(request_id=wire_id))  # NOTE: in case it placed it after all
            raise Unavailable(f"no conductor answered within api.conductor_wait_s = {self.api.conductor_wait_s:g} s "
                              f"(it may be restarting); retry", retry_after_s=self.api.conductor_wait_s)
        placed = answer.result()
        if placed.refusal:
            self.streams.pop(wire_id, None)
            return placed
        flight.placement = placed
        flight.num_legs += 1
        if flight.num_legs == 1:
            flight.predicted_ttft_s, flight.predicted_tbt_s = placed.predicted_ttft_s, placed.predicted_tbt_s
        flight.legs.append(Leg(wire_id, placed.prefill_ids[-1] if placed.prefill_ids else "", placed.decode_id,
                               placed.reuse_blocks, self.clock()))
        return placed

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
                    flight.in_prefill, flight.handed_off = False, None  # colocated: its first report is a token
                    if flight.legs[-1].first_decode_token_s is None:
                        flight.legs[-1].first_decode_token_s = self.clock()
                    flight.is_finished = reason is not None
            except LegFailed as exc:
                await self._migrate(flight, exc)
                continue
            now = self.clock()
            flight.token_times_s.append(now)
            if last is None:
                flight.ttft_s = now - started
            else:
                flight.gaps_s.append(now - last)
            last = now
            event = self._event(flight, detok, token_ids, reason, logprobs, msg.prompt_logprobs)
            if isinstance(msg, m.PrefillDone):
                await self._hand_off(flight, msg, go_on=event.finish_reason is None)
            yield event
            if event.finish_reason is not None:
                return

    async def _hand_off(self, flight: Flight, done: m.PrefillDone, go_on: bool) -> None:
        """Tell the conductor the leg's prefill is done; with `go_on` it sends `Decode`."""
        p = flight.placement
        remaining = flight.params.max_tokens - len(flight.generated)
        hand_off = m.HandOff(done=msgspec.structs.replace(done, prompt_logprobs=None), decode_id=p.decode_id,
                             token_ids=flight.leg_token_ids, block_hashes=flight.block_hashes, go_on=go_on,
                             reply_to=self.inbox.address,
                             sampling=wire_sampling(flight.params, remaining, len(flight.generated)),
                             pool_first_block=p.reuse_blocks if len(p.prefill_ids) > 1 else None)
        # NOTE: the token is already counted in leg_token_ids (generated): decode continues after it
        flight.handed_off = hand_off if go_on else None
        await self.link.send(hand_off)

    async def _next(self, flight: Flight):
        """The next report of the current leg: PrefillDone or Tokens. Raises LegFailed when the leg cannot
        go on and RequestError when the request cannot."""
        if not flight.inbox.empty():  # NOTE: the common case under load: no timer to arm (a token's cost)
            msg = flight.inbox.get_nowait()
            if isinstance(msg, (RequestError, LegFailed)):
                raise msg
            return msg
        decode_id = flight.placement.decode_id
        timeout_s = self.cfg.prefill_timeout_s if flight.in_prefill else self.cfg.token_timeout_s
        time_left_s = flight.deadline_s - self.clock()
        try:
            async with asyncio.timeout(max(0.0, min(timeout_s, time_left_s))):
                msg = await flight.inbox.get()
        except TimeoutError:
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
        flight.in_prefill = False
        leg = flight.legs[-1]
        leg.prefill_done_s, leg.fetch_s, leg.compute_s, leg.kv_transfer_s = (
            self.clock(), done.fetch_seconds, done.compute_seconds, done.kv_seconds)
        leg.queue_s = max(0.0, done.prefill_seconds - done.compute_seconds - done.fetch_seconds)
        if flight.num_legs == 1:
            flight.num_cached_tokens = done.num_cached_tokens
        remaining = flight.params.max_tokens - len(flight.generated)
        reason = done.finish_reason if done.finish_reason == "stop" or remaining == 1 else None
        return [done.first_token], reason

    def _event(self, flight: Flight, detok: IncrementalDetokenizer, token_ids: list[int],
               finish_reason: str | None, logprobs=None, prompt_logprobs=None) -> StreamEvent:
        flight.generated += token_ids
        self.metrics.tokens.inc(len(token_ids))
        text = detok.add(token_ids, final=finish_reason is not None)
        if detok.stopped:
            finish_reason = "stop"
        return StreamEvent(text, token_ids, finish_reason, logprobs, prompt_logprobs)

    async def _migrate(self, flight: Flight, failure: LegFailed) -> None:
        """Move the request to other instances, resuming after the tokens already streamed; raises
        RequestError when it may not move again or has nowhere to go before its deadline."""
        if flight.num_migrations >= self.cfg.migration_limit:
            flight.migration = "limit"
            raise RequestError(f"{failure}; request {flight.request_id} failed (it moved {flight.num_migrations} "
                               f"times; conductor.migration_limit = {self.cfg.migration_limit})")
        old = flight.wire_id
        self._end_leg(flight, failure=str(failure))
        # NOTE: a role that is being restarted comes back within seconds; wait for it as long as a token may take.
        give_up_s = min(flight.deadline_s, self.clock() + self.cfg.token_timeout_s)
        avoid = failure.suspects
        while True:
            try:
                placed = await self._place(flight, admit=False, avoid=avoid, moved_from=old)
            except Unavailable as exc:  # no conductor answered: it may be back in a moment
                placed = m.Placed(request_id=flight.wire_id, refusal="unavailable", error=str(exc))
            if not placed.refusal:
                break
            if self.is_stopping:
                raise RequestError(f"{failure}; request {flight.request_id} could not move: the API process is "
                                   f"shutting down; retry")
            if placed.refusal == "unreachable":
                avoid += tuple(placed.suspects)
            elif placed.refusal != "unavailable":
                raise RequestError(f"{failure}; request {flight.request_id} could not move: {placed.error}")
            if self.clock() + RETRY_PLACEMENT_S > give_up_s:
                flight.migration = "no_instance"
                raise RequestError(f"{failure}; request {flight.request_id} could not move: {placed.error}")
            await asyncio.sleep(RETRY_PLACEMENT_S)
        log.warning("request %s: %s; moved to prefill %s and decode %s, resuming after %d tokens "
                    "(%d of the prompt's blocks reused)", flight.request_id, failure, ",".join(placed.prefill_ids),
                    placed.decode_id, len(flight.generated), placed.reuse_blocks)

    def _send_soon(self, msg) -> None:
        if self.link is not None:
            asyncio.ensure_future(self.link.send(msg))


async def _first(future: asyncio.Future, coro, timeout_s: float) -> None:
    """Until `future` is done, `coro` ends, or `timeout_s` passes."""
    other = asyncio.ensure_future(coro)
    try:
        await asyncio.wait([future, other], timeout=timeout_s, return_when=asyncio.FIRST_COMPLETED)
    finally:
        other.cancel()
