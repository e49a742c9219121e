"""Online models the policies predict with, fitted from measurements (the paper's "polynomial
regression" for prefill time). Pure: samples in, predictions out; no clock of their own."""

from collections import deque

import numpy as np


class _OnlineLinearModel:
    """y = coef . features, seeded with coefficients, then refitted by least squares over the most recent
    samples once there are enough; coefficients stay >= 0 (time never falls as work grows)."""

    def __init__(self, coef: list[float], window: int, min_samples: int):
        self.coef = [float(c) for c in coef]  # plain floats: a prediction is on the scheduler's hot path
        self._samples: deque = deque(maxlen=window)
        self.min_samples = min_samples

    def _observe(self, features: list[float], y: float) -> None:
        self._samples.append((features, y))
        if len(self._samples) >= self.min_samples:
            x = np.array([f for f, _ in self._samples])
            coef, *_ = np.linalg.lstsq(x, np.array([t for _, t in self._samples]), rcond=None)
            self.coef = [max(0.0, float(c)) for c in coef]


class PrefillTimeModel(_OnlineLinearModel):
    """Prefill seconds for a prompt of n tokens with r reused: c0 + c1*(n - r) + c2*(n^2 - r^2)."""

    def __init__(self, c0: float, c1: float, c2: float, window: int = 512, min_samples: int = 16):
        super().__init__([c0, c1, c2], window, min_samples)

    @staticmethod
    def _features(n: int, r: int) -> list[float]:
        r = min(r, n)
        return [1.0, float(n - r), float(n * n - r * r)]

    def predict(self, num_tokens: int, reused_tokens: int = 0) -> float:
        c0, c1, c2 = self.coef
        n, r = num_tokens, min(reused_tokens, num_tokens)
        return max(0.0, c0 + c1 * (n - r) + c2 * (n * n - r * r))

    def observe(self, num_tokens: int, reused_tokens: int, seconds: float) -> None:
        self._observe(self._features(num_tokens, reused_tokens), seconds)


class DecodeStepModel(_OnlineLinearModel):
    """Seconds per decode step: a + b*batch_size + c*context_tokens (0 for an empty batch)."""

    def __init__(self, a: float, b: float, c: float, window: int = 512, min_samples: int = 16):
        super().__init__([a, b, c], window, min_samples)

    def predict(self, batch_size: int, context_tokens: int) -> float:
        if batch_size <= 0:
            return 0.0
        a, b, c = self.coef
        return max(0.0, a + b * batch_size + c * context_tokens)

    def observe(self, batch_size: int, context_tokens: int, seconds: float) -> None:
        self._observe([1.0, float(batch_size), float(context_tokens)], seconds)


class BandwidthEstimator:
    """Bytes per second between two holders: a moving average of completed transfers, seeded from config."""

    def __init__(self, default_bytes_per_s: float, alpha: float = 0.2):
        self.default = default_bytes_per_s
        self.alpha = alpha
        self._rates: dict[tuple[str, str], float] = {}

    def get(self, src: str, dst: str) -> float:
        return self._rates.get((src, dst), self.default)

    def observe(self, src: str, dst: str, num_bytes: int, seconds: float) -> None:
        if seconds <= 0 or num_bytes <= 0:
            return
        rate = num_bytes / seconds
        old = self._rates.get((src, dst))
        self._rates[(src, dst)] = rate if old is None else (1 - self.alpha) * old + self.alpha * rate
