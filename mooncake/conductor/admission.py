"""Admission (early rejection): whether to serve a placed request, judged at its arrival.

- `AcceptAll`: never rejects.
- `TtftOnly`: rejects only a request whose TTFT would break the SLO; decode overload is found out late,
  when the request reaches decode (the rejection study's baseline).
- `EarlyRejection`: Algorithm 1's check on current load: reject if predicted TTFT > TTFT SLO or the
  decode instance's TBT with the request added, as of now, > TBT SLO.
- `PredictiveRejection` (arXiv section 7): the decode load that matters is the one when the request
  reaches decode, a TTFT from now. Count what will be decoding then (running requests not yet finished,
  plus requests still in prefill that will have arrived) and reject if that TBT would break the SLO.
  Rejecting on current load makes prefill and decode load swing in anti-phase, since decode load lags
  admissions by the prefill time; predicting it removes the lag.

A TBT rejection protects the other requests in a decode batch; a request that would decode alone is
never rejected for TBT (turning it away helps nobody, and on slow hardware it would refuse everything)."""

from abc import ABC, abstractmethod

from mooncake.conductor.estimators import DecodeStepModel
from mooncake.conductor.view import ClusterView, Placement, Rejection, RequestView
from mooncake.registry import load_backend


class AdmissionPolicy(ABC):
    def __init__(self, decode_step: DecodeStepModel, ttft_slo_s: float, tbt_slo_s: float):
        self.decode_step = decode_step
        self.ttft_slo_s = ttft_slo_s
        self.tbt_slo_s = tbt_slo_s

    @abstractmethod
    def admit(self, request: RequestView, placement: Placement, cluster: ClusterView,
              now: float) -> Rejection | None:
        """None to serve the request, else why not."""

    def ttft_rejection(self, placement: Placement) -> Rejection | None:
        """The check every rejecting policy starts with: would the first token come too late?"""
        if placement.ttft_s > self.ttft_slo_s:
            return Rejection("ttft_slo", placement.ttft_s, placement.tbt_s)
        return None

    def decode_load(self, request: RequestView, placement: Placement, cluster: ClusterView, at: float) -> float:
        """TBT / TBT SLO of the chosen decode instance at time `at`, with this request added; 0 when the
        request would be alone there."""
        decode = next(d for d in cluster.decodes if d.instance_id == placement.decode_id)
        batch, context = decode.batch_at(at)
        if batch == 0:
            return 0.0
        return self.decode_step.predict(batch + 1, context + request.num_tokens) / self.tbt_slo_s


class AcceptAll(AdmissionPolicy):
    def admit(self, request, placement, cluster, now):
        return None


class TtftOnly(AdmissionPolicy):
    def admit(self, request, placement, cluster, now):
        return self.ttft_rejection(placement)


class EarlyRejection(AdmissionPolicy):
    def admit(self, request, placement, cluster, now):
        if (rejection := self.ttft_rejection(placement)) is not None:
            return rejection
        if (load := self.decode_load(request, placement, cluster, now)) > 1.0:
            return Rejection("tbt_slo", placement.ttft_s, load * self.tbt_slo_s)
        return None


class PredictiveRejection(AdmissionPolicy):
    def admit(self, request, placement, cluster, now):
        if (rejection := self.ttft_rejection(placement)) is not None:
            return rejection
        arrives = now + placement.ttft_s
        load = self.decode_load(request, placement, cluster, arrives)
        if load > 1.0:
            return Rejection("tbt_slo", placement.ttft_s, load * self.tbt_slo_s)
        return None


def make_admission_policy(name: str, decode_step: DecodeStepModel, ttft_slo_s: float,
                          tbt_slo_s: float) -> AdmissionPolicy:
    """The admission policy registered as `name` (mooncake/registry.py)."""
    return load_backend("admission", name)(decode_step, ttft_slo_s, tbt_slo_s)
