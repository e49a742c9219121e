"""A simulated Mooncake cluster: prefill and decode instances apart, every node's DRAM (prefill, and decode
unless `sim.pool_decode_dram` is off) pooled into one KVCache, and the conductor's own policy classes
placing and admitting each request.

Prefill instances run their queue one request at a time (reusing the chosen prefix, fetching it first
when it lives elsewhere); new blocks join the node's pool and the global index. KV streams to decode
layer by layer, so only the last layer's transfer shows; decode instances run continuous batching.

With CPP groups (`conductor.cpp_stages` = X > 1), each simulated prefill instance is a group of X nodes
run as a pipeline (conductor/cpp.py), with the DRAM of all X in its pool share. A request enters stage 0
once stage 0 is free, and each later stage takes each chunk once it is free and the stage before has
passed the chunk on, so requests follow each other through the stages; the first token comes when the last
stage ends. `sim.num_prefill` counts nodes: it must be a multiple of X."""

from collections import deque
from dataclasses import dataclass, field

from mooncake.conductor.cpp import CppSettings, pipelined_prefill_s
from mooncake.conductor.decide import Decider
from mooncake.conductor.policies import Estimators
from mooncake.conductor.prefix_index import PrefixIndex
from mooncake.conductor.view import ClusterView, DecodeLoad, DecodeView, PrefillView, RequestView
from mooncake.config import ConductorConfig, SimConfig
from mooncake.cost import CostModel
from mooncake.errors import ConfigError, Rejected, Unavailable
from mooncake.sim.cluster import SimulatedCluster
from mooncake.sim.metrics import RequestRecord
from mooncake.sim.pool import NodePool
from mooncake.sim.trace import TraceRequest


@dataclass
class _Job:
    record: RequestRecord
    hashes: tuple[int, ...]
    decode_id: str
    reuse_blocks: int
    fetch_from: str | None
    predicted_s: float  # the conductor's prefill-time estimate, for queue views
    ready_s: float = 0.0  # predicted arrival at decode
    compute_s: float = 0.0  # its prefill's compute, once started


@dataclass
class _Prefill:
    instance_id: str
    pool: NodePool
    queue: deque = field(default_factory=deque)
    queued_s: float = 0.0  # sum of the queue's predicted prefill times, kept as jobs come and go
    busy_until: float = 0.0  # when stage 0 (the whole instance, without CPP) can take the next request
    busy: bool = False
    stage_free: list = field(default_factory=lambda: [0.0])  # when each pipeline stage ends its work


@dataclass
class _Active:
    record: RequestRecord
    context: int
    remaining: int


@dataclass
class _Decode:
    instance_id: str
    pool: NodePool | None = None  # its node's DRAM share of the pool, when pooled
    running: list = field(default_factory=list)
    pending: list = field(default_factory=list)  # KV arrived, joins at the next step
    incoming: dict = field(default_factory=dict)  # request id -> _Job still in prefill
    stepping: bool = False
    step_s: float = 0.0


class DisaggregatedCluster(SimulatedCluster):
    def __init__(self, cfg: SimConfig, conductor: ConductorConfig, cost: CostModel):
        super().__init__(cfg, cost)
        self.index = PrefixIndex()
        # NOTE: seeded as an emulated instance seeds the live conductor at Register: the cost model's own
        # coefficients (times conductor.estimator_prior_scale)
        self.est = est = Estimators.from_config(conductor, cost.prefill_coefficients(), cost.decode_coefficients(),
                                                cost.network_bytes_per_s)
        self.cpp = CppSettings.from_config(conductor, cost.activation_bytes_per_token)
        self.decider = Decider(conductor, self.index, est, self.cpp)  # the live conductor's decision core
        self.tbt_slo_s = conductor.tbt_slo_s
        self.ttft_slo_s = conductor.ttft_slo_s
        x = conductor.cpp_stages
        if cfg.num_prefill % x:
            raise ConfigError(f"sim.num_prefill = {cfg.num_prefill} must be a multiple of conductor.cpp_stages = {x}")
        self.prefills = {f"p{i}": _Prefill(f"p{i}", NodePool(x * cfg.dram_blocks_per_node), stage_free=[0.0] * x)
                         for i in range(cfg.num_prefill // x)}
        self.decodes = {f"d{i}": _Decode(f"d{i}", NodePool(cfg.dram_blocks_per_node) if cfg.pool_decode_dram else None)
                        for i in range(cfg.num_decode)}
        self.block_bytes = cost.kv_bytes(cfg.block_tokens)


    # -- conductor ------------------------------------------------------------------------------

    def _view(self, now: float) -> ClusterView:
        prefills = [PrefillView(p.instance_id, max(0.0, p.busy_until - now) + p.queued_s, len(p.queue),
                                len(p.stage_free)) for p in self.prefills.values()]
        decodes = []
        for d in self.decodes.values():
            # NOTE: what the live conductor knows (decide.cluster_view): the instance's last step time and
            # each request's current context, and the tokens it predicts each has left from what it wrote
            # and its max_tokens (sim.max_tokens; 0: the trace's output length, a replay's oracle).
            step = d.step_s or self.est.decode_step.predict(1, 0)
            left = self.est.output_length.left
            loads = [DecodeLoad.ahead(now, left(a.context - a.record.input_tokens, self._cap(a.record)), a.context,
                                      step) for a in d.running + d.pending]
            # NOTE: requests due at decode beyond the TTFT SLO cannot change a decision made now; leaving
            # them out keeps an overloaded run (thousands queued for prefill) from going quadratic.
            horizon = now + self.ttft_slo_s
            loads += [DecodeLoad.ahead(j.ready_s, left(0, self._cap(j.record)), j.record.input_tokens, step)
                      for j in d.incoming.values() if j.ready_s <= horizon]
            decodes.append(DecodeView(d.instance_id, loads))
        return ClusterView(prefills, decodes, block_size=self.cfg.block_tokens, block_bytes=self.block_bytes)

    def _cap(self, record: RequestRecord) -> int:
        return self.cfg.max_tokens or record.output_tokens

    def _arrive(self, i: int, req: TraceRequest) -> None:
        now = self.loop.now
        record = RequestRecord(i, now, req.input_length, req.output_length)
        self.records.append(record)
        request = RequestView(str(i), req.input_length, req.hash_ids, self._cap(record), now)
        view = self._view(now)
        try:
            placement = self.decider.decide(request, view, now)
        except (Unavailable, Rejected):
            record.rejected_at = "arrival"
            return
        record.predicted_ttft_s = placement.ttft_s
        reused = min(placement.reuse_blocks * self.cfg.block_tokens, req.input_length - 1)
        prefill = self.prefills[placement.prefill_id]
        # what the request holds stage 0 for: all of its work, or stage 0's layers of it in a CPP group
        predicted_s = self.est.prefill_time.predict(req.input_length, reused) / len(prefill.stage_free)
        job = _Job(record, req.hash_ids, placement.decode_id, placement.reuse_blocks, placement.fetch_from,
                   predicted_s=predicted_s + placement.transfer_s, ready_s=now + placement.ttft_s)
        self.decodes[placement.decode_id].incoming[i] = job
        prefill.queue.append(job)
        prefill.queued_s += job.predicted_s
        if not prefill.busy:
            self._start_prefill(prefill)

    def loads(self) -> tuple[float, float]:
        """The worst instance of each role: prefill = queued work / TTFT SLO, decode = step time / TBT SLO."""
        now = self.loop.now
        prefill = max(max(0.0, p.busy_until - now) + p.queued_s for p in self.prefills.values())
        decode = max(self.cost.step_s((), len(d.running), sum(a.context for a in d.running))
                     for d in self.decodes.values())
        return prefill / self.ttft_slo_s, decode / self.tbt_slo_s

    # -- prefill --------------------------------------------------------------------------------

    def _start_prefill(self, p: _Prefill) -> None:
        if not p.queue:
            p.busy = False
            return
        job = p.queue.popleft()
        p.queued_s = max(0.0, p.queued_s - job.predicted_s) if p.queue else 0.0
        now = self.loop.now
        n = job.record.input_tokens
        local = p.pool.prefix_len(job.hashes)
        fetched = 0
        holder = self.prefills.get(job.fetch_from) or self.decodes.get(job.fetch_from)
        if holder is not None and holder.pool is not None:  # blocks may have gone since placement
            fetched = max(0, min(job.reuse_blocks, holder.pool.prefix_len(job.hashes)) - local)
        reused = min((local + fetched) * self.cfg.block_tokens, n - 1)
        job.compute_s = compute_s = self.cost.prefill_s(n, reused)
        self.prefill_gpu_s += compute_s
        job.record.cached_tokens = reused
        x = len(p.stage_free)
        # NOTE: a CPP group's stages each read their 1/X of the fetched blocks' layers, in parallel.
        start = now + self.cost.transfer_s(fetched * self.block_bytes / x)
        if x == 1:
            ends = [start + compute_s]
        else:
            ends = pipelined_prefill_s(self.cpp, self.cost.prefill_s, n, reused, self.cost.network_bytes_per_s,
                                       [max(start, f) for f in p.stage_free])
        p.stage_free = ends
        p.busy, p.busy_until = True, ends[0]
        self.loop.at(ends[-1], self._prefill_done, p, job)
        if x > 1:  # stage 0 takes the next request while the later stages finish this one
            self.loop.at(ends[0], self._start_prefill, p)

    def _prefill_done(self, p: _Prefill, job: _Job) -> None:
        now = self.loop.now
        job.record.token_times.append(now)  # the last stage yields the first token
        added, evicted = p.pool.insert(job.hashes)  # new blocks, and fetched ones: a local replica
        self.index.add(p.instance_id, added)
        self.index.remove(p.instance_id, evicted)
        if len(p.stage_free) == 1:  # refit as the live conductor does on PrefillDone (not from a CPP group)
            self.est.prefill_time.observe(job.record.input_tokens, job.record.cached_tokens, job.compute_s)
        decode = self.decodes[job.decode_id]
        decode.incoming.pop(job.record.request_id, None)
        if job.record.output_tokens <= 1:
            self.est.output_length.observe(job.record.output_tokens)  # over with its first token
        else:
            # Layer-wise streaming: all but the last layer's KV moved while later layers computed.
            last_layer_s = self.cost.transfer_s(self.cost.kv_bytes(job.record.input_tokens)) / self.cost.layers
            self.loop.at(now + last_layer_s, self._kv_arrived, decode, job.record, job.hashes)
        if len(p.stage_free) == 1:
            self._start_prefill(p)

    # -- decode ---------------------------------------------------------------------------------

    def _kv_arrived(self, d: _Decode, record: RequestRecord, hashes: tuple[int, ...] = ()) -> None:
        if d.pool is not None:  # the prompt's KV now sits in this node's DRAM: it joins the pool
            added, evicted = d.pool.insert(hashes)
            self.index.add(d.instance_id, added)
            self.index.remove(d.instance_id, evicted)
        if self.cfg.reject_at_decode:
            batch = len(d.running) + len(d.pending) + 1
            context = sum(a.context for a in d.running + d.pending) + record.input_tokens
            if self.est.decode_step.predict(batch, context) > self.tbt_slo_s:
                record.rejected_at = "decode"  # its prefill was wasted
                return
        d.pending.append(_Active(record, record.input_tokens + 1, record.output_tokens - 1))
        if not d.stepping:
            self._step(d)

    def _step(self, d: _Decode) -> None:
        budget = self.cfg.decode_kv_tokens - sum(a.context for a in d.running)
        while d.pending and (d.pending[0].context + d.pending[0].remaining <= budget or not d.running):
            active = d.pending.pop(0)
            budget -= active.context + active.remaining
            d.running.append(active)
        if not d.running:
            d.stepping = False
            return
        d.stepping = True
        context = sum(a.context for a in d.running)
        d.step_s = self.cost.step_s((), len(d.running), context)
        self.est.decode_step.observe(len(d.running), context, d.step_s)  # as the live one from heartbeats
        self.loop.at(self.loop.now + d.step_s, self._step_done, d)

    def _step_done(self, d: _Decode) -> None:
        now = self.loop.now
        still = []
        for a in d.running:
            a.record.token_times.append(now)
            a.context += 1
            a.remaining -= 1
            if a.remaining > 0:
                still.append(a)
            else:  # the live conductor learns the length when the request's LegEnded comes
                self.est.output_length.observe(a.record.output_tokens)
        d.running = still
        self._step(d)
