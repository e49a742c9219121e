#!/usr/bin/env python3
"""What the front door costs per streamed token, and whether it scales out: the emulated 70B model (1P2D,
a high --speedup, so the instances are fast and the front door is what is measured) behind 1 and 2 API
processes, at several stream counts, same run; beside it, with --baseline REF, the same load on git
revision REF (checked out in a temporary worktree: before the front door, its conductor relayed every
token and served the API).

Each row: S concurrent streams of a --prompt-tokens prompt (new each time: no prefix reuse) and
--output-tokens greedy tokens, through the REST API, --rounds times; each figure is the median over rounds.
Per role, CPU seconds (utime + stime of its processes from /proc, over the load) per streamed token; the
conductor's CPU per request; cluster tokens/s; TTFT p50. `--stream-interval 1 4` adds rows of one API
process sending 4 tokens per SSE event (api.stream_interval). Prints a table and writes JSON (`--json`):
`rows[]` with `tree`, `api`, `stream_interval`, `streams`, `tok_per_s`, `ttft_p50_s`, `cpu_us_per_token`
({role: us}), `conductor_ms_per_request`, and `goals`.

    python scripts/bench_frontdoor.py --baseline bfb26b5 --json /tmp/frontdoor.json"""

import argparse
import inspect
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
import uuid
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CLK_TCK = os.sysconf("SC_CLK_TCK")


def cpu_s(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / CLK_TCK


def prompt(n: int) -> list[int]:
    seed = uuid.uuid4().int
    return [32 + (seed >> (i % 100)) % 90 + (i % 7) for i in range(n)]


def stream(url: str, body: dict, out: list) -> None:
    """One streamed completion: (TTFT, tokens) into `out`."""
    req = urllib.request.Request(url + "/v1/completions", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    start, ttft, n = time.perf_counter(), None, 0
    with urllib.request.urlopen(req, timeout=600) as r:
        for line in r:
            if not line.startswith(b"data: {"):
                continue
            event = json.loads(line[6:])
            if "choices" in event and event["choices"] and event["choices"][0].get("token_ids"):
                ttft = ttft if ttft is not None else time.perf_counter() - start
                n += len(event["choices"][0]["token_ids"])
    out.append((ttft or 0.0, n))


def load(url: str, streams: int, args) -> dict:
    """`streams` streams at once (each thread one stream; bounded: every stream ends by itself)."""
    results: list = []
    bodies = [{"model": "bench", "prompt": prompt(args.prompt_tokens), "max_tokens": args.output_tokens,
               "temperature": 0, "ignore_eos": True, "stream": True, "return_token_ids": True}
              for _ in range(streams)]
    threads = [threading.Thread(target=stream, args=(url, body, results)) for body in bodies]
    start = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join(600)
    wall = time.perf_counter() - start
    tokens = sum(n for _, n in results)
    return {"wall_s": wall, "tokens": tokens, "requests": len(results),
            "ttft_p50_s": statistics.median(t for t, _ in results) if results else 0.0}


def one_round(cluster, streams: int, args) -> dict:
    """One load of `streams` streams: its figures, CPU per role from /proc (10 ms ticks: rounds even it out)."""
    before = {p.name: cpu_s(p.pid) for p in cluster.processes}
    got = load(cluster.url, streams, args)
    spent: dict[str, float] = {}
    for p in cluster.processes:
        spent[p.role] = spent.get(p.role, 0.0) + cpu_s(p.pid) - before[p.name]
    tokens = max(1, got["tokens"])
    return {"tok_per_s": got["tokens"] / got["wall_s"], "ttft_p50_s": got["ttft_p50_s"],
            "cpu_us_per_token": {role: s / tokens * 1e6 for role, s in spent.items()},
            "conductor_ms_per_request": spent.get("conductor", 0.0) / max(1, got["requests"]) * 1e3}


def drive(args) -> None:
    """In a subprocess whose tree is args.tree: one cluster per API count, every stream count on it."""
    sys.path.insert(0, str(args.tree))
    from mooncake.config import load_config
    from mooncake.dev import DevCluster
    settings = {"engine.model": "emulated-llama3-70b", "engine.block_size": 64, "engine.emulation_speedup":
                args.speedup, "api.port": 0, "api.model_name": "bench", "conductor.admission": "accept-all",
                "engine.kv_cache_bytes": 1 << 30, "engine.num_threads": 1}
    rows = []
    # NOTE: api.stream_interval beyond 1 with one API process only (a tree before it has no such key)
    runs = [(num_api, interval) for num_api in args.api for interval in args.stream_interval
            if interval == 1 or num_api == 1]
    for num_api, interval in runs:
        kwargs = {"num_api": num_api} if "num_api" in inspect.signature(DevCluster).parameters else {}
        if num_api > 1 and not kwargs:
            continue  # NOTE: a tree before the front door has one front door: its conductor
        workdir = Path(tempfile.mkdtemp(prefix="bench-frontdoor-"))
        config = load_config(None, {**settings, **({"api.stream_interval": interval} if interval > 1 else {})})
        with DevCluster(config, 1, 2, 0, workdir, log_to_files=True, **kwargs) as cluster:
            load(cluster.url, 2, args)  # warm up
            for streams in args.streams:
                rounds = [one_round(cluster, streams, args) for _ in range(args.rounds)]
                rows.append({"tree": args.label, "api": num_api, "stream_interval": interval, "streams": streams,
                             "rounds": args.rounds,
                             **{key: statistics.median(r[key] for r in rounds)
                                for key in ("tok_per_s", "ttft_p50_s", "conductor_ms_per_request")},
                             "cpu_us_per_token": {role: statistics.median(r["cpu_us_per_token"][role] for r in rounds)
                                                  for role in rounds[0]["cpu_us_per_token"]}})
                print(json.dumps(rows[-1]), file=sys.stderr, flush=True)
    Path(args.out).write_text(json.dumps(rows))


def run_tree(tree: Path, label: str, args, intervals: list[int]) -> list[dict]:
    with tempfile.NamedTemporaryFile(suffix=".json") as out:
        cmd = [sys.executable, str(Path(__file__).resolve()), "--drive", "--tree", str(tree), "--label", label,
               "--out", out.name, "--speedup", str(args.speedup), "--prompt-tokens", str(args.prompt_tokens),
               "--output-tokens", str(args.output_tokens), "--rounds", str(args.rounds),
               "--streams", *map(str, args.streams),
               "--api", *map(str, args.api), "--stream-interval", *map(str, intervals)]
        env = {**os.environ, "PYTHONPATH": str(tree)}  # NOTE: the cluster's processes import that tree's mooncake
        subprocess.run(cmd, check=True, cwd=tree, env=env, timeout=3600)
        return json.loads(Path(out.name).read_text())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--streams", type=int, nargs="+", default=[8, 32, 64])
    parser.add_argument("--api", type=int, nargs="+", default=[1, 2], help="API process counts to run")
    parser.add_argument("--speedup", type=float, default=20.0)
    parser.add_argument("--prompt-tokens", type=int, default=64)
    parser.add_argument("--output-tokens", type=int, default=256)
    parser.add_argument("--rounds", type=int, default=5, help="loads per row; each figure is their median")
    parser.add_argument("--stream-interval", type=int, nargs="+", default=[1],
                        help="api.stream_interval values to run (beyond 1: with one API process)")
    parser.add_argument("--baseline", metavar="REF", help="also run git revision REF (a temporary worktree)")
    parser.add_argument("--json", type=Path, help="write the results here")
    parser.add_argument("--drive", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--tree", type=Path, default=ROOT, help=argparse.SUPPRESS)
    parser.add_argument("--label", default="this", help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.drive:
        return drive(args)
    rows = []
    if args.baseline:
        with tempfile.TemporaryDirectory(prefix="bench-frontdoor-base-") as tmp:
            tree = Path(tmp) / "tree"
            subprocess.run(["git", "-C", str(ROOT), "worktree", "add", "--detach", "-q", str(tree), args.baseline],
                           check=True)
            try:
                rows += run_tree(tree, args.baseline, args, [1])
            finally:
                subprocess.run(["git", "-C", str(ROOT), "worktree", "remove", "--force", str(tree)], check=False)
    rows += run_tree(ROOT, "this", args, args.stream_interval)
    print(f"\n{'tree':>8} {'api':>3} {'every':>5} {'streams':>7} {'tok/s':>8} {'TTFT p50':>9} {'us/token: api':>14} "
          f"{'conductor':>9} {'decode':>7} {'conductor ms/req':>16}")
    for r in rows:
        cpu = r["cpu_us_per_token"]
        print(f"{r['tree']:>8} {r['api']:>3} {r.get('stream_interval', 1):>5} {r['streams']:>7} "
              f"{r['tok_per_s']:>8.0f} {r['ttft_p50_s']:>9.3f} "
              f"{cpu.get('api', float('nan')):>14.1f} {cpu.get('conductor', 0):>9.1f} {cpu.get('decode', 0):>7.1f} "
              f"{r['conductor_ms_per_request']:>16.2f}")
    goals = goals_of(rows, args.baseline)
    for name, value in goals.items():
        print(f"{name}: {value}")
    if args.json:
        args.json.write_text(json.dumps({"rows": rows, "goals": goals, "baseline": args.baseline,
                                         "speedup": args.speedup, "prompt_tokens": args.prompt_tokens,
                                         "output_tokens": args.output_tokens}, indent=2))


def goals_of(rows: list[dict], baseline: str | None) -> dict:
    every = [r for r in rows if r["tree"] == "this"]
    this = [r for r in every if r.get("stream_interval", 1) == 1]
    base = {r["streams"]: r for r in rows if r["tree"] == baseline}
    goals = {"conductor_ms_per_request_max": max(r["conductor_ms_per_request"] for r in this),
             "conductor_us_per_token_max": max(r["cpu_us_per_token"].get("conductor", 0.0) for r in this)}
    if base:
        goals["api_over_old_conductor_us_per_token"] = {
            r["streams"]: r["cpu_us_per_token"]["api"] / base[r["streams"]]["cpu_us_per_token"]["conductor"]
            for r in this if r["api"] == 1 and r["streams"] in base}
        for interval in sorted({r["stream_interval"] for r in every} - {1}):
            goals[f"api_over_old_conductor_us_per_token_stream_interval_{interval}"] = {
                r["streams"]: r["cpu_us_per_token"]["api"] / base[r["streams"]]["cpu_us_per_token"]["conductor"]
                for r in every if r["stream_interval"] == interval and r["streams"] in base}
    one = {r["streams"]: r for r in this if r["api"] == 1}
    goals["tok_per_s_api2_over_api1"] = {r["streams"]: r["tok_per_s"] / one[r["streams"]]["tok_per_s"]
                                         for r in this if r["api"] == 2 and r["streams"] in one}
    return goals


if __name__ == "__main__":
    main()
