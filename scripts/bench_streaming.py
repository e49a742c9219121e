#!/usr/bin/env python3
"""What moving KV from prefill to decode adds to TTFT: one long prompt's TTFT through the REST API of a
`mooncake dev` cluster (every role its own process), for each way prefill can move its KV, same run:

- compute_only: the request ends with its first token, so no KV leaves prefill (the floor);
- chunkwise: each chunk's KV is pushed while the next chunk computes (`instance.stream_kv = true`): only
  the last chunk's export and transfer land on TTFT;
- at_end: every block is pushed after the last chunk (`instance.stream_kv = false`);
- layerwise: each layer's KV of a chunk leaves as soon as that layer is computed, while the next layers
  compute (`instance.stream_layers = true`; the paper's Figure 4): only the last layer's share of the
  last chunk lands on TTFT.

Three clusters run side by side (by layer, by chunk, at the end) and the modes are measured in rounds:
each round runs every mode once, in a new order, each prompt new (no prefix reuse). A mode's figure is
the median over rounds of its TTFT over that round's compute_only, so this shared host's drift (+-7%
between runs of the same prompt here) hits both sides of each ratio alike; a bootstrap 90% interval
says what noise is left. For a real model (SmolLM2 on these CPUs) and the emulated LLaMA3-70B, whose
transfers are charged for the modelled KV over the modelled network. Prints a table and writes JSON:
`ttft_s.<mode>` (median TTFT) and `over_compute_only.<mode>` for the first model, and per model under
`models`."""

import argparse
import json
import random
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from mooncake.config import load_config  # noqa: E402
from mooncake.dev import DevCluster  # noqa: E402
from scripts.bench_serving import stream_ttft, tokens  # noqa: E402

MODES = ("layerwise", "chunkwise", "at_end", "compute_only")
GOAL = 1.05  # the issue's: layer-wise within 5% of compute alone


def cluster_for(args, model: str, transport: str, stream_kv: bool, stream_layers: bool = False) -> DevCluster:
    settings = {"engine.model": model, "api.port": 0, "api.model_name": "bench", "instance.transport": transport,
                "instance.stream_kv": stream_kv, "instance.stream_layers": stream_layers,
                "engine.prefill_chunk": args.chunk,
                "engine.max_num_batched_tokens": max(args.chunk, 2048),
                "engine.kv_cache_bytes": 1 << 30, "engine.num_threads": args.threads,
                "conductor.admission": "accept-all"}
    if model.startswith("emulated"):
        settings["engine.block_size"] = 64
    mode = "layerwise" if stream_layers else "chunkwise" if stream_kv else "at_end"
    return DevCluster(load_config(None, settings), num_cache=0, workdir=args.logs / f"{model}-{mode}",
                      log_to_files=True)


def run_model(args, model: str) -> dict:
    samples = {mode: [] for mode in MODES}
    ratios = {mode: [] for mode in MODES}  # per round: the mode's TTFT over that round's compute_only
    order = random.Random(args.seed)
    with cluster_for(args, model, args.transport, True, True) as layers, \
            cluster_for(args, model, args.transport, True) as chunks, \
            cluster_for(args, model, args.transport, False) as at_end:
        for cluster in (layers, chunks, at_end):
            stream_ttft(cluster.url, "bench", tokens(64, "warm-up"))  # first request's one-time costs
        runs = [("compute_only", chunks, 1), ("layerwise", layers, 2), ("chunkwise", chunks, 2),
                ("at_end", at_end, 2)]
        for i in range(args.repeats):
            # NOTE: a new order each round, so no mode always follows another (or a drift's same phase).
            round_s = {}
            for mode, cluster, max_tokens in order.sample(runs, len(runs)):
                prompt = tokens(args.prompt_tokens, f"{model}-{mode}-{i}-{time.time()}")
                round_s[mode] = stream_ttft(cluster.url, "bench", prompt, max_tokens)
            for mode, ttft in round_s.items():
                samples[mode].append(ttft)
                ratios[mode].append(ttft / round_s["compute_only"])
    return {"ttft_s": {mode: statistics.median(s) for mode, s in samples.items()}, "samples_s": samples,
            "over_compute_only": {mode: statistics.median(r) for mode, r in ratios.items()},
            "over_compute_only_90ci": {mode: median_interval(r, order) for mode, r in ratios.items()},
            "ratio_samples": ratios}


def median_interval(values: list[float], rng: random.Random, draws: int = 2000) -> list[float]:
    """A bootstrap 90% interval of the median of `values`: how far this run's noise leaves it uncertain."""
    medians = sorted(statistics.median(rng.choices(values, k=len(values))) for _ in range(draws))
    return [medians[int(0.05 * draws)], medians[int(0.95 * draws) - 1]]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", default="smollm2-135m-instruct,emulated-llama3-70b",
                        help="comma-separated; the first one's figures are also the top-level ttft_s")
    parser.add_argument("--prompt-tokens", type=int, default=4096)
    parser.add_argument("--chunk", type=int, default=512, help="engine.prefill_chunk")
    parser.add_argument("--transport", default="tcp")
    parser.add_argument("--threads", type=int, default=0,
                        help="engine.num_threads of every engine (0: torch's default)")
    parser.add_argument("--repeats", type=int, default=5, help="rounds; each runs every mode once, in a new order")
    parser.add_argument("--seed", type=int, default=0, help="of the rounds' orders and the bootstrap")
    parser.add_argument("--json", type=Path, default=Path("bench-results/streaming.json"))
    parser.add_argument("--keep-logs", action="store_true", help="keep the clusters' logs (kept anyway on failure)")
    args = parser.parse_args()

    models = [m for m in args.models.split(",") if m]
    results = {"args": {k: str(v) for k, v in vars(args).items()}, "models": {}}
    args.logs = Path(tempfile.mkdtemp(prefix="bench-streaming-"))
    try:
        for model in models:
            results["models"][model] = run_model(args, model)
    except BaseException:
        print(f"the clusters' logs are in {args.logs}", file=sys.stderr)
        raise
    if args.keep_logs:
        print(f"the clusters' logs are in {args.logs}")
    else:
        shutil.rmtree(args.logs, ignore_errors=True)
    results["ttft_s"] = results["models"][models[0]]["ttft_s"]
    results["over_compute_only"] = results["models"][models[0]]["over_compute_only"]

    print(f"TTFT of a {args.prompt_tokens}-token prompt in chunks of {args.chunk}, {args.transport}, "
          f"threads {args.threads or 'default'}, median of {args.repeats} rounds; in brackets, the median over "
          f"each round's compute_only, with its bootstrap 90% interval (goal for layerwise: <= {GOAL:.2f})")
    print(f"{'model':>24}" + "".join(f"{mode:>30}" for mode in MODES))
    for model in models:
        r = results["models"][model]
        cells = [f"{r['ttft_s'][m]:.3f} s ({r['over_compute_only'][m]:.3f} "
                 f"{r['over_compute_only_90ci'][m][0]:.3f}-{r['over_compute_only_90ci'][m][1]:.3f})" for m in MODES]
        print(f"{model:>24}" + "".join(f"{c:>30}" for c in cells))
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(results, indent=2))
    print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
