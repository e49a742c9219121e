"""The discrete-event core: a simulated clock and a heap of timed callbacks, in deterministic order."""

import heapq
import itertools
from collections.abc import Callable


class EventLoop:
    def __init__(self):
        self.now = 0.0
        self._heap: list = []
        self._seq = itertools.count()  # ties run in scheduling order: same input, same run

    def at(self, time_s: float, fn: Callable, *args) -> None:
        heapq.heappush(self._heap, (max(time_s, self.now), next(self._seq), fn, args))

    def clock(self) -> float:
        return self.now

    def run(self, progress: Callable[[float], None] | None = None) -> None:
        while self._heap:
            self.now, _, fn, args = heapq.heappop(self._heap)
            fn(*args)
            if progress is not None:
                progress(self.now)
