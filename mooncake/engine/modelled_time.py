"""Emulated time: the cost object of a model runner that emulates hardware (backends/models/emulated.py).

A real runner has none (`ModelRunner.modelled` is None): its steps take what they take. An emulated
runner's forward returns at once, and its `ModelledTime` says what the step would have taken on the
modelled hardware (the cost model the simulator charges, `mooncake/cost.py`, divided by the emulation
speedup): the engine waits that out on its thread (`LLMEngine.step`, `PipelineStage.run`), the instance's
transports wait out the modelled network's share (`transfer/modelled.py`), and the conductor's estimators
are seeded with its coefficients."""

from dataclasses import dataclass
from typing import TYPE_CHECKING

from mooncake.cost import CostModel

if TYPE_CHECKING:
    from mooncake.engine.runner import ForwardBatch


@dataclass(frozen=True)
class ModelledTime:
    cost: CostModel
    speedup: float = 1.0  # modelled seconds per real second (engine.emulation_speedup)
    kv_capacity_tokens: int | None = None  # KV the modelled device holds: the engine sizes its cache to it

    def step_seconds(self, batch: "ForwardBatch", share: float = 1.0) -> float:
        """The step's time on the modelled hardware (CostModel.step_s), after the speedup: decode reads the
        weights once and every batched sequence's KV; each prefill chunk costs Eq. 1 over its context less
        what was computed before; a mixed step as the cost model's step_model says. `share`: the part of
        the layers computed (a CPP stage's)."""
        decode = batch.num_decode
        context = int(batch.positions[:decode].sum()) + decode if decode else 0
        chunks = [(len(span.context_slots), len(span.context_slots) - span.num_tokens) for span in batch.prefills]
        return self.cost.step_s(chunks, decode, context) * share / self.speedup

    def time_coefficients(self) -> tuple[list[float], list[float]]:
        """Prefill seconds c0 + c1*(n - r) + c2*(n^2 - r^2) and decode step seconds a + b*batch + c*context,
        as ([c0, c1, c2], [a, b, c]): instances send them when they register, and the conductor seeds its
        estimators with them."""
        return ([c / self.speedup for c in self.cost.prefill_coefficients()],
                [c / self.speedup for c in self.cost.decode_coefficients()])

    def transfer_seconds(self, num_tokens: int) -> float:
        """The modelled KV of `num_tokens` over the modelled node's network (the real bytes are small)."""
        return self.cost.transfer_s(self.cost.kv_bytes(num_tokens)) / self.speedup

    def activation_seconds(self, num_tokens: int) -> float:
        """The modelled hidden states of `num_tokens` over the modelled network, as the simulator charges a
        CPP stage boundary (the real ones are a digest per token)."""
        return self.cost.transfer_s(num_tokens * self.cost.activation_bytes_per_token) / self.speedup
