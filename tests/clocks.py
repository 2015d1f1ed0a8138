"""A fake clock for the tests of every timing path (no real timing in the tests)."""

from __future__ import annotations

import math


class FakeClock:
    """Time advances by ``per_read`` on every read and by ``per_call`` on every timed call; the clock
    shows it rounded down to ``tick`` (a coarse clock: 12 ms, a scheduler's time slice)."""

    def __init__(self, per_call: float, *, per_read: float = 1e-7, tick: float = 0.0):
        self.true, self.per_call, self.per_read, self.tick = 0.0, per_call, per_read, tick
        self.calls = 0

    def __call__(self) -> float:
        self.true += self.per_read
        return math.floor(self.true / self.tick) * self.tick if self.tick else self.true

    def fn(self) -> None:
        self.calls += 1
        self.true += self.per_call

    def wrap(self, fn):
        """``fn`` that also advances this clock by ``per_call`` (a real call timed on a fake clock)."""

        def timed(*args, **kwargs):
            self.fn()
            return fn(*args, **kwargs)

        return timed
