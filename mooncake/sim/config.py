"""The [sim] table of the config (mooncake/config.py loads it with the others): `mooncake simulate`."""

from dataclasses import dataclass

from mooncake.cost import STEP_MODELS
from mooncake.errors import check_config as _check


@dataclass(frozen=True)
class SimConfig:
    """`mooncake simulate`: the simulated cluster (DESIGN section 8). Blocks are the trace's 512 tokens."""

    mode: str = "mooncake"  # "mooncake" (disaggregated, global pool) or "vllm" (colocated baseline)
    num_prefill: int = 8
    num_decode: int = 8
    num_instances: int = 16  # vllm mode
    dram_blocks_per_node: int = 8192  # each node's share of the KVCache pool
    pool_decode_dram: bool = True  # decode nodes' DRAM joins the pool too (the KV they receive stays there)
    vllm_cache_blocks: int = 3000  # vllm mode: local prefix cache in spare HBM
    prefix_caching: bool = True  # vllm mode
    chunked_prefill: bool = True  # vllm mode
    chunk_tokens: int = 512  # vllm mode: tokens per step with chunked prefill (vLLM's default then)
    decode_kv_tokens: int = 1_500_000  # KV one instance's HBM holds for decoding
    reject_at_decode: bool = False  # the rejection study's baseline: decode refuses what would break TBT
    speed: float = 1.0  # trace time compression
    block_tokens: int = 512
    mfu: float = 0.45  # prefill MFU, fitted to the paper's TTFT by scheduler (scripts/sim_paper.py --fit-mfu)
    decode_efficiency: float = 0.6  # share of HBM bandwidth a decode step achieves
    decode_overhead_s: float = 0.012  # per decode step: kernel launches, TP all-reduces, sampling
    # How a step that mixes prefill and decode work is charged (mooncake/cost.py): "roofline" (the larger of
    # its compute and its memory time, plus the overhead) or "additive" (prefill and decode summed). "": the
    # cost_file's own step_model (the one scripts/profile_engine.py's fit chose), else roofline.
    step_model: str = ""
    # What each request asks as max_tokens. 0: the trace's output_length, which it then writes to the end
    # (a replay's `ignore_eos` oracle: the conductor knows every length). > 0: this cap; each request writes
    # the emulated model's answer to its prompt (mooncake/answer_lengths.py), which nobody is told.
    max_tokens: int = 0
    # A TOML file with a [cost] table (scripts/profile_engine.py fits one to a real engine on one CPU core): the
    # simulated instances' cost model in place of LLaMA3-70B on 8 x A800 (mfu, decode_efficiency and
    # decode_overhead_s above are then the file's).
    cost_file: str = ""

    def __post_init__(self):
        _check(self.mode in ("mooncake", "vllm"), "sim.mode", "must be 'mooncake' or 'vllm'")
        for key in ("num_prefill", "num_decode", "num_instances", "dram_blocks_per_node", "chunk_tokens",
                    "decode_kv_tokens", "block_tokens"):
            _check(getattr(self, key) > 0, f"sim.{key}", "must be > 0")
        _check(self.vllm_cache_blocks >= 0, "sim.vllm_cache_blocks", "must be >= 0")
        _check(self.speed > 0, "sim.speed", "must be > 0")
        _check(0 < self.mfu <= 1, "sim.mfu", "must be in (0, 1]")
        _check(0 < self.decode_efficiency <= 1, "sim.decode_efficiency", "must be in (0, 1]")
        _check(self.decode_overhead_s >= 0, "sim.decode_overhead_s", "must be >= 0")
        _check(self.step_model in ("",) + STEP_MODELS, "sim.step_model",
               f"must be one of {', '.join(STEP_MODELS)}, or empty (the cost file's, else roofline)")
        _check(self.max_tokens >= 0, "sim.max_tokens", "must be >= 0 (0: the trace's output lengths)")
