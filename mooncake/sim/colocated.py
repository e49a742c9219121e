"""The vLLM-like baseline: each instance prefills and decodes on the same GPUs with continuous batching,
so a prefill in a step stalls that step's decode. Optional local prefix cache (in spare HBM) and chunked
prefill. Requests go to the instance with the fewest requests (a plain load balancer)."""

from collections import deque
from dataclasses import dataclass, field

from mooncake.config import SimConfig
from mooncake.cost import CostModel
from mooncake.sim.cluster import SimulatedCluster
from mooncake.sim.metrics import RequestRecord
from mooncake.sim.pool import NodePool
from mooncake.sim.trace import TraceRequest


@dataclass
class _Seq:
    record: RequestRecord
    hashes: tuple[int, ...]
    computed: int = 0  # prompt tokens with KV (reused or computed)
    context: int = 0
    remaining: int = 0


@dataclass
class _Instance:
    instance_id: int
    pool: NodePool
    waiting: deque = field(default_factory=deque)
    running: list = field(default_factory=list)
    stepping: bool = False


class ColocatedCluster(SimulatedCluster):
    def __init__(self, cfg: SimConfig, cost: CostModel):
        super().__init__(cfg, cost)
        capacity = cfg.vllm_cache_blocks if cfg.prefix_caching else 0
        self.instances = [_Instance(i, NodePool(capacity)) for i in range(cfg.num_instances)]

    def _arrive(self, i: int, req: TraceRequest) -> None:
        record = RequestRecord(i, self.loop.now, req.input_length, req.output_length)
        self.records.append(record)
        inst = min(self.instances, key=lambda x: (len(x.waiting) + len(x.running), x.instance_id))
        inst.waiting.append(_Seq(record, req.hash_ids))
        if not inst.stepping:
            self._step(inst)

    def _step(self, inst: _Instance) -> None:
        """Compose one step (prefill work for waiting requests, one token for each running one), run it."""
        work, prefill_s = [], 0.0
        kv_used = sum(s.context + s.remaining for s in inst.running)
        # With chunked prefill, vLLM's token budget per step: running decodes take one token each,
        # prefill chunks the rest. Without it, a prefill step holds one whole prompt (this trace's prompts
        # are long enough that two rarely fit one step's budget).
        budget = max(1, self.cfg.chunk_tokens - len(inst.running))
        for seq in list(inst.waiting):
            n = seq.record.input_tokens
            if seq.computed == 0:  # first scheduled: reuse the local prefix
                if kv_used + n + seq.record.output_tokens > self.cfg.decode_kv_tokens and inst.running:
                    break  # no room for its KV until some running request finishes
                seq.computed = min(inst.pool.prefix_len(seq.hashes) * self.cfg.block_tokens, n - 1)
                seq.record.cached_tokens = seq.computed
                kv_used += n + seq.record.output_tokens
            todo = n - seq.computed
            chunk = min(todo, budget) if self.cfg.chunked_prefill else todo
            if chunk <= 0 or (work and not self.cfg.chunked_prefill):
                break
            prefill_s += self.cost.prefill_s(seq.computed + chunk, seq.computed)
            work.append((seq, chunk))
            budget -= chunk
            if budget <= 0:
                break
        # Without chunked prefill a prefill step runs alone: decode waits for it.
        decoding = inst.running if (self.cfg.chunked_prefill or not work) else []
        if not work and not decoding:
            inst.stepping = False
            return
        inst.stepping = True
        self.prefill_gpu_s += prefill_s
        # One step: the chunks and the decode rows, as the cost model charges a mixed step (roofline or sum).
        chunks = [(seq.computed + chunk, seq.computed) for seq, chunk in work]
        step_s = self.cost.step_s(chunks, len(decoding), sum(s.context for s in decoding))
        self.loop.at(self.loop.now + step_s, self._step_done, inst, work, list(decoding))

    def _step_done(self, inst: _Instance, work, decoding) -> None:
        now = self.loop.now
        for seq in decoding:
            seq.record.token_times.append(now)
            seq.context += 1
            seq.remaining -= 1
        inst.running = [s for s in inst.running if s.remaining > 0]
        for seq, chunk in work:
            seq.computed += chunk
            if seq.computed >= seq.record.input_tokens:  # prompt done: first token, then decode
                inst.waiting.remove(seq)
                inst.pool.insert(seq.hashes)
                seq.record.token_times.append(now)
                seq.context, seq.remaining = seq.record.input_tokens + 1, seq.record.output_tokens - 1
                if seq.remaining > 0:
                    inst.running.append(seq)
        self._step(inst)
