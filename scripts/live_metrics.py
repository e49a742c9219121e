"""What the benchmarks read of a live cluster: its /metrics text (Prometheus histograms) and its processes' CPU."""

import os
import urllib.request
from pathlib import Path


def histogram(text: str, name: str, labels: str = "") -> dict:
    """One Prometheus histogram of a /metrics text, by its label set `labels` (e.g. 'role="decode"'):
    count, mean, the upper bounds of the buckets holding its median and 90th percentile, and the
    cumulative count by bucket."""
    def value(line: str) -> float:
        return float(line.rsplit(" ", 1)[1])

    lines = [line for line in text.splitlines() if line.startswith(name) and labels in line]
    buckets = [(float(line.split('le="')[1].split('"')[0]), value(line)) for line in lines
               if line.startswith(name + "_bucket") and 'le="+Inf"' not in line]
    total = next((value(line) for line in lines if line.startswith(name + "_count")), 0.0)
    total_sum = next((value(line) for line in lines if line.startswith(name + "_sum")), 0.0)

    def quantile(q: float):
        return next((le for le, count in buckets if total and count >= q * total), None)

    return {"count": total, "mean": total_sum / total if total else None, "median_upper_bound": quantile(0.5),
            "p90_upper_bound": quantile(0.9), "cumulative": dict(buckets)}


def scrape(url: str) -> str:
    return urllib.request.urlopen(url + "/metrics", timeout=10).read().decode()


def step_ratios(text: str) -> dict:
    """Per role, measured over modelled step time of the emulated instances, and the share of steps
    within 5% of the model."""
    out = {}
    for role in ("prefill", "decode"):
        h = histogram(text, "mooncake_emulated_step_ratio", f'role="{role}"')
        h["within_5pct"] = h["cumulative"].get(1.05, 0.0) / h["count"] if h["count"] else None
        out[role] = h
    return out


def cpu_seconds(pid: int) -> float:
    """User + system CPU seconds a process has used (from /proc)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
