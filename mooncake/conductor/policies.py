"""Placement policies: which prefill and decode instance serve a request. Algorithm 1 (KVCache-centric,
FAST'25 semantics) and the paper's baselines: random, round-robin, least-loaded, local-cache-aware.
Each policy only chooses the prefill instance (or CPP group: its prefill time is the pipeline's, cpp.py);
decode goes to the lowest predicted TBT for all of them.
Whether to serve the request at all is the admission policy's call (admission.py)."""

import random
from abc import ABC, abstractmethod
from dataclasses import dataclass, field

from mooncake.conductor.cpp import CppSettings, pipelined_prefill_s
from mooncake.conductor.estimators import (BandwidthEstimator, DecodeStepModel, OutputLengthModel,
                                           PrefillTimeModel)
from mooncake.conductor.prefix_index import PrefixIndex
from mooncake.conductor.view import ClusterView, DecodeView, Placement, PrefillView, RequestView
from mooncake.registry import load_backend


@dataclass
class Estimators:
    prefill_time: PrefillTimeModel
    decode_step: DecodeStepModel
    bandwidth: BandwidthEstimator
    output_length: OutputLengthModel = field(default_factory=OutputLengthModel)

    @classmethod
    def from_config(cls, cfg, prefill_coef, decode_coef, bandwidth_bytes_per_s: float) -> "Estimators":
        """The conductor's models as `cfg` (a ConductorConfig) sets them up: seeded with these coefficients
        times conductor.estimator_prior_scale, output lengths as conductor.output_lengths says."""
        k = cfg.estimator_prior_scale
        return cls(PrefillTimeModel(*(c * k for c in prefill_coef)), DecodeStepModel(*(c * k for c in decode_coef)),
                   BandwidthEstimator(bandwidth_bytes_per_s),
                   OutputLengthModel(cfg.output_tokens_prior, learn=cfg.output_lengths == "learned"))


@dataclass(frozen=True)
class _PrefillChoice:
    instance: PrefillView
    reuse_blocks: int
    fetch_from: str | None
    transfer_s: float
    ttft_s: float


class PlacementPolicy(ABC):
    cpp: CppSettings | None = None  # how a prefill view of stages > 1 runs a prompt (cpp.py)

    def __init__(self, index: PrefixIndex, estimators: Estimators):
        self.index = index
        self.est = estimators

    def place(self, request: RequestView, cluster: ClusterView, now: float) -> Placement | None:
        """Where to serve `request`, with the estimates admission needs; None if no instance is up."""
        if not cluster.prefills or not cluster.decodes:
            return None
        choice = self._choose_prefill(request, cluster)
        # NOTE: judge decode load when the request gets there, so requests still in prefill count too.
        decode, tbt_s = self._choose_decode(request, cluster.decodes, now + choice.ttft_s)
        members = choice.instance.member_ids
        return Placement(prefill_id=members[-1] if members else choice.instance.instance_id,
                         decode_id=decode.instance_id, reuse_blocks=choice.reuse_blocks, fetch_from=choice.fetch_from,
                         ttft_s=choice.ttft_s, tbt_s=tbt_s, transfer_s=choice.transfer_s, stage_ids=members)

    @abstractmethod
    def _choose_prefill(self, request: RequestView, cluster: ClusterView) -> _PrefillChoice: ...

    def _ttft(self, request, cluster, instance: PrefillView, reuse_blocks: int, fetch_from: str | None,
              local_blocks: int) -> float:
        """Algorithm 1's estimate: queue + transfer + prefill."""
        transfer_s = self._transfer_s(cluster, instance, reuse_blocks, fetch_from, local_blocks)
        reused_tokens = min(reuse_blocks * cluster.block_size, request.num_tokens)
        return instance.queued_prefill_s + transfer_s + self.prefill_s(request, instance, reused_tokens)

    def prefill_s(self, request, instance: PrefillView, reused_tokens: int) -> float:
        """The predicted prefill time of `request` on `instance` (one, or a CPP group), reusing that many tokens."""
        if instance.stages > 1 and self.cpp is not None:
            bytes_per_s = self.est.bandwidth.get(instance.instance_id, instance.instance_id)
            return pipelined_prefill_s(self.cpp, self.est.prefill_time.predict, request.num_tokens, reused_tokens,
                                       bytes_per_s)[-1]
        return self.est.prefill_time.predict(request.num_tokens, reused_tokens)

    def _transfer_s(self, cluster, instance, reuse_blocks, fetch_from, local_blocks) -> float:
        if fetch_from is None or reuse_blocks <= local_blocks:
            return 0.0
        bytes_needed = (reuse_blocks - local_blocks) * cluster.block_bytes
        return bytes_needed / self.est.bandwidth.get(fetch_from, instance.instance_id)

    def _estimate(self, request, cluster, instance: PrefillView, reuse_blocks: int,
                  fetch_from: str | None, local_blocks: int) -> _PrefillChoice:
        transfer_s = self._transfer_s(cluster, instance, reuse_blocks, fetch_from, local_blocks)
        ttft_s = self._ttft(request, cluster, instance, reuse_blocks, fetch_from, local_blocks)
        return _PrefillChoice(instance, reuse_blocks, fetch_from if transfer_s > 0 else None, transfer_s, ttft_s)

    def _local_only(self, request, cluster, instance: PrefillView) -> _PrefillChoice:
        local = self.index.prefix_len(request.block_hashes, instance.instance_id)
        return self._estimate(request, cluster, instance, local, None, local)

    def _choose_decode(self, request: RequestView, decodes: list[DecodeView], at: float):
        best = None
        for d in decodes:
            batch, context = d.batch_at(at)
            candidate = (self.est.decode_step.predict(batch + 1, context + request.num_tokens), d.instance_id, d)
            if best is None or candidate[:2] < best[:2]:
                best = candidate
        return best[2], best[0]


class KVCacheCentricPolicy(PlacementPolicy):
    """Algorithm 1: for every prefill instance, TTFT = queue + transfer + prefill, reusing either its
    local prefix or, when the pool's best holder has much more (ratio > balancing_threshold), fetching
    the difference from that holder; pick the lowest TTFT. Sources are the holders the cluster view calls
    fetchable. A fetch leaves a replica on the chosen instance (hot-spot migration): its prefix cache
    then holds the blocks, and its next report adds them to the index."""

    def __init__(self, index, estimators, balancing_threshold: float = 2.0):
        super().__init__(index, estimators)
        self.balancing_threshold = balancing_threshold

    def _choose_prefill(self, request, cluster):
        lengths = self.index.prefix_lengths(request.block_hashes)
        # NOTE: only a holder the data plane can read from is a source; any holder is still its own local.
        remote = {h: n for h, n in lengths.items() if cluster.fetchable is None or h in cluster.fetchable}
        best_len = max(remote.values(), default=0)
        best_holder = min((h for h, n in remote.items() if n == best_len), default=None)
        best = None
        for instance in cluster.prefills:
            local = lengths.get(instance.instance_id, 0)
            remote = best_len > 0 and (local == 0 or best_len / local > self.balancing_threshold)
            reuse, source = (best_len, best_holder) if remote else (local, None)
            if instance.member_ids:  # a live CPP group: its stages read the prefix from the pool, or compute it
                local, reuse, source = 0, best_len, best_holder
            ttft = self._ttft(request, cluster, instance, reuse, source, local)
            if best is None or (ttft, instance.instance_id) < best[:2]:
                best = (ttft, instance.instance_id, instance, reuse, source, local)
        _, _, instance, reuse, source, local = best
        return self._estimate(request, cluster, instance, reuse, source, local)


class LocalCacheAwarePolicy(PlacementPolicy):
    """Each instance counts only its own cache; pick the lowest TTFT (no transfers)."""

    def _choose_prefill(self, request, cluster):
        choices = [self._local_only(request, cluster, i) for i in cluster.prefills]
        return min(choices, key=lambda c: (c.ttft_s, c.instance.instance_id))


class LeastLoadedPolicy(PlacementPolicy):
    """Load balancing: the shortest predicted prefill queue, whatever it has cached."""

    def _choose_prefill(self, request, cluster):
        instance = min(cluster.prefills, key=lambda i: (i.queued_prefill_s, i.instance_id))
        return self._local_only(request, cluster, instance)


class RoundRobinPolicy(PlacementPolicy):
    def __init__(self, index, estimators):
        super().__init__(index, estimators)
        self._next = 0

    def _choose_prefill(self, request, cluster):
        instance = cluster.prefills[self._next % len(cluster.prefills)]
        self._next += 1
        return self._local_only(request, cluster, instance)


class RandomPolicy(PlacementPolicy):
    def __init__(self, index, estimators, seed: int = 0):
        super().__init__(index, estimators)
        self.rng = random.Random(seed)

    def _choose_prefill(self, request, cluster):
        return self._local_only(request, cluster, self.rng.choice(cluster.prefills))


def make_placement_policy(name: str, index: PrefixIndex, estimators: Estimators, **kwargs) -> PlacementPolicy:
    """The placement policy registered as `name` (mooncake/registry.py)."""
    return load_backend("placement", name)(index, estimators, **kwargs)
