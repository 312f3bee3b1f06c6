"""The consumer's slots: how many tasks it may hold at once, running or prefetched (backpressure).

A consumer holds at most concurrency + prefetch tasks. With a fixed prefetch it always claims
that far ahead. With the automatic prefetch (`runconsumer` default) the room beyond the running
tasks follows the consumer's pace: it holds only what it would start within PREFETCH_HORIZON_S at
its recent claim rate, at most AUTO_PREFETCH_MAX. A consumer draining a backlog of short tasks
claims in large batches (fewer round trips per task); one running slow tasks prefetches nothing
and leaves the queue to idle peers, instead of sitting on tasks it cannot start for minutes.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

from tasks_app import metrics

# An automatic prefetch holds what the consumer starts in about this long at its recent pace...
PREFETCH_HORIZON_S = 0.02
# ...and never more than this many tasks beyond the running ones.
AUTO_PREFETCH_MAX = 64
# The pace is measured over windows at least this long, smoothed with this time constant.
PACE_WINDOW_S = 0.1
PACE_SMOOTHING_S = 0.3


class Pace:
    """Claims per second, measured over short windows and smoothed: slow to trust a burst, quick to see a lull."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self._window_start = clock()
        self._count = 0
        self.per_s = 0.0

    def note(self, count: int) -> None:
        """Count `count` claimed tasks."""
        self._count += count

    def update(self) -> bool:
        """Close the current window if it is long enough; True if the pace was updated."""
        now = self._clock()
        elapsed = now - self._window_start
        if elapsed < PACE_WINDOW_S:
            return False
        weight = min(1.0, elapsed / PACE_SMOOTHING_S)
        self.per_s += weight * (self._count / elapsed - self.per_s)
        self._window_start, self._count = now, 0
        return True


class Capacity:
    """Counts the tasks this consumer holds; claiming waits while it is full (backpressure)."""

    def __init__(self, concurrency: int, prefetch: int | None, clock: Callable[[], float] = time.monotonic) -> None:
        """`prefetch` None: automatic, following the pace, up to AUTO_PREFETCH_MAX."""
        self.concurrency = concurrency
        self.prefetch_max = AUTO_PREFETCH_MAX if prefetch is None else prefetch
        self._pace = Pace(clock) if prefetch is None else None
        self.limit = concurrency + (0 if self._pace is not None else self.prefetch_max)
        metrics.PREFETCH.set(self.limit - concurrency)
        self.in_use = 0
        self._cond = threading.Condition()

    def acquire(self, timeout_s: float) -> bool:
        """Take one slot, waiting up to `timeout_s` for one to free up."""
        with self._cond:
            if not self._cond.wait_for(lambda: self.in_use < self.limit, timeout_s):
                return False
            self.in_use += 1
            return True

    def acquire_up_to(self, count: int) -> int:
        """Take as many free slots as there are, up to `count`, without waiting."""
        with self._cond:
            self._follow_pace()
            taken = max(0, min(count, self.limit - self.in_use))
            self.in_use += taken
            return taken

    def claimed(self, count: int) -> None:
        """Count tasks just claimed into the slots taken for them (the pace of an automatic prefetch)."""
        if self._pace is not None:
            with self._cond:
                self._pace.note(count)

    def hand_off(self) -> None:
        """Give back the slot of a task that moved to the asyncio lane (which has slots of its own)."""
        self.release(1)

    def take_back(self) -> None:
        """Count such a task again, at once, just before its slot is released as it leaves the consumer."""
        with self._cond:
            self.in_use += 1

    def release(self, count: int = 1) -> None:
        """Give slots back."""
        if count <= 0:
            return
        with self._cond:
            self.in_use -= count
            self._cond.notify_all()

    def _follow_pace(self) -> None:
        if self._pace is None or not self._pace.update():
            return
        prefetch = min(self.prefetch_max, int(self._pace.per_s * PREFETCH_HORIZON_S))
        self.limit = self.concurrency + prefetch
        metrics.PREFETCH.set(prefetch)
        self._cond.notify_all()
