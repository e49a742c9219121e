"""The capacity search of the goodput benchmark (scripts/bench_goodput.py): the highest request rate a
system serves with 90% of requests within both SLOs (the paper's effective request capacity, Fig. 10's
reading), found by bracketing and bisection over rate factors of one trace slice."""

THRESHOLDS_S = (0.1, 0.2, 0.3)  # TBT SLOs, with TTFT <= 30 s
WITHIN = 0.9  # share of requests that must meet both


def capacity(share_within, thresholds=THRESHOLDS_S, start: dict | None = None, steps: int = 6,
             brackets: int = 8) -> dict:
    """Per TBT threshold, the highest rate factor at which at least 90% of requests meet TTFT <= 30 s and
    TBT <= the threshold: doubled or halved from `start[threshold]` (default 1) until it brackets the
    crossing (at most `brackets` runs), then bisected (geometrically) `steps` times. `share_within(rate)` -> {threshold: share}; evaluations are shared.
    A bound never crossed is reported as such ("at_least" / "below")."""
    seen: dict[float, dict] = {}

    def ok(rate: float, key: str) -> bool:
        if rate not in seen:
            seen[rate] = share_within(rate)
        return seen[rate][key] >= WITHIN

    out = {}
    for threshold in thresholds:
        key = f"{threshold:g}"
        low = high = None
        rate = (start or {}).get(key, 1.0)
        for _ in range(brackets):  # bracket: double while it holds, halve while it does not
            if ok(rate, key):
                low, rate = rate, rate * 2
            else:
                high, rate = rate, rate / 2
            if low is not None and high is not None:
                break
        if low is None or high is None:
            out[key] = {"rate": low or 0.0, "bound": "at_least" if low else "below", "evaluated": sorted(seen)}
            continue
        for _ in range(steps):
            middle = (low * high) ** 0.5
            low, high = (middle, high) if ok(middle, key) else (low, middle)
        out[key] = {"rate": round(low, 4), "bound": "bisected", "evaluated": sorted(seen)}
    return out
