"""LLMEngine: requests in, tokens out. `step()` is schedule -> run -> postprocess.

Also the KV hand-off points: `export_kv()` gives a sequence's full blocks as payloads (all layers or one
layer), and `add_request(kv_payloads=...)` imports such payloads so a sequence resumes in this engine."""

import logging
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass

import torch

from mooncake.config import EngineConfig
from mooncake.engine.batch import build_batch
from mooncake.engine.block_pool import BlockPool
from mooncake.engine.grammar import Grammars
from mooncake.engine.kv_cache import PagedKVCache
from mooncake.engine.kv_import import PendingImport, reserve
from mooncake.engine.sampler import logprobs_of, prompt_logprobs_of, sample
from mooncake.sampling import SamplingParams, TokenLogprob
from mooncake.engine.scheduler import Scheduler
from mooncake.engine.sequence import Sequence, finish_reason
from mooncake.errors import ConfigError, InvalidRequestError
from mooncake.hashing import hash_block, hash_blocks, make_namespace
from mooncake.kv_payload import KVPayload
from mooncake.models import resolve_model
from mooncake.registry import load_backend

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class RequestOutput:
    """What one step produced for one request."""

    request_id: str
    new_token_ids: list[int]
    finished: bool
    finish_reason: str | None
    num_prompt_tokens: int
    num_cached_tokens: int
    logprobs: list[TokenLogprob] | None = None  # one per new token, when the request asked
    prompt_logprobs: list[TokenLogprob] | None = None  # with the first token: one per prompt token but the first


@dataclass(frozen=True)
class FilledBlocks:
    """Blocks of one keep_kv request that a step fills, streamed layer by layer (`LLMEngine.layer_sink`):
    indices [first_block, first_block + len(blocks)) of its prompt, each (block, hash), pinned."""

    request_id: str
    first_block: int
    blocks: list[tuple[int, int]]


@dataclass(frozen=True)
class Completion:
    """A finished request, as `generate()` returns it."""

    request_id: str
    token_ids: list[int]
    finish_reason: str
    num_prompt_tokens: int
    num_cached_tokens: int
    ttft_s: float
    total_s: float
    logprobs: list[TokenLogprob] | None = None  # one per token, when the request asked
    prompt_logprobs: list[TokenLogprob] | None = None  # one per prompt token but the first, when asked


class LLMEngine:
    def __init__(self, config: EngineConfig):
        self.config = config
        if config.num_threads:
            torch.set_num_threads(config.num_threads)
        self.device = torch.device(config.device)
        if self.device.type == "cuda" and not torch.cuda.is_available():
            raise ConfigError(f"config key 'engine.device' is {config.device!r} but torch sees no CUDA device")
        self.dtype = getattr(torch, config.kv_dtype)
        self.model = resolve_model(config.model)
        runner_cls = load_backend("models", self.model.config["model_type"])
        self.runner = runner_cls.from_engine_config(self.model.path, self.device, self.dtype, config)
        self.last_modelled_s: float | None = None  # the last step's emulated time; None: not emulated, or no batch
        # ... and when that step ended on the emulated device: its start plus its modelled time, or later if
        # the host took longer; the time.sleep() that waits for it and the hand-back may overshoot
        self.modelled_end = 0.0
        self.block_size = config.block_size
        self.namespace = make_namespace(self.model.model_id, self.block_size, config.kv_dtype)
        self.max_model_len = min(config.max_model_len or self.runner.max_position_embeddings,
                                 self.runner.max_position_embeddings)
        if config.num_kv_blocks:
            num_blocks = config.num_kv_blocks
        elif self.runner.modelled and self.runner.modelled.kv_capacity_tokens:
            num_blocks = max(1, self.runner.modelled.kv_capacity_tokens // self.block_size)
        else:
            block_bytes = self.runner.kv_spec.block_bytes(self.block_size, config.kv_dtype)
            num_blocks = max(1, config.kv_cache_bytes // block_bytes)
        self.kv_cache = PagedKVCache(self.runner.kv_spec, num_blocks, self.block_size, self.dtype, self.device)
        self.block_pool = BlockPool(num_blocks)
        # NOTE: "auto" is resolved by the instance's role (instance/worker.py); a bare engine batches.
        self.scheduler = Scheduler(config, self.block_pool, serial_prefill=config.prefill_batching == "serial")
        self.seqs: dict[str, Sequence] = {}
        self.failed: list[tuple[str, str]] = []  # (request id, why): requests a step failed alone (drain_failed)
        self._importing: set[str] = set()  # request ids between begin_import and finish/cancel_import
        # Layer-wise KV streaming (a prefill instance's engine loop sets it): each step that fills blocks of
        # keep_kv requests pins them and calls layer_sink(i, filled, ready_at) once layer i's KV is written,
        # on the engine thread (it must only hand the work on), then layer_sink(None, filled, None) when the
        # step is over, whether it ran or failed: from then on the sink owes the pins' release
        # (`block_pool.release`). With an emulated runner every layer is handed over as soon as the forward has
        # written them all, each with `ready_at`, the time.perf_counter() its layer ends in the modelled
        # step (nothing of it may leave before); else ready_at is None (ready now).
        self.layer_sink: Callable[[int | None, list[FilledBlocks], float | None], None] | None = None
        self._tokenizer = None
        self._tokenizer_lock = threading.Lock()
        self.grammars = Grammars(lambda: self.tokenizer, self.runner.vocab_size, self.runner.eos_token_ids)
        log.info("engine ready: model %s (%s), %d KV blocks of %d tokens on %s/%s, %s prefill",
                 config.model, self.model.model_id, num_blocks, self.block_size, self.device, config.kv_dtype,
                 "serial" if self.scheduler.serial_prefill else "budget-batched")

    @property
    def tokenizer(self):
        if self._tokenizer is None:
            with self._tokenizer_lock:  # NOTE: a side thread may build it (an engine loop's prepare_grammars)
                if self._tokenizer is None:
                    from transformers import AutoTokenizer
                    self._tokenizer = AutoTokenizer.from_pretrained(self.model.path)
        return self._tokenizer

    # -- requests -----------------------------------------------------------------------------------

    def add_request(self, prompt_token_ids: list[int], params: SamplingParams | None = None,
                    request_id: str | None = None, kv_payloads: list[KVPayload] = (),
                    keep_kv: bool = False) -> str:
        """Queue a request. `kv_payloads` (from another engine's `export_kv`) supply leading blocks of the
        prompt; a payload that fails verification or does not match the prompt's hashes is a miss.
        With `keep_kv` the request's blocks outlive its finish, for `export_kv`, until `pop_completion`
        or `abort` (how a prefill instance holds KV until it is sent)."""
        if kv_payloads:
            pending = self.begin_import(prompt_token_ids, params, request_id, kv_payloads, keep_kv)
            try:
                pending.write(self.kv_cache, self.namespace)
            except BaseException:  # the device's (out of memory): give back what was reserved
                self.cancel_import(pending)
                raise
            return self.finish_import(pending)
        seq = self._new_sequence(prompt_token_ids, params, request_id, keep_kv)
        self.seqs[seq.seq_id] = seq
        self.scheduler.add(seq)
        return seq.seq_id

    def begin_import(self, prompt_token_ids: list[int], params: SamplingParams | None, request_id: str | None,
                     kv_payloads: list[KVPayload], keep_kv: bool = False) -> PendingImport:
        """`add_request` with imported KV, in three phases (mooncake/engine/kv_import.py): this one (between
        steps) checks the request and reserves blocks for the payloads; then `PendingImport.write` (any
        thread, steps may run meanwhile); then `finish_import` (between steps) queues the request, or
        `cancel_import` frees what was reserved."""
        seq = self._new_sequence(prompt_token_ids, params, request_id, keep_kv)
        pending = reserve(self.block_pool, seq, kv_payloads, self.runner.kv_spec.num_layers, self.block_size)
        self._importing.add(seq.seq_id)
        return pending

    def _new_sequence(self, prompt_token_ids: list[int], params: SamplingParams | None, request_id: str | None,
                      keep_kv: bool) -> Sequence:
        params = params or SamplingParams()
        self._validate(prompt_token_ids, params)
        request_id = request_id or uuid.uuid4().hex
        if request_id in self.seqs or request_id in self._importing:
            raise InvalidRequestError(f"request id {request_id!r} is already in use")
        generator = None
        if not params.is_greedy:
            generator = torch.Generator(device=self.device)
            generator.manual_seed(params.seed if params.seed is not None else torch.seed())
        seq = Sequence(seq_id=request_id, prompt_token_ids=list(prompt_token_ids), params=params,
                       generator=generator, keep_kv=keep_kv)
        if params.grammar is not None:
            seq.matcher = self.grammars.matcher(params.grammar, seq.prompt_token_ids[len(prompt_token_ids) -
                                                                                     params.grammar_done:])
        seq.block_hashes = hash_blocks(seq.prompt_token_ids, self.block_size, self.namespace, params.prefix_root)
        return seq

    def finish_import(self, pending: PendingImport) -> str:
        """Enter a written import's sequence with its good leading blocks; frees the rest."""
        seq = pending.seq
        self._importing.discard(seq.seq_id)
        kept, dropped = pending.entries[:pending.num_good], pending.entries[pending.num_good:]
        self.block_pool.release([block for block, _ in dropped])
        for i, (block, parts) in enumerate(kept):
            if parts:
                self.block_pool.register(block, seq.block_hashes[i])
        seq.block_table = [block for block, _ in kept]
        seq.num_computed_tokens = seq.num_cached_tokens = len(seq.block_table) * self.block_size
        seq.num_registered_blocks = len(seq.block_table)
        self.seqs[seq.seq_id] = seq
        self.scheduler.add(seq)
        return seq.seq_id

    def cancel_import(self, pending: PendingImport) -> None:
        """Free an import's blocks (after its write, if one ran: a write in progress still uses them)."""
        self._importing.discard(pending.request_id)
        self.block_pool.release([block for block, _ in pending.entries])
        pending.entries = []

    def abort(self, request_id: str) -> None:
        """Stop a request and free every block it holds; unknown ids are ignored."""
        seq = self.seqs.pop(request_id, None)
        if seq is None:
            return
        if seq.is_finished:
            self.scheduler.release(seq)
        else:
            self.scheduler.finish(seq, "abort")

    def has_unfinished(self) -> bool:
        return self.scheduler.has_work()

    def step(self, since: float | None = None) -> list[RequestOutput]:
        """Schedule, run and sample one batch (or a CPP stage's chunk, `Scheduler.stage_turn`). With an emulated runner the step lasts the time it models,
        counted from `since` (a `time.perf_counter()`; default: now): an engine loop running steps back to
        back passes the previous step's `modelled_end`, so what it does between steps counts against that
        time as it would overlap the device's work on real hardware, and a step the host ended late (a
        sleep's overshoot, a thread's wake-up) shortens the next instead of delaying every later one."""
        started = time.perf_counter() if since is None else since
        self.last_modelled_s = None
        scheduled = self.scheduler.schedule()
        if (chunk := self.scheduler.stage_turn(scheduled)) is not None:  # a CPP stage's chunk takes the step
            chunk.stage.step(chunk, self.scheduler.max_num_batched_tokens, since)
            self.scheduler.on_stage_computed(chunk)
            return []
        if not scheduled:
            return []
        batch, sampled, prompt_rows = build_batch(scheduled, self.block_size, self.device, self.dtype)
        filled = self._filling(scheduled) if self.layer_sink is not None else []
        sink = self.layer_sink
        on_layer = (lambda layer: sink(layer, filled, None)) if filled else None
        modelled = self.runner.modelled
        modelled_s = modelled.step_seconds(batch) if modelled else None
        try:
            logits = self.runner.forward(batch, self.kv_cache.kv, None if modelled else on_layer)
            if filled and modelled:
                self._hand_over_modelled_layers(filled, started, modelled_s)
            self.scheduler.on_computed(scheduled)
            if prompt_rows:
                for r, logprobs in zip(prompt_rows, prompt_logprobs_of(logits, prompt_rows)):
                    r.seq.prompt_logprobs[r.first:] = logprobs  # NOTE: a preempted prompt's are computed again
                logits = logits[:len(sampled)]
            tokens = sample(Grammars.mask(logits, [seq.matcher for seq in sampled]), sampled)
            if None in tokens:
                logits, sampled, tokens = self._drop_unsampled(logits, sampled, tokens)
            outputs = self._postprocess(sampled, tokens, logprobs_of(logits, sampled, tokens))
            self.last_modelled_s = modelled_s
            if modelled_s:
                now = time.perf_counter()
                self.modelled_end = max(now, started + self.last_modelled_s)
                if self.modelled_end > now:
                    time.sleep(self.modelled_end - now)  # on the engine thread, as a device step would hold it
        finally:
            if filled:
                sink(None, filled, None)
        return outputs

    def _drop_unsampled(self, logits: torch.Tensor, seqs: list[Sequence],
                        tokens: list[int | None]) -> tuple[torch.Tensor, list[Sequence], list[int]]:
        """Abort the sequences that got no token (their distribution is not finite) and note them in
        `failed`; the rest of the batch goes on."""
        keep = [i for i, token in enumerate(tokens) if token is not None]
        for seq, token in zip(seqs, tokens):
            if token is None:
                log.warning("request %s: its next-token distribution is not finite (temperature %g); it fails "
                            "alone", seq.seq_id, seq.params.temperature)
                self.failed.append((seq.seq_id, "the model's next-token distribution for this request is not "
                                    "finite (NaN or infinite logits)"))
                self.abort(seq.seq_id)
        return logits[keep], [seqs[i] for i in keep], [tokens[i] for i in keep]

    def drain_failed(self) -> list[tuple[str, str]]:
        """(request id, why) of the requests steps failed alone since the last call; each is aborted."""
        failed, self.failed = self.failed, []
        return failed

    def _filling(self, scheduled: list) -> list[FilledBlocks]:
        """The prompt blocks of keep_kv requests that this step fills, pinned (see `layer_sink`)."""
        filled = []
        for s in scheduled:
            seq = s.seq
            if not seq.keep_kv:
                continue
            first = min(seq.num_computed_tokens // self.block_size, len(seq.block_hashes))
            last = min((seq.num_computed_tokens + s.num_new_tokens) // self.block_size, len(seq.block_hashes))
            if last > first:
                filled.append(FilledBlocks(seq.seq_id, first, [(seq.block_table[i], seq.block_hashes[i])
                                                               for i in range(first, last)]))
        self.block_pool.acquire([block for f in filled for block, _ in f.blocks])
        return filled

    def _hand_over_modelled_layers(self, filled: list[FilledBlocks], started: float, modelled_s: float) -> None:
        """An emulated step: every layer is written already; each goes to the sink now, ready at its end in
        the modelled step (layers take equal shares of it). Waking the engine thread at each layer's end
        instead would time the GIL, not the model."""
        num_layers = self.runner.kv_spec.num_layers
        for layer in range(num_layers):
            self.layer_sink(layer, filled, started + modelled_s * (layer + 1) / num_layers)

    def generate(self, prompts: list[list[int]], params: SamplingParams | None = None) -> list[Completion]:
        """Run prompts to completion together (continuous batching); results in prompt order."""
        ids = [self.add_request(p, params) for p in prompts]
        failed = {}
        while self.has_unfinished():
            self.step()
            failed.update(self.drain_failed())
        if failed:
            for request_id in ids:
                self.abort(request_id)
            raise InvalidRequestError(f"{len(failed)} of {len(ids)} prompts failed: {next(iter(failed.values()))}")
        return [self.pop_completion(i) for i in ids]

    def pop_completion(self, request_id: str) -> Completion:
        """The finished request's result; frees any blocks it kept."""
        seq = self.seqs.get(request_id)
        if seq is None or not seq.is_finished:
            raise InvalidRequestError(f"request {request_id!r} is unknown or not finished")
        del self.seqs[request_id]
        self.scheduler.release(seq)
        now = time.perf_counter()
        return Completion(request_id=request_id, token_ids=list(seq.output_token_ids),
                          finish_reason=seq.finish_reason, num_prompt_tokens=len(seq.prompt_token_ids),
                          num_cached_tokens=seq.num_cached_tokens,
                          ttft_s=(seq.first_token_s or now) - seq.arrival_s, total_s=now - seq.arrival_s,
                          logprobs=list(seq.output_logprobs) if seq.params.logprobs is not None else None,
                          prompt_logprobs=_prompt_logprobs(seq))

    # -- KV export / import ----------------------------------------------------------------------

    def export_kv(self, request_id: str, layer: int | None = None, first_block: int = 0) -> list[KVPayload]:
        """Payloads of the request's computed full blocks from `first_block` on, in prefix order (one
        layer if `layer` is set)."""
        seq = self.seqs.get(request_id)
        if seq is None:
            raise InvalidRequestError(f"unknown request id {request_id!r}")
        return self.export_blocks([(seq.block_table[i], seq.block_hashes[i])
                                   for i in range(first_block, self.num_full_blocks(request_id))], layer)

    def pin_blocks(self, request_id: str, first_block: int, num_blocks: int) -> list[tuple[int, int]]:
        """(block, hash) of the request's computed full blocks [first_block, first_block + num_blocks),
        each held once more (until `block_pool.release`), so `export_blocks` may copy them on another thread
        while steps run: a computed full block is never written again, and a held one never reused."""
        seq = self.seqs.get(request_id)
        if seq is None:
            raise InvalidRequestError(f"unknown request id {request_id!r}")
        last = min(first_block + num_blocks, self.num_full_blocks(request_id))
        blocks = [(seq.block_table[i], seq.block_hashes[i]) for i in range(first_block, last)]
        self.block_pool.acquire([block for block, _ in blocks])
        return blocks

    def export_blocks(self, blocks: list[tuple[int, int]], layer: int | None = None, after=None,
                      view=None) -> list[KVPayload]:
        """Payloads of pinned blocks (`pin_blocks`); safe on any thread while the engine steps. `after`: what
        the copy waits for on a device (`PagedKVCache.mark_written`); `view`: blocks of a CPP stage's
        `PagedKVCache.stage_view`."""
        return self.kv_cache.export_blocks(blocks, self.namespace, layer, after, view)

    def num_full_blocks(self, request_id: str) -> int:
        """How many leading blocks of the request are full and computed (exportable)."""
        seq = self.seqs[request_id]
        return min(seq.num_computed_tokens // self.block_size, len(seq.block_hashes))

    # -- internals --------------------------------------------------------------------------------

    def _validate(self, prompt_token_ids: list[int], params: SamplingParams) -> None:
        n = len(prompt_token_ids)
        if n == 0:
            raise InvalidRequestError("the prompt is empty")
        if n >= self.max_model_len:
            raise InvalidRequestError(f"the prompt has {n} tokens; the context length is {self.max_model_len}")
        if n + params.max_tokens > self.max_model_len:
            raise InvalidRequestError(
                f"prompt ({n} tokens) + max_tokens ({params.max_tokens}) exceeds the context length "
                f"{self.max_model_len}; ask for at most {self.max_model_len - n} tokens")
        vocab = self.runner.vocab_size
        if any(not 0 <= t < vocab for t in prompt_token_ids):
            raise InvalidRequestError(f"prompt token ids must be in [0, {vocab})")
        if params.top_k > vocab:
            raise InvalidRequestError(f"top_k must be at most the vocabulary size {vocab}, got {params.top_k}", "top_k")
        if any(t >= vocab for t in params.stop_token_ids):
            raise InvalidRequestError(f"stop_token_ids must be token ids below {vocab}", "stop_token_ids")
        blocks_needed = -(-(n + params.max_tokens) // self.block_size)
        if blocks_needed > self.block_pool.num_blocks:
            raise InvalidRequestError(f"the request needs {blocks_needed} KV blocks; the cache has "
                                      f"{self.block_pool.num_blocks} (raise engine.kv_cache_bytes)")

    def _postprocess(self, seqs: list[Sequence], tokens: list[int],
                     logprobs: list[TokenLogprob | None]) -> list[RequestOutput]:
        outputs, now = [], time.perf_counter()
        for seq, token, logprob in zip(seqs, tokens, logprobs):
            try:
                complete = seq.matcher is not None and Grammars.advance(seq.matcher, token)
            except InvalidRequestError as exc:  # NOTE: it fails alone, as one whose distribution is not finite
                self.failed.append((seq.seq_id, str(exc)))
                self.abort(seq.seq_id)
                continue
            prompt_logprobs = _prompt_logprobs(seq) if not seq.output_token_ids else None
            seq.output_token_ids.append(token)
            if logprob is not None:
                seq.output_logprobs.append(logprob)
            if seq.first_token_s is None:
                seq.first_token_s = now
            if seq.num_tokens % self.block_size == 0:  # a block just filled: extend the hash chain
                parent = seq.block_hashes[-1] if seq.block_hashes else seq.params.prefix_root
                seq.block_hashes.append(hash_block(parent, seq.token_ids[-self.block_size:], self.namespace))
            # NOTE: the tokenizer is loaded at the first request with stop strings, not before
            reason = "stop" if complete else finish_reason(seq, token, self.runner.eos_token_ids,
                                                            self.max_model_len, lambda: self.tokenizer)
            if reason:
                self.scheduler.finish(seq, reason, free=not seq.keep_kv)
            outputs.append(RequestOutput(seq.seq_id, [token], reason is not None, reason,
                                         len(seq.prompt_token_ids), seq.num_cached_tokens,
                                         None if logprob is None else [logprob], prompt_logprobs))
        return outputs


def _prompt_logprobs(seq: Sequence) -> list[TokenLogprob] | None:
    """Its prompt's logprobs (one per token but the first), when it asked for them."""
    if seq.params.prompt_logprobs is None:
        return None
    if len(seq.prompt_logprobs) != len(seq.prompt_token_ids) - 1:  # NOTE: a bug; its API process fails it alone
        log.error("request %s: %d of its prompt's %d logprobs were computed", seq.seq_id, len(seq.prompt_logprobs),
                  len(seq.prompt_token_ids) - 1)
        return None
    return list(seq.prompt_logprobs)
