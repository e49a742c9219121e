"""Runs an LLMEngine's steps on one worker thread so the event loop stays free for I/O (KV transfers,
heartbeats, control messages). The engine is touched only between steps: callers queue changes with
`call()`, which the loop applies before the next step, or long work with `call_on_engine_thread()`, which
it runs on the engine's thread between steps (a CPP stage's prefix copy), so the event loop stays free
meanwhile; a CPP stage's chunks go through the engine's scheduler (`run_stage_chunk`). A second thread
moves KV bytes while steps run:
`add_request_with_kv` verifies and copies imported blocks there, and `export_kv` copies and checksums
blocks out of the cache there (on a GPU, on a side stream: `PagedKVCache.export_blocks`), so neither
stalls a step nor the event loop.

It is the one door into the engine for the roles (prefill/, decode/, instance/worker.py): they hold an
EngineLoop, never the engine. What never changes after start is in `facts`; what changes is read from
copies the loop takes between steps (`stats`, the prefix cache's mirror behind `prefix_length`,
`take_cache_changes` and `cache_snapshot`); changes go through `call` and the named calls (`add_request`,
`abort`, `complete`); the few reads an `on_outputs` makes between steps (`forwarded_tokens`,
`num_full_blocks`, `pop_completion_now`) raise if a step is running; CPP stages come from
`pipeline_stage`, and their chunks are computed by `run_stage_chunk`."""

import asyncio
import logging
import os
import time
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Awaitable, Callable

from mooncake.config import EngineConfig
from mooncake.engine import LLMEngine
from mooncake.engine.engine import Completion, FilledBlocks, RequestOutput
from mooncake.engine.stage import PipelineStage, StageChunk, reusable_blocks, stage_layers
from mooncake.errors import InvalidRequestError
from mooncake.instance.compute_threads import side_executor
from mooncake.runtime import Supervisor

log = logging.getLogger(__name__)

CACHE_LOG_LIMIT = 1 << 16  # prefix-cache changes kept for the next heartbeat; beyond, a snapshot is due
OnOutputs = Callable[[list[RequestOutput]], Awaitable[None]]
OnFailed = Callable[..., Awaitable[None]]  # (request ids, why, is_invalid=False): those requests ended here


@dataclass(frozen=True)
class EngineFacts:
    """What does not change once the engine has started: read it from any thread."""

    model_id: str
    block_size: int
    num_layers: int
    num_kv_blocks: int
    serial_prefill: bool  # the scheduler computes one prompt's chunk per step (engine.prefill_batching)
    time_coefficients: tuple[list[float], list[float]] | None  # an emulated model's (ModelledTime), else None
    # an emulated model's network (ModelledTime.transfer_seconds / activation_seconds, linear as the cost
    # model's network): per KV block and per token of hidden states; 0 for a real model
    transfer_s_per_block: float
    activation_s_per_token: float


@dataclass(frozen=True)
class EngineStats:
    """The engine as of the last moment between two steps (what a heartbeat reports)."""

    num_waiting: int = 0
    num_running: int = 0
    num_kv_blocks_used: int = 0
    output_tokens: dict[str, int] = field(default_factory=dict)  # request id -> tokens it generated here


class EngineLoop:
    @classmethod
    async def start_engine(cls, config: EngineConfig, on_outputs: OnOutputs, on_failed: OnFailed) -> "EngineLoop":
        """Load an engine of `config` and its loop. The engine is built on the thread that will step it
        (seconds of weights, off the event loop's thread), and is the only thread of this process that
        computes in parallel: the KV copy thread and the event loop's default executor compute alone
        (mooncake/instance/compute_threads.py says why; `mooncake serve` makes the event loop's thread so)."""
        loop = asyncio.get_running_loop()
        # NOTE: replaces the loop's default executor (to_thread's) for the rest of this role's life; one
        # made before this point (a model fetch) ends with its last reference.
        loop.set_default_executor(side_executor("side", max_workers=min(32, (os.cpu_count() or 1) + 4)))
        executor = ThreadPoolExecutor(1, thread_name_prefix="engine")
        try:
            return cls(await loop.run_in_executor(executor, LLMEngine, config), on_outputs, on_failed, executor)
        except BaseException:
            executor.shutdown(wait=False)
            raise

    def __init__(self, engine: LLMEngine, on_outputs: OnOutputs, on_failed: OnFailed,
                 executor: ThreadPoolExecutor | None = None):
        self.engine = engine
        runner, modelled = engine.runner, engine.runner.modelled
        self.facts = EngineFacts(
            model_id=engine.model.model_id, block_size=engine.block_size, num_layers=runner.kv_spec.num_layers,
            num_kv_blocks=engine.block_pool.num_blocks, serial_prefill=engine.scheduler.serial_prefill,
            time_coefficients=modelled.time_coefficients() if modelled else None,
            transfer_s_per_block=modelled.transfer_seconds(engine.block_size) if modelled else 0.0,
            activation_s_per_token=modelled.activation_seconds(1) if modelled else 0.0)
        self.stats = EngineStats(num_kv_blocks_used=engine.block_pool.num_used)
        self._stepping = False  # a step (or a long call) runs on the engine thread
        self._cached: set[int] = set(engine.block_pool.hash_to_block)  # the prefix cache's keys, as of the last gap
        self._cache_log: deque[tuple[str, int]] = deque()  # its changes since the last take_cache_changes
        self._cache_log_lost = False  # more changes than the engine's event log keeps: a snapshot is due
        self._stages: dict[tuple[int, int], PipelineStage] = {}
        self.on_outputs = on_outputs
        self.on_failed = on_failed
        self._executor = executor or ThreadPoolExecutor(1, thread_name_prefix="engine")
        self._kv_executor = side_executor("kv-copy")
        self._calls: deque[tuple[Callable, asyncio.Future, bool]] = deque()  # (fn, its result, on the engine thread)
        self._wake = asyncio.Event()
        self._task: asyncio.Task | None = None
        # (batch size, context tokens, seconds) of recent steps, for the conductor's step-time model
        self.step_samples: deque[tuple[int, int, float]] = deque(maxlen=256)
        self.last_step_s = 0.0
        # An emulated runner's (modelled, measured) seconds per step, measured from the previous step's
        # modelled end when they run back to back (the outputs' handling between them included), else from
        # its start, to when the loop has its outputs: how far this box keeps the emulated pace.
        self.emulated_steps: deque[tuple[float, float]] = deque(maxlen=1024)

    def start(self, supervisor: Supervisor | None = None) -> None:
        """Run the steps. Under a `supervisor` (every role's), a loop that ends by an exception (a bug in
        `on_outputs`, say) ends the process rather than leaving one that heartbeats but steps no more."""
        if supervisor is None:  # a bare loop (tests, benchmarks): its caller owns its failure
            self._task = asyncio.create_task(self._run())
        else:
            self._task = supervisor.spawn(self._run(), "the engine loop")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
            self._task = None
        self._executor.shutdown(wait=True)
        self._kv_executor.shutdown(wait=True)

    async def call(self, fn: Callable, *args):
        """Run `fn(*args)` against the engine between two steps; returns its result (or raises)."""
        return await self._queue(fn, *args)

    async def call_on_engine_thread(self, fn: Callable, *args):
        """`call()` for long work (a forward of its own): run on the engine's thread between two steps,
        so the event loop serves I/O meanwhile. The next step starts after it, as on a device."""
        return await self._queue(fn, *args, on_engine_thread=True)

    def _queue(self, fn: Callable, *args, on_engine_thread: bool = False) -> asyncio.Future:
        future = asyncio.get_running_loop().create_future()
        self._calls.append((lambda: fn(*args), future, on_engine_thread))
        self._wake.set()
        return future

    async def add_request_with_kv(self, prompt_token_ids: list[int], params, request_id: str,
                                  payloads: list, keep_kv: bool = False) -> int:
        """`engine.add_request(kv_payloads=...)` with the payloads verified and copied into their blocks on
        the KV thread while steps run (mooncake/engine/kv_import.py): only reserving the blocks and
        entering the request happen between steps. Cancelled midway, it frees what it reserved as soon as
        nothing uses it any more. Returns how many leading prompt blocks the request entered with (held
        here or imported and verified); the rest are computed."""
        engine = self.engine
        await self.prepare_grammars(params)
        begun = self._queue(engine.begin_import, prompt_token_ids, params, request_id, payloads, keep_kv)
        try:
            pending = await asyncio.shield(begun)
        except asyncio.CancelledError:
            begun.add_done_callback(
                lambda f: f.cancelled() or f.exception() or self._queue(engine.cancel_import, f.result()))
            raise
        written = asyncio.get_running_loop().run_in_executor(self._kv_executor, pending.write, engine.kv_cache,
                                                             engine.namespace)
        try:
            await asyncio.shield(written)
        except BaseException:
            written.add_done_callback(lambda _: self._queue(engine.cancel_import, pending))
            raise
        # NOTE: shielded: once written, the request enters the engine; a drop that cancelled us aborts it next.
        await asyncio.shield(self._queue(engine.finish_import, pending))
        return pending.num_good

    def export_kv(self, request_id: str, first_block: int, num_blocks: int,
                  encode: Callable[[list], object] = list) -> asyncio.Future:
        """`encode(payloads)` of blocks [first_block, first_block + num_blocks) of a request that keeps its
        KV, copied, checksummed and encoded on the KV thread while steps run. Call it between steps (from
        `on_outputs`): the blocks are pinned at once, so an abort meanwhile cannot hand them to another
        request before the copy is done; they are unpinned between two later steps."""
        engine = self.engine
        blocks = engine.pin_blocks(request_id, first_block, num_blocks)
        # NOTE: marked now, between steps: on a GPU the copy then waits for the steps that wrote these
        # blocks, not for the one that runs when the KV thread gets to it.
        written = engine.kv_cache.mark_written()
        future = asyncio.get_running_loop().run_in_executor(
            self._kv_executor, lambda: encode(engine.export_blocks(blocks, after=written)))

        def unpin(f: asyncio.Future) -> None:
            self._queue(engine.block_pool.release, [block for block, _ in blocks])
            if not f.cancelled() and f.exception() is not None:  # its reader, if any, raises it too
                log.debug("exporting the KV of %s failed: %r", request_id, f.exception())
        future.add_done_callback(unpin)
        return future

    def stream_layers(self, deliver: Callable[[int, list[FilledBlocks], asyncio.Future], None],
                      encode: Callable[[list], object] = list) -> None:
        """Layer-wise KV streaming: from now on, as each step writes layer i of blocks it fills for keep_kv
        requests, `deliver(i, filled, future)` is called on the event loop, where `future` gives, per entry
        of `filled` (an engine.FilledBlocks), `encode(its payloads of layer i)`, copied and checksummed on
        the KV thread while the next layers compute. With an emulated model the call comes when the layer
        ends in the modelled step (`ready_at` of `LLMEngine.layer_sink`), not before: the modelled compute
        time is waited out here. The engine pins those blocks for the step; they are released between two
        later steps, once every layer of them has been copied."""
        loop = asyncio.get_running_loop()
        engine = self.engine

        def sink(layer: int | None, filled: list[FilledBlocks], ready_at: float | None) -> None:  # engine thread
            if layer is None:  # the step is over: release the pins after its copies (one KV thread, in order)
                blocks = [block for f in filled for block, _ in f.blocks]
                self._kv_executor.submit(lambda: None).add_done_callback(
                    lambda _: loop.call_soon_threadsafe(self._queue, engine.block_pool.release, blocks))
                return
            written = engine.kv_cache.mark_written()  # on a GPU the layer is only queued: copy after it
            exported = self._kv_executor.submit(
                lambda: [encode(engine.export_blocks(f.blocks, layer, written)) for f in filled])
            loop.call_soon_threadsafe(lambda: deliver_at(ready_at, layer, filled, asyncio.wrap_future(exported)))

        def deliver_at(ready_at: float | None, *args) -> None:  # the event loop
            if ready_at is None:
                deliver(*args)
            else:
                loop.call_later(max(0.0, ready_at - time.perf_counter()), deliver, *args)

        engine.layer_sink = sink

    async def _run(self) -> None:
        loop = asyncio.get_running_loop()
        previous_end = None  # the last step's end, while steps run back to back
        while True:
            if not self._calls and not self.engine.has_unfinished():
                self._wake.clear()
                await self._wake.wait()
                previous_end = None
            while self._calls:
                fn, future, on_engine_thread = self._calls.popleft()
                if future.cancelled():
                    continue
                try:
                    if on_engine_thread:
                        self._stepping = True
                        try:
                            result = await loop.run_in_executor(self._executor, fn)
                        finally:
                            self._stepping = False
                        previous_end = None  # the device was busy with it: the next step starts after it
                    else:
                        result = fn()
                except Exception as exc:  # noqa: BLE001  the caller gets it; the loop goes on
                    if not future.done():
                        future.set_exception(exc)
                else:
                    if not future.done():
                        future.set_result(result)
            if not self.engine.has_unfinished():
                self._between_steps()
                previous_end = None
                continue
            self._between_steps()
            since = previous_end or time.perf_counter()
            self._stepping = True
            try:
                outputs = await loop.run_in_executor(self._executor, self.engine.step, since)
            except Exception as exc:  # noqa: BLE001  fail its requests, keep serving
                self._stepping = False
                log.exception("engine step failed; failing every request in the engine")
                request_ids = list(self.engine.seqs)
                for request_id in request_ids:
                    self.engine.abort(request_id)
                # NOTE: and those the step had failed alone before it raised (aborted already)
                request_ids += [request_id for request_id, _ in self.engine.drain_failed()]
                await self.on_failed(request_ids, f"engine step failed: {exc}")
                previous_end = None
                continue
            self._stepping = False
            self._between_steps()
            if failed := self.engine.drain_failed():  # sequences a step failed alone; the rest went on
                for request_id, error in failed:
                    await self.on_failed([request_id], error, is_invalid=True)
            ended = time.perf_counter()
            # NOTE: what the step cost its requests: from the previous step's (modelled) end when back to back.
            seconds = self.last_step_s = ended - since
            previous_end = ended
            if modelled := self.engine.last_modelled_s:
                self.emulated_steps.append((modelled, seconds))
                # NOTE: the emulated device's clock: lateness of this box (scheduling, wake-ups) is made up
                # by the next step, not carried by every later one, as a GPU runs queued steps back to back.
                previous_end = min(ended, self.engine.modelled_end)
            if outputs:
                context = sum(len(s.prompt_token_ids) + len(s.output_token_ids)
                              for o in outputs if (s := self.engine.seqs.get(o.request_id)) is not None)
                self.step_samples.append((len(outputs), context, seconds))
            await self.on_outputs(outputs)

    # -- the door: requests -----------------------------------------------------------------------------

    async def add_request(self, prompt_token_ids: list[int], params, request_id: str, keep_kv: bool = False) -> str:
        """A request with nothing imported enters the engine between two steps."""
        await self.prepare_grammars(params)
        return await self.call(self.engine.add_request, prompt_token_ids, params, request_id, (), keep_kv)

    async def prepare_grammars(self, params) -> None:
        """Before the first request with a structured output enters: the engine's grammar tokenizer, built
        on a side thread (about a second) rather than on the engine's, where every running stream would
        wait for it."""
        if params.grammar is not None and not self.engine.grammars.is_ready:
            await asyncio.to_thread(self.engine.grammars.prepare)

    async def abort(self, request_id: str) -> None:
        """The request leaves the engine between two steps, freeing what it holds (none: nothing)."""
        await self.call(self.engine.abort, request_id)

    async def complete(self, request_id: str) -> tuple[Completion, int]:
        """A finished request that kept its KV: its completion and how many prompt tokens this engine
        computed; its blocks are freed."""
        def pop():
            num_forwarded = self.engine.seqs[request_id].num_forwarded_tokens
            return self.engine.pop_completion(request_id), num_forwarded
        return await self.call(pop)

    # -- the door: reads between steps, from on_outputs ---------------------------------------------------

    def forwarded_tokens(self, request_id: str) -> int | None:
        """Prompt tokens the request has computed here so far; None once it has left the engine."""
        seq = self._idle().seqs.get(request_id)
        return None if seq is None else seq.num_forwarded_tokens

    def num_full_blocks(self, request_id: str) -> int:
        return self._idle().num_full_blocks(request_id)

    def pop_completion_now(self, request_id: str) -> Completion:
        """A finished request's completion, from on_outputs (it frees the blocks it kept)."""
        return self._idle().pop_completion(request_id)

    def abort_now(self, request_id: str) -> None:
        self._idle().abort(request_id)

    def _idle(self) -> LLMEngine:
        if self._stepping:
            raise RuntimeError("the engine was read while a step runs: read it from on_outputs or through call()")
        return self.engine

    # -- the door: the prefix cache, as of the last gap between steps -------------------------------------

    def prefix_length(self, block_hashes: list[int]) -> int:
        """How many leading blocks of `block_hashes` the prefix cache held at the last gap between steps
        (the engine matches again when the request enters, so a block evicted since is computed)."""
        n = 0
        while n < len(block_hashes) and block_hashes[n] in self._cached:
            n += 1
        return n

    def take_cache_changes(self) -> tuple[list[int], list[int]] | None:
        """(added, evicted) block hashes since the last take or snapshot; None when more changed than the
        engine's log keeps (send `cache_snapshot()` instead)."""
        if self._cache_log_lost:
            return None
        added, evicted = [], []
        while self._cache_log:
            kind, block_hash = self._cache_log.popleft()
            (added if kind == "add" else evicted).append(block_hash)
        return added, evicted

    def cache_snapshot(self) -> list[int]:
        """Every block hash the prefix cache holds; later changes come from `take_cache_changes`."""
        self._cache_log.clear()
        self._cache_log_lost = False
        return list(self._cached)

    # -- the door: CPP ---------------------------------------------------------------------------------

    def pipeline_stage(self, num_stages: int, stage: int) -> PipelineStage:
        """This engine's stage `stage` of `num_stages` (its layer range, `engine/stage.py`), one per range;
        call its methods through `call` or `call_on_engine_thread` only."""
        if not 0 <= stage < num_stages:
            raise InvalidRequestError(f"stage {stage} of {num_stages}")
        layers = stage_layers(self.facts.num_layers, num_stages)[stage]
        key = (layers.start, layers.stop)
        if key not in self._stages:
            self._stages[key] = PipelineStage(self.engine, layers)
        return self._stages[key]

    async def run_stage_chunk(self, stage: PipelineStage, request_id: str, num_tokens: int, hidden,
                              since: float | None = None):
        """`stage.run(request_id, num_tokens, hidden, since)`'s result, computed in this engine's steps when
        its scheduler gives the chunk its turn (`Scheduler.stage_turn`). Cancelled, the chunk leaves the
        queue between two steps (what of it was computed stays computed)."""
        chunk = StageChunk(stage, request_id, num_tokens, hidden, since,
                           waiter=asyncio.get_running_loop().create_future())
        try:
            await self.call(stage.submit, chunk)
            return await chunk.waiter
        except asyncio.CancelledError:  # NOTE: queued or not (the submit may have run): it leaves the queue
            self._queue(self.engine.scheduler.drop_stage_chunk, chunk, "cancelled")
            raise

    def reusable_blocks(self, num_tokens: int) -> int:
        """How many leading blocks of a prompt a CPP stage may take from the cache pool."""
        return reusable_blocks(num_tokens, self.facts.block_size)

    def _between_steps(self) -> None:
        """Copy what the roles read of the engine, while no step runs."""
        engine = self.engine
        scheduler, blocks = engine.scheduler, engine.block_pool
        self.stats = EngineStats(len(scheduler.waiting), len(scheduler.running), blocks.num_used,
                                 {rid: len(seq.output_token_ids) for rid, seq in engine.seqs.items()})
        for chunk in scheduler.drain_stage_chunks():  # a CPP stage's, to its caller
            chunk.answer()
        events = blocks.events
        if len(events) == events.maxlen:  # NOTE: some were dropped: start again from the whole cache
            events.clear()
            self._cached = set(blocks.hash_to_block)
            self._cache_log.clear()
            self._cache_log_lost = True
            return
        while events:
            kind, block_hash = events.popleft()
            (self._cached.add if kind == "add" else self._cached.discard)(block_hash)
            if self._cache_log_lost:
                continue
            if len(self._cache_log) >= CACHE_LOG_LIMIT:  # nobody took them (a decode instance reports none)
                self._cache_log.clear()
                self._cache_log_lost = True
            else:
                self._cache_log.append((kind, block_hash))

    def drain_step_samples(self) -> list[tuple[int, int, float]]:
        return _drain(self.step_samples)

    def drain_emulated_steps(self) -> list[tuple[float, float]]:
        return _drain(self.emulated_steps)


def _drain(samples: deque) -> list[tuple]:
    drained = []
    while samples:
        drained.append(samples.popleft())
    return drained
