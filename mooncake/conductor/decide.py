"""The conductor's decision for one request: where (the placement policy, Algorithm 1 by default) and
whether (the admission policy, early rejection), over a ClusterView of the live instances and the requests
in flight on them. No sockets and no clock of its own: the caller says what time it is. The live
conductor and the simulator (sim/disaggregated.py) decide through the same object."""

import logging

from mooncake.conductor.admission import make_admission_policy
from mooncake.conductor.cpp import CppSettings
from mooncake.conductor.estimators import OutputLengthModel
from mooncake.conductor.flight import Flight
from mooncake.conductor.instances import InstanceRegistry
from mooncake.conductor.policies import Estimators, make_placement_policy
from mooncake.conductor.prefix_index import PrefixIndex
from mooncake.conductor.view import ClusterView, DecodeLoad, DecodeView, Placement, PrefillView, RequestView
from mooncake.config import ConductorConfig
from mooncake.errors import Rejected, Unavailable

log = logging.getLogger(__name__)


class Decider:
    def __init__(self, cfg: ConductorConfig, index: PrefixIndex, estimators: Estimators,
                 cpp: CppSettings | None = None):
        """`cpp`: how the cluster's CPP groups (prefill views of stages > 1) run a prompt; None: no groups."""
        self.cfg = cfg
        kwargs = {"balancing_threshold": cfg.balancing_threshold} if cfg.placement == "kvcache-centric" else {}
        self.policy = make_placement_policy(cfg.placement, index, estimators, **kwargs)
        self.policy.cpp = cpp
        self.admission = make_admission_policy(cfg.admission, estimators.decode_step, cfg.ttft_slo_s,
                                               cfg.tbt_slo_s)

    def decide(self, request: RequestView, cluster: ClusterView, now: float, admit: bool = True) -> Placement:
        """The placement of `request`; raises Unavailable when no instance can take it and, with `admit`,
        Rejected when admission predicts an SLO miss (a migrating request was admitted already)."""
        placement = self.policy.place(request, cluster, now)
        if placement is None:
            missing = " and ".join(r for r, views in (("prefill", cluster.prefills), ("decode", cluster.decodes))
                                   if not views)
            raise Unavailable(f"no live {missing} instance to serve the request; retry when one has registered")
        rejection = self.admission.admit(request, placement, cluster, now) if admit else None
        if rejection is None:
            return placement
        log.debug("rejected %s: %s (TTFT %.2f s, TBT %.3f s predicted)", request.request_id, rejection.reason,
                  rejection.ttft_s, rejection.tbt_s)
        if rejection.reason == "ttft_slo":
            what = f"time to first token {rejection.ttft_s:.2f} s exceeds conductor.ttft_slo_s = {self.cfg.ttft_slo_s:g} s"
        else:
            what = f"time between tokens {rejection.tbt_s:.3f} s exceeds conductor.tbt_slo_s = {self.cfg.tbt_slo_s:g} s"
        raise Rejected(rejection.reason, f"the cluster is overloaded: the predicted {what}; retry later",
                       retry_after_s=max(1.0, placement.ttft_s))


def cluster_view(registry: InstanceRegistry, flights: dict[str, Flight], block_size: int, block_bytes: int,
                 pool_nodes: frozenset[str], now: float, avoid: tuple[str, ...] = (),
                 group_stages: int = 1, idle_step_s: float = 0.0,
                 output_lengths: OutputLengthModel | None = None) -> ClusterView:
    """The live instances with the load of the requests in flight on them, and the live cache nodes as the
    only holders a prefix can be fetched from. Instances in `avoid` are left out while another of their
    role is alive. With `group_stages` > 1 and that many prefill instances, one CPP group more: the
    least-loaded ones, its queue their longest (a prompt runs through every stage).

    A prefill instance's queue is the predicted prefill time of its requests less what it has done of
    them: it has worked on them since its last hand-off or since the oldest of them arrived, whichever is
    later (a batched step serves several at once, so the queue drains as a whole).

    A decode instance's requests decode at its last reported step time (`idle_step_s` before it reported
    one), each with its current context, those still in prefill from their predicted hand-off or now if
    that is past (DecodeLoad.ahead: the simulator predicts the same way from the same information), for the
    tokens `output_lengths` predicts it has left (None: its max_tokens less those written)."""
    def live(role):
        instances = registry.alive(role)
        return [i for i in instances if i.instance_id not in avoid] or instances

    prefills, decodes = [], []
    for instance in live("prefill"):
        queued = [f for r in instance.request_ids if (f := flights.get(r)) is not None and f.in_prefill]
        work_s = sum(f.predicted_prefill_s for f in queued)
        if queued:
            since = max(instance.last_done_s, min(f.placed_s for f in queued))
            work_s = max(0.0, work_s - (now - since))
        prefills.append(PrefillView(instance.instance_id, work_s, len(queued)))
    if 1 < group_stages <= len(prefills):
        members = sorted(sorted(prefills, key=lambda v: (v.queued_prefill_s, v.instance_id))[:group_stages],
                         key=lambda v: v.instance_id)
        prefills.append(PrefillView("+".join(v.instance_id for v in members),
                                    max(v.queued_prefill_s for v in members), max(v.num_queued for v in members),
                                    stages=group_stages, member_ids=tuple(v.instance_id for v in members)))
    for instance in live("decode"):
        step_s = instance.step_s or idle_step_s
        loads = []
        for r in instance.request_ids:
            if (f := flights.get(r)) is not None:
                start_s = max(f.decode_start_s, now) if f.in_prefill else now  # late: all its tokens ahead
                left = (output_lengths.left(f.num_decoded, f.params.max_tokens) if output_lengths is not None
                        else f.num_tokens_left)
                loads.append(DecodeLoad.ahead(start_s, left, f.num_leg_tokens, step_s))
        decodes.append(DecodeView(instance.instance_id, loads))
    return ClusterView(prefills, decodes, block_size, block_bytes, fetchable=pool_nodes)
