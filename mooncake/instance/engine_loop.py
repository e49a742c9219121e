"""Runs an LLMEngine's steps on one worker thread so the event loop stays free for I/O (KV transfers,
heartbeats, control messages). The engine is touched only between steps: callers queue changes with
`call()`, which the loop applies before the next step, or long work with `call_on_engine_thread()`, which
it runs on the engine's thread between steps (a CPP stage's chunk), so the event loop stays free meanwhile. A second thread moves KV bytes while steps run:
`add_request_with_kv` verifies and copies imported blocks there, and `export_kv` copies and checksums
blocks out of the cache there (on a GPU, on a side stream: `PagedKVCache.export_blocks`), so neither
stalls a step nor the event loop."""

import asyncio
import logging
import time
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from typing import Awaitable, Callable

from mooncake.engine import LLMEngine
from mooncake.engine.engine import FilledBlocks, RequestOutput
from mooncake.runtime import Supervisor

log = logging.getLogger(__name__)

OnOutputs = Callable[[list[RequestOutput]], Awaitable[None]]
OnFailed = Callable[..., Awaitable[None]]  # (request ids, why, is_invalid=False): those requests ended here


class EngineLoop:
    def __init__(self, engine: LLMEngine, on_outputs: OnOutputs, on_failed: OnFailed):
        self.engine = engine
        self.on_outputs = on_outputs
        self.on_failed = on_failed
        self._executor = ThreadPoolExecutor(1, thread_name_prefix="engine")
        self._kv_executor = ThreadPoolExecutor(1, thread_name_prefix="kv-copy")
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
            self._queue(engine.pool.release, [block for block, _ in blocks])
            if not f.cancelled() and f.exception() is not None:  # its reader, if any, raises it too
                log.debug("exporting the KV of %s failed: %r", request_id, f.exception())
        future.add_done_callback(unpin)
        return future

    def stream_layers(self, deliver: Callable[[int, list[FilledBlocks], asyncio.Future, float | None], None],
                      encode: Callable[[list], object] = list) -> None:
        """Layer-wise KV streaming: from now on, as each step writes layer i of blocks it fills for keep_kv
        requests, `deliver(i, filled, future, ready_at)` is called on the event loop, where `future` gives,
        per entry of `filled` (an engine.FilledBlocks), `encode(its payloads of layer i)`, copied and
        checksummed on the KV thread while the next layers compute; `ready_at` is as in
        `LLMEngine.layer_sink`. The engine pins those blocks for the step; they are released between two
        later steps, once every layer of them has been copied."""
        loop = asyncio.get_running_loop()
        engine = self.engine

        def sink(layer: int | None, filled: list[FilledBlocks], ready_at: float | None) -> None:  # engine thread
            if layer is None:  # the step is over: release the pins after its copies (one KV thread, in order)
                blocks = [block for f in filled for block, _ in f.blocks]
                self._kv_executor.submit(lambda: None).add_done_callback(
                    lambda _: loop.call_soon_threadsafe(self._queue, engine.pool.release, blocks))
                return
            written = engine.kv_cache.mark_written()  # on a GPU the layer is only queued: copy after it
            exported = self._kv_executor.submit(
                lambda: [encode(engine.export_blocks(f.blocks, layer, written)) for f in filled])
            loop.call_soon_threadsafe(lambda: deliver(layer, filled, asyncio.wrap_future(exported), ready_at))

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
                        result = await loop.run_in_executor(self._executor, fn)
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
                previous_end = None
                continue
            since = previous_end or time.perf_counter()
            try:
                outputs = await loop.run_in_executor(self._executor, self.engine.step, since)
            except Exception as exc:  # noqa: BLE001  fail its requests, keep serving
                log.exception("engine step failed; failing every request in the engine")
                request_ids = list(self.engine.seqs)
                for request_id in request_ids:
                    self.engine.abort(request_id)
                # NOTE: and those the step had failed alone before it raised (aborted already)
                request_ids += [request_id for request_id, _ in self.engine.drain_failed()]
                await self.on_failed(request_ids, f"engine step failed: {exc}")
                previous_end = None
                continue
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

    def drain_step_samples(self) -> list[list]:
        return _drain(self.step_samples)

    def drain_emulated_steps(self) -> list[list]:
        return _drain(self.emulated_steps)


def _drain(samples: deque) -> list[list]:
    drained = []
    while samples:
        drained.append(list(samples.popleft()))
    return drained
