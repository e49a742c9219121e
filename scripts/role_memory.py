#!/usr/bin/env python3
"""Memory per role of a dev cluster as `mooncake dev` runs it (the default model unless --model; its
sizes unless --library-sizes), after it has answered a chat request: resident and peak set size of each
process, from /proc. Beside it, in the same run, the conductor's tokenizer alone as transformers loads it
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

from mooncake.cli import DEV_SIZES  # noqa: E402
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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=None, help="default: the config's engine.model")
    parser.add_argument("--json", type=Path, default=Path("bench-results/role_memory.json"))
    parser.add_argument("--library-sizes", action="store_true", help="1 GiB of KV and pool DRAM, not the dev sizes")
    args = parser.parse_args()
    sizes = {} if args.library_sizes else DEV_SIZES  # what `mooncake dev` without --config runs
    overrides = sizes | {"api.port": 0} | ({"engine.model": args.model} if args.model else {})
    cfg = load_config(None, overrides)
    model = resolve_model(cfg.engine.model)
    start = time.monotonic()
    with DevCluster(cfg, 1, 1, 1, Path(tempfile.mkdtemp(prefix="role-memory-")), log_to_files=True) as cluster:
        ready_s = time.monotonic() - start
        answer = ask(cluster.url, cfg.api.model_name or cfg.engine.model, "What is the capital of France?")
        answered_s = time.monotonic() - start
        roles = {p.name: mib(p.pid) for p in cluster.processes}
    baseline = {how: tokenizer_alone(str(model.path), how) for how in ("transformers", "mooncake")}
    total = sum(r["rss_mib"] for r in roles.values())
    print(f"{cfg.engine.model}: ready in {ready_s:.1f} s, first answer at {answered_s:.1f} s ({answer[:40]!r})")
    print(f"{'process':>12}{'RSS MiB':>10}{'peak MiB':>10}")
    for name, r in roles.items():
        print(f"{name:>12}{r['rss_mib']:>10.0f}{r['peak_mib']:>10.0f}")
    print(f"{'total':>12}{total:>10.0f}")
    print(f"the conductor's tokenizer alone, peak MiB: transformers {baseline['transformers']:.0f}, "
          f"mooncake {baseline['mooncake']:.0f} ({baseline['mooncake'] / baseline['transformers']:.2f}x)")
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps({"model": cfg.engine.model, "ready_s": ready_s, "first_answer_s": answered_s,
                                     "sizes": sizes, "roles": roles, "total_rss_mib": total,
                                     "tokenizer_alone_peak_mib": baseline}, indent=2))
    print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
