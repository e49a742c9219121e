#!/usr/bin/env python3
"""Memory per role of a dev cluster as `mooncake dev` runs it (the default model unless --model; its
sizes unless --library-sizes), after it has answered a chat request, beside the same cluster with the
previous dev defaults (float32, 512 MiB of KV and of pool DRAM) in the same run: resident and peak set
size of each process, from /proc. Beside it, in the same run, the conductor's tokenizer alone as transformers loads it
(which imports torch) and as the conductor now does (mooncake/tokenizer.py). Also: seconds from start to
ready and to the first answer. Prints a table and writes JSON."""

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from mooncake.cli import dev_defaults  # noqa: E402
from mooncake.config import load_config  # noqa: E402
from mooncake.dev import DevCluster, ask  # noqa: E402
from mooncake.models import resolve_model  # noqa: E402


def mib(pid: int) -> dict[str, float]:
    """Resident and peak resident MiB of a process."""
    fields = {}
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        key, _, value = line.partition(":")
        if key in ("VmRSS", "VmHWM"):
            fields[key] = int(value.split()[0]) / 1024
    return {"rss_mib": round(fields["VmRSS"], 1), "peak_mib": round(fields["VmHWM"], 1)}


def tokenizer_alone(path: str, how: str) -> float:
    """Peak MiB of a process that only loads the tokenizer `how` ("transformers" or "mooncake")."""
    load = ("from transformers import AutoTokenizer; t = AutoTokenizer.from_pretrained(p)" if how == "transformers"
            else "from mooncake.tokenizer import LightTokenizer; t = LightTokenizer(p)")
    code = (f"import resource, sys; sys.path.insert(0, {str(ROOT)!r}); p = {path!r}; {load}; "
            "t.apply_chat_template([{'role': 'user', 'content': 'hi'}], add_generation_prompt=True); "
            "print(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024)")
    return round(float(subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                                      timeout=300).stdout), 1)


# What `mooncake dev` ran before it chose its dtype by CPU: the baseline beside today's defaults.
BASELINE = {"engine.dtype": "float32", "engine.kv_cache_bytes": 512 << 20, "store.dram_bytes": 512 << 20}


def measure(cfg) -> dict:
    """Start a dev cluster of `cfg`, ask it one question; its timings and each process's memory."""
    start = time.monotonic()
    with DevCluster(cfg, 1, 1, 1, Path(tempfile.mkdtemp(prefix="role-memory-")), log_to_files=True) as cluster:
        ready_s = time.monotonic() - start
        answer = ask(cluster.url, cfg.api.model_name or cfg.engine.model, "What is the capital of France?")
        answered_s = time.monotonic() - start
        roles = {p.name: mib(p.pid) for p in cluster.processes}
    return {"dtype": cfg.engine.kv_dtype, "ready_s": round(ready_s, 1), "first_answer_s": round(answered_s, 1),
            "answer": answer, "roles": roles, "total_rss_mib": round(sum(r["rss_mib"] for r in roles.values()))}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=None, help="default: the config's engine.model")
    parser.add_argument("--json", type=Path, default=Path("bench-results/role_memory.json"))
    parser.add_argument("--library-sizes", action="store_true", help="1 GiB of KV and pool DRAM, not the dev sizes")
    args = parser.parse_args()
    sizes = {} if args.library_sizes else dev_defaults()  # what `mooncake dev` without --config runs
    extra = {"api.port": 0} | ({"engine.model": args.model} if args.model else {})
    runs = {"baseline": BASELINE, "defaults": sizes}
    results = {name: measure(load_config(None, given | extra)) for name, given in runs.items()}
    model_name = load_config(None, extra).engine.model
    model = resolve_model(model_name)
    tokenizer = {how: tokenizer_alone(str(model.path), how) for how in ("transformers", "mooncake")}
    names = list(results)
    print(f"{'':>16}" + "".join(f"{n:>12}" for n in names))
    for label, key in (("KV dtype", "dtype"), ("ready s", "ready_s"), ("1st answer s", "first_answer_s")):
        print(f"{label:>16}" + "".join(f"{results[n][key]:>12}" for n in names))
    for proc in results[names[0]]["roles"]:
        print(f"{proc + ' RSS MiB':>16}" + "".join(f"{results[n]['roles'][proc]['rss_mib']:>12.0f}" for n in names))
    print(f"{'total RSS MiB':>16}" + "".join(f"{results[n]['total_rss_mib']:>12}" for n in names))
    ratio = results["defaults"]["total_rss_mib"] / results["baseline"]["total_rss_mib"]
    print(f"defaults / baseline: RSS {ratio:.2f}x, first answer "
          f"{results['defaults']['first_answer_s'] / results['baseline']['first_answer_s']:.2f}x; answers: "
          + "; ".join(f"{n} {results[n]['answer'][:40]!r}" for n in names))
    print(f"the conductor's tokenizer alone, peak MiB: transformers {tokenizer['transformers']:.0f}, "
          f"mooncake {tokenizer['mooncake']:.0f} ({tokenizer['mooncake'] / tokenizer['transformers']:.2f}x)")
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps({"model": model_name,
                                     "runs": {n: {"overrides": runs[n], **results[n]} for n in names},
                                     "rss_ratio": ratio, "tokenizer_alone_peak_mib": tokenizer}, indent=2))
    print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
