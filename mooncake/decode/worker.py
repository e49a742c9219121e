"""A decode instance (`mooncake serve --role decode`).

Its transport serves a KV inbox that prefill instances push blocks into. A `Decode` from the conductor
claims the request's blocks, imports them into the paged cache (a block missing or failing verification
is recomputed, never trusted; the bytes are checked and copied on the engine loop's KV thread while
running requests keep stepping) and joins continuous batching; every step's tokens go straight to the API
process that owns each request (its `reply_to`), in one `StepTokens` per API process (a `Tokens` per
request). `Cancel` aborts the request and frees its blocks. Its heartbeat says how far each request got,
so the conductor's load view stays exact without seeing a token.

A CPP group's blocks reach decode by layer from its stages, each of which holds only its layers: decode is
the first instance to hold them whole, so it writes them to the cache pool (`Decode.pool_first_block`) once
imported, as a prefill instance writes the blocks it computes."""

import asyncio
import logging

from mooncake import messages as m
from mooncake.decode.inbox import KVInbox, inbox_ttl_s
from mooncake.errors import InvalidRequestError, KVPayloadError, MooncakeError
from mooncake.instance.pool import PoolAccess
from mooncake.instance.worker import Worker
from mooncake.kv_payload import KVPayload, wire_blocks
from mooncake.transfer.contract import make_transport

log = logging.getLogger(__name__)


class DecodeWorker(Worker):
    role = "decode"

    def __init__(self, config):
        super().__init__(config)
        self.inbox = KVInbox(inbox_ttl_s(config), config.instance.kv_inbox_bytes)
        self._expiry: asyncio.Task | None = None
        self._admissions: dict[str, asyncio.Task] = {}  # request id -> its admission, while it runs
        self._held: set[str] = set()  # requests whose Decode came, until they finish, fail or are dropped
        self.pool = PoolAccess(self.name, config)

    async def start_role(self) -> None:
        self.transport = make_transport(self.config.instance.transport, self.config)
        self.data_address = await self.transport.start(self.inbox, self.config.instance.data_address or None)
        self._expiry = self.supervisor.spawn(self._expire(), "the KV inbox expiry")
        await self.pool.start(self.supervisor)

    async def stop_role(self) -> None:
        if self._expiry is not None:
            self._expiry.cancel()
            await asyncio.gather(self._expiry, return_exceptions=True)
        await self.pool.stop()
        if self.transport is not None:
            await self.transport.stop()

    def decode_load(self) -> m.DecodeLoad:
        generated = self.loop.stats.output_tokens  # NOTE: as of the last gap between steps
        progress = [m.LegProgress(rid, generated[rid]) for rid in self.reports.reply_to if rid in generated]
        return m.DecodeLoad(num_inbox_blocks=len(self.inbox), progress=progress)

    async def on_message(self, msg) -> None:
        if isinstance(msg, m.Decode):
            if msg.request_id in self._held:  # NOTE: a restarted conductor may send a handed-off leg's again
                log.info("%s: request %s is decoding here already; its Decode sent again is ignored", self.name,
                         msg.request_id)
                return
            self._held.add(msg.request_id)
            self.reports.track(msg.request_id, msg.reply_to)
            # NOTE: its own task: importing the KV takes a while, and a Cancel meanwhile must reach it.
            self._admissions[msg.request_id] = self.spawn_for(msg.request_id, self._admit(msg), "admission")
        elif isinstance(msg, m.Cancel):
            if msg.block_hashes:
                self.inbox.release_blocks(msg.block_hashes, self.loop.facts.num_layers)
            await self.drop(msg.request_id)
            self.reports.forget(msg.request_id)
        else:
            log.warning("%s: unexpected %s from the conductor", self.name, type(msg).__name__)

    async def _admit(self, msg: m.Decode) -> None:
        payloads = []
        for data in self.inbox.claim_blocks(msg.block_hashes, self.loop.facts.num_layers):
            try:
                payloads.append(KVPayload.from_bytes(data))
            except KVPayloadError as exc:
                log.warning("%s: request %s: %s; recomputing from there", self.name, msg.request_id, exc)
                break
        if (arrived := len({p.block_hash for p in payloads})) < len(msg.block_hashes):  # whole or by layer
            log.info("%s: request %s: %d of %d prompt blocks arrived; computing the rest here", self.name,
                     msg.request_id, arrived, len(msg.block_hashes))
        try:
            params = msg.sampling.params()
            if payloads:  # verified and copied in while running streams keep stepping
                kept = await self.loop.add_request_with_kv(msg.token_ids, params, msg.request_id, payloads)
                if msg.pool_first_block is not None and self.pool.client is not None and kept > msg.pool_first_block:
                    await self._write_pool(msg.request_id, msg.pool_first_block, kept)
            else:
                await self.loop.add_request(msg.token_ids, params, msg.request_id)
        except (InvalidRequestError, TypeError) as exc:
            await self.report_failure(msg.request_id, str(exc), is_invalid=True)
        except MooncakeError as exc:
            await self.report_failure(msg.request_id, str(exc))
        finally:
            if self._admissions.get(msg.request_id) is asyncio.current_task():
                del self._admissions[msg.request_id]

    async def _write_pool(self, request_id: str, first_block: int, end_block: int) -> None:
        """The request's imported blocks [first_block, end_block) to the pool: pinned between steps, copied and
        encoded on the KV thread, written in the background."""
        try:
            exported = await self.loop.call(self.loop.export_kv, request_id, first_block, end_block - first_block,
                                            wire_blocks)
            blocks = await asyncio.shield(exported)  # NOTE: cancelling the copy would unpin blocks it reads
        except MooncakeError as exc:  # it ended meanwhile
            log.info("%s: request %s: its blocks were not written to the pool: %s", self.name, request_id, exc)
            return
        self.pool.write(request_id, blocks)

    async def report_failure(self, request_id: str, error: str, is_invalid: bool = False) -> None:
        self._held.discard(request_id)
        await super().report_failure(request_id, error, is_invalid)

    async def drop(self, request_id: str) -> None:
        self._held.discard(request_id)
        if (admission := self._admissions.pop(request_id, None)) is not None:
            admission.cancel()  # its reserved blocks are freed once its copy is done
        await super().drop(request_id)

    async def on_outputs(self, outputs) -> None:
        by_api: dict[str, list[m.Tokens]] = {}
        reply_to = self.reports.reply_to
        for out in outputs:
            by_api.setdefault(reply_to.get(out.request_id, ""), []).append(m.Tokens(
                request_id=out.request_id, token_ids=out.new_token_ids, finish_reason=out.finish_reason,
                logprobs=out.logprobs, prompt_logprobs=out.prompt_logprobs))
            if out.finished:
                self.loop.pop_completion_now(out.request_id)
                self.reports.forget(out.request_id)
                self._held.discard(out.request_id)
        for address, reports in by_api.items():
            await self.reports.send_to(address, m.StepTokens(reports=reports) if len(reports) > 1 else reports[0])

    async def _expire(self) -> None:
        while True:
            await asyncio.sleep(min(1.0, self.inbox.ttl_s))
            if n := self.inbox.expire():
                log.info("%s: dropped %d KV blocks no request claimed in time (%g s: instance.kv_inbox_ttl_s)",
                         self.name, n, self.inbox.ttl_s)
