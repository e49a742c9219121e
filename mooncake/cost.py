"""The cost model (DESIGN section 8), for LLaMA3-70B on nodes of 8 x A800 by default: what the simulator
charges, and what the emulated model runner (backends/models/emulated.py) waits instead of computing.

Prefill FLOPs follow FAST'25 Eq. 1, l * (a*n^2*d + b*n*d^2), counted for the uncached part only: a
prompt of n tokens with r reused costs l * (a*(n^2 - r^2)*d + b*(n - r)*d^2). Decode is memory-bound:
a step reads the weights once and every batched request's KV.

A step that batches prefill chunks with decode rows (the colocated baseline's chunked prefill, or any
engine's mixed step) is charged by `step_s` under one of STEP_MODELS:
- "roofline" (default): the larger of the step's compute time (every token's FLOPs, a decode row being a
  one-token chunk, at the fitted MFU) and its memory time (the weights once, plus every row's KV read, at the
  achieved share of HBM bandwidth), plus the per-step overhead when the step decodes. A decode batch is
  memory-bound and a prefill chunk compute-bound, so a mixed step costs less than the two apart.
- "additive": the prefill chunks' compute plus the decode step, as if run one after the other (an upper
  bound; it inflates a colocated engine's TBT).
A pure decode step is memory-bound and a pure prefill chunk of hundreds of tokens compute-bound under
both, so they cost the same; the two models differ only on mixed steps and on tiny chunks. Both add
`decode_row_s` per decode row (work a row costs beyond its FLOPs and bytes: 0 on the testbed; a CPU core's
fitted per-row time, scripts/profile_engine.py, where "additive" with it is a decode step linear in batch
and context, the conductor's own DecodeStepModel form).

Coefficients (LLaMA3-70B on 8 x A800-SXM4-80GB, the paper's testbed):
- gpu_flops 312e12 and hbm_bytes_per_s 8 x 2.0e12: NVIDIA A800/A100 80GB SXM4 datasheet (BF16 dense tensor
  core peak 312 TFLOPS; HBM2e 2,039 GB/s). weight_bytes: 70.6B parameters x 2 bytes (bf16).
- kv_bytes_per_token: 80 layers x 2 (K, V) x 8 KV heads x 128 x 2 bytes (the model card's GQA shape).
- mfu 0.45: fitted to the paper's TTFT by scheduler (scripts/sim_paper.py --fit-mfu); inside the 0.35-0.55
  range prefill kernels reach on A100s (Sarathi-Serve, OSDI'24, and Vidur, MLSys'24, profiles).
- decode_efficiency 0.6 (achieved share of HBM bandwidth, "MBU") and the per-step overhead: the order of
  what published A100 decode measurements report (Databricks' "LLM inference performance engineering"
  MBU figures; TP-8 steps add all-reduces and launches); chosen, not fitted, and selectable in [cost].

Chunked pipeline parallelism (CPP, DESIGN section 6): a prompt's chunks flow through X instances, each
holding 1/X of the layers, with only activations crossing stage boundaries (`pipeline_ends`)."""

from dataclasses import dataclass, fields

from mooncake.errors import ModelError

STEP_MODELS = ("roofline", "additive")


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
    decode_row_s: float = 0.0  # per decode row and step, beyond its FLOPs and bytes (0: none, as on the testbed)
    activation_bytes_per_token: int = 8192 * 2  # hidden state at a stage boundary, bf16
    step_model: str = "roofline"  # how a mixed prefill + decode step is charged: one of STEP_MODELS

    def __post_init__(self):
        if self.step_model not in STEP_MODELS:
            raise ModelError(f"cost model step_model {self.step_model!r}: must be one of {', '.join(STEP_MODELS)}")

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
        return (self.decode_overhead_s + self.decode_row_s * batch_size
                + bytes_read / (self.hbm_bytes_per_s * self.decode_efficiency))

    def step_s(self, prefills: list[tuple[int, int]] = (), batch_size: int = 0, context_tokens: int = 0) -> float:
        """One engine step: prefill chunks given as (context after the chunk, context before it) and a decode
        batch of `batch_size` rows reading `context_tokens` of KV in all, charged by `step_model`."""
        if not prefills and batch_size <= 0:
            return 0.0
        if self.step_model == "additive":
            return sum(self.prefill_s(n, r) for n, r in prefills) + self.decode_step_s(batch_size, context_tokens)
        flops = sum(self.prefill_flops(n, r) for n, r in prefills)
        if batch_size > 0:  # each row a one-token chunk: l * (b*d^2 + a*d*(2c + 1)) summed over the rows
            flops += self.layers * (self.b * batch_size * self.d_model ** 2
                                    + self.a * self.d_model * (2 * context_tokens - batch_size))
        compute_s = flops / (self.gpus_per_node * self.gpu_flops * self.mfu)
        read = self.weight_bytes + self.kv_bytes(context_tokens + sum(min(r, n) for n, r in prefills))
        memory_s = read / (self.hbm_bytes_per_s * self.decode_efficiency)
        return max(compute_s, memory_s) + (self.decode_overhead_s + self.decode_row_s * batch_size if batch_size > 0
                                           else 0.0)

    def prefill_coefficients(self) -> tuple[float, float, float]:
        """(c0, c1, c2) seeding the conductor's PrefillTimeModel with this cost model, exactly."""
        rate = self.gpus_per_node * self.gpu_flops * self.mfu
        return 0.0, self.layers * self.b * self.d_model ** 2 / rate, self.layers * self.a * self.d_model / rate

    def decode_coefficients(self) -> tuple[float, float, float]:
        """(a, b, c) seeding the conductor's DecodeStepModel: a + b*batch + c*context_tokens."""
        rate = self.hbm_bytes_per_s * self.decode_efficiency
        return self.decode_overhead_s + self.weight_bytes / rate, self.decode_row_s, self.kv_bytes_per_token / rate


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
