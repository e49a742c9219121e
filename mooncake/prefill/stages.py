"""A prefill instance's part in CPP groups (DESIGN section 6): the `PrefillStage` jobs the conductor sends
each instance of a group, for a prompt long enough to be worth a pipeline.

Stage k holds layers k*L/X .. (k+1)*L/X - 1 (`engine/stage.py`). For each chunk of the prompt it takes the
previous stage's hidden states from this instance's `StageInbox` (stage 0: the tokens), computes its
layers in the engine's steps, its turn among the engine's prompts given by its scheduler, and sends the result to the next stage
(`stage_link.run_stage`). As each chunk fills blocks, it pushes its layers of them to decode while the next
chunk computes, one payload per block and layer, as layer-wise streaming does, so decode claims each block
by all its layers and only the last chunk's push lands on TTFT.

Only the last stage reports `PrefillDone`, and only when every stage's KV is in decode's inbox: each stage
waits for the one before to say its KV is there (an empty chunk after the last, in the inbox), pushes its
own, and says so to the next. A failure anywhere ends the stage's job with `RequestFailed`; the conductor
then cancels the others and moves the request.

A prompt whose prefix the cache pool holds is placed with `reuse_blocks`: every stage reads those blocks
whole from the pool, keeps its layers of them, and computes only the rest (the chunks start after them).
A stage's blocks are never entered in the prefix cache."""

import asyncio
import logging
import time
from dataclasses import dataclass

import torch

from mooncake import messages as m
from mooncake.hidden_payload import encode_hidden
from mooncake.errors import InvalidRequestError, KVPayloadError, MooncakeError
from mooncake.kv_payload import KVPayload, wire_blocks
from mooncake.prefill.kv_moves import push_to_decode, read_prefix
from mooncake.prefill.stage_link import StageInbox, chunk_key, run_stage, time_left
from mooncake.transfer.contract import TransferError

log = logging.getLogger(__name__)


@dataclass
class _StageJob:
    msg: m.PrefillStage
    reused_blocks: int  # leading blocks every stage of the group reads from the pool
    sizes: list[int]  # the chunks of the rest of the prompt, in tokens
    task: asyncio.Task | None = None

    @property
    def keys(self) -> list[int]:
        """Every inbox key of this request's chunks to this stage, and the one saying the KV is in."""
        return [chunk_key(self.msg.request_id, self.msg.stage, j) for j in range(len(self.sizes) + 1)]


class PrefillStages:
    """The worker's stage jobs and its StageInbox; its engine's stages come from `EngineLoop.pipeline_stage`."""

    def __init__(self, worker, max_bytes: int):
        self.worker = worker
        self.inbox = StageInbox(max_bytes)
        self.jobs: dict[str, _StageJob] = {}

    def admit(self, msg: m.PrefillStage) -> None:
        if msg.request_id in self.jobs:
            log.warning("%s: stage job %s is already here; ignored", self.worker.name, msg.request_id)
            return
        n, size = len(msg.token_ids), self.worker.loop.facts.block_size
        reused = max(0, min(msg.reuse_blocks, self.worker.loop.reusable_blocks(n)))
        step = max(1, msg.chunk_tokens)
        sizes = [min(step, n - i) for i in range(reused * size, n, step)]
        job = self.jobs[msg.request_id] = _StageJob(msg, reused, sizes)
        job.task = self.worker.spawn_for(msg.request_id, self._run(job), "a CPP stage")

    async def drop(self, request_id: str) -> None:
        job = self.jobs.pop(request_id, None)
        if job is None:
            return
        self.inbox.drop(job.keys)
        if job.task is not None and job.task is not asyncio.current_task():
            job.task.cancel()
            await asyncio.gather(job.task, return_exceptions=True)

    def _stage(self, msg: m.PrefillStage):
        if not 0 <= msg.stage < msg.num_stages or msg.chunk_tokens <= 0:
            raise InvalidRequestError(f"stage {msg.stage} of {msg.num_stages} in chunks of {msg.chunk_tokens} tokens")
        return self.worker.loop.pipeline_stage(msg.num_stages, msg.stage)

    async def _run(self, job: _StageJob) -> None:
        msg, worker = job.msg, self.worker
        rid, last = msg.request_id, msg.stage == msg.num_stages - 1
        what = f"request {rid} stage {msg.stage}"
        received = time.perf_counter()
        deadline = time.monotonic() + msg.deadline_s
        n, sizes = len(msg.token_ids), job.sizes
        try:
            stage = self._stage(msg)
            params = msg.sampling.params(max_tokens=1)
        except (InvalidRequestError, TypeError, ValueError) as exc:
            self.jobs.pop(rid, None)
            await worker.report_failure(rid, f"CPP stage {msg.stage}: {exc}", is_invalid=True)
            return
        try:
            await worker.loop.prepare_grammars(params)  # NOTE: the last stage's first token may need it
            prefix, fetched_bytes, fetch_s = await self._read_prefix(job)
            # NOTE: on the engine's thread: copying a long prefix in would stall the event loop
            await worker.loop.call_on_engine_thread(stage.begin, rid, msg.token_ids, prefix, params.prefix_root)
            computing = time.perf_counter()
        except InvalidRequestError as exc:
            self.jobs.pop(rid, None)
            await worker.report_failure(rid, f"CPP stage {msg.stage}: {exc}", is_invalid=True)
            return
        except (MooncakeError, asyncio.TimeoutError) as exc:  # the group cannot reuse what it was placed to
            if isinstance(exc, KVPayloadError) and exc.block_hash is not None:
                worker.pool.remove(exc.block_hash, rid, str(exc))
            if self.jobs.pop(rid, None) is not None:
                log.warning("%s: CPP stage %d of request %s: %s", worker.name, msg.stage, rid, exc)
                await worker.report_failure(rid, f"CPP stage {msg.stage}: {exc}")
            return
        pushes: list[asyncio.Task] = []
        pushed = 0  # leading blocks whose push has started

        def push_filled(_chunk: int) -> None:  # after each chunk: its full blocks leave while the next computes
            nonlocal pushed
            full = stage.num_full_blocks(rid)
            if msg.decode_address and full > pushed:
                pushes.append(asyncio.ensure_future(self._push_kv(stage, msg, deadline, pushed, full)))
                pushed = full
        try:
            logits = await run_stage(stage, msg.stage, rid, sizes, worker.loop.run_stage_chunk, self.inbox,
                                     worker.transport, msg.next_address or None, deadline, push_filled)
            compute_s = time.perf_counter() - computing
            sent = [r for r in await asyncio.gather(*pushes) if r is not None]
            if msg.stage > 0:  # the stages before have their KV in decode's inbox
                await self.inbox.take(chunk_key(rid, msg.stage, len(sizes)), time_left(deadline, what),
                                      f"request {rid} stage {msg.stage}: the KV of the stages before")
            if not last:
                done = await worker.transport.send(msg.next_address, [(chunk_key(rid, msg.stage + 1, len(sizes)),
                                                                       encode_hidden(torch.empty(0)))],
                                                   time_left(deadline, what), request_id=rid, self_checked=True)
                if not done.ok:
                    raise TransferError(f"request {rid}: stage {msg.stage + 1} at {msg.next_address} refused the "
                                        f"word that the KV is in ({done.blocks[0].error})")
                return
            token, logprob, reason = await worker.loop.call(stage.first_token, rid, logits, params)
            log.info("%s: request %s: first token from a %d-stage CPP pipeline, %d tokens in %d chunks, %.3f s",
                     worker.name, rid, msg.num_stages, n, len(sizes), time.perf_counter() - received)
            if self.jobs.pop(rid, None) is None:
                return  # cancelled meanwhile
            await worker.report(rid, m.PrefillDone(
                request_id=rid, first_token=token, finish_reason=reason, first_logprob=logprob,
                num_cached_tokens=job.reused_blocks * worker.loop.facts.block_size,
                num_computed_tokens=sum(sizes), fetched_bytes=fetched_bytes, fetch_seconds=fetch_s,
                num_kv_blocks_sent=len(msg.block_hashes) if msg.decode_address else 0,
                kv_bytes=sum(r.num_bytes for r in sent), kv_seconds=sum(r.seconds for r in sent),
                prefill_seconds=time.perf_counter() - received, compute_seconds=compute_s))
        except (MooncakeError, asyncio.TimeoutError) as exc:
            if self.jobs.pop(rid, None) is not None:
                log.warning("%s: CPP stage %d of request %s failed: %s", worker.name, msg.stage, rid, exc)
                # NOTE: a request the model cannot sample (InvalidRequestError) fails alone; moving it would not help
                await worker.report_failure(rid, f"CPP stage {msg.stage}: {exc}",
                                            is_invalid=isinstance(exc, InvalidRequestError))
        finally:
            self.jobs.pop(rid, None)
            worker.reports.forget(rid)
            for push in pushes:
                push.cancel()
            await asyncio.gather(*pushes, return_exceptions=True)  # NOTE: none still reads the blocks end frees
            await worker.loop.call(stage.end, rid)

    async def _read_prefix(self, job: _StageJob) -> tuple[list[KVPayload], int, float]:
        """The prompt's leading blocks the conductor placed the group to reuse, whole, from the cache pool
        (each stage keeps its layers of them); with the bytes read and the seconds it took. Every stage
        must start from the same block, so a block the pool no longer holds fails the stage (TransferError),
        as does one it serves corrupted (KVPayloadError, here or as `begin` checks it; the caller removes it
        from the pool): the conductor moves the request."""
        msg, worker = job.msg, self.worker
        wanted = msg.block_hashes[:job.reused_blocks]
        if not wanted:
            return [], 0, 0.0
        what = f"request {msg.request_id} stage {msg.stage}"
        if worker.cache is None:
            raise TransferError(f"{what}: placed to reuse {len(wanted)} blocks from the cache pool, but this "
                                f"instance has no cache pool (cache.nodes)")
        read = await read_prefix(worker.cache, wanted)
        if read.missing is not None:
            error = f"{what}: block {read.missing} of the prefix it was placed to reuse: {read.error}"
            raise KVPayloadError(error, read.bad_key) if read.bad_key is not None else TransferError(error)
        return read.payloads, read.num_bytes, read.seconds

    async def _push_kv(self, stage, msg: m.PrefillStage, deadline: float, first_block: int,
                       end_block: int):
        """This stage's layers of the prompt's blocks [first_block, end_block) into decode's inbox; None when
        there are none."""
        worker = self.worker
        payloads = await worker.loop.call_on_engine_thread(stage.export, msg.request_id, first_block, end_block)
        if not payloads:
            return None
        blocks = await asyncio.to_thread(wire_blocks, payloads)
        what = f"request {msg.request_id} stage {msg.stage}"
        return await push_to_decode(worker.transport, msg.decode_id, msg.decode_address, msg.request_id, blocks,
                                    time_left(deadline, what), f"{msg.request_id}/S{msg.stage}/B{first_block}",
                                    f" from stage {msg.stage}")

