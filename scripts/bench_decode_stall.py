#!/usr/bin/env python3
"""Decode stall benchmark: how much requests joining a decode instance (their prompt's KV imported)
slow the streams already running there, in one run.

A decode engine on its engine loop runs `--streams` requests for good (their prompts `--stream-blocks`
blocks long). Phases, taken in turn
`--rounds` times so the box's noise falls on each alike:
- `no_arrivals`: nothing joins;
- `local_hit`: the same arrivals as below, their KV already in this engine's prefix cache (put there
  between phases): what the joiners cost the batch with no bytes to move;
- `kv_thread`: every `--join-every` seconds a request joins with a `--prompt-tokens` prompt's KV, imported
  as the decode role does it (verified and copied on the engine loop's KV thread while steps run);
- `inline`: the same arrivals imported the way it was done before, between two steps on the event loop
  (`engine.add_request(kv_payloads=...)`), for comparison.
Joiners ask for 2 tokens and their prompts are one token past a whole number of blocks, so each sits
in the batch for two steps as a stream with a long context. Their KV is one real export
re-stamped with each joiner's block hashes (the bytes are what a hand-off moves; the joiner's text does
not matter here). Prints the time between tokens of the running streams (p50, p99, max) per phase and the
p99 ratios to `no_arrivals` and to `local_hit`; writes JSON (default bench-results/decode_stall.json)
with keys `tbt_p99_s.<phase>`, `ratio_p99.<phase>` and `ratio_p99_to_local_hit.<phase>`. Goal (issue 15):
`kv_thread` within 10% of `no_arrivals`."""

import argparse
import asyncio
import json
import statistics
import sys
import time
from dataclasses import replace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from mooncake.config import EngineConfig  # noqa: E402
from mooncake.engine import LLMEngine, SamplingParams  # noqa: E402
from mooncake.env import offline_hub  # noqa: E402
from mooncake.hashing import hash_blocks  # noqa: E402
from mooncake.instance.engine_loop import EngineLoop  # noqa: E402

PHASES = ("no_arrivals", "local_hit", "kv_thread", "inline")


def parse_args():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="smollm2-135m-instruct", help="catalog name or model directory")
    p.add_argument("--dtype", default="auto")
    p.add_argument("--streams", type=int, default=8, help="requests decoding throughout")
    p.add_argument("--prompt-blocks", type=int, default=16, help="KV blocks (64 tokens) each joiner brings")
    p.add_argument("--stream-blocks", type=int, default=4, help="KV blocks (64 tokens) of each stream's prompt")
    p.add_argument("--join-every", type=float, default=0.5, help="seconds between joiners")
    p.add_argument("--phase-s", type=float, default=5.0, help="seconds per phase per round")
    p.add_argument("--rounds", type=int, default=4)
    p.add_argument("--json", default="bench-results/decode_stall.json")
    return p.parse_args()


def joiner_payloads(engine: LLMEngine, exported, prompt: list[int]):
    """The exported payloads under `prompt`'s block hashes (its KV bytes, not its text's)."""
    hashes = hash_blocks(prompt, engine.block_size, engine.namespace)
    return [replace(p, block_hash=h) for p, h in zip(exported, hashes)]


async def run(args) -> dict:
    cfg = EngineConfig(model=args.model, dtype=args.dtype, block_size=64, prefill_chunk=512,
                       kv_cache_bytes=2 << 30)
    prompt_tokens = args.prompt_blocks * cfg.block_size + 1  # every block imported, one token computed
    source = LLMEngine(cfg)  # the prefill side, once
    vocab = source.runner.vocab_size
    prompt = [(7 * i) % (vocab - 2) + 1 for i in range(prompt_tokens)]
    rid = source.add_request(prompt, SamplingParams(max_tokens=1, ignore_eos=True), keep_kv=True)
    while source.has_unfinished():
        source.step()
    exported = source.export_kv(rid)
    del source
    engine = LLMEngine(cfg)
    kv_mib = sum(len(p.data) for p in exported) / (1 << 20)

    last: dict[str, tuple[float, str | None]] = {}  # running stream -> (its last token's time, phase)
    phase = {"name": None}
    gaps: dict[str, list[float]] = {name: [] for name in PHASES}
    finished = []  # joiners that got every token
    failure = []  # an engine step's error: the run stops there

    async def on_outputs(outputs):
        now, name = time.perf_counter(), phase["name"]
        for out in outputs:
            if out.request_id.startswith("join") and out.finished:
                finished.append(out.request_id)
            if out.request_id.startswith("stream"):
                before = last.get(out.request_id)
                if name and before and before[1] == name:
                    gaps[name].append(now - before[0])
                last[out.request_id] = (now, name)

    async def on_failed(ids, error, is_invalid=False):
        failure.append(error)

    loop = EngineLoop(engine, on_outputs, on_failed)
    loop.start()
    def joiner(n: int) -> list[int]:
        ids = list(prompt)
        ids[0], ids[1] = n % (vocab - 2) + 1, n // (vocab - 2) % (vocab - 2) + 1  # its own block hashes
        return ids

    stream_tokens = args.stream_blocks * cfg.block_size + 1
    stream_params = SamplingParams(max_tokens=min(4000, engine.max_model_len - stream_tokens), ignore_eos=True)
    for i in range(args.streams):
        ids = joiner(vocab * vocab - 1 - i)[:stream_tokens]
        await loop.call(engine.add_request, ids, stream_params, f"stream-{i}",
                        joiner_payloads(engine, exported, ids)[:args.stream_blocks])
    await asyncio.sleep(2.0)  # every stream decoding
    joined, admissions = 0, set()
    joiner_params = SamplingParams(max_tokens=2, ignore_eos=True)
    per_phase = int(args.phase_s / args.join_every) + 1

    def cache_locally(ids: list[int], payloads) -> None:
        engine.add_request(ids, SamplingParams(max_tokens=1), "warm", payloads)
        engine.abort("warm")  # its blocks stay in the prefix cache

    try:
        for _ in range(args.rounds):
            for name in PHASES:
                if failure:
                    raise RuntimeError(f"an engine step failed: {failure[0]}")
                if name == "local_hit":
                    for n in range(joined + 1, joined + per_phase + 1):
                        ids = joiner(n)
                        await loop.call(cache_locally, ids, joiner_payloads(engine, exported, ids))
                    await asyncio.sleep(0.5)
                phase["name"] = name
                end = time.perf_counter() + args.phase_s
                while (now := time.perf_counter()) < end:
                    if name != "no_arrivals":
                        joined += 1
                        ids = joiner(joined)
                        payloads = joiner_payloads(engine, exported, ids)
                        if name in ("kv_thread", "local_hit"):
                            task = asyncio.create_task(loop.add_request_with_kv(ids, joiner_params,
                                                                                f"join-{joined}", payloads))
                            admissions.add(task)
                            task.add_done_callback(admissions.discard)
                        else:
                            await loop.call(engine.add_request, ids, joiner_params, f"join-{joined}", payloads)
                    await asyncio.sleep(max(0.0, min(args.join_every, end - now)))
                phase["name"] = None
                await asyncio.sleep(1.0)  # joiners done before the next phase
                for r in [r for r, s in engine.seqs.items() if r.startswith("join") and s.is_finished]:
                    await loop.call(engine.pop_completion, r)
    finally:
        await loop.stop()

    def pct(values, q):
        values = sorted(values)
        return values[min(len(values) - 1, int(q * len(values)))]
    result = {"model": args.model, "dtype": cfg.kv_dtype, "streams": args.streams,
              "prompt_tokens": prompt_tokens, "joiner_kv_mib": round(kv_mib, 1),
              "join_every_s": args.join_every, "joiners": joined,
              "joiners_finished": len(finished),
              "tbt_p50_s": {n: statistics.median(gaps[n]) for n in PHASES},
              "tbt_p99_s": {n: pct(gaps[n], 0.99) for n in PHASES},
              "tbt_max_s": {n: max(gaps[n]) for n in PHASES},
              "gaps": {n: len(gaps[n]) for n in PHASES}}
    base = result["tbt_p99_s"]["no_arrivals"]
    result["ratio_p99"] = {n: result["tbt_p99_s"][n] / base for n in PHASES}
    hit = result["tbt_p99_s"]["local_hit"]
    result["ratio_p99_to_local_hit"] = {n: result["tbt_p99_s"][n] / hit for n in PHASES}
    return result


def main() -> None:
    args = parse_args()
    offline_hub()
    deadline = 120 + args.rounds * len(PHASES) * (args.phase_s + 5)  # NOTE: a stuck run ends, and says so
    result = asyncio.run(asyncio.wait_for(run(args), deadline))
    print(f"decode stall: {result['model']} ({result['dtype']}), {args.streams} streams, a joiner with "
          f"{result['prompt_tokens']} prompt tokens ({result['joiner_kv_mib']} MiB of KV) every {args.join_every} s")
    print(f"{'phase':<12} {'gaps':>6} {'p50 ms':>8} {'p99 ms':>8} {'max ms':>8} {'p99 / none':>11} {'p99 / hit':>10}")
    for n in PHASES:
        print(f"{n:<12} {result['gaps'][n]:>6} {1e3 * result['tbt_p50_s'][n]:>8.1f} "
              f"{1e3 * result['tbt_p99_s'][n]:>8.1f} {1e3 * result['tbt_max_s'][n]:>8.1f} "
              f"{result['ratio_p99'][n]:>11.2f} {result['ratio_p99_to_local_hit'][n]:>10.2f}")
    out = Path(args.json)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
