"""Online models the policies predict with, fitted from measurements (the paper's "polynomial
regression" for prefill time). Pure: samples in, predictions out; no clock of their own."""

import bisect
import itertools
from collections import deque

import numpy as np


class _OnlineLinearModel:
    """y = coef . features, seeded with coefficients, then refitted once there are enough samples, every
    `SOLVE_EVERY` samples: least squares over the most recent `window` samples, pulled lightly toward the
    seed (ridge), in constant time per sample. The window's X'X and X'y are running sums (a sample that
    leaves the window is subtracted; they are summed afresh once per window so rounding never builds up),
    and features are divided by typical magnitudes so the 3x3 normal equations stay well conditioned.
    Coefficients stay >= 0 (time never falls as work grows)."""

    PRIOR_WEIGHT = 1e-3  # of the seed, against the window's samples: enough to keep the fit well posed
    # NOTE: the solve is most of a sample's cost, and a decode instance reports every step (the simulator
    # too): solving on every 8th keeps the fit as fresh as its window needs at an eighth of the cost.
    SOLVE_EVERY = 8

    def __init__(self, coef: list[float], window: int, min_samples: int, scale: list[float]):
        self.coef = [float(c) for c in coef]  # plain floats: a prediction is on the scheduler's hot path
        self.scale = np.array(scale, dtype=float)
        self.prior = np.array(coef, dtype=float) * self.scale  # the seed, in scaled features
        self.window, self.min_samples = window, min_samples
        self._samples: deque = deque()
        self._xtx = np.zeros((len(coef), len(coef)))
        self._xty = np.zeros(len(coef))
        self._since_resum = 0
        self._since_solve = 0

    def seed(self, coef: list[float]) -> bool:
        """Start from `coef` instead (what an instance says its steps take), unless samples have come."""
        if self._samples or not all(c >= 0 for c in coef):
            return False
        self.coef = [float(c) for c in coef]
        self.prior = np.array(self.coef) * self.scale
        return True

    def _observe(self, features: list[float], y: float) -> None:
        x = np.asarray(features, dtype=float) / self.scale
        self._samples.append((x, y))
        self._xtx += np.outer(x, x)
        self._xty += x * y
        if len(self._samples) > self.window:
            old, old_y = self._samples.popleft()
            self._xtx -= np.outer(old, old)
            self._xty -= old * old_y
        self._since_resum += 1
        if self._since_resum >= self.window:
            self._since_resum = 0
            xs = np.array([x for x, _ in self._samples])
            self._xtx, self._xty = xs.T @ xs, xs.T @ np.array([t for _, t in self._samples])
        self._since_solve += 1
        if len(self._samples) >= self.min_samples and (self._since_solve >= self.SOLVE_EVERY
                                                       or len(self._samples) == self.min_samples):
            self._since_solve = 0
            eye = np.eye(len(self.prior)) * self.PRIOR_WEIGHT
            scaled = np.linalg.solve(self._xtx + eye, self._xty + self.PRIOR_WEIGHT * self.prior)
            self.coef = [max(0.0, float(c)) for c in scaled / self.scale]


class PrefillTimeModel(_OnlineLinearModel):
    """Prefill seconds for a prompt of n tokens with r reused: c0 + c1*(n - r) + c2*(n^2 - r^2)."""

    def __init__(self, c0: float, c1: float, c2: float, window: int = 512, min_samples: int = 16):
        super().__init__([c0, c1, c2], window, min_samples, scale=[1.0, 1e3, 1e6])

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
        super().__init__([a, b, c], window, min_samples, scale=[1.0, 10.0, 1e4])

    def predict(self, batch_size: int, context_tokens: int) -> float:
        if batch_size <= 0:
            return 0.0
        a, b, c = self.coef
        return max(0.0, a + b * batch_size + c * context_tokens)

    def observe(self, batch_size: int, context_tokens: int, seconds: float) -> None:
        self._observe([1.0, float(batch_size), float(context_tokens)], seconds)


class OutputLengthModel:
    """Tokens a request has left to write, learned from the answers seen end (the paper's conductor is not
    told output lengths; a client's max_tokens is a cap, far above most answers).

    For a request that has written k tokens under a cap of m: E[min(L, m) | L > k] - k over the last
    `window` answer lengths L, or `prior_tokens` (capped) until `min_samples` have ended. One past every
    length seen: a quarter of what it wrote more, at least one. With `learn` off it is the old rule, the
    cap less what was written: exact only when the cap is the true length (a replay's --oracle)."""

    REBUILD_EVERY = 8  # observations between rebuilds of the sorted window (a prediction is a bisection)

    def __init__(self, prior_tokens: int = 256, learn: bool = True, window: int = 2048, min_samples: int = 16):
        self.prior_tokens, self.learn = prior_tokens, learn
        self.window, self.min_samples = window, min_samples
        self._lengths: deque = deque(maxlen=window)
        self._sorted: list[int] = []
        self._sums: list[int] = [0]  # prefix sums of _sorted
        self._since_rebuild = 0

    @property
    def num_samples(self) -> int:
        return len(self._sorted)

    def observe(self, num_tokens: int) -> None:
        if num_tokens <= 0:
            return
        self._lengths.append(num_tokens)
        self._since_rebuild += 1
        if self._since_rebuild >= self.REBUILD_EVERY or len(self._lengths) <= self.min_samples:
            self._since_rebuild = 0
            self._sorted = sorted(self._lengths)
            self._sums = [0, *itertools.accumulate(self._sorted)]

    def left(self, written: int, cap: int) -> int:
        """Tokens predicted still to come of a request that wrote `written` under max_tokens `cap`."""
        most = max(0, cap - written)
        if not self.learn or most == 0:
            return most
        if len(self._sorted) < self.min_samples:
            return min(most, max(1, self.prior_tokens - written))
        s, sums = self._sorted, self._sums
        first = bisect.bisect_right(s, written)  # answers longer than what it wrote: the ones it may be
        if first == len(s):
            return min(most, max(1, written // 4))
        capped = bisect.bisect_left(s, cap, lo=first)  # from here on an answer stops at the cap
        total = sums[capped] - sums[first] + cap * (len(s) - capped)
        return min(most, max(1, round(total / (len(s) - first)) - written))

    def expected(self, cap: int) -> int:
        """Tokens predicted for a new request under max_tokens `cap`."""
        return self.left(0, cap)


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
