"""PNG plots like the paper's, from simulation reports: TTFT and TBT CDFs, effective capacity against
the TBT threshold, and prefill/decode load over time. Needs matplotlib (`pip install 'mooncake[sim]'`)."""

from pathlib import Path

import numpy as np

from mooncake.errors import MooncakeError
from mooncake.sim.metrics import TTFT_LIMIT_S

THRESHOLDS_S = np.linspace(0.02, 0.5, 49)


def pyplot():
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise MooncakeError("plots need matplotlib: pip install 'mooncake[sim]' (or run with --no-plots)") from None
    return plt


def capacity_curve(result: dict) -> np.ndarray:
    """Share of all requests served with TTFT <= 30 s and TBT <= t, for each t in THRESHOLDS_S."""
    ttft = np.array(result["per_request"]["ttft_s"])
    tbt = np.array(result["per_request"]["tbt_s"])
    ok_ttft = ttft <= TTFT_LIMIT_S
    return np.array([np.sum(ok_ttft & (tbt <= t)) for t in THRESHOLDS_S]) / max(1, result["requests"])


def write_plots(results: dict[str, dict], out_dir: str | Path) -> list[Path]:
    """One figure per metric, every labelled run overlaid (load over time: one panel per run)."""
    plt = pyplot()
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    paths = []
    for metric, unit, scale in (("ttft_s", "TTFT (s)", 1.0), ("tbt_s", "TBT (ms)", 1000.0)):
        fig, ax = plt.subplots(figsize=(6, 4))
        for label, result in results.items():
            values = np.sort(np.array(result["per_request"][metric]) * scale)
            if len(values):
                ax.plot(values, np.arange(1, len(values) + 1) / len(values), label=label)
        ax.set_xlabel(unit)
        ax.set_ylabel("CDF")
        ax.set_xscale("log")
        ax.grid(alpha=0.3)
        ax.legend()
        paths.append(save_figure(fig, out / f"{metric.removesuffix('_s')}_cdf.png", plt))
    fig, ax = plt.subplots(figsize=(6, 4))
    for label, result in results.items():
        ax.plot(THRESHOLDS_S * 1000, capacity_curve(result) * 100, label=label)
    ax.set_xlabel("TBT threshold (ms), TTFT <= 30 s")
    ax.set_ylabel("requests within SLO (%)")
    ax.grid(alpha=0.3)
    ax.legend()
    paths.append(save_figure(fig, out / "capacity_vs_threshold.png", plt))
    with_load = {k: v for k, v in results.items() if v.get("load_over_time")}
    if with_load:
        fig, axes = plt.subplots(len(with_load), 1, figsize=(8, 2.5 * len(with_load)), squeeze=False, sharex=True)
        for ax, (label, result) in zip(axes[:, 0], with_load.items()):
            samples = np.array(result["load_over_time"])
            ax.plot(samples[:, 0], samples[:, 1], label="prefill load")
            ax.plot(samples[:, 0], samples[:, 2], label="decode load")
            ax.axhline(1.0, color="grey", linestyle="--", linewidth=0.8)
            ax.set_title(label, fontsize=9)
            ax.set_ylabel("load / SLO")
            ax.legend(fontsize=8)
        axes[-1, 0].set_xlabel("time (s)")
        paths.append(save_figure(fig, out / "load_over_time.png", plt))
    return paths


def save_figure(fig, path: Path, plt) -> Path:
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
