"""What every simulated cluster shares: the event loop, the replay of a trace into arrivals, records."""

from abc import ABC, abstractmethod

from mooncake.config import SimConfig
from mooncake.cost import CostModel
from mooncake.sim.events import EventLoop
from mooncake.sim.metrics import RequestRecord
from mooncake.sim.trace import TraceRequest


class SimulatedCluster(ABC):
    def __init__(self, cfg: SimConfig, cost: CostModel):
        self.cfg, self.cost = cfg, cost
        self.loop = EventLoop()
        self.records: list[RequestRecord] = []
        self.prefill_gpu_s = 0.0  # GPU time spent in prefill compute, summed over instances
        self.load_samples: list[tuple[float, float, float]] = []  # (time, prefill load, decode load)

    def run(self, trace: list[TraceRequest], progress=None, sample_every_s: float = 10.0) -> list[RequestRecord]:
        end_s = 0.0
        for i, req in enumerate(trace):
            end_s = req.timestamp_ms / 1000 / self.cfg.speed
            self.loop.at(end_s, self._arrive, i, req)
        t = 0.0
        while t <= end_s:  # loads are sampled while requests arrive
            self.loop.at(t, self._sample)
            t += sample_every_s
        self.loop.run(progress)
        return self.records

    def _sample(self) -> None:
        loads = self.loads()
        if loads is not None:
            self.load_samples.append((self.loop.now, *loads))

    def loads(self) -> tuple[float, float] | None:
        """(prefill load, decode load) now, each as a share of its SLO; None where not modelled."""
        return None

    @abstractmethod
    def _arrive(self, i: int, req: TraceRequest) -> None:
        """Request number `i` of the trace arrives at the current simulated time."""
