"""The asyncio lane: `async def` handlers of a consumer run on one event loop, not a thread each.

A success is handed to the ack batcher from the loop; anything else is settled on a small thread
pool, so the loop never waits on Redis. A task keeps its seat until its ack is written. A handler's
`loop.stop()` is logged and the loop run again; a loop it closed fails its runs, and a new one starts.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import threading
import time
from collections import deque
from collections.abc import Callable, Coroutine
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from functools import partial
from typing import Any

from tasks_app.consumer.claiming import Capacity
from tasks_app.consumer.time_limits import RunClock, exit_if_forked, guard_loop, unguard_loop
from tasks_app.exceptions import TaskCancelled, TaskTimeout

logger = logging.getLogger(__name__)

# Threads settling the runs that cannot be settled on the loop (failures make round trips).
SETTLE_THREADS = 4
# How often a worker waiting for a seat looks whether the consumer began to stop.
SEAT_WAIT_S = 0.05

# (value, raised, duration, on_settled, on_loop) -> True if `on_settled` is called later (see Executor).
Settle = Callable[[Any, BaseException | None, float, Callable[[], None], bool], bool]


@dataclass(eq=False)
class Flight:
    """One coroutine handed to the lane: what settles it, and its clock."""

    settle: Settle
    clock: RunClock
    done: Callable[[], None] = lambda: None
    forced: bool = False  # the forced cancel reached the run (on the loop)
    task: asyncio.Task[None] | None = None
    loop: asyncio.AbstractEventLoop | None = None  # the loop it was handed to

    def cancel(self) -> None:
        """Cancel the run for a forced cancel: TaskCancelled where it awaits (at once if it has not begun)."""
        if self.clock.force_cancel() and self.loop is not None:
            with contextlib.suppress(RuntimeError):  # "Event loop is closed": the lane fails its runs (`_replace`)
                self.loop.call_soon_threadsafe(self._cancel_on_loop)

    def _cancel_on_loop(self) -> None:
        if self.task is not None and not self.task.done():
            self.forced = True
            self.task.cancel()

    def settle_off_loop(self, value: Any, raised: BaseException | None, duration_s: float) -> None:
        """Settle the run on this thread (not the loop, which must not wait on Redis)."""
        try:
            later = self.settle(value, raised, duration_s, self.done, False)
        except Exception:  # settle dead-letters as a last resort; this is a bug: the lease recovers the task
            logger.exception("unexpected error settling an async task")
            later = False
        if not later:
            self.done()


class LaneSeat:
    """A seat on `lane` taken before a run's start is written; given back unless a run took it."""

    def __init__(self, lane: AsyncLane, seats: threading.BoundedSemaphore) -> None:
        self.lane = lane
        self._seats: threading.BoundedSemaphore | None = seats

    def hand_to_run(self) -> None:
        """The run submitted with it gives the seat back once it is settled."""
        self._seats = None

    def give_back(self) -> None:
        """Give the seat back if no run took it (its task did not start)."""
        seats, self._seats = self._seats, None
        if seats is not None:
            seats.release()


class AsyncLane:
    """One event loop in a thread of its own, running up to `concurrency` coroutine handlers at once."""

    def __init__(self, concurrency: int, worker_room: Capacity, stopping: Callable[[], bool] = lambda: False) -> None:
        self.concurrency = concurrency
        self.worker_room = worker_room  # a task handed to the lane gives back its share of the consumer's room
        self.stopping = stopping  # then a run waiting for a seat does not start
        self._seats = threading.BoundedSemaphore(concurrency)
        self._lock = threading.Lock()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._inbox: LoopInbox | None = None  # the runs handed to `_loop`, begun one batch per wake-up
        self._settlers: ThreadPoolExecutor | None = None
        self._flights: set[Flight] = set()
        self._tasks: set[asyncio.Task[None]] = set()  # touched on the loop only

    @property
    def running(self) -> int:
        """Tasks handed to the lane and not yet settled."""
        with self._lock:
            return len(self._flights)

    def reserve(self) -> LaneSeat | None:
        """Take a seat for a run, waiting while the lane is full; `submit` hands it to the run."""
        while not self._seats.acquire(timeout=SEAT_WAIT_S):
            if self.stopping():
                return None
        if self.stopping():  # the stop may have come while the last wait ended
            self._seats.release()
            return None
        return LaneSeat(self, self._seats)

    def submit(
        self, coroutine: Coroutine[Any, Any, Any], flight: Flight, on_settled: Callable[[], None], seat: LaneSeat
    ) -> None:
        """Run `coroutine` on the loop in `seat` and settle its outcome as `flight` says."""
        seat.hand_to_run()
        flight.done = partial(self._done, on_settled, flight)
        with self._lock:
            self._flights.add(flight)
            flight.loop = self._loop or self._start()
            inbox = self._inbox
        self.worker_room.release()  # the lane has seats of its own
        if inbox is None or not inbox.put(self._begin, coroutine, flight):
            coroutine.close()  # a handler closed the loop: the lane fails the runs handed to it (`_replace`)

    def close(self) -> None:
        """Stop the loop and the settling threads (after the consumer waited for the running tasks)."""
        with self._lock:
            loop, self._loop, self._inbox = self._loop, None, None
            settlers, self._settlers = self._settlers, None
        if loop is not None:
            with contextlib.suppress(RuntimeError):  # "Event loop is closed" (by a handler)
                loop.call_soon_threadsafe(self._cancel_then_stop, loop)
        if settlers is not None:
            settlers.shutdown(wait=False)

    def _cancel_then_stop(self, loop: asyncio.AbstractEventLoop) -> None:
        """On the loop: cancel the runs still on it (settled already), then stop it once they had that turn."""
        for task in list(self._tasks):
            task.cancel()
        loop.call_soon(loop.stop)

    def _start(self) -> asyncio.AbstractEventLoop:
        loop = asyncio.new_event_loop()
        threading.Thread(target=self._serve, args=(loop,), name="async-lane", daemon=True).start()
        if self._settlers is None:
            self._settlers = ThreadPoolExecutor(SETTLE_THREADS, thread_name_prefix="async-settle")
        self._loop, self._inbox = loop, LoopInbox(loop)
        return loop

    def _serve(self, loop: asyncio.AbstractEventLoop) -> None:
        """Run the loop until `close` stops it, whatever a handler does to it (see the module's docstring)."""
        stop_logged, pid = False, os.getpid()
        guard_loop(loop)  # a child a handler forks here exits once the loop gets control back
        while True:
            stopped = False
            try:
                loop.run_forever()
                stopped = True
            except BaseException:  # SystemExit or KeyboardInterrupt in a task a handler spawned: asyncio re-raises it
                exit_if_forked(pid)
                if not loop.is_closed():
                    logger.exception("an asyncio task of a handler raised out of the event loop; the loop goes on")
            exit_if_forked(pid)
            with self._lock:
                if self._loop is not loop:  # `close` stopped it
                    unguard_loop()
                    return
            if loop.is_closed():
                unguard_loop()
                self._replace(loop)
                return
            if stopped and not stop_logged:
                logger.error("a handler stopped the asyncio lane's event loop (loop.stop()): it is run again")
                stop_logged = True

    def _replace(self, closed: asyncio.AbstractEventLoop) -> None:
        """Fail the runs of a loop a handler closed (they can never go on); the next run starts a new loop."""
        logger.error("a handler closed the asyncio lane's event loop: its runs fail, and a new loop runs the next ones")
        with self._lock:
            if self._loop is closed:
                self._loop, self._inbox = None, None
            lost = [flight for flight in self._flights if flight.loop is closed]
        error = RuntimeError("the asyncio lane's event loop was closed (by a handler) while the task ran")
        now = time.monotonic()
        for flight in lost:
            clock = flight.clock
            if clock.give_up():
                flight.settle_off_loop(
                    None, clock.cancel_error or clock.timeout_error or error, now - clock.started_monotonic
                )

    def _begin(self, coroutine: Coroutine[Any, Any, Any], flight: Flight) -> None:
        """On the loop: start the run as an asyncio task, held here (the loop keeps only weak references)."""
        run = self._run(coroutine, flight)
        try:  # a handler may have set a task factory that fails
            task = asyncio.get_running_loop().create_task(run)
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)
        except Exception as exc:
            logger.exception("an async task could not be started on its event loop")
            run.close()
            coroutine.close()
            if flight.clock.finish():
                self._settle_later(flight, None, exc, time.monotonic() - flight.clock.started_monotonic)

    async def _run(self, coroutine: Coroutine[Any, Any, Any], flight: Flight) -> None:
        pid = os.getpid()
        value, raised = await self._outcome(coroutine, flight)
        exit_if_forked(pid)  # a child its handler forked: the run is its parent's to settle
        if flight.clock.finish():  # unless the time limits gave up on it first
            duration_s = time.monotonic() - flight.clock.started_monotonic
            queued = False
            if raised is None:
                try:
                    queued = flight.settle(value, None, duration_s, flight.done, True)  # a success is only queued
                except Exception:  # a bug: settled the slow way, which dead-letters as a last resort
                    logger.exception("unexpected error settling an async task on the loop")
            if not queued:
                self._settle_later(flight, value, raised, duration_s)

    @staticmethod
    async def _outcome(coroutine: Coroutine[Any, Any, Any], flight: Flight) -> tuple[Any, BaseException | None]:
        """Await the run; its value and what it raised (a forced cancel that reached it wins over both)."""
        flight.task = asyncio.current_task()
        if flight.clock.cancel_error is not None:  # cancelled with force before it began
            coroutine.close()
        else:
            try:
                value = await coroutine
            except BaseException as exc:  # a handler's sys.exit() or cancellation fails the task, not the lane
                if not flight.forced or isinstance(exc, TaskTimeout):
                    return None, exc
            else:
                if not flight.forced:
                    return value, None
        return None, TaskCancelled("the task was cancelled with force")

    def _settle_later(self, flight: Flight, value: Any, raised: BaseException | None, duration_s: float) -> None:
        """Settle a run on a settling thread, not on the loop (which must not wait on Redis)."""
        settlers = self._settlers
        if settlers is not None:
            settlers.submit(flight.settle_off_loop, value, raised, duration_s)
        else:  # closed while it ran (past the grace period)
            flight.settle_off_loop(value, raised, duration_s)

    def _done(self, on_settled: Callable[[], None], flight: Flight) -> None:
        """Once the task left the consumer's hands: its room and its seat are given back."""
        self.worker_room.take_back()  # on_settled gives back room in the consumer: the room handed off
        on_settled()
        with self._lock:
            self._flights.discard(flight)
        self._seats.release()


class LoopInbox:
    """Callbacks handed to one event loop from any thread, called on it in the order given."""

    # One drain takes every callback queued while the loop was busy. A callback is queued before the
    # flag is read and the drain clears the flag before taking callbacks, so none is left waiting.

    __slots__ = ("_calls", "_loop", "_scheduled")

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop
        self._calls: deque[tuple[Callable[..., None], tuple[Any, ...]]] = deque()
        self._scheduled = False

    def put(self, callback: Callable[..., None], *args: Any) -> bool:
        """Have `callback(*args)` called on the loop soon; False if the loop is closed (it never will be)."""
        self._calls.append((callback, args))
        if self._scheduled:
            return True
        self._scheduled = True
        try:
            self._loop.call_soon_threadsafe(self._drain)
        except RuntimeError:  # "Event loop is closed"
            self._scheduled = False
            return False
        return True

    def _drain(self) -> None:
        """On the loop: make the calls queued until now (later ones wait for the next turn of the loop)."""
        self._scheduled = False
        calls = self._calls
        for _ in range(len(calls)):
            callback, args = calls.popleft()
            try:
                callback(*args)
            except Exception:  # as the loop would log a failing callback; the others are still made
                logger.exception("a callback handed to the asyncio lane's event loop raised")
