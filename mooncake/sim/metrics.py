"""Per-request outcomes of a simulation and the report over them (FAST'25 definitions): TBT is the mean
of a request's longest 10% token gaps; a request counts toward effective capacity iff it was served with
TTFT <= 30 s and TBT <= the threshold."""

import math
from dataclasses import dataclass, field

import numpy as np

TTFT_LIMIT_S = 30.0


@dataclass
class RequestRecord:
    request_id: int
    arrival_s: float
    input_tokens: int
    output_tokens: int
    cached_tokens: int = 0
    token_times: list[float] = field(default_factory=list)  # first token (end of prefill) onwards
    rejected_at: str | None = None  # "arrival" | "decode" | None
    predicted_ttft_s: float = 0.0  # the conductor's, at placement (0: not predicted, as in the colocated baseline)

    @property
    def ttft_s(self) -> float | None:
        return self.token_times[0] - self.arrival_s if self.token_times else None

    @property
    def tbt_s(self) -> float | None:
        gaps = np.diff(self.token_times)
        if len(gaps) == 0:
            return None if not self.token_times else 0.0
        k = max(1, math.ceil(0.1 * len(gaps)))
        return float(np.sort(gaps)[-k:].mean())


def report(records: list[RequestRecord], thresholds_s=(0.1, 0.2, 0.3), prefill_gpu_s: float = 0.0) -> dict:
    served = [r for r in records if r.rejected_at is None and r.token_times]
    ttft = np.array([r.ttft_s for r in served]) if served else np.array([0.0])
    tbt = np.array([r.tbt_s for r in served]) if served else np.array([0.0])
    capacity = {f"{int(t * 1000)}ms": sum(1 for r in served if r.ttft_s <= TTFT_LIMIT_S and r.tbt_s <= t)
                / len(records) for t in thresholds_s}
    input_tokens = sum(r.input_tokens for r in records)
    return {
        "requests": len(records),
        "served": len(served),
        "rejected": {stage: sum(1 for r in records if r.rejected_at == stage) for stage in ("arrival", "decode")},
        "effective_capacity": capacity,
        "ttft_s": _stats(ttft),
        "tbt_s": _stats(tbt),
        "hit_ratio": sum(r.cached_tokens for r in served) / input_tokens if input_tokens else 0.0,
        "prefill_gpu_s": prefill_gpu_s,
        "prediction": prediction_figures([r.predicted_ttft_s / r.ttft_s for r in served
                                          if r.predicted_ttft_s > 0 and r.ttft_s > 0]),
    }


def prediction_figures(ratios) -> dict:
    """Predicted over measured TTFT: the median ratio and the share within 0.85-1.15 (None: no requests)."""
    if len(ratios) == 0:
        return {"median_ratio": None, "share_0.85_1.15": None, "count": 0}
    values = np.asarray(ratios, dtype=float)
    return {"median_ratio": float(np.median(values)),
            "share_0.85_1.15": float(((values >= 0.85) & (values <= 1.15)).mean()), "count": len(values)}


def _stats(values: np.ndarray) -> dict:
    return {"mean": float(values.mean()), "p50": float(np.percentile(values, 50)),
            "p90": float(np.percentile(values, 90)), "p99": float(np.percentile(values, 99))}
