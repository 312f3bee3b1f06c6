"""A consumer's graceful stop: stop claiming, return what never started, let the running finish within the grace."""

from __future__ import annotations

import logging
import queue as queue_module
import threading
import time
from collections.abc import Callable

from tasks_app.consumer import identity
from tasks_app.consumer.ack_batcher import AckBatcher
from tasks_app.consumer.claimed import Claimed
from tasks_app.consumer.executor import Executor
from tasks_app.consumer.options import ConsumerOptions
from tasks_app.consumer.process_mode import ProcessGuard, exit_within_s
from tasks_app.consumer.registration import Registration
from tasks_app.consumer.retiring import RetiringIds
from tasks_app.protocol.broker import Broker

# The lifecycle's logger: a stop is said where the start was (log filters name it).
logger = logging.getLogger("tasks_app.consumer.lifecycle")


class Stopping:
    """How a consumer stops gracefully (SIGTERM, SIGINT, SIGHUP, a burst's end, process mode's recycling)."""

    options: ConsumerOptions
    broker: Broker
    executor: Executor
    acks: AckBatcher
    guard: ProcessGuard
    registration: Registration
    retiring: RetiringIds
    work: queue_module.SimpleQueue[Claimed]
    instance: str
    consumer_id: str
    exit_code: int
    claiming_stopped: threading.Event
    workers_stop: threading.Event
    loops_stopped: threading.Event
    give_up: threading.Event
    _claimers: list[threading.Thread]
    _busy: int
    _busy_lock: threading.Lock
    # Return claimed tasks to their queues unstarted (the consumer's; give_up: stop trying once set).
    _return_unstarted: Callable[[list[Claimed], threading.Event], None]

    def shutdown(self) -> int:
        """Stop claiming, return unstarted tasks, let running ones finish within the grace period (from now)."""
        grace_over = threading.Event()
        timer = threading.Timer(self.options.grace_s, grace_over.set)
        timer.daemon = True
        timer.start()
        self.claiming_stopped.set()
        self._finish_within_grace(grace_over)
        for thread in self._claimers:  # a claim landing meanwhile is returned by `dispatch`
            thread.join(timeout=self.options.block_s + 1)
        self._return_queued(grace_over)  # dispatched as the stop began
        timer.cancel()
        # The runs given up on are settled, then finished tasks acked (not returned), within one wait for Redis.
        writes_by = time.monotonic() + self.options.grace_s + 5
        self.executor.wait_hung_settled(timeout_s=self.options.grace_s + 5)  # their failures go before deregistering
        self.workers_stop.set()
        self.acks.close(timeout_s=max(0.0, writes_by - time.monotonic()))
        self.loops_stopped.set()
        self.give_up.set()
        registered_id, registered = self.registration.current()
        identity.deregister_everywhere(self.broker, registered, registered_id, self.instance)
        try:
            self.retiring.renew(leaving=True)
        except Exception as exc:
            logger.error("could not deregister the ids left after a lost lease (their leases will expire): %s", exc)
        self.guard.stop()
        self.executor.close()
        logger.info("consumer %s stopped", self.consumer_id)
        return self.exit_code

    def _finish_within_grace(self, grace_over: threading.Event) -> None:
        """Return the tasks that never started and let the running ones finish, until `grace_over`; then give
        up on those still running (each uses an attempt: a task outliving every grace period is not run for good).

        With Redis away the return is given up once the grace period is over (the lease then
        recovers those tasks) instead of holding the stop until Redis is back.
        """
        self._return_queued(grace_over)
        while not grace_over.is_set():
            with self._busy_lock:
                if self._busy + self.executor.async_running() <= self.executor.hung():  # not for hung ones
                    return
            grace_over.wait(0.05)
        with self._busy_lock:
            still_running = self._busy + self.executor.async_running() - self.executor.hung()
        # No retry of theirs is due before this process is surely gone (as after a hard limit).
        interrupted = self.executor.interrupt_running(self.options.grace_s, exit_within_s(self.options))
        logger.warning(
            "grace period over with %d task(s) still running: %d run(s) given up on, each failed with "
            "TaskInterrupted (an attempt used)",
            still_running,
            interrupted,
        )

    def _return_queued(self, grace_over: threading.Event) -> None:
        """Return the tasks handed to the workers that none has taken yet."""
        unstarted: list[Claimed] = []
        while True:
            try:
                unstarted.append(self.work.get_nowait())
            except queue_module.Empty:
                break
        if unstarted:
            self._return_unstarted(unstarted, grace_over)
