"""Importing a request's KV in three phases, so that verifying and copying the bytes never holds up an
engine step: `LLMEngine.begin_import` reserves the blocks (between steps), `PendingImport.write` verifies
each payload and copies it into its reserved block (on any thread, while steps run: no step reads or
writes a block that no sequence has yet), and `LLMEngine.finish_import` enters the sequence (between
steps). `add_request(kv_payloads=...)` runs the three back to back."""

import logging
from dataclasses import dataclass, field

from mooncake.engine.block_pool import BlockPool
from mooncake.engine.kv_cache import PagedKVCache
from mooncake.engine.sequence import Sequence
from mooncake.errors import KVPayloadError
from mooncake.kv_payload import KVPayload

log = logging.getLogger(__name__)


@dataclass
class PendingImport:
    seq: Sequence
    # Per leading block of the prompt, in order: (block, payloads to write there); no payloads for a block
    # this engine already held (acquired as it is).
    entries: list[tuple[int, list[KVPayload]]] = field(default_factory=list)
    num_good: int = 0  # leading entries written and verified (held ones count as good)

    @property
    def request_id(self) -> str:
        return self.seq.seq_id

    def write(self, kv_cache: PagedKVCache, namespace: bytes) -> int:
        """Verify every payload and copy it into its block, in prefix order, stopping at the first that
        fails (the rest is recomputed). Safe on any thread while the engine steps. Returns `num_good`."""
        for block, parts in self.entries:
            try:
                for payload in parts:
                    kv_cache.import_block(block, payload, namespace)
            except KVPayloadError as exc:
                log.warning("request %s: imported KV rejected, recomputing from there: %s", self.request_id, exc)
                break
            self.num_good += 1
        return self.num_good


def reserve(block_pool: BlockPool, seq: Sequence, payloads: list[KVPayload], num_layers: int,
            block_size: int) -> PendingImport:
    """A block per leading prompt block the payloads (or this engine's cache) cover, up to the last
    full block before the prompt's last token: held ones acquired, the others allocated for writing.
    Between steps (`LLMEngine.begin_import`)."""
    by_hash: dict[int, dict] = {}
    for p in payloads:
        by_hash.setdefault(p.block_hash, {})[p.layer] = p
    max_blocks = (seq.num_tokens - 1) // block_size
    pending = PendingImport(seq)
    for block_hash in seq.block_hashes[:max_blocks]:
        block = block_pool.match_prefix([block_hash])  # already cached here: reuse it, payload or not
        if block:
            block_pool.acquire(block)
            pending.entries.append((block[0], []))
            continue
        parts = by_hash.get(block_hash, {})
        chosen = [parts[None]] if None in parts else [parts.get(layer) for layer in range(num_layers)]
        if any(p is None for p in chosen):
            break  # the chain stops at the first missing block
        block = block_pool.allocate(1)
        if block is None:
            break
        pending.entries.append((block[0], chosen))
    return pending
