#!/usr/bin/env python3
"""Chunked pipeline parallelism (CPP): TTFT of one long cold prompt on 1, 2 and 4 prefill instances,
beside the paper's claim that a group of X instances run as a pipeline prefills a long prompt close to X
times faster (DESIGN section 6: CPP is the paper's answer to prompts too long for one node's TTFT).

Two measurements, same prompts:
- sim: `mooncake simulate` on a trace of that one prompt, `sim.num_prefill` = X and `conductor.cpp_stages`
  = X (one group), LLaMA3-70B on 8 x A800 nodes (the cost model);
- emulated: X engines of the emulated LLaMA3-70B in this process, each a `PipelineStage` holding 1/X of the
  layers (mooncake/engine/stage.py), each with a transport of its own (`--transport`, TCP by default), the
  chunks' hidden states sent to the next stage's inbox over it (mooncake/prefill/stage_link.py), the
  modelled time waited out at `--speedup`; with X = 1, one engine's own chunked prefill is the baseline.
  The emulated hidden states are small (a digest per token); each hop also waits the modelled
  activations' transfer time, as the simulator charges it. Times are scaled back to the modelled hardware
  (x speedup).
- live (`--live`): the same prompt through the REST API of a `mooncake dev` cluster of X prefill
  instances (each its own process, `conductor.cpp_stages` = X, so the conductor places it on a group of
  all of them) and one decode instance, emulated LLaMA3-70B at `--speedup`: what a user's request sees,
  the conductor, the stages' activations and their KV to decode included. Medians of `--repeats`.

Prints, per prompt length, TTFT and speedup over one instance for X = 1, 2, 4, and writes JSON:
`sim.<tokens>.<X>`, `emulated.<tokens>.<X>` (and `live.<tokens>.<X>`) in seconds, and
`speedup.<source>.<tokens>.<X>`."""

import argparse
import asyncio
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from mooncake.config import EngineConfig, load_config  # noqa: E402
from mooncake.engine import LLMEngine, SamplingParams  # noqa: E402
from mooncake.engine.stage import PipelineStage, stage_layers  # noqa: E402
from tests.cpp_harness import run_group  # noqa: E402
from mooncake.transfer.modelled import ModelledNetwork  # noqa: E402
from mooncake.registry import load_backend  # noqa: E402
from mooncake.sim.run import simulate  # noqa: E402

MODEL = "emulated-llama3-70b"
BLOCK = 512  # the trace's block


def sim_ttft(tokens: int, stages: int, chunk: int) -> float:
    blocks = tokens // BLOCK
    with tempfile.TemporaryDirectory() as tmp:
        trace = Path(tmp) / "one.jsonl"
        trace.write_text(json.dumps({"timestamp": 0, "input_length": tokens, "output_length": 2,
                                     "hash_ids": list(range(blocks))}) + "\n")
        config = load_config(ROOT / "configs/sim/mooncake-8p8d.toml",
                             {"sim.num_prefill": stages, "sim.num_decode": 1, "conductor.cpp_stages": stages,
                              "conductor.cpp_chunk_tokens": chunk})
        return simulate(trace, config)["ttft_s"]["mean"]


def emulated_ttft(cfg: EngineConfig, tokens: int, stages: int, chunk: int, tag: str, transport: str) -> float:
    prompt = [(hash((tag, i)) % 250) + 1 for i in range(tokens)]  # fresh tokens: no prefix reuse
    if stages == 1:
        engine = LLMEngine(cfg)
        started = time.perf_counter()
        engine.generate([prompt], SamplingParams(max_tokens=1))
        return time.perf_counter() - started
    num_layers = LLMEngine(cfg).runner.kv_spec.num_layers
    group = [PipelineStage(LLMEngine(cfg), layers) for layers in stage_layers(num_layers, stages)]
    runner = group[0].engine.runner  # NOTE: the modelled network takes the activations' hop time
    transports = [ModelledNetwork(load_backend("transports", transport)(host="127.0.0.1"), 0.0, 1,
                                  runner.modelled.activation_seconds(1)) for _ in group]
    started = time.perf_counter()
    asyncio.run(run_group(group, transports, tag, prompt, chunk))
    elapsed = time.perf_counter() - started
    for stage in group:
        stage.end(tag)
    return elapsed


def live_ttft(tokens: int, stages: int, chunk: int, speedup: float, repeats: int) -> float:
    """Median TTFT (modelled seconds) of fresh `tokens`-token prompts through a dev cluster of `stages`
    prefill instances run as one CPP group."""
    from mooncake.dev import DevCluster
    from scripts.bench_serving import stream_ttft
    settings = {"engine.model": MODEL, "engine.block_size": 64, "engine.emulation_speedup": speedup,
                "engine.prefill_chunk": chunk, "engine.max_num_batched_tokens": chunk,
                "engine.kv_cache_bytes": 1 << 30, "api.port": 0, "api.model_name": "bench",
                "conductor.admission": "accept-all", "conductor.cpp_stages": stages,
                "conductor.cpp_threshold_tokens": chunk, "conductor.cpp_chunk_tokens": chunk}
    with DevCluster(load_config(None, settings), num_prefill=stages, num_decode=1, num_cache=0,
                    workdir=Path(tempfile.mkdtemp(prefix="bench-cpp-")), log_to_files=True) as cluster:
        stream_ttft(cluster.url, "bench", [7] * 64)  # first request's one-time costs
        samples = [stream_ttft(cluster.url, "bench", [(hash((stages, i, j)) % 250) + 1 for j in range(tokens)], 2)
                   for i in range(repeats)]
    return statistics.median(samples) * speedup


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", default="32768,65536,131000",
                        help="prompt lengths, comma-separated (131000: 128k tokens less room for the first token)")
    parser.add_argument("--stages", default="1,2,4", help="group sizes, comma-separated")
    parser.add_argument("--chunk", type=int, default=2048, help="tokens per pipeline chunk (conductor.cpp_chunk_tokens)")
    parser.add_argument("--speedup", type=float, default=5.0, help="the emulated engine's time compression")
    parser.add_argument("--transport", default="tcp", choices=["tcp", "shm"],
                        help="what carries the hidden states between stages")
    parser.add_argument("--live", action="store_true", help="also through a dev cluster's REST API (see above)")
    parser.add_argument("--repeats", type=int, default=3, help="prompts per live measurement (median)")
    parser.add_argument("--json", default="bench-results/cpp.json")
    args = parser.parse_args()
    lengths = [int(x) for x in args.tokens.split(",")]
    sizes = [int(x) for x in args.stages.split(",")]
    from mooncake.models.fetch import fetch_model
    cfg = EngineConfig(model=str(fetch_model(MODEL)), block_size=64, prefill_chunk=args.chunk,
                       max_num_batched_tokens=args.chunk, emulation_speedup=args.speedup)
    sources = ("sim", "emulated", "live") if args.live else ("sim", "emulated")
    result = {**{source: {} for source in sources}, "speedup": {source: {} for source in sources},
              "chunk_tokens": args.chunk, "emulation_speedup": args.speedup, "transport": args.transport}
    print(f"one cold prompt, LLaMA3-70B on 8 x A800 per instance, chunks of {args.chunk} tokens; TTFT in modelled "
          f"seconds (speedup over 1 instance; the paper: close to X for long prompts)")
    print(f"{'tokens':>8}{'instances':>11}" + "".join(f"{source + ' s':>12}{'x':>7}" for source in sources))
    for tokens in lengths:
        for source in sources:
            result[source][tokens] = {}
            result["speedup"][source][tokens] = {}
        for x in sizes:
            result["sim"][tokens][x] = sim_ttft(tokens, x, args.chunk)
            result["emulated"][tokens][x] = emulated_ttft(cfg, tokens, x, args.chunk, f"{tokens}-{x}",
                                                          args.transport) * args.speedup
            if args.live:
                result["live"][tokens][x] = live_ttft(tokens, x, args.chunk, args.speedup, args.repeats)
            cells = ""
            for source in sources:
                value = result[source][tokens][x]
                result["speedup"][source][tokens][x] = result[source][tokens][sizes[0]] / value
                cells += f"{value:>12.2f}{result['speedup'][source][tokens][x]:>7.2f}"
            print(f"{tokens:>8}{x:>11}" + cells, flush=True)
    out = ROOT / args.json if not Path(args.json).is_absolute() else Path(args.json)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
