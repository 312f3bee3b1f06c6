"""The asyncio lane: `async def` handlers of a consumer run on one event loop, not a thread each.

A worker thread decodes the task and records its start as for any task, then hands the
coroutine here and moves on: the task gives back its worker slot and takes one of the lane's
`--async-concurrency` slots instead (the worker waits while the lane is full). The outcome is
settled through the same path as a sync run (results, retries, acks and fences): a success is
handed to the ack batcher from the loop (that only queues it), anything else is settled on a
small pool of threads, so the loop never waits on Redis. A task keeps its lane slot until its ack is
written: a crash can re-run at most concurrency + prefetch + async concurrency tasks.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import Callable, Coroutine
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Protocol

from tasks_app.exceptions import TaskTimeout

logger = logging.getLogger(__name__)

# Threads settling the runs that cannot be settled on the loop (failures make round trips).
SETTLE_THREADS = 4

Settle = Callable[[Any, BaseException | None, BaseException | None, float, Callable[[], None]], bool]
"""Settles a run: (value, error, raised, duration, on_settled) -> True if `on_settled` is called later."""

SucceedNow = Callable[[Any, float, Callable[[], None]], bool | None]
"""Settles a success without waiting on Redis, on the loop: (value, duration, on_settled) -> as
`Settle`, or None when it cannot (then the run is settled by `Settle` on a settling thread)."""


class WorkerSlots(Protocol):
    """The consumer's capacity, of which a task handed to the lane gives back its slot."""

    def hand_off(self) -> None: ...
    def take_back(self) -> None: ...


@dataclass(eq=False)
class _Flight:
    """One coroutine handed to the lane: what settles it, and whether that was done."""

    settle: Settle
    timeout_s: float | None
    succeed_now: SucceedNow | None = None
    done: Callable[[], None] = lambda: None
    started: float = field(default_factory=time.monotonic)
    settled: bool = False
    lock: threading.Lock = field(default_factory=threading.Lock)

    def take_settling(self) -> bool:
        """True for the one caller that settles this run (its end, or a hard limit)."""
        with self.lock:
            first, self.settled = not self.settled, True
            return first


class AsyncLane:
    """One event loop in a thread of its own, running up to `concurrency` coroutine handlers at once."""

    def __init__(self, concurrency: int, worker_slots: WorkerSlots) -> None:
        self.concurrency = concurrency
        self.worker_slots = worker_slots
        self._slots = threading.BoundedSemaphore(concurrency)
        self._running = 0
        self._lock = threading.Lock()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._settlers: ThreadPoolExecutor | None = None
        self._flights: set[_Flight] = set()

    @property
    def running(self) -> int:
        """Tasks handed to the lane and not yet settled."""
        with self._lock:
            return self._running

    def submit(
        self,
        coroutine: Coroutine[Any, Any, Any],
        settle: Settle,
        on_settled: Callable[[], None],
        timeout_s: float | None,
        succeed_now: SucceedNow | None = None,
    ) -> None:
        """Run `coroutine` on the loop and settle its outcome; waits while the lane is full."""
        self._slots.acquire()
        flight = _Flight(settle, timeout_s, succeed_now)
        flight.done = self._done_callback(on_settled, flight)
        with self._lock:
            self._running += 1
            self._flights.add(flight)
            loop = self._loop or self._start()
        self.worker_slots.hand_off()
        asyncio.run_coroutine_threadsafe(self._run(coroutine, flight), loop)

    def fail_hung(self, grace_s: float) -> int:
        """Settle as timed out every run still going `grace_s` past its timeout (the loop is blocked)."""
        now = time.monotonic()
        with self._lock:
            hung = [
                flight
                for flight in self._flights
                if flight.timeout_s is not None and now - flight.started >= flight.timeout_s + grace_s
            ]
        failed = 0
        for flight in hung:
            if flight.take_settling():
                assert flight.timeout_s is not None
                error = TaskTimeout(f"task exceeded its timeout of {flight.timeout_s:g} s")
                logger.error("an async task is still running %g s past its timeout: its event loop is blocked", grace_s)
                self._settle(flight, None, error, now - flight.started)
                failed += 1
        return failed

    def close(self) -> None:
        """Stop the loop and the settling threads (after the consumer waited for the running tasks)."""
        with self._lock:
            loop, self._loop = self._loop, None
            settlers, self._settlers = self._settlers, None
        if loop is not None:
            loop.call_soon_threadsafe(loop.stop)
        if settlers is not None:
            settlers.shutdown(wait=False)

    def _start(self) -> asyncio.AbstractEventLoop:
        loop = asyncio.new_event_loop()
        threading.Thread(target=loop.run_forever, name="async-lane", daemon=True).start()
        self._settlers = ThreadPoolExecutor(SETTLE_THREADS, thread_name_prefix="async-settle")
        self._loop = loop
        return loop

    async def _run(self, coroutine: Coroutine[Any, Any, Any], flight: _Flight) -> None:
        value: Any = None
        raised: BaseException | None = None
        try:
            value = await coroutine
        except BaseException as exc:  # a handler's sys.exit() or cancellation fails the task, not the lane
            raised = exc
        if flight.take_settling():
            duration_s = time.monotonic() - flight.started
            later = None
            if raised is None and flight.succeed_now is not None:
                try:
                    later = flight.succeed_now(value, duration_s, flight.done)  # a success is only queued
                except Exception:  # a bug: settled the slow way, which dead-letters as a last resort
                    logger.exception("unexpected error settling an async task on the loop")
            settlers = self._settlers
            if later is not None:
                if not later:
                    flight.done()
            elif settlers is not None:
                settlers.submit(self._settle, flight, value, raised, duration_s)
            else:  # closed while it ran (past the grace period)
                self._settle(flight, value, raised, duration_s)

    def _settle(self, flight: _Flight, value: Any, raised: BaseException | None, duration_s: float) -> None:
        try:
            later = flight.settle(value, raised, raised, duration_s, flight.done)
        except Exception:  # settle dead-letters as a last resort; this is a bug: the lease recovers the task
            logger.exception("unexpected error settling an async task")
            later = False
        if not later:
            flight.done()

    def _done_callback(self, on_settled: Callable[[], None], flight: _Flight) -> Callable[[], None]:
        """What runs once the task left the consumer's hands: its slots are given back."""

        def done() -> None:
            self.worker_slots.take_back()  # on_settled releases a worker slot: the one handed off
            on_settled()
            with self._lock:
                self._running -= 1
                self._flights.discard(flight)
            self._slots.release()

        return done
