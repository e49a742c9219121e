"""Chunked pipeline parallelism (CPP, DESIGN section 6) in the engine: one stage of a prompt's pipeline.

A group of X engines (prefill instances) splits the model's layers into X contiguous ranges
(`stage_layers`). Each engine's `PipelineStage` computes its range over a prompt, chunk by chunk: the first
stage from the token embeddings, each later one from the hidden states the stage before handed on
(`mooncake/hidden_payload.py`: what crosses a stage boundary, checked end to end), the last one
ending in the logits of the prompt's last token, from which the first token is sampled. So only
activations cross stages, and a stage starts chunk j + 1 while the next stage computes chunk j.

A stage keeps the prompt's KV in its engine's cache seen as a cache of its layers alone
(`PagedKVCache.stage_view`): a stage of m of the model's L layers fits L // m of its blocks in one of the
engine's, so a prompt takes about 1/X of each member's cache (decode, which holds it whole, still bounds
its length). Those blocks are never
registered in the prefix cache (another request must not match them) and are freed by `end`.
`export` gives its layers of the prompt's full blocks, one payload per layer, as layer-wise streaming
sends them, so decode assembles a block from the X stages' layers. A stage's chunk is a forward of its
own (`run`), never batched with other requests, whose layers differ; in an instance it goes through the
engine's scheduler as a `StageChunk` (`submit`): it takes a step of the engine's when it is its turn, first
come, first served with the engine's prompts, at most a step's token budget per step
(`Scheduler.stage_turn`). A prompt's cached prefix (whole blocks from the cache pool) is given to `begin`:
each stage copies its layers of it in, and the chunks start after it."""

import time
from dataclasses import dataclass, field

import torch

from mooncake.engine.runner import ForwardBatch, PrefillSpan
from mooncake.engine.grammar import Grammars
from mooncake.engine.sampler import logprobs_of, sample
from mooncake.engine.sequence import Sequence
from mooncake.errors import InvalidRequestError, KVPayloadError
from mooncake.hashing import hash_blocks
from mooncake.kv_payload import KVPayload
from mooncake.sampling import SamplingParams, TokenLogprob

def reusable_blocks(num_tokens: int, block_size: int) -> int:
    """How many of a prompt's leading blocks a stage may take from the cache: all full ones before its
    last token, which is computed (the first token is sampled from it), as `LLMEngine` reuses."""
    return (num_tokens - 1) // block_size


def stage_layers(num_layers: int, stages: int) -> list[range]:
    """Stage k's layers: k*L/X .. (k+1)*L/X - 1 (DESIGN section 6)."""
    if not 1 <= stages <= num_layers:
        raise InvalidRequestError(f"cannot split {num_layers} layers into {stages} pipeline stages")
    bounds = [k * num_layers // stages for k in range(stages + 1)]
    return [range(a, b) for a, b in zip(bounds, bounds[1:])]


@dataclass
class _Job:
    prompt: list[int]
    held: list[int]  # the engine's blocks, held for the prompt
    blocks: list[int]  # the prompt's blocks in the stage view, inside `held`
    hashes: list[int]
    done: int = 0  # tokens computed
    modelled_end: float = 0.0  # an emulated model's: when its last chunk ended on the modelled device
    arrival_s: float = field(default_factory=time.perf_counter)  # its turn among the engine's prompts


@dataclass(eq=False)
class StageChunk:
    """The next `num_tokens` of a prompt through `stage`, waiting in its engine's scheduler for steps of
    its own (`PipelineStage.submit`). When `finished`, `result` is what `run` gives those tokens at
    once, or `error` says why it failed (the chunk's failure alone, never its step's)."""

    stage: "PipelineStage"
    request_id: str
    num_tokens: int
    hidden: torch.Tensor | None  # the stage before's output for these tokens; None on the first stage
    since: float | None = None  # when it could have started on an emulated device (`run`'s `since`)
    waiter: object = None  # its caller's, to hand the result to (EngineLoop's future); never read here
    arrival_s: float = 0.0  # its request's arrival in the stage (`begin`), set by `submit`
    done: int = 0  # tokens computed
    parts: list = field(default_factory=list)  # what each step of it gave
    result: torch.Tensor | None = None
    error: Exception | None = None

    @property
    def finished(self) -> bool:
        return self.error is not None or self.done >= self.num_tokens

    def answer(self) -> None:
        """Once finished: its result or error to `waiter` (a future, on the thread that owns it), unless the
        waiter is done already (cancelled)."""
        if self.waiter is None or self.waiter.done():
            return
        if self.error is not None:
            self.waiter.set_exception(self.error)
        else:
            self.waiter.set_result(self.result)


class PipelineStage:
    """Layers `layers` of the prompts given to it, in `engine`'s cache. Not thread-safe: call it on the
    engine's thread, between its steps."""

    def __init__(self, engine, layers: range):
        num_layers = engine.runner.kv_spec.num_layers
        if not (0 <= layers.start < layers.stop <= num_layers):
            raise InvalidRequestError(f"stage layers {layers.start}..{layers.stop - 1} are outside the model's "
                                      f"{num_layers}")
        self.engine, self.layers = engine, layers
        self.first, self.last = layers.start == 0, layers.stop == num_layers
        self.view = engine.kv_cache.stage_view(layers)
        self.jobs: dict[str, _Job] = {}

    def begin(self, request_id: str, prompt_token_ids: list[int], prefix: list[KVPayload] = (),
              prefix_root: int = 0) -> None:
        """Hold blocks for the prompt; InvalidRequestError when the cache has no room or the id is taken.
        `prefix`: whole-block payloads of the prompt's leading blocks (read from the cache pool), at most
        `reusable_blocks`: this stage's layers of them are copied in and the prompt's chunks start after
        them; KVPayloadError (nothing held) when one is not the prompt's block or fails its check."""
        engine, n = self.engine, len(prompt_token_ids)
        if request_id in self.jobs:
            raise InvalidRequestError(f"request id {request_id!r} is already in this stage")
        if not 0 < n < engine.max_model_len:
            raise InvalidRequestError(f"the prompt has {n} tokens; the context length is {engine.max_model_len}")
        hashes = hash_blocks(prompt_token_ids, engine.block_size, engine.namespace, prefix_root)
        if len(prefix) > reusable_blocks(n, engine.block_size):
            raise InvalidRequestError(f"a {n}-token prompt reuses at most {reusable_blocks(n, engine.block_size)} "
                                      f"blocks, not {len(prefix)}: its last token is computed")
        num_blocks = -(-n // engine.block_size)
        held = engine.block_pool.allocate(-(-num_blocks // self.view.per_block))
        if held is None:
            raise InvalidRequestError(f"no room in this stage's KV cache for a {n}-token prompt")
        job = _Job(list(prompt_token_ids), held, self.view.blocks_in(held, num_blocks), hashes)
        for block, block_hash, payload in zip(job.blocks, hashes, prefix):
            try:
                if payload.block_hash != block_hash:
                    raise KVPayloadError(f"block {payload.block_hash:#x} is not the prompt's block {block_hash:#x}")
                engine.kv_cache.import_stage_block(self.view, block, payload, engine.namespace)
            except KVPayloadError as exc:
                engine.block_pool.release(held)
                raise KVPayloadError(str(exc), payload.block_hash) from None
            except BaseException:  # the device's (out of memory): the blocks go back all the same
                engine.block_pool.release(held)
                raise
        job.done = len(prefix) * engine.block_size
        self.jobs[request_id] = job

    def run(self, request_id: str, num_tokens: int, hidden: torch.Tensor | None,
            since: float | None = None) -> torch.Tensor:
        """The next `num_tokens` of the prompt through this stage's layers: the hidden states for the next
        stage, or, on the last stage, the logits of the prompt's last token ([1, vocab], after its last
        chunk; [0, vocab] before). An emulated runner's modelled time is waited out here, counted from
        `since` (a time.perf_counter(); default now): a caller whose next chunk was ready when the last one
        ended passes that one's `modelled_end`, so the host's lateness shortens this chunk, as a device
        running chunks back to back would, instead of adding up over the prompt (as `LLMEngine.step`)."""
        job = self.jobs[request_id]
        start, end = job.done, min(job.done + num_tokens, len(job.prompt))
        if end <= start:
            raise InvalidRequestError(f"request {request_id!r}: the whole prompt has been through this stage")
        if hidden is not None:
            hidden = hidden.to(self.engine.device)  # here, on the engine's thread: it waits for the device
        # NOTE: not before the engine's own last step ended on the device (a stage shares its engine's).
        started = time.perf_counter() if since is None else max(since, self.engine.modelled_end)
        runner = self.engine.runner
        batch = self._batch(job, start, end)
        out = runner.forward_stage(batch, self.view.kv, self.layers, hidden)
        job.done = end
        if runner.modelled:
            now = time.perf_counter()
            share = len(self.layers) / runner.kv_spec.num_layers
            job.modelled_end = max(now, started + runner.modelled.step_seconds(batch, share))
            self.engine.modelled_end = job.modelled_end  # NOTE: the device is its engine's: the next chunk waits
            if job.modelled_end > now:
                time.sleep(job.modelled_end - now)
        return out

    def submit(self, chunk: StageChunk) -> None:
        """Queue `chunk` in the engine's scheduler, between steps; InvalidRequestError when its request is
        not in this stage or the prompt has fewer tokens left than it and the chunks queued before it."""
        job = self.jobs.get(chunk.request_id)
        if job is None:
            raise InvalidRequestError(f"request {chunk.request_id!r} is not in this stage")
        queued = sum(c.num_tokens - c.done for c in self.engine.scheduler.stage_chunks
                     if c.stage is self and c.request_id == chunk.request_id)
        if not 0 < chunk.num_tokens <= len(job.prompt) - job.done - queued:
            raise InvalidRequestError(f"request {chunk.request_id!r}: a chunk of {chunk.num_tokens} tokens, with "
                                      f"{len(job.prompt) - job.done - queued} of its prompt left for this stage")
        chunk.arrival_s = job.arrival_s
        self.engine.scheduler.stage_chunks.append(chunk)

    def step(self, chunk: StageChunk, max_tokens: int, since: float | None = None) -> None:
        """One engine step of `chunk` (its turn, `Scheduler.stage_turn`): at most `max_tokens` more of it
        through `run`, its first part from its own `since` when it has one, a later part from the step's."""
        try:
            n = min(chunk.num_tokens - chunk.done, max_tokens)
            hidden = None if chunk.hidden is None else chunk.hidden[chunk.done:chunk.done + n]
            out = self.run(chunk.request_id, n, hidden, chunk.since if chunk.done == 0 and chunk.since is not None
                           else since)
            if chunk.done + n == chunk.num_tokens:  # the last stage's logits are its last part's (its last token's)
                chunk.result = out if self.last or not chunk.parts else torch.cat(chunk.parts + [out])
                chunk.parts = []
            else:
                chunk.parts.append(out)
            chunk.done += n
        except Exception as exc:  # noqa: BLE001  the chunk's caller gets it; the engine steps on
            chunk.error = exc

    def modelled_end(self, request_id: str) -> float | None:
        """When the request's last chunk here ended on an emulated device (see `run`); None when no chunk
        of it ran on one."""
        job = self.jobs.get(request_id)
        return job.modelled_end if job is not None and job.modelled_end else None

    def _batch(self, job: _Job, start: int, end: int) -> ForwardBatch:
        device, size = self.engine.device, self.engine.block_size
        table = torch.tensor(job.blocks, dtype=torch.long)
        context = torch.arange(end)
        slots = table[context // size] * size + context % size
        return ForwardBatch(
            input_ids=torch.tensor(job.prompt[start:end], dtype=torch.long, device=device),
            positions=torch.arange(start, end, device=device),
            slot_mapping=slots[start:].to(device),
            num_decode=0,
            decode_groups=(),
            prefills=(PrefillSpan(0, end - start, slots.to(device)),),
            logits_indices=torch.tensor([end - start - 1] if end == len(job.prompt) else [], dtype=torch.long,
                                        device=device))

    def num_full_blocks(self, request_id: str) -> int:
        """How many leading blocks of the prompt are full and through this stage (exportable)."""
        job = self.jobs[request_id]
        return min(job.done // self.engine.block_size, len(job.hashes))

    def export(self, request_id: str, first_block: int = 0, end_block: int | None = None) -> list[KVPayload]:
        """This stage's layers of the prompt's full computed blocks [first_block, end_block) (default: to
        the last full one): a payload per block and layer."""
        job, engine = self.jobs[request_id], self.engine
        full = self.num_full_blocks(request_id) if end_block is None else min(end_block, self.num_full_blocks(request_id))
        blocks = list(zip(job.blocks[first_block:full], job.hashes[first_block:full]))
        by_layer = [engine.export_blocks(blocks, layer, view=self.view) for layer in self.layers]
        return [by_layer[k][i] for i in range(len(blocks)) for k in range(len(self.layers))]

    def first_token(self, request_id: str, logits: torch.Tensor,
                    params: SamplingParams) -> tuple[int, TokenLogprob | None, str | None]:
        """On the last stage: the first token sampled from `run`'s logits as the engine samples it, its
        logprob when asked, and "stop" or "length" when it already ends the request."""
        engine = self.engine
        generator = None
        if not params.is_greedy:
            generator = torch.Generator(device=engine.device)
            generator.manual_seed(params.seed if params.seed is not None else torch.seed())
        prompt = self.jobs[request_id].prompt
        seq = Sequence(request_id, prompt, params, generator=generator)
        logits = logits.float()
        matcher = engine.grammars.matcher(params.grammar, prompt[len(prompt) - params.grammar_done:]) \
            if params.grammar is not None else None
        (token,) = sample(Grammars.mask(logits, [matcher]), [seq])
        if token is None:
            raise InvalidRequestError(f"request {request_id}: the model's next-token distribution is not finite "
                                      "(NaN or infinite logits)")
        (logprob,) = logprobs_of(logits, [seq], [token])
        stops = token in params.stop_token_ids or (not params.ignore_eos and token in engine.runner.eos_token_ids) \
            or matcher is not None and Grammars.advance(matcher, token)
        return token, logprob, "stop" if stops else "length" if params.max_tokens <= 1 else None

    def end(self, request_id: str) -> None:
        """Free the prompt's blocks, failing its chunks still queued; unknown ids are ignored."""
        self.engine.scheduler.drop_stage_chunks(self, request_id, f"request {request_id!r} left the stage")
        job = self.jobs.pop(request_id, None)
        if job is not None:
            self.engine.block_pool.release(job.held)
