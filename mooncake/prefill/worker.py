"""A prefill instance (`mooncake serve --role prefill`).

For each `Prefill` from the conductor: read the reusable prefix blocks it lacks locally from the cache
pool, queue the prompt (sampling one token) with its KV kept, and after every engine step push the
blocks that just filled to the decode instance's KV inbox and to the cache pool, so the transfer of one
chunk overlaps the compute of the next (chunk-wise streaming). With `instance.stream_layers`, decode gets
each layer of those blocks as soon as the layer is computed instead (layer-wise streaming); the pool
still gets whole blocks after the step. When the first token is out and every
block has arrived at decode, release the request's blocks (they stay in the local prefix cache) and
report `PrefillDone`. A request that misses its deadline or is cancelled is aborted and its blocks freed.
A `PrefillStage` (one stage of a CPP group's pipeline) is stages.py's; the instance's transport serves
the stage inbox where the stage before sends it activations."""

import asyncio
import logging
import time
from dataclasses import dataclass, field

from mooncake import messages as m
from mooncake.sampling import TokenLogprob
from mooncake.errors import InvalidRequestError, MooncakeError
from mooncake.instance.pool import PoolAccess
from mooncake.instance.worker import Worker
from mooncake.kv_payload import KVPayload, wire_blocks
from mooncake.prefill.kv_moves import push_to_decode, read_prefix
from mooncake.prefill.stages import PrefillStages
from mooncake.store.client import CacheClient
from mooncake.transfer.contract import make_transport

log = logging.getLogger(__name__)



@dataclass
class _Job:
    msg: m.Prefill
    received_s: float
    num_sent_blocks: int = 0  # leading blocks already pushed (or being pushed)
    layered: set[int] = field(default_factory=set)  # blocks (prompt indices) streamed to decode by layer
    pushes: list[asyncio.Task] = field(default_factory=list)
    num_pool_blocks: int = 0  # leading blocks read from the pool (no need to write them back)
    fetched_bytes: int = 0
    fetch_seconds: float = 0.0
    num_forwarded: int = 0  # prompt tokens computed so far, as of the last step
    compute_seconds: float = 0.0  # time of the steps that computed some of its prompt
    first_token: int | None = None
    first_logprob: TokenLogprob | None = None
    prompt_logprobs: list[TokenLogprob] | None = None
    finish_reason: str | None = None
    deadline: asyncio.TimerHandle | None = None  # fails it if it is still here at msg.deadline_s


class PrefillWorker(Worker):
    role = "prefill"
    prefill_batching = "serial"  # one prompt at a time: the queue the conductor predicts (Algorithm 1)

    def __init__(self, config):
        super().__init__(config)
        self.jobs: dict[str, _Job] = {}
        self.pool = PoolAccess(self.name, config)
        self.cache: CacheClient | None = None  # the pool's client, when it has one
        self._snapshot_due = False  # the next heartbeat sends the whole prefix cache
        self.stages: PrefillStages | None = None  # its part in CPP groups (stages.py)
        self._last_entry: asyncio.Future | None = None  # the latest request's entry into the engine

    async def start_role(self) -> None:
        self.transport = self.modelled(make_transport(self.config.instance.transport, self.config))
        self.pool.wrap = self.modelled
        # NOTE: it serves only the stage inbox: CPP stages of other instances send it activations.
        self.stages = PrefillStages(self, self.config.instance.kv_inbox_bytes)
        self.data_address = await self.transport.start(self.stages.inbox, self.config.instance.data_address or None)
        self.cache = await self.pool.start(self.supervisor)
        if self.config.instance.stream_layers:
            self.loop.stream_layers(self._push_layer, wire_blocks)

    async def stop_role(self) -> None:
        for job in self.jobs.values():
            for task in job.pushes:
                task.cancel()
            if job.deadline is not None:
                job.deadline.cancel()
        await self.pool.stop()
        if self.transport is not None:
            await self.transport.stop()

    def cache_changes(self) -> m.CacheChanges:
        """What entered and left the prefix cache since the last heartbeat; the whole cache instead when
        a snapshot was asked for (a new registration, a Resync, or more changes than the log keeps)."""
        changes = None if self._snapshot_due else self.loop.take_cache_changes()
        if changes is None:
            self._snapshot_due = False
            return m.CacheChanges(added=self.loop.cache_snapshot(), is_snapshot=True)
        added, evicted = changes
        return m.CacheChanges(added=added, evicted=evicted)

    def on_registered(self) -> None:
        super().on_registered()
        self._snapshot_due = True

    # -- requests ---------------------------------------------------------------------------------

    async def on_message(self, msg) -> None:
        if isinstance(msg, m.Prefill):
            self.reports.track(msg.request_id, msg.reply_to)
            self.spawn_for(msg.request_id, self._admit(msg), "admission")
        elif isinstance(msg, m.PrefillStage):
            self.reports.track(msg.request_id, msg.reply_to)
            self.stages.admit(msg)
        elif isinstance(msg, m.Cancel):
            await self.drop(msg.request_id)
            self.reports.forget(msg.request_id)
        elif isinstance(msg, m.Resync):
            log.info("%s: the conductor missed some reports; sending the whole prefix cache", self.name)
            self._snapshot_due = True
        else:
            log.warning("%s: unexpected %s from the conductor", self.name, type(msg).__name__)

    async def _admit(self, msg: m.Prefill) -> None:
        job = _Job(msg, time.perf_counter())
        self.jobs[msg.request_id] = job
        job.deadline = asyncio.get_running_loop().call_later(msg.deadline_s, self._on_deadline, job)
        # NOTE: with serial prefill, requests enter the engine in the order they came, as the conductor
        # predicts this queue: one that reads the pool first is not overtaken by a later one meanwhile.
        entered = asyncio.get_running_loop().create_future()
        previous, self._last_entry = self._last_entry, entered
        try:
            params = msg.sampling.params(max_tokens=1)
            payloads = await self._read_pool(job)
            await self.loop.prepare_grammars(params)  # NOTE: here, so a cancel meanwhile is seen below
            if previous is not None and self.loop.facts.serial_prefill:
                await asyncio.shield(previous)  # NOTE: it always ends: each admission sets it when done
            if msg.request_id not in self.jobs:
                return  # cancelled while reading the pool or waiting its turn
            if payloads:  # verified and copied in while other requests keep stepping
                kept = await self.loop.add_request_with_kv(msg.token_ids, params, msg.request_id, payloads, True)
                if msg.request_id not in self.jobs:  # cancelled while its blocks were copied in
                    await self.loop.abort(msg.request_id)
                elif kept < job.num_pool_blocks:  # a pool block failed its check: recomputed here
                    self._forget_pool_block(job, kept)
            else:
                await self.loop.add_request(msg.token_ids, params, msg.request_id, keep_kv=True)
        except (InvalidRequestError, TypeError) as exc:
            job.deadline.cancel()
            self.jobs.pop(msg.request_id, None)
            await self.report_failure(msg.request_id, str(exc), is_invalid=True)
        except MooncakeError as exc:
            job.deadline.cancel()
            self.jobs.pop(msg.request_id, None)
            await self.report_failure(msg.request_id, str(exc))
        finally:
            entered.set_result(None)

    async def _read_pool(self, job: _Job) -> list[KVPayload]:
        """The blocks the conductor said to reuse that this instance does not hold, from the cache pool."""
        msg = job.msg
        if self.cache is None or msg.reuse_blocks <= 0 or msg.sampling.prompt_logprobs is not None:
            return []  # NOTE: a prompt whose logprobs are wanted is computed whole (the conductor reuses none)
        local = self.loop.prefix_length(msg.block_hashes[:msg.reuse_blocks])
        wanted = msg.block_hashes[local:msg.reuse_blocks]
        if not wanted:
            return []
        read = await read_prefix(self.cache, wanted)
        job.fetch_seconds, job.fetched_bytes = read.seconds, read.num_bytes
        job.num_pool_blocks = local + len(read.payloads)
        if read.bad_key is not None:  # a bad block is a miss: compute from there
            self._forget_pool_block(job, job.num_pool_blocks, read.error)
        return read.payloads

    def _forget_pool_block(self, job: _Job, index: int, why: str = "it failed its check") -> None:
        """The pool served block `index` of the request's prompt corrupted (no transport checks a KV payload:
        its reader does). It is computed here instead: remove the bad copy so that the recomputed one,
        written back like any new block, takes its place (a put of a key the pool holds is a no-op)."""
        job.num_pool_blocks = index
        self.pool.remove(job.msg.block_hashes[index], job.msg.request_id, why)

    async def on_outputs(self, outputs) -> None:
        # Every request that computed in this step, finished or mid-prompt, streams what just filled. A
        # step that computed several is charged to each by its share of the step's tokens: the conductor
        # fits its prefill model to these times, and charging each the whole step would bias it upward.
        forwarded = []
        for job in self.jobs.values():
            done = self.loop.forwarded_tokens(job.msg.request_id)
            if job.first_token is None and done is not None and done > job.num_forwarded:
                forwarded.append((job, done - job.num_forwarded))
                job.num_forwarded = done
        total = sum(n for _, n in forwarded)
        for job, num_tokens in forwarded:
            job.compute_seconds += self.loop.last_step_s * num_tokens / total
        for job in self.jobs.values():
            if (job.first_token is None and self.config.instance.stream_kv
                    and self.loop.forwarded_tokens(job.msg.request_id) is not None):
                self._push_new_blocks(job)
        for out in outputs:
            job = self.jobs.get(out.request_id)
            if job is None and out.finished:
                self.loop.abort_now(out.request_id)  # cancelled meanwhile: free the blocks it kept
            elif job is not None and out.finished:
                self._push_new_blocks(job)  # the last chunk's blocks (all of them, without stream_kv)
                job.first_token, job.finish_reason = out.new_token_ids[0], out.finish_reason
                job.first_logprob = out.logprobs[0] if out.logprobs else None
                job.prompt_logprobs = out.prompt_logprobs
                self.spawn_for(job.msg.request_id, self._hand_off(job), "the hand-off")

    def _push_new_blocks(self, job: _Job) -> None:
        """Between steps: start pushing the request's blocks that filled since the last push, to decode
        (those not already streamed there by layer) and to the pool. They are copied out of the cache and
        encoded on the engine loop's KV thread while the next step runs."""
        request_id = job.msg.request_id
        num_full = min(self.loop.num_full_blocks(request_id), len(job.msg.block_hashes))
        if num_full <= job.num_sent_blocks:
            return
        first = job.num_sent_blocks
        job.num_sent_blocks = num_full
        wanted = range(max(first, job.num_pool_blocks) if self.cache is not None else num_full, num_full)
        if not wanted and all(i in job.layered for i in range(first, num_full)):
            return  # every block went to decode layer by layer, and the pool needs none
        exported = self.loop.export_kv(request_id, first, num_full - first, wire_blocks)
        job.pushes.append(asyncio.create_task(self._push(job, exported, first)))

    async def _push(self, job: _Job, exported: asyncio.Future, first_block: int):
        """One chunk's blocks to decode (must arrive before the hand-off) and to the pool (best effort,
        on its own: a slow or dead cache node never delays a hand-off)."""
        msg = job.msg
        # NOTE: shielded: cancelling the copy's future would unpin its blocks while the copy still reads them.
        blocks = await asyncio.shield(exported)
        to_pool = [b for i, b in enumerate(blocks) if first_block + i >= job.num_pool_blocks]
        if self.cache is not None and to_pool:
            self.pool.write(msg.request_id, to_pool)
        to_decode = [b for i, b in enumerate(blocks) if first_block + i not in job.layered]
        if not msg.decode_address or not to_decode:  # none when the request ends with its first token
            return None
        return await self._send_to_decode(job, to_decode, f"{msg.request_id}/{first_block}")

    def _push_layer(self, layer: int, filled: list, exported: asyncio.Future) -> None:
        """On the event loop, as a step writes layer `layer` of blocks it fills (layer-wise streaming,
        `EngineLoop.stream_layers`): push that layer of each request's new blocks to its decode instance
        while the next layers compute. The pool still gets whole blocks, after the step."""
        for i, entry in enumerate(filled):
            job = self.jobs.get(entry.request_id)
            if job is None or not job.msg.decode_address:
                continue
            job.layered.update(range(entry.first_block, entry.first_block + len(entry.blocks)))
            job.pushes.append(asyncio.create_task(
                self._push_layer_of(job, exported, i, entry.first_block, layer)))

    async def _push_layer_of(self, job: _Job, exported: asyncio.Future, index: int, first_block: int, layer: int):
        # NOTE: shielded: the copy is shared by every request of the step.
        blocks = (await asyncio.shield(exported))[index]
        return await self._send_to_decode(job, blocks, f"{job.msg.request_id}/{first_block}/L{layer}")

    async def _send_to_decode(self, job: _Job, blocks: list, transfer_id: str):
        """Push payloads to the request's decode instance; a block it did not take fails the hand-off."""
        msg = job.msg
        return await push_to_decode(self.transport, msg.decode_id, msg.decode_address, msg.request_id, blocks,
                                    self._time_left(job), transfer_id)

    async def _hand_off(self, job: _Job) -> None:
        msg = job.msg
        try:
            results = await asyncio.wait_for(asyncio.gather(*job.pushes), self._time_left(job))
        except (MooncakeError, asyncio.TimeoutError) as exc:
            await self.drop(msg.request_id)
            await self.report_failure(msg.request_id, f"KV transfer to decode failed: {exc or 'deadline'}")
            return
        if self.jobs.pop(msg.request_id, None) is None:
            return  # cancelled meanwhile
        job.deadline.cancel()
        done, num_forwarded = await self.loop.complete(msg.request_id)
        await self.report(msg.request_id, m.PrefillDone(
            request_id=msg.request_id, first_token=job.first_token, finish_reason=job.finish_reason,
            first_logprob=job.first_logprob, prompt_logprobs=job.prompt_logprobs,
            num_cached_tokens=done.num_cached_tokens, num_computed_tokens=num_forwarded,
            num_kv_blocks_sent=job.num_sent_blocks if msg.decode_address else 0,
            kv_bytes=sum(r.num_bytes for r in results if r), kv_seconds=sum(r.seconds for r in results if r),
            prefill_seconds=time.perf_counter() - job.received_s, compute_seconds=job.compute_seconds,
            fetched_bytes=job.fetched_bytes, fetch_seconds=job.fetch_seconds), is_last=True)

    async def drop(self, request_id: str) -> None:
        if self.stages is not None:
            await self.stages.drop(request_id)
        job = self.jobs.pop(request_id, None)
        if job is not None:
            job.deadline.cancel()
            for task in job.pushes:
                task.cancel()
        await self.loop.abort(request_id)

    def _time_left(self, job: _Job) -> float:
        return max(0.01, job.msg.deadline_s - (time.perf_counter() - job.received_s))

    def _on_deadline(self, job: _Job) -> None:
        """The request's prefill deadline passed (a timer set at admission): if it is still here, it fails."""
        if self.jobs.get(job.msg.request_id) is job:
            self.spawn_for(job.msg.request_id, self._fail_request(
                job.msg.request_id, f"prefill did not finish within {job.msg.deadline_s:g} s"), "the deadline")
