"""The cost model (DESIGN section 8), for LLaMA3-70B on nodes of 8 x A800 by default: what the simulator
charges, and what the emulated model runner (backends/models/emulated.py) waits instead of computing.

Prefill FLOPs follow FAST'25 Eq. 1, l * (a*n^2*d + b*n*d^2), counted for the uncached part only: a
prompt of n tokens with r reused costs l * (a*(n^2 - r^2)*d + b*(n - r)*d^2). Decode is memory-bound:
a step reads the weights once and every batched request's KV.

Chunked pipeline parallelism (CPP, DESIGN section 6): a prompt's chunks flow through X instances, each
holding 1/X of the layers, with only activations crossing stage boundaries (`pipeline_ends`)."""

from dataclasses import dataclass, fields

from mooncake.errors import ModelError


@dataclass(frozen=True)
class CostModel:
    layers: int = 80
    d_model: int = 8192
    a: float = 4.0
    b: float = 22.0
    gpus_per_node: int = 8
    gpu_flops: float = 312e12  # A800 bf16 peak
    mfu: float = 0.45  # fitted model FLOPs utilisation of prefill
    kv_bytes_per_token: int = 320 * 1024  # LLaMA3-70B, GQA 8, bf16
    network_bytes_per_s: float = 4 * 200e9 / 8  # 4 x 200 Gbps per node
    weight_bytes: float = 140e9  # 70B parameters in bf16
    hbm_bytes_per_s: float = 8 * 2.0e12  # 8 GPUs
    decode_efficiency: float = 0.6  # share of HBM bandwidth a decode step achieves
    decode_overhead_s: float = 0.004  # launch and sampling per step
    activation_bytes_per_token: int = 8192 * 2  # hidden state at a stage boundary, bf16

    @classmethod
    def from_dict(cls, values: dict, where: str) -> "CostModel":
        """From a table of its fields (an emulated model's [cost]); an unknown key is an error naming it."""
        known = {f.name for f in fields(cls)}
        if unknown := sorted(set(values) - known):
            raise ModelError(f"{where}: unknown cost-model key(s) {', '.join(unknown)}; known: {', '.join(sorted(known))}")
        return cls(**values)

    def prefill_flops(self, num_tokens: int, reused_tokens: int = 0) -> float:
        n, r = num_tokens, min(reused_tokens, num_tokens)
        return self.layers * (self.a * (n * n - r * r) * self.d_model + self.b * (n - r) * self.d_model ** 2)

    def prefill_s(self, num_tokens: int, reused_tokens: int = 0) -> float:
        return self.prefill_flops(num_tokens, reused_tokens) / (self.gpus_per_node * self.gpu_flops * self.mfu)

    def kv_bytes(self, num_tokens: int) -> float:
        return num_tokens * self.kv_bytes_per_token

    def transfer_s(self, num_bytes: float) -> float:
        return num_bytes / self.network_bytes_per_s

    def decode_step_s(self, batch_size: int, context_tokens: int) -> float:
        if batch_size <= 0:
            return 0.0
        bytes_read = self.weight_bytes + self.kv_bytes(context_tokens)
        return self.decode_overhead_s + bytes_read / (self.hbm_bytes_per_s * self.decode_efficiency)

    def prefill_coefficients(self) -> tuple[float, float, float]:
        """(c0, c1, c2) seeding the conductor's PrefillTimeModel with this cost model, exactly."""
        rate = self.gpus_per_node * self.gpu_flops * self.mfu
        return 0.0, self.layers * self.b * self.d_model ** 2 / rate, self.layers * self.a * self.d_model / rate

    def decode_coefficients(self) -> tuple[float, float, float]:
        """(a, b, c) seeding the conductor's DecodeStepModel: a + b*batch + c*context_tokens."""
        rate = self.hbm_bytes_per_s * self.decode_efficiency
        return self.decode_overhead_s + self.weight_bytes / rate, 0.0, self.kv_bytes_per_token / rate


def pipeline_ends(chunk_s: list[float], stages: int, hop_s: float = 0.0,
                  free_s: list[float] | None = None) -> list[float]:
    """When each stage of a pipeline ends its last chunk: chunk j takes chunk_s[j] / stages on every stage
    (the layers split evenly) and starts on stage k once stage k is free (free_s[k], default 0), has
    finished chunk j - 1, and stage k - 1 has finished chunk j and sent its activations (hop_s). One
    stage: its free time plus the sum of the chunks."""
    ends = list(free_s) if free_s is not None else [0.0] * stages
    for seconds in chunk_s:
        share, ready = seconds / stages, 0.0
        for k in range(stages):
            ready = max(ends[k], ready + (hop_s if k else 0.0)) + share
            ends[k] = ready
    return ends
