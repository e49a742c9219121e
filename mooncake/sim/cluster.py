"""What every simulated cluster shares: the event loop, the replay of a trace into arrivals, records."""

from abc import ABC, abstractmethod

from mooncake.config import SimConfig
from mooncake.sim.cost import CostModel
from mooncake.sim.events import EventLoop
from mooncake.sim.metrics import RequestRecord
from mooncake.sim.trace import TraceRequest


class SimulatedCluster(ABC):
    def __init__(self, cfg: SimConfig, cost: CostModel):
        self.cfg, self.cost = cfg, cost
        self.loop = EventLoop()
        self.records: list[RequestRecord] = []
        self.prefill_gpu_s = 0.0  # GPU time spent in prefill compute, summed over instances

    def run(self, trace: list[TraceRequest], progress=None) -> list[RequestRecord]:
        for i, req in enumerate(trace):
            self.loop.at(req.timestamp_ms / 1000 / self.cfg.speed, self._arrive, i, req)
        self.loop.run(progress)
        return self.records

    @abstractmethod
    def _arrive(self, i: int, req: TraceRequest) -> None:
        """Request number `i` of the trace arrives at the current simulated time."""
